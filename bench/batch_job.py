"""What the batch job's machinery costs: `flexevict.generate --input` (pre-pass, windows,
blocks, per-block commits, assembly in input order) against `python -m flexevict.bench` at the
same model, lengths and effective batch, side by side in one run. Goal: the job's throughput
>= 0.9x the bench's.

    python bench/batch_job.py [--model opt-125m] [--prompt-len 64] [--gen-len 16]
        [--gpu-batch-size 8] [--num-gpu-batches 2] [--blocks 6] [--repeats 3] [--threads 1]
        [--json FILE]

Bench: FlexGen's benchmark (one block of gpu_batch_size x num_gpu_batches random prompts,
after its warm-up), run --blocks times; throughput = generated tokens / the runs' prefill +
decode time. Job: --blocks blocks of
prompts of exactly --prompt-len tokens (dummy weights: one token per byte), greedy, after a
one-block warm-up job in the same process; throughput = generated tokens / (job wall time -
model load). Runs alternate bench, job, bench, job ...; the ratio is of the medians. Every job
row must generate all --gen-len tokens (no early end-of-sequence), else the jobs did less work.
On a shared machine the two sides' speeds drift between runs; the job's own engine share (its
blocks' generation time / its wall time) measures its machinery without that noise.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from common import write_json

from flexevict.bench.throughput import parse_args as bench_args, run as bench_run
from flexevict.runtime.generation import Sampling
from flexevict.jobs import JobSpec, run_job
from flexevict.runtime.placement import Placement
from flexevict.policies import PolicySpec


class TimedSpec(JobSpec):
    """A JobSpec that times its model load (the bench's clock does not include one)."""
    load_seconds: list = []

    def llm(self, progress=False):
        t0 = time.perf_counter()
        llm = super().llm(progress=False)
        TimedSpec.load_seconds.append(time.perf_counter() - t0)
        return llm


def write_prompts(path: str, rows: int, length: int):
    """rows prompts of exactly `length` byte tokens, all different."""
    with open(path, "w") as f:
        for i in range(rows):
            text = (f"row {i} " + "abcdefghijklmnopqrstuvwxyz" * length)[:length]
            f.write(json.dumps({"id": i, "prompt": text}) + "\n")


def run_one_job(args, folder: str, rows: int, name: str) -> dict:
    inp, out = os.path.join(folder, f"{name}.in.jsonl"), os.path.join(folder, f"{name}.jsonl")
    write_prompts(inp, rows, args.prompt_len)
    spec = TimedSpec(input=inp, output=out, model=args.model, path=None, weights="_DUMMY_",
                     device="cpu", dtype="float32", seed=0,
                     placement=Placement(gpu_batch_size=args.gpu_batch_size,
                                         num_gpu_batches=args.num_gpu_batches),
                     policy=PolicySpec("full"), sampling=Sampling(),
                     max_new_tokens=args.gen_len, threads=args.threads)
    t0 = time.perf_counter()
    summary = run_job(spec, restart=True)
    wall = time.perf_counter() - t0 - TimedSpec.load_seconds[-1]
    return {"wall_s": wall, "load_s": TimedSpec.load_seconds[-1],
            "generated_tokens": summary["generated_tokens"],
            "all_rows_full_length": summary["generated_tokens"] == rows * args.gen_len,
            "engine_s": summary["generate_seconds"],
            "commit_s": summary["commit_seconds"],
            "throughput": summary["generated_tokens"] / wall}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="opt-125m")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=16)
    ap.add_argument("--gpu-batch-size", type=int, default=8)
    ap.add_argument("--num-gpu-batches", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    block = args.gpu_batch_size * args.num_gpu_batches
    bench_argv = ["--model", args.model, "--device", "cpu", "--prompt-len", str(args.prompt_len),
                  "--gen-len", str(args.gen_len), "--gpu-batch-size", str(args.gpu_batch_size),
                  "--num-gpu-batches", str(args.num_gpu_batches)]
    benches, jobs = [], []
    with tempfile.TemporaryDirectory() as folder:
        run_one_job(args, folder, block, "warmup")
        for r in range(args.repeats):
            runs = [bench_run(bench_args(bench_argv)) for _ in range(args.blocks)]
            seconds = sum(b["total_latency_s"] for b in runs)
            benches.append({"throughput": block * args.gen_len * args.blocks / seconds,
                            "latency_s": [b["total_latency_s"] for b in runs]})
            jobs.append(run_one_job(args, folder, block * args.blocks, f"job{r}"))
            print(f"repeat {r}: bench {benches[-1]['throughput']:.1f} token/s, job "
                  f"{jobs[-1]['throughput']:.1f} token/s", file=sys.stderr)
    bench_tp = statistics.median(b["throughput"] for b in benches)
    job_tp = statistics.median(j["throughput"] for j in jobs)
    commits = [j["commit_s"] for j in jobs]
    result = {
        "model": args.model, "weights": "_DUMMY_", "prompt_len": args.prompt_len,
        "gen_len": args.gen_len, "gpu_batch_size": args.gpu_batch_size,
        "num_gpu_batches": args.num_gpu_batches, "block": block, "job_blocks": args.blocks,
        "threads": args.threads, "repeats": args.repeats,
        "bench_throughput": bench_tp, "job_throughput": job_tp, "ratio": job_tp / bench_tp,
        "goal": ">= 0.9", "commit_seconds_per_block_mean":
            sum(c["total"] for c in commits) / sum(c["blocks"] for c in commits),
        "commit_seconds_per_block_max": max(c["max"] for c in commits),
        "job_engine_share": statistics.median(j["engine_s"] / j["wall_s"] for j in jobs),
        "all_rows_full_length": all(j["all_rows_full_length"] for j in jobs),
        "bench_runs": benches, "job_runs": jobs,
    }
    print(f"bench {bench_tp:.1f} token/s, job {job_tp:.1f} token/s: ratio {result['ratio']:.3f} "
          f"(goal >= 0.9); commit {1e3 * result['commit_seconds_per_block_mean']:.2f} ms per "
          f"block (max {1e3 * result['commit_seconds_per_block_max']:.2f} ms); the job's "
          f"blocks took {100 * result['job_engine_share']:.1f}% of its wall time")
    write_json(args.json, result, "cpu")


if __name__ == "__main__":
    main()
