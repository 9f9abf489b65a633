r"""`python -m flexevict.generate`: one prompt, or an offline batch job over a JSONL file.

    python -m flexevict.generate --model smollm2-135m --prompt "The capital of France is" \
        --max-new-tokens 32
    python -m flexevict.generate --model smollm2-135m --input prompts.jsonl --output out.jsonl \
        --max-new-tokens 64

A job runs block by block (--gpu-batch-size x --num-gpu-batches prompts, grouped by length
within a look-ahead --window) and commits each finished block to out.jsonl.state/; killed, it
continues where it stopped when the same command is run again. out.jsonl is written, in input
order, when every row is done, with out.summary.json (and out.errors.jsonl with --on-error skip).
--ray ADDRESS --workers N runs the same job on a Ray cluster.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from flexevict.cli import (add_model_args, check_gpu_batch_size, cpu_threads, has_auto,
                           plan_job, policy_spec, print_resolved)
from flexevict.errors import UserError, cli_errors
from flexevict.runtime.generation import Sampling, Watch
from flexevict.runtime.progress import Progress

DEFAULT_GPU_BATCH = 8            # generate's --gpu-batch-size when not given


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m flexevict.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt; the completion is printed")
    src.add_argument("--input", help='JSONL file of {"id": ..., "prompt": ...} lines, or OpenAI '
                     'batch requests ({"custom_id", "url", "body"}: their body settings override '
                     "the flags below)")
    p.add_argument("--output", help="JSONL output (with --input), in input order: each input "
                   "row plus completion and tokens; for OpenAI batch requests, batch output lines")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--greedy", action="store_true", help="greedy decoding (the default)")
    p.add_argument("--temperature", type=float, default=None,
                   help="sample with this temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=None,
                   help="deprecated: the same as --gpu-batch-size N with one GPU batch (a block is "
                        f"--gpu-batch-size, default {DEFAULT_GPU_BATCH} here, x --num-gpu-batches)")
    job = p.add_argument_group("batch jobs (--input)")
    job.add_argument("--chat", action="store_true",
                     help="format each prompt (or a row's messages) with the model's chat template")
    job.add_argument("--on-error", choices=["fail", "skip"], default="fail",
                     help="fail: any bad row stops the job before the model loads (default); "
                          "skip: bad rows go to OUT.errors.jsonl and the job goes on")
    job.add_argument("--window", type=int, default=None,
                     help="look-ahead rows sorted by length into blocks (default 16 blocks); "
                          "bounds the memory for any input size")
    job.add_argument("--restart", action="store_true",
                     help="discard the committed blocks of an earlier run and start over")
    job.add_argument("--ray", metavar="ADDRESS",
                     help="run on Ray: auto (a running cluster, else a local one) or HEAD:6379")
    job.add_argument("--workers", type=int, default=1,
                     help="engine workers with --ray, one model each (default 1)")
    args = p.parse_args(argv)
    if args.input and not args.output:
        p.error("--input needs --output")
    if args.greedy and args.temperature is not None:
        p.error("--greedy and --temperature exclude each other")
    return args


def batch_flags(args):
    """One notion of batch size with bench and eval: --gpu-batch-size x --num-gpu-batches.
    The old --batch-size N is --gpu-batch-size N with one GPU batch."""
    if args.batch_size is not None:
        if args.batch_size < 1:
            raise UserError(f"--batch-size must be >= 1 (got {args.batch_size})")
        if args.gpu_batch_size or args.num_gpu_batches != 1:
            raise UserError("--batch-size is the old name of --gpu-batch-size with one GPU batch; "
                            "give --gpu-batch-size and --num-gpu-batches instead")
        print(f"note: --batch-size is deprecated; use --gpu-batch-size {args.batch_size}",
              file=sys.stderr)
        args.gpu_batch_size = args.batch_size
    check_gpu_batch_size(args)
    if not has_auto(args):             # with auto placement flags, the planner picks it
        args.gpu_batch_size = args.gpu_batch_size or DEFAULT_GPU_BATCH


def job_spec(args):
    """Every flag checked before anything is read -> the job's JobSpec."""
    from flexevict.api import resolve_device, resolve_model
    from flexevict.core.config import DTYPES, default_dtype
    from flexevict.jobs import JobSpec
    if args.prompt is not None and not args.prompt.strip():
        raise UserError("--prompt is empty; give it some text")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1 (got {args.max_new_tokens})")
    if args.output and not os.access(os.path.dirname(os.path.abspath(args.output)), os.W_OK):
        raise UserError(f"{args.output}: output directory is not writable")
    if args.prompt is not None and (args.ray or args.on_error != "fail" or args.restart):
        raise UserError("--ray, --on-error and --restart are for jobs: give --input and --output")
    if args.workers < 1:
        raise UserError(f"--workers must be >= 1 (got {args.workers})")
    if args.input:
        from flexevict.jobs.runner import check_paths
        check_paths(args.input, args.output)
    batch_flags(args)
    sampling = Sampling(greedy=args.temperature is None,
                        temperature=1.0 if args.temperature is None else args.temperature,
                        top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    sampling.check()
    policy = policy_spec(args)
    policy.make()                      # its arguments refused now, not after the model loads
    placement = plan_job(args)         # --threads auto, auto flags and the run's checks too
    if placement.gpu_batch_size < 1:
        placement = dataclasses.replace(placement, gpu_batch_size=DEFAULT_GPU_BATCH)
    if args.ray and args.device == "auto":
        raise UserError("with --ray give the workers' device: --device cpu or --device cuda")
    device = args.device if args.ray else str(resolve_device(args.device))
    dtype = args.dtype or default_dtype(device)
    if dtype not in DTYPES:
        raise UserError(f"unknown --dtype '{dtype}' ({', '.join(DTYPES)})")
    _, weights = resolve_model(args.model, args.path)
    spec = JobSpec(input=args.input, output=args.output, model=args.model, path=args.path,
                   weights=weights, device=device, dtype=dtype, seed=args.seed,
                   placement=placement, policy=policy, sampling=sampling,
                   max_new_tokens=args.max_new_tokens, chat=args.chat, window=args.window or 0,
                   on_error=args.on_error, threads=args.threads,
                   created=int(os.stat(args.input).st_mtime) if args.input and
                   os.path.isfile(args.input) else 0)
    if args.window is not None and args.window < spec.block_size:
        raise UserError(f"--window must hold at least one block ({spec.block_size} rows: "
                        f"--gpu-batch-size x --num-gpu-batches); got {args.window}")
    return spec


def generate_one(spec, prompt: str) -> str:
    """The --prompt path: one prompt (chat-formatted with --chat), checked before loading."""
    from flexevict.jobs.inputs import Row, RowError
    try:
        ids = spec.prompter().encode(Row(0, None, {}, prompt=prompt, request=spec.defaults))
    except RowError as e:
        raise UserError(f"--prompt: {e.reason}") from None
    llm = spec.llm(progress=True)
    try:
        with Progress(spec.max_new_tokens, "generating", "token") as bar:
            outs, resolved = llm.generate_block([ids], spec.max_new_tokens, spec.sampling,
                                                spec.policy, watch=Watch(None, lambda *_:
                                                                         bar.update()))
    finally:
        llm.close()
    print_resolved([resolved])
    return llm.tokenizer.decode(outs[0])


def summary_line(s: dict) -> str:
    from flexevict.jobs.state import paths_for
    failed = f" ({s['failed_rows']} failed rows in {s['errors']})" if s["failed_rows"] else ""
    rate = s["this_run"]["generated_tokens_per_second"] or 0.0
    return (f"wrote {s['completed_rows']} completions to {s['output']}{failed}; this run "
            f"generated {s['this_run']['generated_tokens']} tokens in "
            f"{s['this_run']['wall_seconds']:.1f} s ({rate:.1f} tokens/s); summary in "
            f"{paths_for(s['output'])['summary']}")


def main(argv=None):
    args = parse_args(argv)
    with cli_errors("flexevict.generate"), cpu_threads(args.threads):
        spec = job_spec(args)
        if args.prompt is not None:
            print(generate_one(spec, args.prompt))
            return
        from flexevict.jobs import run_job
        summary = run_job(spec, restart=args.restart, ray=args.ray, workers=args.workers)
        if summary is None:            # already complete: nothing was generated
            return
        print_resolved(summary["resolved"])
        print(summary_line(summary), file=sys.stderr)


if __name__ == "__main__":
    main()
