"""What `recall` costs and saves at long context: `full`, `h2o` and `recall` at one budget,
side by side in one run (each a fresh `python -m flexevict.bench` process, in turn, so a
disturbance of the shared machine hits all alike), reported as decode and total throughput
and their ratios to `full` and to `h2o`.

    python bench/recall_speed.py --out bench/results/recall_speed_cpu

Each run is `python -m flexevict.bench --model smollm2-135m --prompt-len 6144 --gen-len 64
--gpu-batch-size 1 --threads 2 --policy P [--budget 0.1]`. Writes OUT.md (the table and the
commands) and OUT.json (every run's bench JSON).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import write_report  # noqa: E402
from eviction_cost import run_case, this_tree  # noqa: E402

from flexevict.errors import UserError, cli_errors  # noqa: E402

POLICIES = ("full", "h2o", "recall")


def bench_argv(policy: str, args) -> list[str]:
    argv = ["--model", args.model, "--prompt-len", str(args.prompt_len), "--gen-len",
            str(args.gen_len), "--gpu-batch-size", str(args.batch), "--threads", "2",
            "--policy", policy]
    return argv if policy == "full" else argv + ["--budget", str(args.budget)]


def table(runs: dict, args) -> str:
    lines = [f"{args.model}, {args.prompt_len} + {args.gen_len}, batch {args.batch}, "
             f"budget {args.budget}", "",
             "| policy | prefill s | decode tok/s | decode vs full | decode vs h2o | "
             "total tok/s | eviction share of decode |", "|---|---|---|---|---|---|---|"]
    for policy, r in runs.items():
        if "error" in r:
            lines.append(f"| {policy} | error: {r['error']} ||||||")
            continue
        ratio = lambda other: ("–" if "error" in runs.get(other, {"error": 1}) else  # noqa: E731
                               f"{r['decode_throughput'] / runs[other]['decode_throughput']:.2f}")
        share = r.get("eviction_share_of_decode")
        lines.append(f"| {policy} | {r['prefill_latency_s']:.1f} | {r['decode_throughput']:.2f} | "
                     f"{ratio('full')} | {ratio('h2o')} | {r['total_throughput']:.2f} | "
                     + ("–" if share is None else f"{100 * share:.1f}%") + " |")
    lines += ["", "Commands:", ""]
    lines += [f"    python -m flexevict.bench {' '.join(bench_argv(p, args))}" for p in runs]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-len", type=int, default=6144)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1, help="--gpu-batch-size of every run")
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.md, .json")
    args = ap.parse_args(argv)
    with cli_errors("bench/recall_speed.py"):
        if min(args.prompt_len, args.gen_len, args.batch) < 1:
            raise UserError("--prompt-len, --gen-len and --batch must be >= 1")
        tree, runs = this_tree(), {}
        with tempfile.TemporaryDirectory() as scratch:
            for policy in POLICIES:
                runs[policy] = run_case(tree, bench_argv(policy, args), scratch,
                                        os.path.join(scratch, "cache"))
                print(f"{policy}: " + (runs[policy]["error"] if "error" in runs[policy] else
                                       f"{runs[policy]['decode_throughput']:.2f} decode token/s"),
                      file=sys.stderr, flush=True)
        write_report(args.out, table(runs, args), {"args": vars(args), "runs": runs})


if __name__ == "__main__":
    main()
