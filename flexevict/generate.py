"""`python -m flexevict.generate`: offline batch generation (one prompt, or a JSONL file).

    python -m flexevict.generate --model smollm2-135m --prompt "The capital of France is" --max-new-tokens 32
    python -m flexevict.generate --model smollm2-135m --input prompts.jsonl --output out.jsonl --max-new-tokens 64
"""
from __future__ import annotations

import argparse
import os
import sys

from .cli import (add_model_args, check_prompts, cpu_threads, load_llm, policy_spec, print_resolved,
                  read_jsonl_prompts, without_line, write_jsonl_atomic)
from .errors import UserError, cli_errors
from .generation import Sampling


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m flexevict.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt; the completion is printed")
    src.add_argument("--input", help='JSONL file of {"id": ..., "prompt": ...} lines')
    p.add_argument("--output", help="JSONL output (with --input): id, prompt, completion, tokens")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--greedy", action="store_true", help="greedy decoding (the default)")
    p.add_argument("--temperature", type=float, default=None, help="sample with this temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args(argv)
    if args.input and not args.output:
        p.error("--input needs --output")
    if args.greedy and args.temperature is not None:
        p.error("--greedy and --temperature exclude each other")
    return args


def main(argv=None):
    args = parse_args(argv)
    with cli_errors("flexevict.generate"), cpu_threads(args.threads):
        if args.prompt is not None and not args.prompt.strip():
            raise UserError("--prompt is empty; give it some text")
        rows = read_jsonl_prompts(args.input) if args.input else [{"prompt": args.prompt}]
        if args.output and not os.access(os.path.dirname(os.path.abspath(args.output)), os.W_OK):
            raise UserError(f"{args.output}: output directory is not writable")
        sampling = Sampling(greedy=args.temperature is None,
                            temperature=1.0 if args.temperature is None else args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
        sampling.check()
        spec = policy_spec(args)
        check_prompts(args, rows, args.max_new_tokens, args.input or "--prompt")
        llm = load_llm(args)
        outs = llm.generate([r["prompt"] for r in rows], args.max_new_tokens, sampling,
                            policy=spec, batch_size=args.batch_size, progress=len(rows) > 1)
        print_resolved(llm.resolved)
        if args.input:
            write_jsonl_atomic(args.output, [{**without_line(r), "completion": o["completion"],
                                              "tokens": o["tokens"]} for r, o in zip(rows, outs)])
            print(f"wrote {len(rows)} completions to {args.output}", file=sys.stderr)
        else:
            print(outs[0]["completion"])


if __name__ == "__main__":
    main()
