"""`python -m flexevict.eval`: accuracy on the same engine path as generation.

    python -m flexevict.eval ppl --model smollm2-135m --text FILE --max-tokens 1024 --json
"""
from __future__ import annotations

import argparse
import json

from .cli import add_model_args, load_llm, read_text
from .errors import UserError, cli_errors


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m flexevict.eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="task", required=True)
    ppl = sub.add_parser("ppl", help="perplexity of a text file's first N tokens")
    add_model_args(ppl)
    ppl.add_argument("--text", required=True, help="UTF-8 text file")
    ppl.add_argument("--max-tokens", type=int, default=None, help="keep the first N tokens")
    ppl.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def run_ppl(args) -> dict:
    text = read_text(args.text)
    if args.max_tokens is not None and args.max_tokens < 2:
        raise UserError(f"--max-tokens must be >= 2 (got {args.max_tokens})")
    llm = load_llm(args, progress=not args.json)
    result = llm.score(text, max_tokens=args.max_tokens, policy=args.policy)
    return {"model": llm.config.name, "policy": args.policy, "budget": 1.0, **result}


def main(argv=None):
    args = parse_args(argv)
    with cli_errors("flexevict.eval"):
        result = run_ppl(args)
        if args.json:
            print(json.dumps(result))
        else:
            print(f"{result['model']} policy={result['policy']} tokens={result['tokens']} "
                  f"nll={result['nll']:.4f} ppl={result['ppl']:.4f}")


if __name__ == "__main__":
    main()
