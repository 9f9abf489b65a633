"""Eviction bookkeeping cost per decode step, and decode throughput with eviction vs full cache.

    python bench/policy_overhead.py [--batch 8] [--context 2048] [--new-tokens 32] [--budget 0.2]
                                    [--policies all] [--json FILE]

SmolLM2-135M on CPU (the packaged real weights), batch 8, prompts of `--context` real tokens
(Wikipedia), greedy. For each policy, in one run: prefill time, decode time per step, and the
time spent inside the policy's decode hooks (`before_attention` + `after_attention`: victim
choice, score updates, commits) as a fraction of the decode step. `full` runs in the same
process, so the decode throughput ratio of each policy vs `full` is measured side by side.
"""
import argparse
import time

import torch
from common import write_json

import flexevict.generation as gen
from flexevict import LLM
from flexevict.generation import Sampling, generate
from flexevict.packaged import wikipedia_text
from flexevict.policies import POLICIES, PolicySpec


class Timed:
    """Wall time of prefill forwards, decode forwards and the policy's decode hooks."""

    def __init__(self, policy):
        self.t = {"prefill": 0.0, "decode": 0.0, "hooks": 0.0}
        self.steps = 0
        self.policy = policy
        for hook in ("before_attention", "after_attention"):
            setattr(policy, hook, self._wrap(getattr(policy, hook)))

    def _wrap(self, fn):
        def timed(*args):
            t0 = time.perf_counter()
            out = fn(*args)
            self.t["hooks"] += time.perf_counter() - t0
            return out
        return timed

    def forward(self, real):
        def timed(model, tokens, inp, bufs, policy):
            t0 = time.perf_counter()
            out = real(model, tokens, inp, bufs, policy)
            phase = "prefill" if tokens.dim() == 2 else "decode"
            self.t[phase] += time.perf_counter() - t0
            self.steps += phase == "decode"
            return out
        return timed


def run(llm, prompts, new_tokens, spec):
    policy = spec.make()
    timer = Timed(policy)
    real = gen.forward
    gen.forward = timer.forward(real)
    try:
        generate(llm.model, prompts, new_tokens, policy, Sampling(), (), llm.pad_id)
    finally:
        gen.forward = real
    step = timer.t["decode"] / timer.steps
    return {"policy": spec.name, "slots": policy.slots, "prefill_s": timer.t["prefill"],
            "decode_step_ms": 1e3 * step, "hooks_ms_per_step": 1e3 * timer.t["hooks"] / timer.steps,
            "hooks_fraction_of_step": timer.t["hooks"] / timer.t["decode"],
            "decode_tok_per_s": len(prompts) / step}


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--policies", default="all")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    names = sorted(POLICIES) if args.policies == "all" else args.policies.split(",")
    names = ["full"] + [n for n in names if n != "full"]
    llm = LLM("smollm2-135m")
    ids = llm.tokenizer.encode(wikipedia_text(), special=False)
    prompts = [ids[i * args.context:(i + 1) * args.context] for i in range(args.batch)]
    rows = []
    with torch.inference_mode():
        for name in names:
            spec = PolicySpec(name, budget=None if name == "full" else args.budget)
            row = run(llm, prompts, args.new_tokens, spec)
            rows.append(row)
            full = rows[0]
            row["decode_speedup_vs_full"] = full["decode_step_ms"] / row["decode_step_ms"]
            print(f"{name:13s} slots {row['slots']:5d}  prefill {row['prefill_s']:6.1f}s  decode "
                  f"{row['decode_step_ms']:6.1f} ms/step ({row['decode_tok_per_s']:5.1f} tok/s, "
                  f"{row['decode_speedup_vs_full']:.2f}x full)  policy hooks "
                  f"{row['hooks_ms_per_step']:5.2f} ms = {100 * row['hooks_fraction_of_step']:4.1f}% "
                  "of the step", flush=True)
    result = {"model": "smollm2-135m", "device": "cpu", "batch": args.batch,
              "context": args.context, "new_tokens": args.new_tokens, "budget": args.budget,
              "rows": rows}
    write_json(args.json, result)


if __name__ == "__main__":
    main()
