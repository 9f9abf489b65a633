"""Shared by the scripts in bench/: the package's run metadata and JSON writer, the seed policies,
running a command that writes its result as JSON (each benchmark case is its own process), and
writing a comparison's tables and runs.

    python bench/common.py      # the run metadata every result here records, for this machine
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

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


def run_driver(python: str, driver: str, spec: dict, name: str, read):
    """Run a peer's driver script (text `driver`) with the peer's own interpreter `python`, on
    the inputs `spec` (JSON), in a fresh folder outside the tree, with this environment's
    PYTHONPATH and VIRTUAL_ENV removed (the peer imports only its own packages) -> read(spec),
    where spec also holds `tmp`, the folder, and `out`, the JSON file the driver writes; read
    runs before the folder goes. A failed driver is a UserError with its stderr's end."""
    from flexevict.errors import UserError
    with tempfile.TemporaryDirectory(prefix=f"{name}-peer-") as tmp:
        path, inputs = os.path.join(tmp, "driver.py"), os.path.join(tmp, "in.json")
        spec = dict(spec, out=os.path.join(tmp, "out.json"), tmp=tmp)
        with open(path, "w") as f:
            f.write(driver)
        with open(inputs, "w") as f:
            json.dump(spec, f)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        proc = subprocess.run([python, path, inputs], cwd=tmp, env=env, capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise UserError(f"the {name} driver failed:\n" + proc.stderr[-3000:])
        return read(spec)


def read_out(spec: dict) -> dict:
    """`run_driver`'s reader of the driver's JSON output alone."""
    with open(spec["out"]) as f:
        return json.load(f)
