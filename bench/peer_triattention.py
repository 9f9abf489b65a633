"""Prompt-time selection of `triattention` against the authors' TriAttention code, on the same
token ids with SmolLM2-135M (or a small random Qwen3, `--model qwen3-tiny`: bench/common.py)
and the same query statistics: the kept token indices per layer and kv head.

    python bench/peer_triattention.py --peer-python PEER_VENV/bin/python \\
        --triattention-src TRIATTENTION_CHECKOUT \\
        --out bench/results/peer_triattention/kept_smollm2_cpu
    python bench/peer_triattention.py --peer-python PEER_VENV/bin/python \\
        --triattention-src TRIATTENTION_CHECKOUT --model qwen3-tiny \\
        --out bench/results/peer_triattention/kept_qwen3_tiny_cpu

The authors' repository (WeianMao/triattention; its `triattention/methods` and
`triattention/common` suffice, pure PyTorch + transformers) is run from a checkout outside this
tree by a driver written to a temporary folder and run with the peer venv's Python (any venv
with torch, transformers 5 and gguf: e.g. kvpress's, bench/peer_kvpress.py). The driver imports
nothing from flexevict: it loads the model with transformers, prefills the prompt with
a full cache, converts flexevict's calibration file to the authors' statistics format (per
layer and query head: the mean complex pre-RoPE query and its mean modulus), builds their
`TriAttention` compressor (the per-layer, per-kv-head mode with its z-score normalisation and
max over the group, no tie-breaking noise, the prompt allowed to compete) and asks it which
of the prompt's tokens to keep (`compute_keep_indices`, with the next position = the prompt's
length).

flexevict runs the same ids through `--policy triattention --policy-arg stats=FILE` with
`--budget-tokens` = kept + 1 and records each layer's kept positions after the prefill
(bench/peer_kvpress.py's `flexevict_run`), and the NLL of the next tokens teacher-forced
(evicting one token per step; the authors' code is not run past the prompt here).

Writes OUT.md (the table) and OUT.json (every number).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (LOAD_MODEL, PEER_MODELS, peer_model, read_out,  # noqa: E402
                    run_driver, write_report)
from peer_kvpress import compare, flexevict_run, nll, prompt_ids  # noqa: E402

from flexevict.api import LLM  # noqa: E402
from flexevict.errors import cli_errors  # noqa: E402
from flexevict.policies import get_policy  # noqa: E402
from flexevict.calibrate_policy import calibrate_triattention, default_text  # noqa: E402
from flexevict.policies.triattention import (SHIPPED, load_calibration,  # noqa: E402
                                             save_calibration)
from flexevict.runtime.machine import run_metadata  # noqa: E402

# the peer's side: run with the peer venv's Python, in a folder outside this tree
DRIVER = r'''
import importlib.metadata, json, os, sys
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
import torch
from transformers import AutoModelForCausalLM, DynamicCache

spec = json.load(open(sys.argv[1]))
sys.path.insert(0, spec["src"])
from triattention.methods.triattention import TriAttention, TriAttentionConfig

''' + LOAD_MODEL + r'''model_path = os.path.join(spec["tmp"], "model")
model.config.save_pretrained(model_path)
ids = spec["prompt"]
P = len(ids)

ours = torch.load(spec["calibration"], weights_only=True)
layers, heads = ours["q_mean"].shape[:2]
rs = getattr(model.config, "rope_scaling", None) or {}
stats = {"metadata": {"head_dim": model.config.head_dim if getattr(model.config, "head_dim", None)
                      else model.config.hidden_size // model.config.num_attention_heads,
                      "rope_style": "half",
                      "rope_type": rs.get("rope_type") or rs.get("type") or "default",
                      "sampled_heads": [[l, h] for l in range(layers) for h in range(heads)]},
         "stats": {f"layer{l:02d}_head{h:02d}": {"q_mean_real": ours["q_mean"][l, h, :, 0],
                                                 "q_mean_imag": ours["q_mean"][l, h, :, 1],
                                                 "q_abs_mean": ours["q_abs"][l, h]}
                   for l in range(layers) for h in range(heads)}}
stats_path = os.path.join(spec["tmp"], "stats.pt")
torch.save(stats, stats_path)

with torch.inference_mode():
    cache = DynamicCache()
    model(input_ids=torch.tensor([ids]), past_key_values=cache, logits_to_keep=1)
    pkv = tuple((layer.keys, layer.values) for layer in cache.layers)
    result = {n: importlib.metadata.version(n) for n in ("transformers", "torch")}
    result["kept"] = {}
    for kept in spec["kept"]:
        comp = TriAttention(TriAttentionConfig(
            stats_path=stats_path, model_path=model_path, device=torch.device("cpu"),
            dtype=torch.float32, budget=kept, normalize_scores=True, seed=None,
            per_layer_perhead_pruning=True, layer_perhead_aggregation="max",
            allow_prefill_compression=True, count_prompt_tokens=True))
        comp.cache_positions = list(range(P))
        comp.absolute_position = P
        keep = comp.compute_keep_indices(pkv, prefix_length=0)     # (layers, kv heads, kept)
        result["kept"][str(kept)] = [[sorted(h.tolist()) for h in layer] for layer in keep]
json.dump(result, open(spec["out"], "w"))
'''


def calibrate(llm: LLM, model: str, tmp: str) -> str:
    """The statistics file for `model`: SmolLM2's shipped one, else one made now from Macbeth
    (`python -m flexevict.calibrate_policy`'s defaults, at most the model's positions) in tmp."""
    if model == "smollm2-135m":
        return os.path.join(SHIPPED, "smollm2-135m.pt")
    text, name = default_text()
    ids = llm.tokenizer.encode(text, special=False)[:llm.config.max_positions]
    path = os.path.join(tmp, "triattention.pt")
    save_calibration(path, calibrate_triattention(llm.engine, ids, name))
    return path


def run_peer(python: str, spec: dict) -> dict:
    return run_driver(python, DRIVER, spec, "TriAttention", read_out)


def table(rows: list[dict], args, peer: dict, model: str, calibration: str) -> str:
    lines = [f"{model}, Hamlet tokens [{args.offset}, "
             f"{args.offset + args.prompt_len}) as the prompt; statistics: "
             f"{load_calibration(calibration).describe()}; the authors' code from a "
             f"checkout of WeianMao/triattention outside the tree (transformers "
             f"{peer['transformers']}, torch {peer['torch']}); kept = tokens kept per layer and "
             "kv head after the prefill (flexevict: --budget-tokens kept + 1).", "",
             "| kept | identical (layer, head) sets | tokens swapped | NLL flexevict (evicts) | "
             "NLL full |", "|---|---|---|---|---|"]
    for r in rows:
        c = r["compare"]
        lines.append(f"| {r['kept']} | {c['identical_heads']}/{c['heads']} | "
                     f"{c['tokens_swapped']} | {r['nll_flexevict']:.4f} | {r['nll_full']:.4f} |")
    if args.model != "smollm2-135m":
        lines += ["", "Random weights: the NLLs say only how eviction moves them, not how well "
                  "the model predicts Hamlet."]
    lines += ["", f"NLL over the {args.targets - 1} teacher-forced tokens after the first.", "",
              "Command:", "",
              f"    python bench/peer_triattention.py --peer-python PEER_PYTHON "
              f"--triattention-src TRIATTENTION_CHECKOUT --model {args.model} "
              f"--prompt-len {args.prompt_len} "
              f"--targets {args.targets} --offset {args.offset} "
              + " ".join(f"--kept {k}" for k in args.kept) + f" --out {args.out}"]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peer-python", required=True,
                    help="the Python of a venv with torch, transformers 5 and gguf")
    ap.add_argument("--triattention-src", required=True,
                    help="a checkout of WeianMao/triattention (outside this tree)")
    ap.add_argument("--model", choices=PEER_MODELS, default="smollm2-135m")
    ap.add_argument("--calibration", default=None,
                    help="the statistics both use (default: SmolLM2's shipped one; for "
                         "qwen3-tiny, made here from 4096 tokens of Macbeth)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--targets", type=int, default=32, help="tokens teacher-forced after it")
    ap.add_argument("--offset", type=int, default=2000, help="first Hamlet token of the prompt")
    ap.add_argument("--kept", type=int, action="append", default=None,
                    help="tokens kept after the prefill; repeat (default 96, 128, 256)")
    ap.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.md, .json")
    args = ap.parse_args(argv)
    args.kept = args.kept or [96, 128, 256]
    with cli_errors("bench/peer_triattention.py"), tempfile.TemporaryDirectory() as tmp:
        source, path, model = peer_model(args.model, tmp)
        llm = LLM(path)
        calibration = args.calibration or calibrate(llm, args.model, tmp)
        ids, targets = prompt_ids(llm, args.prompt_len, args.targets, args.offset)
        peer = run_peer(args.peer_python, {**source, "prompt": ids, "kept": args.kept,
                                           "src": args.triattention_src,
                                           "calibration": calibration})
        _, full_logits = flexevict_run(llm, ids, targets, get_policy("full"))
        rows = []
        for kept in args.kept:
            policy = get_policy("triattention", budget_tokens=kept + 1, stats=calibration)
            ours, logits = flexevict_run(llm, ids, targets, policy)
            rows.append({"kept": kept, "compare": compare(ours, peer["kept"][str(kept)]),
                         "nll_flexevict": nll(logits, targets, 1),
                         "nll_full": nll(full_logits, targets, 1)})
        result = {"meta": run_metadata(), "peer": {k: v for k, v in peer.items() if k != "kept"},
                  "args": {k: v for k, v in vars(args).items()
                           if k not in ("peer_python", "triattention_src", "calibration")},
                  "calibration": load_calibration(calibration).describe(), "rows": rows}
        write_report(args.out, table(rows, args, peer, model, calibration), result)
        llm.close()


if __name__ == "__main__":
    main()
