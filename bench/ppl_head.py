"""Streaming perplexity with the head per decode step, and with the steps' hidden states through
the head together: the same NLL, in how much time, side by side in one process.

    python bench/ppl_head.py --model gemma3-270m --tokens 1024 \
        --out bench/results/ppl_head_gemma3_cpu

`stream_nll` knows each next token, so its decode steps need not wait for their logits. With
`head_rows=1` every step runs the head alone (as generation must): on a CPU each such call
reads the whole (V, D) output matrix for a few rows, and with Gemma-3's 262k-token vocabulary
that read is most of a step. With the default (256 rows) the head runs once per 256 rows.
The two run alternately, --rounds times each, on the sweep's perplexity documents (`Ppl`, the
packaged Wikipedia and Hamlet texts) under --policy at --budget. Writes OUT.md and OUT.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import run_metadata, write_report  # noqa: E402

from flexevict.api import LLM  # noqa: E402
from flexevict.errors import UserError, cli_errors  # noqa: E402
from flexevict.evaluation.tasks import Ppl  # noqa: E402
from flexevict.policies import PolicySpec  # noqa: E402
from flexevict.runtime.generation import stream_nll  # noqa: E402

WAYS = {"per step": 1, "together": 256}          # head_rows


def measure(llm: LLM, docs: list[list[int]], spec: PolicySpec, rounds: int) -> dict:
    """-> {way: {"seconds": [...], "nll": (B, N-1)}}, the ways alternating round by round."""
    out = {way: {"seconds": []} for way in WAYS}
    for _ in range(rounds):
        for way, rows in WAYS.items():
            start = time.perf_counter()
            nll, layout = stream_nll(llm.engine, docs, spec.make(), head_rows=rows)
            out[way]["seconds"].append(round(time.perf_counter() - start, 3))
            out[way]["nll"], out[way]["slots"] = nll, layout.slots
    return out


def table(r: dict, args) -> str:
    best = {way: min(r["ways"][way]["seconds"]) for way in WAYS}
    lines = [f"{args.model}, {args.docs} documents of {r['tokens']} tokens in one batch, "
             f"`{args.policy}` at {args.budget} ({r['slots']} slots, {r['decode_steps']} decode "
             f"steps), {torch.get_num_threads()} torch thread(s), best of {args.rounds}", "",
             "| head | seconds | decode steps / s |", "|---|---|---|"]
    for way in WAYS:
        lines.append(f"| {way} | {best[way]:.2f} | {r['decode_steps'] / best[way]:.1f} |")
    lines += ["", f"per step / together: {best['per step'] / best['together']:.2f}x; largest NLL "
              f"difference between the two {r['max_nll_diff']:.2e} nats (float rounding)", "",
              "Command:", "", f"    python bench/ppl_head.py --model {args.model} --tokens "
              f"{args.tokens} --docs {args.docs} --policy {args.policy} --budget {args.budget} "
              f"--rounds {args.rounds} --out {args.out}"]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per document")
    ap.add_argument("--docs", type=int, default=4, help="documents in the batch")
    ap.add_argument("--policy", default="h2o")
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.md, .json")
    args = ap.parse_args(argv)
    with cli_errors("bench/ppl_head.py"):
        if args.rounds < 1 or args.threads < 1:
            raise UserError("--rounds and --threads must be >= 1")
        spec = PolicySpec.parse(args.policy, budget=args.budget)
        torch.set_num_threads(args.threads)
        llm = LLM(args.model)
        task = Ppl(llm, tokens=args.tokens, docs=args.docs)
        docs = list(task.docs.values())
        ways = measure(llm, docs, spec, args.rounds)
        a, b = (ways[w].pop("nll").double() for w in WAYS)
        slots = ways["together"]["slots"]
        r = {"run": run_metadata("cpu"), "args": vars(args), "tokens": len(docs[0]),
             "slots": slots, "decode_steps": len(docs[0]) - 1 - slots,
             "max_nll_diff": float((a - b).abs().max()), "ways": ways}
        write_report(args.out, table(r, args), r)


if __name__ == "__main__":
    main()
