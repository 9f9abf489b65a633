"""Prompt-time selections of `keydiff` and `snapkv` against kvpress's presses, on the same token
ids with SmolLM2-135M (or a small random Qwen3, `--model qwen3-tiny`: bench/common.py): the
kept token indices per layer and kv head, and the logits of the tokens that follow.

    python bench/peer_kvpress.py --kvpress-python KVPRESS_VENV/bin/python \\
        --out bench/results/peer_kvpress/kept_smollm2_cpu
    python bench/peer_kvpress.py --kvpress-python KVPRESS_VENV/bin/python --model qwen3-tiny \\
        --out bench/results/peer_kvpress/kept_qwen3_tiny_cpu

kvpress (0.5.x: transformers < 5.3) lives in its own venv outside this tree: this script
writes a small driver into a temporary folder and runs it there with that venv's Python. The
driver imports nothing from flexevict; it loads the model with transformers, prefills
the prompt under each press and reads the kept keys back from the cache (matched bit for bit
to the uncompressed prompt's keys, which gives their token indices), then teacher-forces the
next tokens with positions continuing from the prompt length, as kvpress's pipeline decodes.

flexevict runs the same ids with `--budget-tokens` = kept + 1 (the scratch slot), records each
layer's kept positions after the prefill, and teacher-forces the same tokens. The first decode
step attends the same tokens in both (the kept ones and the new one); from the second on they
differ by design: kvpress keeps every generated token, flexevict evicts one per step. Cases
(pairs of flexevict policy and kvpress press):

- keydiff-oneshot: `keydiff block=0` / `KeyDiffPress`
- keydiff-block: `keydiff block=B` / `BlockPress(KeyDiffPress, block_size=B)`
- snapkv: `snapkv window=W kernel=K` / `SnapKVPress(window_size=W, kernel_size=K)`, for the
  paper's (32, 7) and kvpress's defaults (64, 5)

and, flexevict alone (kvpress has no such press), `keydiff block=B window=--keydiff-window`:
what protecting the newest tokens from KeyDiff's per-step eviction does to the NLL.

Writes OUT.md (the tables) and OUT.json (every number). Setting up the peer's venv:

    python3 -m venv ~/kvpress-venv
    ~/kvpress-venv/bin/pip install torch==2.13.0           # the CPU wheel first
    ~/kvpress-venv/bin/pip install kvpress==0.5.5 gguf
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from common import (LOAD_MODEL, PEER_MODELS, peer_model, read_out,  # noqa: E402
                    run_driver, write_report)

from flexevict.api import LLM  # noqa: E402
from flexevict.errors import UserError, cli_errors  # noqa: E402
from flexevict.evaluation.tasks import shakespeare_text  # noqa: E402
from flexevict.policies import get_policy  # noqa: E402
from flexevict.runtime.machine import run_metadata  # noqa: E402

# the peer's side: run with kvpress's Python, in a folder outside this tree
DRIVER = r'''
import contextlib, importlib.metadata, json, os, sys
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
import torch
import kvpress
from transformers import AutoModelForCausalLM, DynamicCache

spec = json.load(open(sys.argv[1]))
''' + LOAD_MODEL + r'''ids, targets = spec["prompt"], spec["targets"]
P = len(ids)


def make(case):
    kind, kept = case["press"], case["kept"]
    ratio = 1 - (kept + 0.5) / P              # int(P * (1 - ratio)) == kept
    if kind == "keydiff":
        return kvpress.KeyDiffPress(compression_ratio=ratio)
    if kind == "keydiff-block":
        return kvpress.BlockPress(kvpress.KeyDiffPress(compression_ratio=ratio),
                                  block_size=case["block"])
    return kvpress.SnapKVPress(compression_ratio=ratio, window_size=case["window"],
                               kernel_size=case["kernel"])


@torch.inference_mode()
def run(press):
    cache = DynamicCache()
    with press(model) if press is not None else contextlib.nullcontext():
        out = model(input_ids=torch.tensor([ids]), past_key_values=cache, logits_to_keep=1)
    keys = [layer.keys[0].clone() for layer in cache.layers]          # (Hk, n, d) per layer
    logits = [out.logits[0, -1].float()]
    for i, t in enumerate(targets[:-1]):
        step = model(input_ids=torch.tensor([[t]]), past_key_values=cache,
                     position_ids=torch.tensor([[P + i]]))
        logits.append(step.logits[0, -1].float())
    return keys, torch.stack(logits)


full_keys, full_logits = run(None)
result = {name: importlib.metadata.version(name) for name in ("kvpress", "transformers", "torch")}
result["cases"] = {}
saved = {"full": full_logits}
for case in spec["cases"]:
    keys, logits = run(make(case))
    kept, exact = [], True
    for k, full in zip(keys, full_keys):
        heads = []
        for h in range(k.shape[0]):
            d = torch.cdist(k[h].double(), full[h].double(),        # (kept, P), exact
                            compute_mode="donot_use_mm_for_euclid_dist")
            best = d.min(dim=1)
            exact &= bool((best.values == 0).all())
            heads.append(sorted(best.indices.tolist()))
        kept.append(heads)
    result["cases"][case["name"]] = {"kept": kept, "keys_matched_exactly": exact}
    saved[case["name"]] = logits
torch.save(saved, spec["logits_out"])
json.dump(result, open(spec["out"], "w"))
'''


def prompt_ids(llm: LLM, prompt_len: int, targets: int, offset: int) -> tuple[list, list]:
    ids = llm.tokenizer.encode(shakespeare_text(), special=False)
    if len(ids) < offset + prompt_len + targets:
        raise UserError(f"Hamlet holds {len(ids)} tokens; lower --offset or --prompt-len")
    return ids[offset:offset + prompt_len], ids[offset + prompt_len:offset + prompt_len + targets]


@torch.inference_mode()
def flexevict_run(llm: LLM, ids, targets, policy) -> tuple[list, torch.Tensor]:
    """Prefill ids under policy, teacher-force targets -> (kept positions [layer][kv head],
    logits (len(targets), V): row i predicts targets[i])."""
    kept, logits = {}, []
    cls = type(policy)
    real = cls.prefill

    def spy(self, buf, k, v, pos, valid, scores=None, **kw):
        real(self, buf, k, v, pos, valid, scores, **kw)
        cap = buf.capacity
        held = torch.where(buf.valid[:cap], buf.pos[:cap], -1).t()   # (kv heads, slots)
        kept[buf.layer] = [sorted(p for p in row.tolist() if p >= 0) for row in held]

    def consume(i, k, h, head):
        x = head(h[:, -1] if h.dim() == 3 else h)
        logits.append(x[0].float())
        return torch.tensor([targets[i]]) if i < len(targets) else x.argmax(-1)

    with mock.patch.object(cls, "prefill", spy):
        llm.engine.run([ids], len(targets), policy, consume)
    return [kept[j] for j in sorted(kept)], torch.stack(logits)


def nll(logits: torch.Tensor, targets: list[int], first: int = 0) -> float:
    """Mean negative log-likelihood of targets[first:] (logits row i predicts targets[i])."""
    lp = torch.log_softmax(logits[first:].double(), dim=-1)
    return float(-lp[torch.arange(len(targets) - first), torch.tensor(targets[first:])].mean())


def compare(ours: list, theirs: list) -> dict:
    """Kept sets [layer][head] of both -> agreement counts and every difference."""
    heads = same = 0
    diffs = []
    for j, (a_layer, b_layer) in enumerate(zip(ours, theirs)):
        for h, (a, b) in enumerate(zip(a_layer, b_layer)):
            heads += 1
            if a == b:
                same += 1
            else:
                diffs.append({"layer": j, "head": h, "only_flexevict": sorted(set(a) - set(b)),
                              "only_kvpress": sorted(set(b) - set(a))})
    swapped = sum(len(d["only_flexevict"]) for d in diffs)
    return {"heads": heads, "identical_heads": same, "tokens_swapped": swapped,
            "differences": diffs}


def cases(args) -> list[dict]:
    out = []
    for kept in args.kept:
        out.append({"name": f"keydiff-oneshot@{kept}", "press": "keydiff", "kept": kept,
                    "policy": ("keydiff", {"block": 0})})
        out.append({"name": f"keydiff-block{args.block}@{kept}", "press": "keydiff-block",
                    "kept": kept, "block": args.block,
                    "policy": ("keydiff", {"block": args.block})})
        for w, k in ((32, 7), (64, 5)):
            if kept - 1 >= w:
                out.append({"name": f"snapkv-w{w}-k{k}@{kept}", "press": "snapkv", "kept": kept,
                            "window": w, "kernel": k,
                            "policy": ("snapkv", {"window": w, "kernel": k})})
    return out


def run_peer(python: str, spec: dict) -> tuple[dict, dict]:
    """kvpress's JSON output and its step-1 logits (a tensor file beside it)."""
    def read(spec):
        return read_out(spec), torch.load(os.path.join(spec["tmp"], spec["logits_out"]))
    return run_driver(python, DRIVER, dict(spec, logits_out="logits.pt"), "kvpress", read)


def table(rows: list[dict], args, model: str) -> str:
    lines = [f"{model}, Hamlet tokens "
             f"[{args.offset}, {args.offset + args.prompt_len}) as the prompt, the next "
             f"{args.targets} teacher-forced; kept = tokens kept per layer and kv head after the "
             f"prefill (flexevict: --budget-tokens kept + 1).", "",
             "| case | kept | identical (layer, head) sets | tokens swapped | step-1 logits "
             "max abs diff | NLL flexevict (evicts) | NLL kvpress (grows) | NLL full |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["compare"]
        if c is None:                                  # flexevict alone
            lines.append(f"| {r['name'].split('@')[0]} (flexevict only) | {r['kept']} | – | – | "
                         f"– | {r['nll_flexevict']:.4f} | – | {r['nll_full']:.4f} |")
            continue
        lines.append(f"| {r['name'].split('@')[0]} | {r['kept']} | {c['identical_heads']}/"
                     f"{c['heads']} | {c['tokens_swapped']} | {r['step1_logits_max_abs_diff']:.2e}"
                     f" | {r['nll_flexevict']:.4f} | {r['nll_kvpress']:.4f} | "
                     f"{r['nll_full']:.4f} |")
    if args.model != "smollm2-135m":
        lines += ["", "Random weights: the NLLs say only whether the engines agree, not how well "
                  "the model predicts Hamlet."]
    lines += ["", "NLL over the teacher-forced tokens after the first (the prefill's prediction "
              "is the same in all three); step 1 attends the same tokens in both engines, later "
              "steps do not (kvpress keeps every generated token, flexevict evicts one per "
              "step).", "", "Command:", "",
              f"    python bench/peer_kvpress.py --kvpress-python KVPRESS_PYTHON --model "
              f"{args.model} --prompt-len "
              f"{args.prompt_len} --targets {args.targets} --offset {args.offset} --block "
              f"{args.block} --keydiff-window {args.keydiff_window} "
              + " ".join(f"--kept {k}" for k in args.kept)
              + f" --out {args.out}"]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvpress-python", required=True,
                    help="the Python of a venv holding kvpress (and gguf)")
    ap.add_argument("--model", choices=PEER_MODELS, default="smollm2-135m")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--targets", type=int, default=32, help="tokens teacher-forced after it")
    ap.add_argument("--offset", type=int, default=2000, help="first Hamlet token of the prompt")
    ap.add_argument("--kept", type=int, action="append", default=None,
                    help="tokens kept after the prefill; repeat (default 96, 128, 256)")
    ap.add_argument("--block", type=int, default=128, help="KeyDiff's block size")
    ap.add_argument("--keydiff-window", type=int, default=32,
                    help="flexevict's keydiff with this protected window too (0: not run)")
    ap.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.md, .json")
    args = ap.parse_args(argv)
    args.kept = args.kept or [96, 128, 256]
    with cli_errors("bench/peer_kvpress.py"), tempfile.TemporaryDirectory() as tmp:
        if min(args.kept) < 3 or max(args.kept) >= args.prompt_len or args.targets < 2:
            raise UserError("--kept must be in [3, --prompt-len) and --targets >= 2")
        source, path, model = peer_model(args.model, tmp)
        llm = LLM(path)
        ids, targets = prompt_ids(llm, args.prompt_len, args.targets, args.offset)
        todo = cases(args)
        spec = {**source, "prompt": ids, "targets": targets,
                "cases": [{k: v for k, v in c.items() if k != "policy"} for c in todo]}
        peer, peer_logits = run_peer(args.kvpress_python, spec)
        _, full = flexevict_run(llm, ids, targets, get_policy("full"))
        rows = []
        for c in todo:
            name, kw = c["policy"]
            kept, logits = flexevict_run(llm, ids, targets,
                                         get_policy(name, budget_tokens=c["kept"] + 1, **kw))
            theirs = peer_logits[c["name"]]
            rows.append({"name": c["name"], "kept": c["kept"], "policy": name, "arguments": kw,
                         "compare": compare(kept, peer["cases"][c["name"]]["kept"]),
                         "keys_matched_exactly": peer["cases"][c["name"]]["keys_matched_exactly"],
                         "step1_logits_max_abs_diff": float((logits[1] - theirs[1]).abs().max()),
                         "nll_flexevict": nll(logits, targets, 1),
                         "nll_kvpress": nll(theirs, targets, 1), "nll_full": nll(full, targets, 1),
                         "full_logits_max_abs_diff": float((full - peer_logits["full"]).abs()
                                                           .max())})
        for kept in args.kept if args.keydiff_window else ():
            kw = {"block": args.block, "window": args.keydiff_window}
            _, logits = flexevict_run(llm, ids, targets,
                                      get_policy("keydiff", budget_tokens=kept + 1, **kw))
            rows.append({"name": f"keydiff-block{args.block}-window{args.keydiff_window}@{kept}",
                         "kept": kept, "policy": "keydiff", "arguments": kw, "compare": None,
                         "nll_flexevict": nll(logits, targets, 1),
                         "nll_full": nll(full, targets, 1)})
        llm.close()
        data = {"args": {**vars(args), "kvpress_python": "KVPRESS_PYTHON"},
                "run": run_metadata("cpu"),
                "peer": {k: v for k, v in peer.items() if k != "cases"}, "rows": rows}
        write_report(args.out, table(rows, args, model), data)
        if any(math.isnan(r["nll_flexevict"]) for r in rows):
            raise UserError("a NaN NLL")


if __name__ == "__main__":
    main()
