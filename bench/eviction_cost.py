"""What eviction costs and what it buys on a CPU: every seed policy at a 20% budget against
`full`, at 2048 prompt tokens with 32 and with 256 generated, run by two source trees side by
side (this checkout, "after", and another, "before": e.g. the commit before a change), case by
case in alternation so that a disturbance of the shared machine hits both alike; without
--before, this tree alone (the cost of policies that have no "before", e.g. the weight-free
methods of 2025-2026 beside `full` and `h2o`).

    git worktree add /tmp/before <commit>
    python bench/eviction_cost.py --before /tmp/before --out bench/results/eviction_cost_cpu
    python bench/eviction_cost.py --policy full --policy h2o --policy triattention \
        --policy keydiff --policy snapkv --out bench/results/eviction_cost_cpu_methods_2026

Each run is `python -m flexevict.bench --model smollm2-135m --prompt-len 2048 --gen-len G
--gpu-batch-size 8 --threads 2 --policy P [--budget 0.2]` in a fresh process with the tree
first on PYTHONPATH; each tree keeps its own calibration cache (FLEXEVICT_CACHE_DIR), so the
prediction each run prints is its own tree's. Writes OUT.md (the tables) and OUT.json (every
run's bench JSON). --model, --prompt-len, --gen-len and --batch change the case (the committed
results use the defaults); --budget (0.2) and `--policy recall` (not a seed policy) too.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from common import SEED_POLICIES, write_report  # noqa: E402
from side_by_side import prepare  # noqa: E402

from flexevict.errors import UserError, cli_errors  # noqa: E402

POLICIES = ("full",) + SEED_POLICIES
# not seed policies, compared with them: recall, and the weight-free methods engines ship in 2026
CHOICES = POLICIES + ("recall", "triattention", "keydiff", "snapkv")
GEN_LENS = (32, 256)


def this_tree() -> str:
    """ROOT, which imports its own policies: through the installed package when it is the
    installed tree, else through the link `prepare` makes (a worktree of this checkout)."""
    import flexevict.policies
    installed = os.path.dirname(os.path.dirname(os.path.realpath(flexevict.policies.__file__)))
    return ROOT if installed == os.path.realpath(ROOT) else prepare(ROOT)


def bench_argv(policy: str, gen_len: int, args) -> list[str]:
    argv = ["--model", args.model, "--prompt-len", str(args.prompt_len), "--gen-len",
            str(gen_len), "--gpu-batch-size", str(args.batch), "--threads", "2",
            "--policy", policy]
    return argv if policy == "full" else argv + ["--budget", str(args.budget)]


def run_case(tree: str, argv: list[str], scratch: str, cache: str) -> dict:
    """One bench run from `tree` -> its JSON result, or {"error": last stderr line}."""
    out = os.path.join(scratch, "r.json")
    env = dict(os.environ, PYTHONPATH=tree, FLEXEVICT_PROGRESS_SECONDS="0",
               FLEXEVICT_CACHE_DIR=cache)
    proc = subprocess.run([sys.executable, "-m", "flexevict.bench", *argv, "--json", out],
                          cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    with open(out) as f:
        return json.load(f)


def summary(r: dict, full: dict | None) -> dict:
    """The table's numbers of one run (and its ratios to `full`'s run of the same tree)."""
    if "error" in r:
        return {"error": r["error"]}
    pred = r.get("predicted") or {}
    row = {"prefill_s": r["prefill_latency_s"], "decode_tok_s": r["decode_throughput"],
           "total_tok_s": r["total_throughput"], "eviction_s": r["eviction_s"],
           "prefill_eviction_s": r.get("prefill_eviction_s"),     # None: before the split
           "decode_eviction_share": r["eviction_share_of_decode"],
           "measured_over_predicted": (r["total_throughput"] / pred["throughput"]
                                       if pred.get("throughput") else None)}
    if full and "error" not in full:
        row["prefill_vs_full"] = r["prefill_latency_s"] / full["prefill_latency_s"]
        row["total_vs_full"] = r["total_throughput"] / full["total_throughput"]
    return row


def table(results: dict, prompt_len: int, gen_len: int, label: str) -> str:
    fmt = lambda x, p=2: "–" if x is None else f"{x:.{p}f}"  # noqa: E731
    lines = [f"### {label}, {prompt_len} + {gen_len}", "",
             "| policy | prefill s | prefill vs full | decode tok/s | eviction (prefill; decode, "
             "share of decode) | total tok/s | total vs full | planner measured / predicted |",
             "|---|---|---|---|---|---|---|---|"]
    for policy, r in results[label][str(gen_len)].items():
        s = summary(r, results[label][str(gen_len)].get("full"))
        if "error" in s:
            lines.append(f"| {policy} | error: {s['error']} |||||||")
            continue
        if s["prefill_eviction_s"] is None:      # the old counter: prefill and decode together
            evict = f"{s['eviction_s']:.2f} s in all"
        else:
            share = s["decode_eviction_share"]
            evict = (f"{s['prefill_eviction_s']:.2f} s; {s['eviction_s']:.2f} s"
                     + ("" if share is None else f", {100 * share:.1f}%"))
        lines.append(f"| {policy} | {fmt(s['prefill_s'], 1)} | {fmt(s.get('prefill_vs_full'))} | "
                     f"{fmt(s['decode_tok_s'], 1)} | {evict} | {fmt(s['total_tok_s'])} | "
                     f"{fmt(s.get('total_vs_full'))} | {fmt(s['measured_over_predicted'])} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", metavar="DIR",
                    help="the other source tree (default: none, this tree alone)")
    ap.add_argument("--policy", action="append", default=[], choices=CHOICES,
                    help="only these policies (default: the seven above)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--gen-len", type=int, action="append", default=[],
                    help="generated tokens (repeatable; default 32 and 256)")
    ap.add_argument("--batch", type=int, default=8, help="--gpu-batch-size of every run")
    ap.add_argument("--budget", type=float, default=0.2, help="every policy's but full's")
    ap.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.md, .json")
    args = ap.parse_args(argv)
    gen_lens = args.gen_len or list(GEN_LENS)
    with cli_errors("bench/eviction_cost.py"):
        if min(args.prompt_len, args.batch, *gen_lens) < 1:
            raise UserError("--prompt-len, --gen-len and --batch must be >= 1")
        if not 0 < args.budget <= 1:
            raise UserError(f"--budget must be in (0, 1] (got {args.budget})")
        trees = {"before": prepare(args.before)} if args.before else {}
        trees["after"] = this_tree()
        policies = args.policy or list(POLICIES)
        results = {label: {str(g): {} for g in gen_lens} for label in trees}
        with tempfile.TemporaryDirectory() as scratch:
            caches = {label: os.path.join(scratch, f"cache-{label}") for label in trees}
            for g in gen_lens:
                for n, policy in enumerate(policies):
                    order = list(trees.items())
                    for label, tree in (order if n % 2 == 0 else reversed(order)):
                        r = run_case(tree, bench_argv(policy, g, args), scratch, caches[label])
                        results[label][str(g)][policy] = r
                        print(f"{label} {args.prompt_len}+{g} {policy}: "
                              + (r["error"] if "error" in r else
                                 f"{r['total_throughput']:.2f} token/s"), file=sys.stderr,
                              flush=True)
        text = "\n\n".join(table(results, args.prompt_len, g, label)
                             for g in gen_lens for label in trees)
        commands = {f"{policy}@{g}": "python -m flexevict.bench "
                    + " ".join(bench_argv(policy, g, args)) for policy in policies
                    for g in gen_lens}
        write_report(args.out, text, {"before": trees.get("before"), "commands": commands,
                                      "runs": results})


if __name__ == "__main__":
    main()
