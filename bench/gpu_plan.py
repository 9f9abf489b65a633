"""Every GPU table from one command: `python bench/suites.py gpu --out DIR --max-minutes M`.

The steps below run in priority order, each in its own process: the GPU-only tests, a GPU
calibration (the planner's `auto` and every prediction use it), the headline job (OPT-30B under
a T4's limits: weights streamed from CPU memory, FlexGen 0.1.8 `full` beside flexevict `full`
and `h2o` at 20%, each engine at the placement and batch its planner picks), H2O's A100 table
(OPT-6.7B 2048 + 2048, `full` and `h2o` both as CUDA graphs), the kernels and dummy weights
made on the GPU (bench/dummy_weights.py), the 2026 methods,
a 70B-class model, and last each seed policy's hooks' share of a replayed decode step
(bench/hook_share.py at OPT-6.7B 2048 + 2048, batch 24: every policy with and without its
hooks, the goal <= 5%). The plan is printed first (steps, estimated minutes). A step starts
only if its estimate fits the minutes left, and is killed at the deadline, so a time-limited
machine gets back every finished result; a step whose result is already in DIR (same command)
is read back, not run: run the same command again to go on.

Results: DIR/gpu/<step>_<device>.json per step, each naming the GPU, driver, torch, CUDA and
commit at its top level; DIR/gpu_<device>.md (one table per group) and DIR/gpu_<device>.json.

Both engines get the same limits: `--gpu-mem-limit` caps flexevict's allocator and FlexGen's
placement is sized to it (its own percent, as in its README); the host limit (HOST_LIMIT_GIB)
is flexevict's `--cpu-mem-limit`, and FlexGen runs at the largest batch whose weights and
cache fit under it (`flexgen_batch`). FlexGen comes from wheels carried in .peers/wheels
(`bench/peers/fetch_wheels.sh` fills it where there is network).
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

from flexevict.bench.report import write_json
from flexevict.core.config import registry_config
from flexevict.errors import UserError

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WHEELS = os.path.join(ROOT, ".peers", "wheels")
HOST_LIMIT_GIB = 96          # of the GPU machine's 128 GiB: both engines' host memory
T4_GIB = 16                  # H2O's Table 3 and FlexGen's README: a T4's memory
OVERHEAD_GIB = 4             # a FlexGen process besides its weights and cache (CUDA, torch)
AUTO = ["--percent", "auto", "--gpu-batch-size", "auto", "--num-gpu-batches", "auto",
        "--cpu-cache-compute", "auto"]


@dataclass
class Step:
    """One process of the plan. kind: "command" (argv as given), "engine" (argv of
    `python -m flexevict.bench`) or "flexgen" (argv of bench/peers/flexgen_peer.py)."""
    name: str
    group: str
    kind: str
    argv: list[str]
    minutes: float                      # estimate on an H100/H200 machine, start-up included
    env: dict = field(default_factory=dict)

    def command(self, out: str) -> list[str]:
        if self.kind == "engine":
            return [sys.executable, "-m", "flexevict.bench", *self.argv, "--json", out]
        if self.kind == "flexgen":
            return [sys.executable, os.path.join(HERE, "peers", "flexgen_peer.py"), *self.argv,
                    "--json", out]
        return [a.replace("{OUT}", out) for a in self.argv]


def flexgen_batch(model: str, prompt: int, gen: int, w_cpu: float, gpu_batches: int) -> int:
    """FlexGen's largest GPU batch size whose CPU weights (w_cpu of them) and whole CPU cache
    (FlexGen allocates prompt + gen - 1 tokens per sequence) fit under HOST_LIMIT_GIB."""
    c = registry_config(model)
    weights = w_cpu * c.weight_bytes("float16") / 2**30
    per_seq = 2 * c.num_layers * c.hidden_size * 2 * (prompt + gen - 1) / 2**30
    free = HOST_LIMIT_GIB - OVERHEAD_GIB - weights
    return max(int(free / per_seq) // gpu_batches, 1)


def headline(prompt: int, gen: int, cut: int = 8) -> list[Step]:
    """OPT-30B under a T4's limits: FlexGen `full` (its T4 setting, "20 80 0 100 0 100"),
    flexevict `full` and `h2o` 20% at the planner's placement and batch."""
    tag, lengths = f"opt-30b-{prompt}+{gen}", ["--prompt-len", str(prompt), "--gen-len", str(gen)]
    limits = ["--gpu-mem-limit", str(T4_GIB), "--cpu-mem-limit", str(HOST_LIMIT_GIB)]
    gbs = flexgen_batch("opt-30b", prompt, gen, 0.8, 2)
    flexgen = ["--model", "opt-30b", *lengths, "--percent", "20", "80", "0", "100", "0", "100",
               "--gpu-batch-size", str(gbs), "--num-gpu-batches", "2", "--cpu-cache-compute",
               "--cut-gen-len", str(cut)]
    ours = ["--model", "opt-30b", *lengths, *AUTO, *limits, "--cut-gen-len", str(cut), "--yes"]
    # h2o before full: the headline ratio needs FlexGen and h2o; full's was measured first
    return [Step(f"{tag}-flexgen-full", tag, "flexgen", flexgen, 2.0),
            Step(f"{tag}-h2o-0.2", tag, "engine", ours + ["--policy", "h2o", "--budget", "0.2"],
                 2.5),
            Step(f"{tag}-full", tag, "engine", ours + ["--policy", "full"], 2.0)]


def a100_table() -> list[Step]:
    """H2O's A100 table: OPT-6.7B 2048 + 2048 at batch 24, `full` and `h2o` both graphed, in
    one call; batch 64 with `h2o` (where `full` cannot fit)."""
    base = ["--model", "opt-6.7b", "--prompt-len", "2048", "--gen-len", "2048", "--percent",
            "100", "0", "100", "0", "100", "0", "--num-gpu-batches", "1",
            "--ignore-max-positions", "--yes"]
    return [Step(f"opt-6.7b-2048+2048-bs{bs}-{tag}", "opt-6.7b-2048+2048", "engine",
                 base + ["--gpu-batch-size", str(bs), *pol], minutes)
            for bs, tag, pol, minutes in ((24, "full", ["--policy", "full"], 1.5),
                                          (24, "h2o-0.2", ["--policy", "h2o", "--budget", "0.2"],
                                           1.0),
                                          (64, "h2o-0.2", ["--policy", "h2o", "--budget", "0.2"],
                                           1.5))]


def methods_2026() -> list[Step]:
    """The eviction methods engines ship in 2026 beside `h2o`, on H2O's A100 case (OPT-6.7B
    2048 + 2048, batch 24, 20%, graphed where the policy is graph-safe), 256 steps run."""
    base = ["--model", "opt-6.7b", "--prompt-len", "2048", "--gen-len", "2048", "--percent",
            "100", "0", "100", "0", "100", "0", "--gpu-batch-size", "24", "--num-gpu-batches",
            "1", "--ignore-max-positions", "--cut-gen-len", "256", "--budget", "0.2", "--yes"]
    return [Step(f"opt-6.7b-2048+2048-bs24-{p}-cut256", "methods-2026", "engine",
                 base + ["--policy", p], 1.0)
            for p in ("h2o", "keydiff", "snapkv", "triattention")]


def llama70b() -> list[Step]:
    """A 70B-class model (Llama-3-70B shapes), 2048 + 256, at the planner's placement and
    batch under the machine's own memory: `h2o` 20% against `full`."""
    base = ["--model", "llama-3-70b", "--prompt-len", "2048", "--gen-len", "256", *AUTO,
            "--cpu-mem-limit", str(HOST_LIMIT_GIB), "--cut-gen-len", "8", "--yes"]
    return [Step(f"llama-3-70b-2048+256-{tag}", "llama-3-70b-2048+256", "engine", base + pol, 3.0)
            for tag, pol in (("full", ["--policy", "full"]),
                             ("h2o-0.2", ["--policy", "h2o", "--budget", "0.2"]))]


def hook_share() -> list[Step]:
    """Each seed policy's (and recall's) hooks' share of a replayed decode step on H2O's A100
    case (OPT-6.7B 2048 + 2048, batch 24, 20%, graphed, 64 token steps run): bench/hook_share.py
    runs each policy with and without its hooks, 3 alternating rounds, on one engine (dummy
    weights made once). About 5 s a run (a 24 x 2048 prefill, the warm-up, 63 steps and their
    graph captures) x 7 policies x 2 x 3 rounds, and the weights."""
    argv = [sys.executable, os.path.join(HERE, "hook_share.py"), "--model", "opt-6.7b",
            "--prompt-len", "2048", "--gen-len", "2048", "--gpu-batch-size", "24",
            "--cut-gen-len", "64", "--budget", "0.2", "--rounds", "3", "--device", "cuda",
            "--cuda-graphs", "--json", "{OUT}"]
    return [Step("hook-share-opt-6.7b-2048+2048-bs24", "hook-share", "command", argv, 5.0)]


def steps() -> list[Step]:
    py = sys.executable
    build = Step("kernels-build", "correctness", "command",
                 [py, "-m", "flexevict.bench.kernels", "--load"], 0.8)
    tests = Step("gpu-tests", "correctness", "command",
                 [py, "-m", "pytest", "tests", "--gpu-only", "-n", "8", "--timeout", "90", "-q",
                  "-p", "no:cacheprovider", "--junitxml", "{OUT}.xml"], 1.0)
    calibration = Step("calibration", "calibration", "command",
                       [py, "-m", "flexevict.calibrate", "--device", "cuda", "--recalibrate",
                        "--out", "{OUT}"], 1.2)
    kernels = Step("kernels", "kernels", "command",
                   [py, "-m", "flexevict.bench.kernels", "--json", "{OUT}"], 1.0)
    # dummy weights made on the GPU (io/seeded.py): the 1 GB/s goal is the CPU's; the GPU's
    # should sit near its memory bandwidth
    dummy = Step("dummy-weights", "kernels", "command",
                 [py, os.path.join(HERE, "dummy_weights.py"), "--device", "cuda", "--model",
                  "opt-6.7b", "--dtypes", "float16,bfloat16", "--json", "{OUT}"], 0.5)
    return ([build, tests, calibration] + headline(512, 512) + headline(512, 32) + a100_table()
            + [kernels, dummy] + methods_2026() + llama70b() + hook_share())


# ---------------------------------------------------------------------------- running

def machine() -> dict:
    """What every result names at its top level: GPU, driver, torch, CUDA, host, commit."""
    import torch

    from flexevict.runtime.machine import run_metadata
    meta = run_metadata("cuda" if torch.cuda.is_available() else "cpu")
    try:
        import pynvml
        pynvml.nvmlInit()
        meta["driver"] = pynvml.nvmlSystemGetDriverVersion()
    except Exception as e:          # no NVIDIA driver here: said, not hidden
        meta["driver"] = f"unknown ({type(e).__name__})"
    meta["host_memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                                    / 2**30, 1)
    meta["cpu_cores"] = os.cpu_count()
    return meta


def flexgen_env() -> dict:
    """The environment FlexGen runs in: FLEXGEN_PYTHON as set, else this python with the
    wheels in .peers/wheels installed once into .peers/site (no network needed)."""
    if os.environ.get("FLEXGEN_PYTHON"):
        return {}
    site = os.path.join(ROOT, ".peers", "site")
    wheels = sorted(glob.glob(os.path.join(WHEELS, "*.whl")))
    if not os.path.isdir(os.path.join(site, "flexgen")) and wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--target", site, *wheels], check=True)
    path = os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))
    return {"FLEXGEN_PYTHON": sys.executable, "PYTHONPATH": path}


def run_step(step: Step, base: str, env: dict, seconds_left: float) -> dict:
    """Run one step, killed after `seconds_left` -> its row: the command, wall seconds, exit
    code, the result (an engine's or FlexGen's JSON; for a command, its own file if it wrote
    one) or the error, and the last lines of its output."""
    out = base + (".result.json" if step.kind != "command" else "")
    cmd = step.command(out)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds_left,
                              env={**os.environ, **env, **step.env})
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, stdout, stderr = "timeout", _text(e.stdout), _text(e.stderr)
    tail = (stdout + stderr).strip().splitlines()[-30:]
    print("\n".join(tail), file=sys.stderr, flush=True)
    row = {"step": step.name, "group": step.group, "kind": step.kind, "command": " ".join(cmd),
           "seconds": round(time.monotonic() - t0, 1), "rc": rc, "output_tail": tail}
    result = _read(out) if step.kind != "command" else _read(out) or _read(out + ".xml")
    if result is not None:
        row["result"] = result           # a test run's counts, also where some failed
    if rc != 0 or (result is None and step.kind != "command"):
        # a step that wrote a result (a test run's counts) says so there; else its last line
        row["error"] = tail[-1] if tail and result is None else f"exit {rc}"
    return row


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def _read(path: str):
    """A step's JSON result, a JUnit XML file's counts, or None."""
    if not os.path.exists(path):
        return None
    if path.endswith(".xml"):
        suite = ET.parse(path).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError:
        return None


def check_installed() -> None:
    """Every step runs `flexevict` in a new process, where a checkout on the path is not
    enough (`policies/` becomes `flexevict.policies` only when installed): found before the
    first step, not in each step's traceback (the first plan run on a GPU lost a call so)."""
    import importlib.util
    if importlib.util.find_spec("flexevict.policies") is None:
        raise UserError("flexevict is not installed here (flexevict.policies is missing): run "
                        "`FLEXEVICT_KERNELS=0 pip install --no-deps --no-build-isolation -e .` "
                        "in the checkout first, or `ln -sfn ../policies flexevict/policies` "
                        "with the checkout on PYTHONPATH")


def run_plan(out: str, max_minutes: float | None, only: str | None) -> int:
    """Print the plan, run what fits, write the tables -> exit code (3 while steps remain)."""
    from suites import device_label
    check_installed()
    dev, meta = device_label(), machine()
    folder = os.path.join(out, "gpu")
    os.makedirs(folder, exist_ok=True)
    plan = [s for s in steps() if not only or only in s.name]
    print_plan(plan, meta, max_minutes)
    deadline = time.monotonic() + 60 * (max_minutes or 1e6)
    env, rows, left = flexgen_env(), [], []
    for step in plan:
        base = os.path.join(folder, f"{step.name}_{dev}")
        calibration = os.path.join(folder, f"calibration_{dev}")
        if os.path.exists(calibration):     # every step after it plans and predicts with it
            env["FLEXEVICT_CALIBRATION"] = calibration
        cmd = " ".join(step.command(base + (".result.json" if step.kind != "command" else "")))
        done = _read(base + ".json")
        if done and done.get("command") == cmd and "error" not in done:
            rows.append(done)
            continue
        seconds_left = deadline - time.monotonic()
        if seconds_left < 60 * step.minutes:
            left.append(step.name)
            continue
        print(f"[gpu] {step.name} (about {step.minutes:g} min)", file=sys.stderr, flush=True)
        rows.append(run_step(step, base, env, seconds_left))

        with open(base + ".json", "w") as f:
            json.dump({**meta, **rows[-1]}, f, indent=1)
    from gpu_tables import tables
    text = tables(rows, meta)
    with open(os.path.join(out, f"gpu_{dev}.md"), "w") as f:
        f.write(text + "\n")
    write_json(os.path.join(out, f"gpu_{dev}.json"),
               {**meta, "steps": rows, "steps_left": left, "table": text})
    print(text)
    if left:
        print(f"[gpu] {len(left)} step(s) left: {', '.join(left)}; run the same command again "
              "to go on", file=sys.stderr)
    return 3 if left else 0


def print_plan(plan: list[Step], meta: dict, max_minutes: float | None) -> None:
    print(f"GPU plan on {meta['device']} (driver {meta['driver']}, torch {meta['torch']}, "
          f"CUDA {meta['cuda']}, commit {meta['commit']}); "
          + (f"{max_minutes:g} minutes" if max_minutes else "no time limit"), flush=True)
    total = 0.0
    for s in plan:
        total += s.minutes
        print(f"  {total:5.1f} min  {s.name}", flush=True)


def list_plan() -> None:
    """`--list`: every step and its command, nothing run."""
    for s in steps():
        print(f"gpu/{s.name} ({s.minutes:g} min): {' '.join(s.command('OUT'))}")


if __name__ == "__main__":
    import argparse

    from flexevict.errors import cli_errors
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="results folder")
    ap.add_argument("--max-minutes", type=float, default=None, metavar="M",
                    help="start no step that would not end within M minutes")
    ap.add_argument("--only", default=None, help="the steps whose name contains this")
    ap.add_argument("--list", action="store_true", help="print the steps, run nothing")
    args = ap.parse_args()
    if args.list:
        list_plan()
        sys.exit(0)
    with cli_errors("bench/gpu_plan.py"):
        sys.exit(run_plan(args.out, args.max_minutes, args.only))
