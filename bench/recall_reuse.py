"""How much of the pages a `recall` step needs is already in its buffer from the step before:
on real weights and text, the share of recalled places whose page changed. With the cache
offloaded, the buffer's own load (on the load lane, overlapped with the previous layer) brings
back the pages that stay, and the step copies only the changed ones over the link itself, so
this share is the part of the gather a step still waits for.

    python bench/recall_reuse.py --out bench/results/recall/recall_reuse_smollm2_cpu

SmolLM2-135M (the packaged Q4_1 weights) on Hamlet: --batch prompts of --prompt-len tokens
from successive parts of the play, --gen-len greedy tokens, `recall` at each --budget. Counts
every layer's page gather in every decode step but the first (after the prefill no page is in
place). Writes OUT.md and OUT.json.
"""
from __future__ import annotations

import argparse
import os
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import write_report  # noqa: E402

from flexevict.api import LLM  # noqa: E402
from flexevict.errors import UserError, cli_errors  # noqa: E402
from flexevict.evaluation.tasks import shakespeare_text  # noqa: E402
from flexevict.policies import PolicySpec  # noqa: E402
from flexevict.policies import recall  # noqa: E402
from flexevict.runtime.generation import Sampling  # noqa: E402


class GatherCount:
    """Stands in for recall's page gather: counts each call's places fetched and places."""

    def __init__(self):
        self.calls: list[tuple[int, int]] = []
        self.gather = recall.gather_pages

    def __call__(self, history, pages, fetch, region):
        self.calls.append((int(fetch.sum()), fetch.numel()))
        return self.gather(history, pages, fetch, region)


def measure(llm: LLM, prompts: list[list[int]], gen_len: int, budget: float) -> dict:
    """One greedy run of `recall` at `budget` -> the share of recalled places copied per step."""
    count = GatherCount()
    with mock.patch.object(recall, "gather_pages", count):
        _, resolved = llm.generate_block(prompts, gen_len, Sampling(), PolicySpec("recall", budget),
                                         stop_ids=())
    layers = llm.config.num_layers                  # per step and layer: K's gather, then V's
    later = count.calls[2 * layers::2]                # K's past the first step: V copies the same
    copied, places = sum(c for c, _ in later), sum(n for _, n in later)
    return {"budget": budget, "resolved": resolved, "steps": len(later) // layers,
            "copied_pages": copied, "pages": places,
            "share_copied": copied / places if places else None}


def table(results: list[dict], args) -> str:
    lines = [f"SmolLM2-135M on Hamlet, {args.batch} prompts of {args.prompt_len} tokens + "
             f"{args.gen_len} generated, greedy", "",
             "| budget | page | pages per step | window | decode steps counted | "
             "share of recalled pages copied per step |", "|---|---|---|---|---|---|"]
    for r in results:
        lay, share = r["resolved"], r["share_copied"]
        lines.append(f"| {r['budget']} | {lay.get('page')} | {lay.get('pages_per_step')} | "
                     f"{lay.get('window')} | {r['steps']} | "
                     + ("–" if share is None else f"{100 * share:.1f}%") + " |")
    lines += ["", "Command:", "", f"    python bench/recall_reuse.py --prompt-len "
              f"{args.prompt_len} --gen-len {args.gen_len} --batch {args.batch} --budget "
              + " --budget ".join(map(str, args.budget)) + f" --out {args.out}"]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="prompts in the batch")
    ap.add_argument("--budget", type=float, action="append", default=None,
                    help="recall's budget; repeat for several (default 0.1 and 0.2)")
    ap.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.md, .json")
    args = ap.parse_args(argv)
    args.budget = args.budget or [0.1, 0.2]
    with cli_errors("bench/recall_reuse.py"):
        if min(args.prompt_len, args.gen_len, args.batch) < 2:
            raise UserError("--prompt-len, --gen-len and --batch must be >= 2")
        llm = LLM("smollm2-135m")
        ids = llm.tokenizer.encode(shakespeare_text())
        if len(ids) < args.batch * args.prompt_len:
            raise UserError(f"Hamlet holds {len(ids)} tokens, fewer than --batch x "
                            f"--prompt-len; lower either")
        prompts = [ids[i * args.prompt_len:(i + 1) * args.prompt_len] for i in range(args.batch)]
        results = [measure(llm, prompts, args.gen_len, b) for b in args.budget]
        write_report(args.out, table(results, args), {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
