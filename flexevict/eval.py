"""`python -m flexevict.eval`: accuracy on the same engine path as generation.

    python -m flexevict.eval ppl --model smollm2-135m --text FILE --max-tokens 1024 --json
    python -m flexevict.eval ppl --model smollm2-135m --text FILE --policy h2o --budget 0.2 --json
    python -m flexevict.eval agreement --model smollm2-135m --policy h2o --budget 0.2 \\
        --input prompts.jsonl --max-new-tokens 64 --json

With eviction, `ppl` prefills `--prefill-tokens` tokens (default: the slot count) and feeds the
rest one token at a time through the decode path, evicting exactly as generation does.
`agreement` compares greedy continuations with the full cache's.
"""
from __future__ import annotations

import argparse
import json
import sys

from .cli import add_model_args, load_llm, policy_spec, print_resolved, read_jsonl_prompts, read_text
from .errors import UserError, cli_errors
from .metrics import rouge_l, token_agreement
from .policies import PolicySpec


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m flexevict.eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="task", required=True)
    ppl = sub.add_parser("ppl", help="perplexity of a text file's first N tokens")
    add_model_args(ppl)
    ppl.add_argument("--text", required=True, help="UTF-8 text file")
    ppl.add_argument("--max-tokens", type=int, default=None, help="keep the first N tokens")
    ppl.add_argument("--prefill-tokens", type=int, default=None,
                     help="with eviction: tokens prefilled before decoding (default: slots)")
    agree = sub.add_parser("agreement", help="greedy continuations vs the full cache")
    add_model_args(agree)
    agree.add_argument("--input", required=True, help='JSONL of {"id": ..., "prompt": ...}')
    agree.add_argument("--max-new-tokens", type=int, default=64)
    agree.add_argument("--batch-size", type=int, default=8)
    for sp in (ppl, agree):
        sp.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def budget_label(args):
    if args.budget_tokens is not None:
        return None
    return args.budget if args.budget is not None else 1.0


def run_ppl(args) -> dict:
    text = read_text(args.text)
    if args.max_tokens is not None and args.max_tokens < 2:
        raise UserError(f"--max-tokens must be >= 2 (got {args.max_tokens})")
    spec = policy_spec(args)
    llm = load_llm(args, progress=not args.json)
    result = llm.score(text, max_tokens=args.max_tokens, policy=spec,
                       prefill_tokens=args.prefill_tokens)
    print_resolved(llm.resolved)
    return {"model": llm.config.name, "policy": args.policy, "budget": budget_label(args), **result}


def run_agreement(args) -> dict:
    rows = read_jsonl_prompts(args.input)
    spec = policy_spec(args)
    llm = load_llm(args, progress=not args.json)
    prompts = [r["prompt"] for r in rows]
    # exactly max_new_tokens each (no stop tokens) so both runs are compared step for step
    ref = llm.generate(prompts, args.max_new_tokens, policy=PolicySpec("full"),
                       batch_size=args.batch_size, stop_ids=())
    llm.resolved.clear()
    out = llm.generate(prompts, args.max_new_tokens, policy=spec, batch_size=args.batch_size,
                       stop_ids=())
    print_resolved(llm.resolved)
    per = []
    for row, a, r in zip(rows, out, ref):
        frac, first = token_agreement(a["ids"], r["ids"])
        per.append({"id": row.get("id"), "token_agreement": frac, "first_divergence": first,
                    "rouge_l": rouge_l(a["completion"], r["completion"])})
    mean = lambda key: sum(p[key] for p in per) / len(per)
    return {"model": llm.config.name, "policy": args.policy, "budget": budget_label(args),
            "slots": [r["slots"] for r in llm.resolved], "prompts": len(per),
            "max_new_tokens": args.max_new_tokens, "token_agreement": mean("token_agreement"),
            "first_divergence": mean("first_divergence"), "rouge_l": mean("rouge_l"),
            "per_prompt": per}


def main(argv=None):
    args = parse_args(argv)
    with cli_errors("flexevict.eval"):
        result = run_ppl(args) if args.task == "ppl" else run_agreement(args)
        if args.json:
            print(json.dumps(result))
        elif args.task == "ppl":
            print(f"{result['model']} policy={result['policy']} slots={result['slots']} "
                  f"tokens={result['tokens']} nll={result['nll']:.4f} ppl={result['ppl']:.4f}")
        else:
            print(f"{result['model']} policy={result['policy']} token_agreement="
                  f"{result['token_agreement']:.3f} first_divergence={result['first_divergence']:.1f}"
                  f" rouge_l={result['rouge_l']:.3f}", file=sys.stdout)


if __name__ == "__main__":
    main()
