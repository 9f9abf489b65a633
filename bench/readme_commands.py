"""Every command of README.md run as a new user runs it, under a pipe: its wall time, exit code
and longest silent gap (the longest stretch with no line on stdout or stderr, from the start to
the exit), side by side in one table.

    python bench/readme_commands.py --out bench/results/readme_commands_cpu

Each command runs in a fresh interpreter from a scratch folder whose `bench/` is the
repository's (outputs land there, not in the checkout), with the environment as given (set
FLEXEVICT_PROGRESS_SECONDS to see its effect). Commands that need a GPU, a Ray cluster or an
hour of measuring are listed and skipped; the headline `bench --model opt-30b` runs (it answers
before loading anything).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ELSEWHERE = ("--device cuda", "--ray ", "opt-6.7b", "opt-175b", "eval sweep", "calibrate")


def readme_commands(path: str) -> list[str]:
    """The `python -m flexevict...` lines of the file's bash blocks, continuations joined and
    trailing comments dropped, in order, each once."""
    text = open(path, encoding="utf-8").read()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line.startswith("python -m flexevict.") and line not in out:
                out.append(line)
    return out


def run(cmd: str, cwd: str, limit: float) -> dict:
    """One command under a pipe -> {command, rc, wall_s, longest_gap_s, lines, last_line}."""
    start = time.monotonic()
    stamps, lines = [start], []
    argv = [sys.executable if a == "python" else a for a in shlex.split(cmd)]
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    killer = threading.Timer(limit, proc.kill)
    killer.start()
    for line in proc.stdout:
        stamps.append(time.monotonic())
        lines.append(line.rstrip("\n"))
    rc = proc.wait()
    killer.cancel()
    stamps.append(time.monotonic())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"command": cmd, "rc": rc, "wall_s": round(stamps[-1] - start, 2),
            "longest_gap_s": round(max(gaps), 2), "lines": len(lines),
            "last_line": lines[-1][:300] if lines else ""}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="results prefix: OUT.json and OUT.md")
    p.add_argument("--limit", type=float, default=1800, help="seconds per command at most")
    p.add_argument("--only", default="", help="run only the commands containing this text")
    args = p.parse_args(argv)
    commands = [c for c in readme_commands(os.path.join(ROOT, "README.md")) if args.only in c]
    results, skipped = [], [c for c in commands if any(n in c for n in ELSEWHERE)]
    with tempfile.TemporaryDirectory() as scratch:
        os.symlink(os.path.join(ROOT, "bench"), os.path.join(scratch, "bench"))
        for cmd in commands:
            if cmd in skipped:
                continue
            results.append(run(cmd, scratch, args.limit))
            r = results[-1]
            print(f"{r['wall_s']:8.1f} s  gap {r['longest_gap_s']:6.1f} s  rc {r['rc']}  {cmd}",
                  file=sys.stderr)
    load = os.getloadavg()
    summary = {"machine": os.uname().nodename, "cpus": os.cpu_count(), "load_after": load,
               "progress_seconds": os.environ.get("FLEXEVICT_PROGRESS_SECONDS"),
               "results": results, "skipped": skipped}
    with open(args.out + ".json", "w") as f:
        json.dump(summary, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write("| command | rc | wall s | longest silent gap s |\n|---|---|---|---|\n")
        for r in results:
            f.write(f"| `{r['command']}` | {r['rc']} | {r['wall_s']} | {r['longest_gap_s']} |\n")
        f.write(f"\nSkipped (need a GPU, Ray or an hour): {len(skipped)}; load average after: "
                f"{load[0]:.2f}\n")


if __name__ == "__main__":
    main()
