"""What batch invariance costs a mixed-length batch job: the batcher that only pads together
prompts whose budget resolves alike (`generation.plan_batches`) against plain length-sorted
batches, side by side in one run, with how many completions each gives identical to the prompt
run alone.

    python bench/batching.py [--prompts 60] [--batch-size 8] [--policy h2o] [--budget 0.5]
                             [--max-new-tokens 32] [--threads 1] [--json FILE]

SmolLM2-135M (packaged Q4_1 weights, fp32 on CPU), prompts = the first 20-80 words of gensim's
Lee news articles (lengths vary as in a real job), greedy.
"""
import argparse
import random
import time

import torch
from common import write_json

from flexevict import LLM
from flexevict.runtime.generation import Sampling, generate, plan_batches
from flexevict.policies import PolicySpec
from flexevict.evaluation.tasks import news_articles


def prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(a.split()[:rng.randint(20, 80)]) for a in news_articles()[:n]]


def sorted_chunks(lengths, batch_size):
    """Length-sorted batches of batch_size regardless of budgets (the old batcher)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[a:a + batch_size] for a in range(0, len(order), batch_size)]


def run(llm, encoded, batches, spec, new_tokens):
    """-> (outputs per prompt, seconds, generated tokens)."""
    out, t0 = [None] * len(encoded), time.perf_counter()
    for batch in batches:
        ids = generate(llm.engine, [encoded[i] for i in batch], new_tokens, spec.make(),
                       Sampling(), (), llm.pad_id)
        for i, row in zip(batch, ids):
            out[i] = row
    return out, time.perf_counter() - t0, sum(len(r) for r in out)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--policy", default="h2o")
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM("smollm2-135m")
    encoded = [llm.tokenizer.encode(p) for p in prompts(args.prompts)]
    spec = PolicySpec(args.policy, budget=args.budget)
    lengths = [len(e) for e in encoded]
    alone, _, _ = run(llm, encoded, [[i] for i in range(len(encoded))], spec, args.max_new_tokens)
    plans = {"invariant": plan_batches(lengths, args.max_new_tokens, spec.make(), args.batch_size),
             "length-sorted": sorted_chunks(lengths, args.batch_size)}
    result = {"model": "smollm2-135m", "policy": args.policy, "budget": args.budget,
              "prompts": len(encoded), "batch_size": args.batch_size,
              "max_new_tokens": args.max_new_tokens, "prompt_tokens": [min(lengths), max(lengths)]}
    for name, batches in plans.items():
        out, seconds, tokens = run(llm, encoded, batches, spec, args.max_new_tokens)
        result[name] = {"batches": len(batches), "seconds": round(seconds, 3),
                        "tokens_per_s": round(tokens / seconds, 2),
                        "same_as_alone": sum(a == b for a, b in zip(out, alone))}
    result["throughput_ratio"] = round(result["invariant"]["tokens_per_s"]
                                       / result["length-sorted"]["tokens_per_s"], 3)
    llm.close()
    print(result)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
