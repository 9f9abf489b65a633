"""Shared by the scripts in bench/: the package's run metadata and JSON writer, the seed policies,
running a command that writes its result as JSON (each benchmark case is its own process), and
writing a comparison's tables and runs.

    python bench/common.py      # the run metadata every result here records, for this machine
"""
import argparse
import json
import subprocess
import sys

from flexevict.bench.report import write_json  # noqa: F401
from flexevict.runtime.machine import run_metadata

# the policies of the cost-of-eviction comparisons (bench/eviction_cost.py, the placement
# suite's 2048-token cases): the five papers' and TOVA
SEED_POLICIES = ("h2o", "buzz", "cascade", "hashevict", "vatp", "tova")


def run_engine(c: dict, out: str) -> dict:
    """`python -m flexevict.bench` with a case's argv (a suite case: {"name", "argv", "peer"})
    -> its JSON result, or the error record of `run_json`."""
    return run_json([sys.executable, "-m", "flexevict.bench", *c["argv"], "--json", out], out)


def run_json(argv: list[str], out: str) -> dict:
    """Run a command that writes its result as JSON to `out` -> that result, or {"error": its
    last stderr line, "stderr_tail": the last 40}. The stderr tail is echoed either way, so
    warnings and tracebacks land in the caller's log too."""
    proc = subprocess.run(argv, capture_output=True, text=True)
    lines = proc.stderr.strip().splitlines()
    if lines:
        print("\n".join(lines[-40:]), file=sys.stderr, flush=True)
    if proc.returncode != 0:
        return {"error": (lines or ["failed"])[-1], "stderr_tail": lines[-40:]}
    with open(out) as f:
        return json.load(f)


def write_report(prefix: str, text: str, data: dict) -> None:
    """A comparison's outputs: PREFIX.md (the tables, `text`), PREFIX.json (`data`, every run)
    and the tables printed."""
    with open(prefix + ".md", "w") as f:
        f.write(text + "\n")
    with open(prefix + ".json", "w") as f:
        json.dump(data, f, indent=1)
    print(text)


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(json.dumps(run_metadata("cpu"), indent=1))
