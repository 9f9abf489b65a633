r"""The CPU suite run by two source trees side by side: this checkout and another (e.g. the
commit before a refactor), case by case in alternation, so that a disturbance of the shared
machine hits both alike. Reports each tree's median total throughput per case and their ratio.

    git worktree add /tmp/before <commit>       # or: git archive <commit> | tar -x -C /tmp/before
    python bench/side_by_side.py --before /tmp/before --rounds 3 \
        --out bench/results/side_by_side_cpu

Each run is `python -m flexevict.bench <case> --threads 1` (no peer) in a fresh
process with the tree first on PYTHONPATH (its `policies/` reachable as flexevict.policies via a
symlink the script makes if the tree lacks one). Writes OUT.md and OUT.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from common import write_report  # noqa: E402
from suites import SUITES  # noqa: E402

from flexevict.errors import UserError, cli_errors  # noqa: E402


def prepare(tree: str) -> str:
    """The tree's absolute path, checked; links policies/ in as flexevict/policies when the
    tree is a plain source copy (an editable install maps it, a bare PYTHONPATH does not)."""
    tree = os.path.abspath(tree)
    if not os.path.isfile(os.path.join(tree, "flexevict", "__init__.py")):
        raise UserError(f"--before {tree}: not a flexevict source tree (no flexevict/__init__.py)")
    link = os.path.join(tree, "flexevict", "policies")
    if os.path.isdir(os.path.join(tree, "policies")) and not os.path.exists(link):
        os.symlink(os.path.join("..", "policies"), link)
    return tree


def run_case(tree: str, argv: list[str], scratch: str) -> float | None:
    """Total throughput (token/s) of one bench run from `tree`, or None when it failed."""
    out = os.path.join(scratch, "r.json")
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1", FLEXEVICT_PROGRESS_SECONDS="0")
    proc = subprocess.run([sys.executable, "-m", "flexevict.bench", *argv, "--threads", "1",
                           "--json", out], cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"  failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}", file=sys.stderr)
        return None
    with open(out) as f:
        return json.load(f)["total_throughput"]


def compare(cases: list[dict], trees: dict[str, str], rounds: int) -> list[dict]:
    runs = {c["name"]: {label: [] for label in trees} for c in cases}
    with tempfile.TemporaryDirectory() as scratch:
        for r in range(rounds):
            for c in cases:
                for label, tree in (trees.items() if r % 2 == 0 else reversed(trees.items())):
                    runs[c["name"]][label].append(run_case(tree, c["argv"], scratch))
                print(f"round {r + 1}/{rounds} {c['name']}: {runs[c['name']]}", file=sys.stderr)
    rows = []
    for name, by in runs.items():
        med = {label: statistics.median(v) if all(x is not None for x in v) else None
               for label, v in by.items()}
        ratio = med["after"] / med["before"] if med["after"] and med["before"] else None
        rows.append({"case": name, "runs": by, "median": med, "after_over_before": ratio})
    return rows


def table(rows: list[dict], rounds: int, before: str) -> str:
    lines = [f"## CPU suite, this tree (after) vs {before} (before), side by side", "",
             f"Median total throughput (token/s) of {rounds} alternating runs per case and tree, "
             "--threads 1.", "", "| case | before | after | after / before |", "|---|---|---|---|"]
    fmt = lambda x, p: "n/a" if x is None else f"{x:.{p}f}"  # noqa: E731
    for r in rows:
        lines.append(f"| {r['case']} | {fmt(r['median']['before'], 1)} | "
                     f"{fmt(r['median']['after'], 1)} | {fmt(r['after_over_before'], 2)} |")
    ratios = [r["after_over_before"] for r in rows if r["after_over_before"]]
    if ratios:
        lines += ["", f"Median of the ratios: {statistics.median(ratios):.2f} "
                      f"(range {min(ratios):.2f} to {max(ratios):.2f})."]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, metavar="DIR", help="the other source tree")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--case", action="append", default=[], help="only these CPU suite cases")
    ap.add_argument("--gen-len", type=int, default=None, help="override every case's --gen-len")
    ap.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.md, .json")
    args = ap.parse_args(argv)
    with cli_errors("bench/side_by_side.py"):
        if args.rounds < 1:
            raise UserError(f"--rounds {args.rounds}: must be >= 1")
        cases = [c for c in SUITES["cpu"]() if not args.case or c["name"] in args.case]
        if not cases:
            raise UserError(f"--case {', '.join(args.case)}: not in the cpu suite")
        for c in cases:
            if args.gen_len:
                i = c["argv"].index("--gen-len")
                c["argv"][i + 1] = str(args.gen_len)
        trees = {"before": prepare(args.before), "after": ROOT}
        rows = compare(cases, trees, args.rounds)
        text = table(rows, args.rounds, os.path.basename(os.path.abspath(args.before)))
        write_report(args.out, text, {"before": trees["before"], "rounds": args.rounds,
                                      "cases": rows})


if __name__ == "__main__":
    main()
