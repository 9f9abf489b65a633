"""Benchmark suites, one command each; every case runs in its own process (so peak memory is
the case's own), peers side by side in the same run.

    python bench/suites.py cpu              # runs on a CPU machine (CI-sized), vs transformers
    python bench/suites.py flexgen          # FlexGen's table on a GPU, vs FlexGen 0.1.8
    python bench/suites.py h2o              # H2O's table on a GPU (h2o 20% vs full)
    python bench/suites.py h2o-policies     # buzz, cascade, hashevict, vatp at 20%,
                                            # OPT-6.7B 2048+2048
    python bench/suites.py bound            # weights streamed from CPU vs the PCIe bound
    python bench/suites.py placement-cpu    # the cost model: predicted vs measured, auto placement
    python bench/suites.py --list
    python bench/suites.py gpu --dry-run    # a GPU run: two device calls (README)
    python bench/suites.py gpu --call N --out DIR

Results: bench/results/<suite>/<case>_<device>.json and a summary <suite>_<device>.md/.json.
FlexGen runs from its own environment outside this tree: set FLEXGEN_PYTHON to its python
(see bench/peers/README.md). Cases whose setting cannot fit this machine record the engine's
one-line memory error instead of numbers, and their peer is not run (it would only meet the
same wall, as a 150+ GB host allocation and an OOM kill). `--case NAME` (repeatable) runs those
cases, `--cut-gen-len N` overrides their cut, `--json FILE` writes the summary there too.
"""
from __future__ import annotations

import argparse
import fnmatch
import glob
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
PLACEMENT_RESULTS = os.path.join(RESULTS, "placement")
# the GPU plan starts before the package is installed: then it is imported from the source tree
sys.path.append(ROOT)

from flexevict.runtime.machine import device_name, git_commit  # noqa: E402
from flexevict.errors import UserError, cli_errors  # noqa: E402

# FlexGen's README table (T4 16 GB, prompt 512, gen 32): percents and batch sizes as published
FLEXGEN = {
    "opt-6.7b": ("100 0 100 0 100 0", 2, 1, []),
    "opt-6.7b-compressed": ("100 0 100 0 100 0", 72, 1, ["--compress-weight", "--compress-cache"]),
    # not in FlexGen's table: half the weights streamed from the CPU (issue: weights partly there)
    "opt-6.7b-weights-half-cpu": ("50 50 100 0 100 0", 8, 1, []),
    "opt-30b": ("20 80 0 100 0 100", 48, 3, ["--cpu-cache-compute"]),
    "opt-30b-compressed": ("0 100 0 100 0 100", 64, 8, ["--compress-cache"]),
    "opt-175b": ("0 50 0 0 0 100", 32, 8, ["--cpu-cache-compute", "--pin-weight", "0"]),
    "opt-175b-compressed": ("0 100 0 100 0 100", 48, 3, ["--compress-weight", "--compress-cache"]),
}
# H2O's committed T4 logs for OPT-30B (prompt 512, budget 20%), and its A100 6.7B 2048+2048 runs
H2O_30B = {32: [("0 100 0 100 0 100", 52, 14), ("20 80 0 100 0 100", 48, 16)],
           512: [("0 100 0 100 0 100", 52, 8), ("20 80 0 100 0 100", 40, 10)],
           1024: [("0 100 0 100 0 100", 44, 6), ("20 80 0 100 0 100", 40, 7)]}


EAGER = ["--cuda-graphs", "false"]


def case(name, model, prompt, gen, percent, gbs, nb, extra=(), policy=("full",), peer=None,
         cut=None):
    argv = ["--model", model, "--prompt-len", str(prompt), "--gen-len", str(gen),
            "--percent", *percent.split(), "--gpu-batch-size", str(gbs),
            "--num-gpu-batches", str(nb), "--policy", policy[0], "--yes", *extra]
    if len(policy) > 1:
        argv += ["--budget", str(policy[1])]
    if cut:
        argv += ["--cut-gen-len", str(cut)]
    return {"name": name, "argv": argv, "peer": peer}


def suite_cpu():
    """CPU-sized: what runs here in minutes. SmolLM2 (real weights) in memory vs on disk; OPT
    placements; h2o vs full; each paired with transformers' generate at the same setting."""
    smol = _packaged_smollm2()
    cases = []
    for model, path in (("smollm2-135m", smol), ("opt-125m", None)):
        extra = ["--device", "cpu"] + (["--path", path] if path else [])
        hf = {"kind": "hf", "model": model, "path": path}
        for label, percent in (("memory", "100 0 100 0 100 0"), ("weights-disk", "0 0 100 0 100 0"),
                               ("weights-cpu-cache-cpu", "0 100 0 100 100 0")):
            cases.append(case(f"{model}-{label}-full", model, 128, 32, percent, 4, 2, extra,
                              peer=hf if label == "memory" else None))
        cases.append(case(f"{model}-memory-h2o-0.2", model, 128, 32, "100 0 100 0 100 0", 4, 2,
                          extra, policy=("h2o", 0.2)))
        cases.append(case(f"{model}-cache-cpu-compute-h2o-0.2", model, 128, 32,
                          "100 0 0 100 100 0", 4, 2, extra + ["--cpu-cache-compute"],
                          policy=("h2o", 0.2)))
    return cases


def suite_flexgen():
    """FlexGen's table; OPT-6.7B under a T4's 16 GB (--gpu-mem-limit 16)."""
    cases = []
    for name, (percent, gbs, nb, extra) in FLEXGEN.items():
        model = "-".join(name.split("-")[:2])
        limit = ["--gpu-mem-limit", "16"]
        cut = None if model == "opt-6.7b" else 8            # FlexGen's suite projects these too
        cases.append(case(name, model, 512, 32, percent, gbs, nb, limit + extra, cut=cut,
                          peer={"kind": "flexgen"}))
    return cases


def suite_h2o():
    cases = []
    for gen, settings in H2O_30B.items():
        for percent, gbs, nb in settings:
            tag = f"opt-30b-512+{gen}-{percent.replace(' ', '-')}-bs{gbs * nb}"
            extra = ["--cpu-cache-compute", "--gpu-mem-limit", "16"]
            for pol in (("full",), ("h2o", 0.2)):
                cases.append(case(f"{tag}-{pol[0]}", "opt-30b", 512, gen, percent, gbs, nb, extra,
                                  policy=pol, cut=8))
    long = ["--ignore-max-positions"]
    for bs in (24, 64):
        for pol in (("full",), ("h2o", 0.2)):
            # uncut: full's step grows with the context (a projection misses the curve), and
            # h2o's graphed steps capture one graph per ring position in their first lap
            cases.append(case(f"opt-6.7b-2048+2048-bs{bs}-{pol[0]}", "opt-6.7b", 2048, 2048,
                              "100 0 100 0 100 0", bs, 1, long, policy=pol))
    # h2o with every step eager: its eviction share and what the graphs save, side by side
    cases.append(case("opt-6.7b-2048+2048-bs24-h2o-eager", "opt-6.7b", 2048, 2048,
                      "100 0 100 0 100 0", 24, 1, long + EAGER, policy=("h2o", 0.2), cut=256))
    return cases


def suite_h2o_policies():
    """The seed policies at 20%, every step eager so that each one's eviction share is timed
    (graphed steps run the hooks untimed)."""
    return [case(f"opt-6.7b-2048+2048-bs24-{p}", "opt-6.7b", 2048, 2048, "100 0 100 0 100 0", 24,
                 1, ["--ignore-max-positions"] + EAGER, policy=(p, 0.2), cut=64)
            for p in ("h2o", "buzz", "cascade", "hashevict", "vatp")]


def suite_bound():
    """Decode with every weight streamed from pinned CPU memory: the step cannot beat
    bytes per step / host-to-device bandwidth (measured in the same run); goal >= 80%."""
    return [case(f"{m}-weights-cpu-bs{b}", m, 512, 32, "0 100 100 0 100 0", b, 1, cut=16)
            for m in ("opt-6.7b", "opt-13b") for b in (8, 32)]


# --cpu-mem-limit (GiB) of the placement suite's tight cases: below what the all-in-memory setting
# of the CPU suite holds (about 1.0 GiB for both models), above what weights on disk hold
PLACEMENT_LIMIT_GB = 0.8
AUTO_FLAGS = ["--compress-weight", "auto", "--compress-cache", "auto", "--cpu-cache-compute",
              "auto"]


def suite_placement_cpu():
    """The CPU suite at --threads 1, each result with the cost model's prediction; then per
    model and policy --percent auto (every switch auto) at the suite's batch, with no memory
    limit and under --cpu-mem-limit PLACEMENT_LIMIT_GB (bench/results/placement/)."""
    smol = _packaged_smollm2()
    cases = [{**c, "argv": c["argv"] + ["--threads", "1"], "peer": None} for c in suite_cpu()]
    for model, path in (("smollm2-135m", smol), ("opt-125m", None)):
        extra = ["--device", "cpu", "--threads", "1"] + (["--path", path] if path else [])
        cases.append(case(f"{model}-weights-disk-h2o-0.2", model, 128, 32, "0 0 100 0 100 0", 4,
                          2, extra, policy=("h2o", 0.2)))     # hand-written, fits the limit
        for pol in (("full",), ("h2o", 0.2)):
            tag = "-".join(map(str, pol))
            cases.append(case(f"{model}-auto-{tag}", model, 128, 32, "auto", 4, 2,
                              extra + AUTO_FLAGS, policy=pol))
            cases.append(case(f"{model}-auto-{tag}-limit", model, 128, 32, "auto", 4, 2,
                              extra + AUTO_FLAGS + ["--cpu-mem-limit", str(PLACEMENT_LIMIT_GB)],
                              policy=pol))
    return cases


def suite_recall():
    """Recall at long context with the cache on the CPU (LLaMA-3-8B shapes, 32k prompt, batch
    4): recall 10% (history on the CPU, pages fetched each step) against full attending on the
    CPU (--cpu-cache-compute) and full streaming the whole cache to the GPU every step."""
    long = ["--ignore-max-positions"]
    cache_cpu = "100 0 0 100 100 0"
    return [case(f"llama-3-8b-32768+32-bs4-{tag}", "llama-3-8b", 32768, 32, cache_cpu, 4, 1,
                 long + extra, policy=pol, cut=16)
            for tag, pol, extra in (("recall", ("recall", 0.1), []),
                                    ("full-cpu-compute", ("full",), ["--cpu-cache-compute"]),
                                    ("full-stream", ("full",), []))]


SUITES = {"cpu": suite_cpu, "placement-cpu": suite_placement_cpu, "flexgen": suite_flexgen,
          "h2o": suite_h2o,
          "h2o-policies": suite_h2o_policies, "bound": suite_bound, "recall": suite_recall}


# ---------------------------------------------------------------------------- running

def device_label() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    name = device_name(torch.device("cuda"))
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def run_engine(c: dict, out: str) -> dict:
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


PEER_SKIPPED = "peer skipped: engine case does not fit"
MEMORY_ERRORS = ("out of GPU memory", "out of CPU memory", "not enough disk")   # memory.py's


def does_not_fit(engine: dict) -> bool:
    """The engine's case failed its memory preflight (or ran out of memory)."""
    return any(m in engine.get("error", "") for m in MEMORY_ERRORS)


def run_case(c: dict, base: str) -> dict:
    """The engine, then its peer at the same setting unless the engine's case cannot fit."""
    engine = run_engine(c, base + ".json")
    if c["peer"] and does_not_fit(engine):
        peer = {"skipped": PEER_SKIPPED}
    else:
        peer = run_peer(c, base + ".peer.json")
    return {"case": c["name"], "command": "python -m flexevict.bench " + " ".join(c["argv"]),
            "engine": engine, "peer": peer}


def prediction_table(rows: list[dict]) -> str:
    """The cost model's prediction next to the measurement for every case that ran (each bench
    result carries its `predicted`; README "Every bench run checks the model")."""
    lines = ["### Predicted vs measured (cost model)", "",
             "| case | prefill s pred / meas | decode step ms pred / meas | total tok/s pred / "
             "meas | meas / pred | calibration | bound (predicted) |", "|" + "---|" * 7]
    for r in rows:
        e = r["engine"]
        p = e.get("predicted")
        if not p:
            continue
        step = e["decode_latency_s"] / max(e["gen_len"] - 1, 1)
        cal = p["calibration"]
        tag = "synthetic" if cal["synthetic"] else "quick" if cal["quick"] else "measured"
        lines.append(f"| {r['case']} | {p['prefill_s']:.2f} / {e['prefill_latency_s']:.2f} | "
                     f"{1e3 * p['decode_step_s']:.1f} / {1e3 * step:.1f} | "
                     f"{p['throughput']:.1f} / {e['total_throughput']:.1f} | "
                     f"{e['total_throughput'] / p['throughput']:.2f} | {tag} | {p['bound']} |")
    return "\n".join(lines)


def run_peer(c: dict, out: str) -> dict | None:
    peer = c["peer"]
    if not peer:
        return None
    script = {"hf": "hf_generate.py", "flexgen": "flexgen_peer.py"}[peer["kind"]]
    argv = [sys.executable, os.path.join(HERE, "peers", script), *c["argv"], "--json", out]
    if peer.get("path"):
        argv += ["--path", peer["path"]]
    return run_json(argv, out)


def summarize(name: str, rows: list[dict]) -> str:
    head = ("| case | policy | batch | total tok/s | prefill tok/s | decode tok/s | peak GPU GB "
            "| peak RSS GB | eviction % | peer | peer total tok/s | ratio |")
    lines = [f"## {name}", "", head, "|" + "---|" * 12]
    fmt = lambda x, p=2: "n/a" if x is None else f"{x:.{p}f}"  # noqa: E731
    for r in rows:
        e, p = r["engine"], r.get("peer") or {}
        if "error" in e:
            note = p.get("skipped", p.get("error", ""))
            lines.append(f"| {r['case']} | | | error: {e['error']} | | | | | | {note} | | |")
            continue
        share = e.get("eviction_share_of_decode")
        ratio = (e["total_throughput"] / p["total_throughput"]
                 if p.get("total_throughput") else None)
        lines.append(
            f"| {r['case']} | {e['policy']['policy']} ({e['policy']['slots']} slots) "
            f"| {e['batch']} "
            f"| {fmt(e['total_throughput'])} | {fmt(e['prefill_throughput'], 1)} "
            f"| {fmt(e['decode_throughput'])} | {fmt(e['peak_gpu_mem_gb'])} "
            f"| {fmt(e['peak_cpu_rss_gb'])} | {fmt(None if share is None else 100 * share, 1)} "
            f"| {p.get('peer', p.get('error', ''))} | {fmt(p.get('total_throughput'))} "
            f"| {fmt(ratio)} |")
    return "\n".join(lines)


def h2d_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float | None:
    """Pinned host-to-device copy bandwidth in bytes/s (best of `repeats`), or None on CPU."""
    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    return nbytes / best


def bound_table(rows: list[dict], bandwidth: float | None) -> str:
    """Per decode step: bytes moved host-to-device / bandwidth vs the measured step time."""
    lines = ["host-to-device bandwidth (pinned): "
             + ("n/a (no CUDA)" if bandwidth is None else f"{bandwidth / 1e9:.2f} GB/s"), "",
             "| case | GB per decode step | bound ms | measured ms (median step) "
             "| bound / measured |",
             "|---|---|---|---|---|"]
    for r in rows:
        e = r["engine"]
        if "error" in e or bandwidth is None:
            continue
        steps = len(e["step_seconds"])
        per_step = sum(v for k, v in e["bytes_moved"].items() if k.endswith("->gpu")) / steps
        measured = sorted(e["step_seconds"][1:])[len(e["step_seconds"][1:]) // 2]
        bound = per_step / bandwidth
        lines.append(f"| {r['case']} | {per_step / 1e9:.2f} | {1e3 * bound:.1f} | "
                     f"{1e3 * measured:.1f} | {bound / measured:.2f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the first GPU run
#
# Two device calls, one command each, the second right after the first while the machine is
# warm (bench/README.md, "GPU run"):
#     FLEXEVICT_COMMIT=<sha> python3 bench/suites.py gpu --call N --out $OUT
# The machine (an H100 or H200, 16 cores, 128 GB RAM, no network; Python 3.12, torch
# 2.11.0+cu130, nvcc, ninja, pytest-xdist, pytest-timeout, transformers; no gguf, no flexgen:
# their wheels travel in bench/wheels/) gets the working tree copied in; each call must end
# within 9 minutes and may send back at most 8 files. Every step's output goes to one log; a
# failed step is recorded and the call goes on; no step starts or runs past DEADLINE_S.
#
# Estimates (minutes) from the first H200 run (bench/results/README.md). OPT-6.7B in fp16 is
# 13.4 GB; its KV cache is 0.5 MB per token per sequence (2 x 32 layers x 4096 x 2 bytes), so
# batch 24 at 2048 + 2048 tokens holds 48 GiB at the end. A decode step there took ~20 ms
# (host-bound: the weights and a 20% cache read in ~5 ms at 4.3 TB/s); prefill of 24 x 2048
# tokens ~1.8 s. Every case is its own process: python and torch start, 13.4 GB of dummy
# weights made on the GPU, the warm-up (WARMUP_PROMPT + WARMUP_TOKENS tokens,
# flexevict/bench/throughput.py): ~20-30 s before its clock starts.

WHEELS = os.path.join(HERE, "wheels")
WHEEL_GLOBS = {"gguf": "gguf-*.whl", "flexgen": "flexgen-0.1.8-*.whl"}
DOWNLOAD = "pip download --no-deps gguf==0.19.0 flexgen==0.1.8 -d bench/wheels"
SO_GLOB = "_C.*.so"                        # the built extension, flexevict/_C.<abi>.so
KNOWN_SO = "bench/wheels/" + SO_GLOB        # where call 2 looks for carried kernels
# the GPU's calibration for the cost model (flexevict.calibrate) is cached here, not in ~/.cache:
# call 1 measures it and sends it back; put into this folder (untracked, not ignored) it travels
# with the tree to call 2, whose benches then predict with it instead of measuring again
CALIBRATION_DIR = os.path.join(WHEELS, "calibration")
CALIBRATION_GLOB = "calibration-*.json"
SCRATCH = os.path.join(tempfile.gettempdir(), "flexevict-gpu")   # per-case files stay here
FLEXGEN_SITE = os.path.join(tempfile.gettempdir(), "flexgen-site")
SITE = os.path.join(tempfile.gettempdir(), "flexevict-site")     # gguf, unpacked
CALL_LIMIT_MIN = 9.0
DEADLINE_S = 8.0 * 60               # python start and the last writes fit in the rest
MAX_FILES = 8                       # what the device tool sends back per call


@dataclass(frozen=True)
class Step:
    name: str
    cmd: str                        # a bash command line, run in the repository root
    minutes: float                  # estimated wall time on the GPU machine
    outputs: tuple = ()             # files it writes into the call's folder (names, or globs)
    ok: tuple = (0,)                # exit codes that mean it worked
    fallback_min: float = 0.0       # more minutes when its fallback path runs


class _Parts:
    """What the calls share: the python, the folders, the install and kernel steps."""

    def __init__(self, call: int, out: str, py: str, so: str | None):
        self.py, self.o = _q(py), _q(out)
        self.res = _q(os.path.join(SCRATCH, f"call{call}"))
        # no pip install of the package: an editable install needs build isolation, which
        # reaches for PyPI (none there). The tree runs in place on PYTHONPATH (run_call), with
        # policies/ linked in as flexevict.policies and gguf unpacked beside it
        self.install = Step(
            "install", f"ln -sfn ../policies flexevict/policies && {self.py} -m pip install -q "
            f"--no-deps --no-index --target {SITE} bench/wheels/{WHEEL_GLOBS['gguf']}", 0.3)
        self.load = f"{self.py} -m flexevict.bench.kernels --load"   # prints where from, time
        # without call 1's .so the kernels are built just in time, for this GPU only: ~1.5 min
        self.kernels = Step(
            "place kernels", f"(cp {_q(so) if so else KNOWN_SO} flexevict/ 2>/dev/null || echo "
            f"'no kernels carried from call 1: building them now') && {self.load}", 0.2,
            fallback_min=1.3)

    def suite(self, name, cases, file, minutes, cut=None, env="") -> Step:
        """Some cases of a suite; per-case files in the scratch folder, the summary in DIR."""
        picks = " ".join(f"--case {_q(c)}" for c in cases)
        cut = f" --cut-gen-len {cut}" if cut else ""
        return Step(f"{name} suite -> {file}",
                    f"{env}{self.py} bench/suites.py {name} {picks}{cut} --out {self.res} "
                    f"--json {self.o}/{file}", minutes, (file,))


def _q(path: str) -> str:
    return path if path.startswith("$") else shlex.quote(path)      # "$OUT" stays a variable


BS24 = "opt-6.7b-2048+2048-bs24-"


def _call1(p: _Parts) -> list[Step]:
    """Correctness after recall and the kept weights, then what never ran (third run): every
    GPU-only test, a full calibration of the GPU (so every bench prints its prediction),
    recall 10% vs full at 32k with the cache on the CPU, FlexGen with half the weights on the
    CPU. The deadline skips what does not fit, so the steps go in order of what matters most."""
    return [
        p.install,
        # torch's just-in-time build under ninja for this GPU's architecture alone (32 s on
        # the first H200 run); every later process loads it from torch's extension cache
        Step("build kernels", f"{p.load}", 0.6),
        # every test that skips without CUDA (tests/test_kernels.py included) in 8 workers,
        # each test at most 120 s: 274 tests in 32 s on the first H200 run
        Step("GPU tests", f"{p.py} -m pytest -p flexevict.bench.gpu_tests tests -n 8 "
             "--timeout 120 --continue-on-collection-errors -q -rs -p no:cacheprovider "
             f"--junitxml={p.o}/call1-gpu-tests.xml", 0.8, ("call1-gpu-tests.xml",),
             ok=(0, 5)),
        # the cost model's measurements of this GPU (item 7), cached where every bench reads it
        Step("calibrate", f"timeout 120 {p.py} -m flexevict.calibrate --device cuda "
             f"--recalibrate && cp {CALIBRATION_DIR}/{CALIBRATION_GLOB} {p.o}/", 1.2,
             ("calibration-*.json",)),
        # three cases of ~20 s start, a 4 x 32k prefill and 16 decode steps (full on the CPU
        # reads 17 GB of cache per step)
        p.suite("recall", ["llama-3-8b-32768+32-bs4-recall",
                           "llama-3-8b-32768+32-bs4-full-cpu-compute",
                           "llama-3-8b-32768+32-bs4-full-stream"], "call1-recall.json", 2.5),
        Step("flexgen install", f"{p.py} -m pip install -q --no-deps --no-index --target "
             f"{FLEXGEN_SITE} bench/wheels/{WHEEL_GLOBS['flexgen']}", 0.1),
        # FlexGen makes its all-ones weights as host arrays and copies them (~1 min)
        p.suite("flexgen", ["opt-6.7b-weights-half-cpu"], "call1-flexgen.json", 1.8,
                env=f"FLEXGEN_PYTHON={p.py} PYTHONPATH={FLEXGEN_SITE} "),
    ]


def _call2(p: _Parts) -> list[Step]:
    """After call 1: recall's page gather and history append as one kernel each (reading and
    writing the pinned CPU history over PCIe, no host sync), checked by every GPU-only test
    and timed against full streaming its cache, side by side; call 1's calibration travels in
    bench/wheels/calibration/ so the benches predict without measuring again."""
    return [
        p.install, p.kernels,
        Step("GPU tests", f"{p.py} -m pytest -p flexevict.bench.gpu_tests tests -n 8 "
             "--timeout 120 -q -rs -p no:cacheprovider "
             f"--junitxml={p.o}/call2-gpu-tests.xml", 0.6, ("call2-gpu-tests.xml",), ok=(0, 5)),
        p.suite("recall", ["llama-3-8b-32768+32-bs4-recall", "llama-3-8b-32768+32-bs4-full-stream"],
                "call2-recall.json", 1.6),
    ]


GPU_CALLS = {1: _call1, 2: _call2}


def call_files(call: int, steps: list[Step]) -> list[str]:
    """The files a call sends back: its log, its record, and every step's outputs."""
    return [f"call{call}-log.txt", f"call{call}-plan.json", *(f for s in steps for f in s.outputs)]


def gpu_plan(call: int, out: str, py: str = "python3", so: str | None = None) -> list[Step]:
    """The steps of device call 1, 2 or 3, writing into the folder `out`."""
    steps = GPU_CALLS[call](_Parts(call, out, py, so))
    files = call_files(call, steps)
    assert len(files) <= MAX_FILES and len(set(files)) == len(files), files
    return steps




def wheels_needed(call: int) -> list[str]:
    return ["gguf", "flexgen"]


def missing_wheels(call: int) -> list[str]:
    """One line per wheel this call needs that bench/wheels/ lacks (or holds twice)."""
    lines = []
    for name in wheels_needed(call):
        found = glob.glob(os.path.join(WHEELS, WHEEL_GLOBS[name]))
        if len(found) != 1:
            lines.append(f"bench/wheels/ holds {len(found)} {WHEEL_GLOBS[name]} (needs one): "
                         f"run `{DOWNLOAD}` on a machine with network before the call "
                         "(bench/README.md, First GPU run)")
    return lines


def describe_plan(calls, so: str | None = None) -> str:
    """Every command of every call with its estimate, and each call's total."""
    commit = git_commit()
    lines = []
    for call in calls:
        steps = gpu_plan(call, "$OUT", so=so)
        total = sum(s.minutes for s in steps)
        worst = total + sum(s.fallback_min for s in steps)
        lines.append(f"call {call}: FLEXEVICT_COMMIT={commit} python3 bench/suites.py gpu "
                     f"--call {call} --out $OUT")
        lines += [f"  {s.minutes:4.1f} min  {s.name}: {s.cmd}" for s in steps]
        more = f" ({worst:.1f} if call 1's kernels are not carried)" if worst > total else ""
        files = call_files(call, steps)
        lines.append(f"  total {total:.1f} min{more}, limit {CALL_LIMIT_MIN:g}; "
                     f"{len(files)} files back: {', '.join(files)}")
        lines += [f"  MISSING: {m}" for m in missing_wheels(call)]
    return "\n".join(lines)


def run_shell(step: Step, log, env: dict, timeout: float) -> int:
    """Run step.cmd with bash in the repository root, its output appended to `log` -> exit
    code; 124 when it runs past `timeout` (its whole process group is killed)."""
    proc = subprocess.Popen(["bash", "-o", "pipefail", "-c", step.cmd], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return 124


def run_call(call: int, out: str, so: str | None = None) -> int:
    """Run device call `call` into `out` -> 0 when every step worked, else 1."""
    missing = missing_wheels(call)
    if missing:
        raise UserError(missing[0])
    if so is not None and not re.fullmatch(r"_C\..*\.so", os.path.basename(so)):
        raise UserError(f"--so {so}: expected the _C.*.so that call 1 wrote")
    if so is not None and not os.path.isfile(so):
        raise UserError(f"--so {so}: no such file")
    os.makedirs(out, exist_ok=True)
    steps = gpu_plan(call, os.path.abspath(out), sys.executable, so and os.path.abspath(so))
    commit = git_commit()
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", FLEXEVICT_COMMIT=commit,
               FLEXEVICT_CACHE_DIR=CALIBRATION_DIR,
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, SITE, os.environ.get("PYTHONPATH")])))
    # no device name here: CUDA stays untouched in this process (each case's JSON names it)
    record = {"call": call, "commit": commit, "steps": []}
    plan_json = os.path.join(out, f"call{call}-plan.json")
    start = time.monotonic()
    with open(os.path.join(out, f"call{call}-log.txt"), "a") as log:
        for step in steps:
            r = run_step(step, log, env, DEADLINE_S - (time.monotonic() - start))
            record["steps"].append(r)
            print(f"[call {call}] {step.name}: {r['status']} ({r.get('seconds', 0):.0f} s, "
                  f"est. {60 * step.minutes:.0f} s)", flush=True)
            with open(plan_json, "w") as f:
                json.dump(record, f, indent=1)
    moved = enforce_file_limit(out, set(call_files(call, steps)))
    if moved:
        print(f"[call {call}] moved {len(moved)} stray file(s) to {SCRATCH}: {', '.join(moved)}")
    return 0 if all(r["status"] == "ok" for r in record["steps"]) else 1


def run_step(step: Step, log, env: dict, left_s: float) -> dict:
    """One step under what is left of the call's time -> its record."""
    entry = {"name": step.name, "cmd": step.cmd, "estimate_min": step.minutes}
    if left_s < 15:
        return {**entry, "status": "skipped: the call's 9 minutes are used up"}
    log.write(f"\n===== {step.name} (est. {step.minutes} min, at most {left_s:.0f} s)\n"
              f"$ {step.cmd}\n")
    log.flush()
    t0 = time.monotonic()
    rc = run_shell(step, log, env, timeout=left_s)
    seconds = time.monotonic() - t0
    status = "ok" if rc in step.ok else "timed out" if rc == 124 else f"failed (exit {rc})"
    log.write(f"===== {step.name}: {status} in {seconds:.0f} s\n")
    log.flush()
    return {**entry, "rc": rc, "seconds": seconds, "status": status}


def enforce_file_limit(out: str, keep: set) -> list[str]:
    """Move every file under `out` that the plan did not declare to SCRATCH (the device tool
    sends back at most MAX_FILES files) -> the moved names."""
    stray = os.path.join(SCRATCH, "stray")
    moved = []
    for folder, _, files in os.walk(out):
        for name in files:
            rel = os.path.relpath(os.path.join(folder, name), out)
            if not any(fnmatch.fnmatchcase(rel, k) for k in keep):
                os.makedirs(stray, exist_ok=True)
                os.replace(os.path.join(folder, name),
                           os.path.join(stray, rel.replace(os.sep, "_")))
                moved.append(rel)
    return moved


def gpu_main(args) -> None:
    if args.dry_run:
        print(describe_plan([args.call] if args.call else GPU_CALLS, args.so))
        return
    if not args.call or not args.out:
        raise UserError("gpu: give --call N and --out DIR (or --dry-run to see the plan)")
    sys.exit(run_call(args.call, args.out, args.so))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("suite", nargs="?", choices=[*SUITES, "gpu"])
    ap.add_argument("--list", action="store_true", help="print the cases and their commands")
    ap.add_argument("--only", default=None, help="run the cases whose name contains this")
    ap.add_argument("--case", action="append", default=[], metavar="NAME",
                    help="run this case (exact name; repeatable)")
    ap.add_argument("--cut-gen-len", type=int, default=None, metavar="N",
                    help="run N decode steps of every selected case and project the rest")
    ap.add_argument("--out", default=None, help=f"results folder (default {RESULTS})")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the summary here")
    ap.add_argument("--repeat", type=int, default=5, metavar="N",
                    help="placement-cpu: run every case N times, rounds over all cases, and "
                         "compare the median run of each (default 5)")
    ap.add_argument("--call", type=int, choices=sorted(GPU_CALLS), help="gpu: which device call")
    ap.add_argument("--dry-run", action="store_true", help="gpu: print the plan, run nothing")
    ap.add_argument("--so", default=None, metavar="PATH",
                    help=f"gpu call 2: carried built kernels (default: {KNOWN_SO})")
    args = ap.parse_args(argv)
    with cli_errors("bench/suites.py"):
        if args.suite == "gpu":
            return gpu_main(args)
        if args.list or not args.suite:
            for n in ([args.suite] if args.suite else list(SUITES)):
                for c in SUITES[n]():
                    print(f"{n}/{c['name']}: python -m flexevict.bench {' '.join(c['argv'])}"
                          + (f"   [peer: {c['peer']['kind']}]" if c["peer"] else ""))
            return
        if args.suite == "placement-cpu":
            from placement_table import run_placement_suite
            return run_placement_suite(select(args), args.out or PLACEMENT_RESULTS,
                                       args.repeat)
        run_suite(args.suite, select(args), args.out or RESULTS, args.json)


def select(args) -> list[dict]:
    """The suite's cases that --only / --case pick, with --cut-gen-len applied."""
    cases = SUITES[args.suite]()
    unknown = set(args.case) - {c["name"] for c in cases}
    if unknown:
        raise UserError(f"--case {', '.join(sorted(unknown))}: not in suite '{args.suite}' "
                        f"(see `python bench/suites.py {args.suite} --list`)")
    cases = [c for c in cases if (not args.only or args.only in c["name"])
             and (not args.case or c["name"] in args.case)]
    if args.cut_gen_len is not None:
        if args.cut_gen_len < 1:
            raise UserError(f"--cut-gen-len {args.cut_gen_len}: must be >= 1")
        for c in cases:
            argv = c["argv"]
            if "--cut-gen-len" in argv:
                i = argv.index("--cut-gen-len")
                del argv[i:i + 2]
            argv += ["--cut-gen-len", str(args.cut_gen_len)]
    return cases


def run_suite(suite: str, cases: list[dict], out: str, summary_json: str | None = None):
    """Run the cases one process each -> rows; writes the per-case JSONs under out/suite, the
    table out/suite_device.md, the summary out/suite_device.json (and summary_json)."""
    dev = device_label()
    folder = os.path.join(out, suite)
    os.makedirs(folder, exist_ok=True)
    rows = []
    for c in cases:
        print(f"[{suite}] {c['name']}", file=sys.stderr, flush=True)
        rows.append(run_case(c, os.path.join(folder, f"{c['name']}_{dev}")))
        print(summarize(suite, rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    table = summarize(f"{suite} on {dev}", rows) + "\n\n" + prediction_table(rows)
    summary = {"suite": suite, "device": dev, "cases": rows}
    if suite == "bound":
        bandwidth = h2d_bandwidth()
        table += "\n\n" + bound_table(rows, bandwidth)
        summary["h2d_bandwidth"] = bandwidth
    summary["table"] = table
    with open(os.path.join(out, f"{suite}_{dev}.md"), "w") as f:
        f.write(table + "\n")
    for path in filter(None, (os.path.join(out, f"{suite}_{dev}.json"), summary_json)):
        with open(path, "w") as f:
            json.dump(summary, f, indent=1)
    print(table)
    return rows


def _packaged_smollm2():
    from flexevict.io.packaged import smollm2_gguf
    return smollm2_gguf()


if __name__ == "__main__":
    main()
