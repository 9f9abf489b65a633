"""This machine's measured rates for the placement cost model (costmodel.py), and where they
are kept; `python -m flexevict.calibrate` is its command line.

What is measured (each the best of a few repeats, on data larger than the CPU caches where a
rate is meant to be a memory or link rate):

- links: host-to-device and device-to-host bandwidth from pinned and from pageable memory. On a
  CPU-only machine the "device" is the CPU and every link is the memcpy the engine's cpu-tier
  copies do (a cache load is `copy_` between two host buffers).
- disk: write and read bandwidth of files under --offload-dir, the way the engine uses them: a
  fresh file mapped with `torch.from_file`, written through the mapping, then read through a new
  mapping. Without root the page cache cannot be dropped, so the read is served from the page
  cache (minor faults), not the device: a run whose disk tier does not fit in free RAM reads
  slower than this.
- per compute device and dtype: matrix-multiply throughput on the engine's path (oneDNN-packed
  weights on a CPU in fp32, `model.PackedWeight`) at a prefill shape (flop/s) and at decode
  shapes (weight bytes/s, streaming more weights than the caches hold, and re-reading a layer
  that fits the last-level cache); the cost of preparing a streamed weight for compute (the
  oneDNN reorder the engine does per use on a CPU, by layer size); element-wise memory
  bandwidth; 4-bit quantize/dequantize; decode attention per cached slot (K and V from memory,
  not from a cache that holds them); causal prefill attention and H2O's prompt column sums
  (flop/s at several prompt lengths: the rate grows with S); a one-layer probe's prefill halves (the
  element-wise work besides matmuls and attention); and the fixed cost of each
  schedule-layer cell and of each lane job, from the real engine on a tiny model (a small
  model's step is mostly this).
- on a CPU, the real engine on a six-layer probe model, with every weight in memory and with
  every weight streamed from the cpu tier: the cost model scales its CPU compute and streaming
  terms to reproduce those steps (costmodel.CostModel._efficiency).
- per policy (measured on first use of that policy, and again when the code its hooks run has
  changed since, `hook_code`): its hooks' cost per decode step, fixed and per (slot x row), and
  its prefill hook per (prompt token x row).

On a machine shared with other work a disturbance lasts seconds, longer than one measurement's
repeats: the short measurements run in ROUNDS (3) rounds spread over the calibration and keep
their medians, the long ones the median of their own repeats; 30-35 s on a quiet 2-core CPU,
`--quick` about 10 s. A first calibration on a machine whose cores other work keeps busy
(`other_work_cores`, from /proc/stat) is a quick one: it measures the machine as it is then,
in about twice a quiet calibration's time rather than ten times. A quick one is marked as such
and serves until a command that needs a calibration finds the machine quiet, which measures a
full one (`load`). A quick one measures fewer rounds, repeats and sizes, not smaller shapes.

Everything is measured at one torch thread per core, plus how much longer a compute-bound and
a memory-bound piece of work take on one thread (`measure_thread_scaling`) and the engine's fixed
costs on one thread: a run on fewer threads scales the CPU's constants by Amdahl's law through
those two points and interpolates the fixed costs (`for_threads`), so one calibration serves
every --threads. The result is cached per machine (device name, torch
version) as JSON in $FLEXEVICT_CACHE_DIR, else $XDG_CACHE_HOME/flexevict/, else
~/.cache/flexevict/; commands that need it calibrate on first use (`bench` only when asked:
an `auto` flag or --predict). `--calibration FILE` (plan, bench, generate, eval), or the
environment variable FLEXEVICT_CALIBRATION=FILE, reads a file instead (nothing is measured or
written then), e.g. one written with --out or --synthetic.
"""
from __future__ import annotations

import bisect
import functools
import hashlib
import inspect
import json
import math
import os
import re
import sys
import tempfile
import time

import torch

from flexevict.core.paths import cache_dir

from flexevict.core.config import ARCHS, DTYPES, default_dtype
from flexevict.errors import UserError, setting
from flexevict.runtime.allocator import steady_host_allocator
from flexevict.runtime.machine import device_name

SCHEMA = 3       # 3: prefill attention with prompt scores is one fused pass
MB = 1 << 20
# Hidden sizes of the layers whose weights' prepare cost is measured (27 to 108 MB a layer: the
# rate falls by half between 1024 and 1536, where a matrix passes glibc's mmap threshold, and
# is flat beyond either end: 3 and 12 MB layers measured as 27 MB's, 192 MB as 108 MB's).
PREPARE_HIDDEN = (768, 1024, 1536)
# Datasheet numbers for --synthetic (rates achievable in practice, about 60-85% of peak); the
# overheads are typical CUDA-launch-bound values. Not measured: say so wherever used.
SYNTHETIC = {
    "h100": {"name": "NVIDIA H100 80GB HBM3 (synthetic)", "gemm": 600e12, "mem": 2.8e12,
             "h2d_pinned": 50e9, "h2d_pageable": 20e9, "d2h_pinned": 50e9,
             "d2h_pageable": 18e9, "disk_read": 3e9, "disk_write": 2e9, "cpu_cores": 16,
             "cpu_mem": 150e9, "cpu_gemm": 1.5e12, "memory_gb": 80, "host_memory_gb": 128},
}


# ---------------------------------------------------------------------------- where it lives

def machine_key(device: torch.device) -> dict:
    """What a calibration is of: the device and the torch build. Not the thread count: one
    calibration serves every --threads (`Calibration.threads`)."""
    return {"device": device_name(device), "torch": torch.__version__}


def cache_path(key: dict, kind: str = "calibration") -> str:
    """The cache file of machine `key`: its calibration, or (kind "probe") probe.py's record."""
    slug = re.sub(r"[^a-z0-9.]+", "-", f"{key['device']}-torch{key['torch']}"
                  .lower()).strip("-")
    return os.path.join(cache_dir(), f"{kind}-{slug}.json")


# ---------------------------------------------------------------------------- the record

class Calibration:
    """The measured constants (a JSON dict) and where they are kept; sections for a compute
    device and dtype, and for a policy, are measured on first use and saved."""

    def __init__(self, data: dict, path: str | None, measure_ok: bool = True, steps=None,
                 threads: int | None = None):
        """steps: where each measuring step is reported (`Steps`); a calibration read from
        its cache reports a section measured on first use with a Steps of its own. threads:
        the torch CPU threads the run will use; the CPU's constants, measured at one thread
        per core, are scaled to them (`for_threads`; None: as measured)."""
        self.data, self.path, self.measure_ok = data, path, measure_ok
        self.steps, self.threads = steps, threads

    def as_measured(self) -> "Calibration":
        """This calibration at the thread count it was measured at (nothing scaled): where
        the cost model fits its efficiency factors to the engine probe, a run of that count."""
        return Calibration(self.data, self.path, self.measure_ok, self.steps, threads=None)

    @property
    def synthetic(self) -> bool:
        return bool(self.data.get("synthetic"))

    @property
    def read_only(self) -> bool:
        """Nothing is measured: a synthetic calibration, or a file read as given."""
        return self.synthetic or not self.measure_ok

    @property
    def quick(self) -> bool:
        return bool(self.data.get("quick"))

    def link(self, name: str) -> float:
        """Bytes/s of a link; on a machine without a GPU every link is a host memcpy, which
        runs on the torch threads (scaled to them like the CPU's element-wise passes)."""
        rate = self.data["links"][name]
        cpu = [v for k, v in self.data.get("devices", {}).items() if k.startswith("cpu:")]
        if self.data.get("gpu_memory_gb") is None and cpu and not name.startswith("disk"):
            rate /= _thread_factors(cpu[0].get("thread_scaling"), self.data["host"].get(
                "threads", 1), self.threads).get("elementwise", 1.0)
        return rate

    def host(self, name: str):
        return self.data["host"][name]

    def device(self, device: torch.device, dtype: torch.dtype) -> dict:
        """Compute constants of (device, dtype), measured now if missing."""
        kind = torch.device(device).type
        key = f"{kind}:{dtype_name(dtype)}"
        devices = self.data.setdefault("devices", {})
        if key not in devices:
            alike = [k for k in devices if k.startswith(f"{kind}:")]
            if alike and self.read_only:
                return devices[alike[0]]     # a file made elsewhere: the same device, another dtype
            self._need_measuring(key)
            with _threads(self.data["host"].get("threads", torch.get_num_threads())):
                devices[key] = measure_device(torch.device(device), dtype, self.quick,
                                              self.steps or Steps(device_steps(kind, self.quick)))
            self.save()
        if kind != "cpu":
            return devices[key]
        return for_threads(devices[key], self.data["host"], self.threads)

    def policy(self, spec, device: torch.device, dtype: torch.dtype) -> dict:
        """Hook costs of a policy (name and arguments) on (device, dtype)."""
        key = (f"{torch.device(device).type}:{dtype_name(dtype)}:{spec.name}:{sorted(spec.args)}"
               f"{POLICY_COSTS}")
        table = self.data.setdefault("policies", {})
        entry, code = table.get(key), hook_code(spec.name)
        if entry is not None and (entry.get("code") == code or self.read_only):
            return entry            # a file read as given serves whatever code measured it
        if self.read_only:
            return synthetic_policy(self.data)
        (self.steps or Steps(1))(f"the {spec.name} policy's hooks"
                                 + (" (their code changed)" if entry else ""))
        table[key] = measure_policy(spec, torch.device(device), dtype, self.quick) | {
            "code": code}
        self.save()
        return table[key]

    def _need_measuring(self, what: str):
        if self.read_only:
            src = self.path or "the calibration"
            raise UserError(f"{src} has no measurements for {what} and cannot measure them on "
                            "this machine; give a calibration made on the target machine "
                            "(`python -m flexevict.calibrate` there) or drop "
                            f"{setting('calibration')}")

    def save(self):
        if self.path and self.measure_ok:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            tmp = self.path + ".partial"
            with open(tmp, "w") as f:
                json.dump(self.data, f, indent=1)
            os.replace(tmp, self.path)


def load(device: torch.device, threads: int | None = None, offload_dir: str | None = None,
         path: str | None = None, recalibrate: bool = False, quick: bool = False,
         log=print) -> Calibration:
    """The calibration for this machine (measured now if not cached), or the file `path`, for
    a run on `threads` torch CPU threads (default: torch's current count). It is measured at
    one thread per core, whatever `threads` is: one calibration serves every thread count."""
    threads = threads or torch.get_num_threads()
    steady_host_allocator()            # measure in the allocator state the engine runs in
    path = path or os.environ.get("FLEXEVICT_CALIBRATION")
    if path:
        return read_file(path, threads)
    key = machine_key(device)
    where = cache_path(key)
    data, busy = (None, None) if recalibrate else _reusable(_read_cache(key), quick, where, log)
    if data is not None:
        return Calibration(data, where, threads=threads)
    log(f"calibrating this machine (once, for every --threads; cached in {where})",
        file=sys.stderr)
    t0 = time.perf_counter()
    busy = other_work_cores() if busy is None else busy
    if not quick and busy >= BUSY_CORES:
        quick = True
        log(f"calibrating: other work keeps about {busy:.1f} of this machine's cores busy: a "
            "quick calibration, which measures it as it is now (the next command that needs a "
            "calibration on a quiet machine measures it fully)", file=sys.stderr)
    steps = Steps(planned(device, quick), log)
    with _threads(_cores()):
        machine = measure_machine(device, offload_dir, quick, steps)
        machine["host"]["busy_cores"] = round(busy, 2)
        cal = Calibration(machine | {"machine": key}, where, steps=steps, threads=threads)
        cal.device(device, DTYPES[default_dtype(device)])
        if device.type == "cuda":        # attention where a CPU cache lives (--cpu-cache-compute)
            cal.device(torch.device("cpu"), DTYPES[default_dtype(device)])
    cal.save()
    log(f"calibrated in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return cal


def _reusable(data: dict | None, quick: bool, where: str, log) -> tuple[dict | None, float | None]:
    """The cached calibration `data` if `load` may use it as it is -> (data or None to measure
    again, the other work's cores when it looked). Measured again: one whose prefill attention
    was timed at a single short prompt (made before `attention_rate`), and a quick one where a
    full one is asked for and the machine is quiet now (a quick one is made while other work
    keeps cores busy: it serves, said as such, until a command that needs a calibration finds
    the machine quiet)."""
    if data is None:
        return None, None
    if any("prefill_attn" not in d for d in data.get("devices", {}).values()):
        log(f"calibrating: the cached calibration {where} timed prefill attention at one short "
            "prompt only: measuring again", file=sys.stderr)
        return None, None
    if not data.get("quick") or quick:
        return data, None
    busy = other_work_cores()
    if busy < BUSY_CORES:
        log(f"calibrating: the cached calibration {where} is a quick one and this machine is "
            "quiet now: measuring it fully, once", file=sys.stderr)
        return None, busy
    log(f"calibration: the quick one, {where} (other work keeps about {busy:.1f} cores busy "
        "now; the next command that needs a calibration on a quiet machine measures a full "
        "one)", file=sys.stderr)
    return data, busy


def cached(device: torch.device, threads: int | None = None) -> Calibration | None:
    """This machine's calibration if one is cached (or named by $FLEXEVICT_CALIBRATION), read
    only: nothing is measured, and a section it lacks is not measured either. None when there
    is none (`load` would measure it)."""
    threads = threads or torch.get_num_threads()
    if os.environ.get("FLEXEVICT_CALIBRATION"):
        return read_file(os.environ["FLEXEVICT_CALIBRATION"], threads)
    key = machine_key(device)
    data = _read_cache(key)
    return None if data is None else Calibration(data, cache_path(key), measure_ok=False,
                                                 threads=threads)


def _read_cache(key: dict) -> dict | None:
    """The cached calibration of machine `key`, or None when there is none, it is broken, or
    it is of another schema or machine (then it is measured again)."""
    try:
        with open(cache_path(key)) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    return data if data.get("schema") == SCHEMA and data.get("machine") == key else None


class Steps:
    """One line per calibration step on stderr: what it measures, step i of N, elapsed: a
    minute of measuring is never silent. N is an estimate made up front (`planned`); a
    step past it raises N."""

    def __init__(self, total: int, log=print):
        self.total, self.done, self.log = total, 0, log
        self.start = time.perf_counter()

    def __call__(self, what: str) -> None:
        self.done += 1
        self.total = max(self.total, self.done)
        self.log(f"calibrating: step {self.done}/{self.total}: {what} "
                 f"({time.perf_counter() - self.start:.0f} s elapsed)", file=sys.stderr,
                 flush=True)


def _quiet(what: str) -> None:
    """A Steps stand-in that says nothing (measuring a section on first use, in a test)."""


def planned(device: torch.device, quick: bool) -> int:
    """How many Steps a first calibration of `device` takes: the machine's 4, the compute
    device's, and on a GPU the CPU's too (for --cpu-cache-compute)."""
    cpu = device_steps("cpu", quick) if device.type == "cuda" else 0
    return 4 + device_steps(device.type, quick) + cpu


def device_steps(kind: str, quick: bool) -> int:
    """Steps of `measure_device` on a device of `kind`: one per round, 2 long ones, and on a
    CPU the engine probe and (with more than one thread) the fixed costs on one thread."""
    cpu = 0 if kind == "cuda" else 2 + (_cores() > 1)
    return (1 if quick else ROUNDS) + 2 + cpu


def read_file(path: str, threads: int | None = None) -> Calibration:
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise UserError(f"{setting('calibration')} {path}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{setting('calibration')} {path}: not a calibration JSON ({e.msg}); write "
                        "one with `python -m flexevict.calibrate --out FILE`") from None
    if data.get("schema") != SCHEMA or "links" not in data:
        raise UserError(f"{setting('calibration')} {path}: not a calibration of schema {SCHEMA}; "
                        "write one with `python -m flexevict.calibrate --out FILE`")
    return Calibration(data, path, measure_ok=False, threads=threads)


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


class _threads:
    def __init__(self, n):
        self.n, self.before = n, torch.get_num_threads()

    def __enter__(self):
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.before)


# ---------------------------------------------------------------------------- timing

def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn, device="cpu", repeats: int = 5, median: bool = False,
              warm: bool = True) -> float:
    """Seconds of fn(): the best of `repeats` after one warm-up call (unless not `warm`; on a
    shared machine the best is the least disturbed), or their median (for work that a run
    does over and over, like streaming weights, whose typical time is what the engine sees)."""
    if warm:
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return _median(times) if median else min(times)


def _fit(xs, ts) -> tuple[float, float]:
    """Least-squares line t = a + b x, a and b clipped at 0 -> (a, b)."""
    n = len(xs)
    mx, mt = sum(xs) / n, sum(ts) / n
    var = sum((x - mx) ** 2 for x in xs)
    b = max(sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / var, 0.0) if var else 0.0
    return max(mt - b * mx, 0.0), b


# ---------------------------------------------------------------------------- the machine

def measure_machine(device: torch.device, offload_dir: str | None, quick: bool,
                    step=_quiet) -> dict:
    """Links, disk and host constants (the compute sections come per device and dtype),
    measured at torch's current thread count; step(what) is called before each of its 4
    steps."""
    step("host-device copies")
    links = measure_links(device, 256 * MB)          # quick too: larger than the caches
    step("disk writes and reads")
    disk = measure_disk(offload_dir or tempfile.gettempdir(), (32 if quick else 128) * MB)
    gpu_gb = torch.cuda.get_device_properties(device).total_memory / (1 << 30) \
        if device.type == "cuda" else None
    step("parallel lanes on the CPU cores")
    parallel = measure_parallel(quick)
    step("one lane job")
    lane_job = measure_lane_job(device)
    return {"schema": SCHEMA, "quick": quick, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "gpu_memory_gb": gpu_gb,
            "links": {**links, **disk},
            "host_memory_gb": _mem_total_gb(),
            "host": {"cores": _cores(), "parallel": parallel,
                     "lane_job_s": lane_job, "threads": torch.get_num_threads(),
                     "disk_note": "read from the page cache through a fresh mapping of a "
                                  "just-written file (the cache cannot be dropped without root)"}}


def measure_links(device: torch.device, nbytes: int) -> dict:
    """Bytes/s of host<->device copies, pinned and pageable. Without CUDA: the host memcpy."""
    if device.type != "cuda":
        a, b = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        a.fill_(1)
        bw = nbytes / best_time(lambda: b.copy_(a))
        return {k: bw for k in ("h2d_pinned", "h2d_pageable", "d2h_pinned", "d2h_pageable")}
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for pinned in (True, False):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        tag = "pinned" if pinned else "pageable"
        out[f"h2d_{tag}"] = nbytes / best_time(lambda: gpu.copy_(host, non_blocking=pinned),
                                               device)
        out[f"d2h_{tag}"] = nbytes / best_time(lambda: host.copy_(gpu, non_blocking=pinned),
                                               device)
    return out


def measure_disk(folder: str, nbytes: int) -> dict:
    """Write and read bytes/s of a file under `folder` through torch.from_file mappings, as
    the engine's disk tier uses them (see the module docstring for what the read measures)."""
    folder = os.path.expanduser(folder)
    try:
        os.makedirs(folder, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix="calibrate-", suffix=".bin", dir=folder)
        os.close(fd)
    except OSError as e:
        raise UserError(f"{setting('offload_dir')} {folder}: cannot write a test file there "
                        f"({e.strerror}); give a writable directory") from None
    src = torch.ones(nbytes, dtype=torch.uint8)
    try:
        writes, reads = [], []
        for _ in range(3):
            with open(path, "wb") as f:
                f.truncate(nbytes)                       # a fresh sparse file, as the engine
            t0 = time.perf_counter()
            torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8).copy_(src)
            writes.append(time.perf_counter() - t0)
            dst = torch.empty(nbytes, dtype=torch.uint8)
            t0 = time.perf_counter()
            dst.copy_(torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8))
            reads.append(time.perf_counter() - t0)
    finally:
        os.remove(path)
    return {"disk_write": nbytes / min(writes), "disk_read": nbytes / min(reads)}


def _mem_total_gb() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return None


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


# Other work that keeps this many cores busy makes a first calibration quick: each of its
# measurements then takes several times as long (threads wait for cores), and the many repeats
# of a full one, there to find the least disturbed, would find none (a 2-core CPU with a
# 2-thread job beside it: 100 s against 11 s quiet)
BUSY_CORES = 0.5


def other_work_cores(seconds: float = 0.25) -> float:
    """How many of this process's cores other work keeps busy, measured over `seconds` while
    this one sleeps: the CPU time /proc/stat counts as not idle on the CPUs this process may
    run on (work elsewhere on a larger host does not compete); 0 where there is no /proc."""
    ours = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    try:
        with open("/proc/stat") as f:
            idle0, all0, cpus = cpu_ticks(f.read(), ours)
        time.sleep(seconds)
        with open("/proc/stat") as f:
            idle1, all1, _ = cpu_ticks(f.read(), ours)
    except (OSError, ValueError, IndexError):
        return 0.0
    total = all1 - all0
    return cpus * (total - (idle1 - idle0)) / total if total > 0 else 0.0


def cpu_ticks(stat: str, cpus: set[int]) -> tuple[int, int, int]:
    """(idle + iowait ticks, all ticks, CPUs counted) of /proc/stat's text over the CPUs
    `cpus`, or over every CPU when it has no line for any of them. The fields counted are user
    .. steal (guest time is inside user)."""
    lines = {p[0]: [int(x) for x in p[1:9]] for p in map(str.split, stat.splitlines())
             if p and re.fullmatch(r"cpu\d+", p[0])}
    rows = [lines[f"cpu{c}"] for c in sorted(cpus) if f"cpu{c}" in lines] or list(lines.values())
    return sum(r[3] + r[4] for r in rows), sum(sum(r) for r in rows), len(rows)


def measure_parallel(quick: bool) -> float:
    """How many threads of CPU work run at once here: the speed-up of one piece of work per
    core run on that many threads at once over one thread, in [1, cores]. On a machine shared
    with other processes this is what is left to the engine's lanes (at calibration time)."""
    import threading
    cores = _cores()
    if cores < 2:
        return 1.0
    x = torch.randn(256, 256)

    def work():
        with _threads(1):
            for _ in range(200):                  # quick too: thread start-up is not work
                x @ x
    one = best_time(work, repeats=3)

    def together():
        ts = [threading.Thread(target=work) for _ in range(cores)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    return min(max(cores * one / best_time(together, repeats=3), 1.0), float(cores))


def measure_lane_job(device: torch.device) -> float:
    """Seconds one job on a threaded lane costs the submitting thread (submit + wait)."""
    from flexevict.runtime.offload import Lane
    lane = Lane("calibrate", device, threaded=True)
    try:
        n = 200
        return best_time(lambda: [lane.submit(lambda: None).wait() for _ in range(n)],
                         repeats=3) / n
    finally:
        lane.close()


# ---------------------------------------------------------------------------- threads

def measure_thread_scaling(quick: bool) -> dict:
    """How much longer work takes on one torch thread than on the current count (one per
    core), t1 / tN in [1, N] of: "compute", a prefill-shaped matrix product; "memory", a
    decode-shaped stream of weights larger than the caches; "elementwise", a copy larger than
    the caches; "attention", decode attention over 2048 slots of K and V from memory (it
    scales unlike a weight stream: 1.9x against 1.7x on the 2-core CPU); "sdpa" and "scored",
    prefill attention at SCALING_PREFILL tokens on SDPA and on the scored pass (SDPA gained
    1.45x from a second thread where a product gained 1.98x: scaled as a product, a 4096-token
    prefill's attention was priced 36% slow on one thread). One thread, then N,
    back to back: a busy machine slows both. One sample per
    round of `measure_device`, which keeps the median: a disturbance of a second or two that
    hits the N-thread half looks like no scaling at all."""
    from flexevict.core.model import onednn_usable
    n = torch.get_num_threads()
    if n < 2:
        return dict.fromkeys(SCALING, 1.0)
    cpu = torch.device("cpu")
    prep, apply = _linear_op(cpu, torch.float32, onednn_usable(cpu, torch.float32))
    m, k = 512, 2048            # quick too: the shapes of a full calibration, fewer rounds
    x, w = torch.randn(m, k), prep(torch.randn(k, k))
    # the engine's path: a plain x @ w.T at 4 rows runs on one thread whatever the count
    ws = [prep(torch.randn(3072, 768)) for _ in range(12)]     # 9 MB each
    v = torch.randn(4, 768)
    a = torch.ones(32 * MB // 4)
    b = torch.empty_like(a)
    attend = _decode_ring(cpu, torch.float32, 2048)
    sdpa, scored = _prefill_attention(cpu, torch.float32, SCALING_PREFILL)
    work = {"compute": lambda: apply(x, w), "memory": lambda: [apply(v, u) for u in ws],
            "elementwise": lambda: b.copy_(a), "attention": attend, "sdpa": sdpa,
            "scored": scored}
    out = {}
    for name, fn in work.items():
        with _threads(1):
            fn()                                            # warm-up at each count
        fn()
        ones, alls = [], []
        for _ in range(SCALING_REPEATS if name in SCALING_SHORT else 2):    # alternating
            with _threads(1):
                ones.append(best_time(fn, repeats=1, warm=False))
            alls.append(best_time(fn, repeats=1, warm=False))
        out[name] = min(max(min(ones) / min(alls), 1.0), float(n))
    return out


# one-thread and all-thread samples per kind and round: the best of each (on a shared 2-core
# machine a 2-thread sample is the one another process disturbs, and with 2 samples the compute
# ratio came out 1.32, 1.56 and 1.95 in three calibrations of the same quiet-ish machine)
SCALING_REPEATS = 4
SCALING_SHORT = ("compute", "memory", "elementwise")      # the kinds of a few ms: 4 samples
SCALING_PREFILL = 2048


def _thread_factors(scaling: dict | None, n: int, threads: int | None) -> dict:
    """{kind: time on `threads` torch threads over time on the calibration's n} for each kind
    of SCALING (`scaling`: `measure_thread_scaling`), by Amdahl's law (t = a + b / threads)
    through the two measured points (1 and n threads); more threads than n gain nothing. 1.0
    without a measurement."""
    if not scaling or not threads or threads == n or n < 2:
        return dict.fromkeys(SCALING, 1.0)
    t = min(max(threads, 1), n)
    out = {}
    for name, ratio in scaling.items():
        b = (ratio - 1) / (1 - 1 / n)              # t(1) = ratio, t(N) = 1
        out[name] = 1 - b / n + b / t
    return out


# a CPU section's rates (bytes or flop/s), by the kind of work that sets them (the kinds of
# `measure_thread_scaling`; "compute" also scales the probe's prefill halves, "memory" decode
# attention, "elementwise" a CPU-only machine's links). Not the weight preparation table: a
# streamed layer's reorder is bound by faulting in fresh pages, and measure_prepare gives the
# same rates on one thread as on two.
SCALING = {"compute": ("gemm_flops",),
           "memory": ("gemv_bw", "gemv_hot_bw"),
           "elementwise": ("mem_bw", "quant_bw", "dequant_bw"),
           "attention": (),            # decode attention's time per unit (`for_threads`)
           "sdpa": ("sdpa_flops",),    # and the prefill attention tables, by their kinds
           "scored": ("scored_attn_flops",)}
# a kind a calibration did not measure (made before it) scales as this one
SCALING_FALLBACK = {"attention": "memory", "sdpa": "compute", "scored": "compute"}


def for_threads(section: dict, host: dict, threads: int | None) -> dict:
    """A CPU section (`measure_device`) for a run on `threads` torch threads (`host`: the
    machine's record, with the thread count it was measured at). Compute-bound rates
    and times (products, prefill attention, prefill halves) scale by the compute factor of
    `_thread_factors`, memory-bound ones (weight streams, decode attention) by the memory
    factor, element-wise passes by theirs (SCALING says which is which). The engine's fixed
    costs per layer cell and lane job, which grow with the threads an op forks and joins, are
    measured on one thread and on all, and interpolated in between. The engine probe stays as
    measured: the cost model fits its efficiency factors at the measured count
    (`Calibration.as_measured`)."""
    factors = _thread_factors(section.get("thread_scaling"), host.get("threads", 1), threads)
    if set(factors.values()) == {1.0} or "overhead_one_thread" not in section:
        return section
    factors |= {kind: factors[instead] for kind, instead in SCALING_FALLBACK.items()
                if kind not in section["thread_scaling"]}
    fc = factors["compute"]
    out = dict(section)
    for kind, rates in SCALING.items():
        out.update({k: section[k] / factors[kind] for k in rates if k in section})
    attn = section["attn_decode"]
    out["attn_decode"] = {**attn, "per_unit_s": attn["per_unit_s"] * factors["attention"]}
    if "prefill_attn" in section:            # prefill attention by prompt length
        out["prefill_attn"] = {k: [[s, rate / factors[k]] for s, rate in table]
                               for k, table in section["prefill_attn"].items()}
    for probe in ("probe", "probe_long"):
        if probe in section:
            out[probe] = {arch: {**p, "attn_s": p["attn_s"] * fc, "mlp_s": p["mlp_s"] * fc}
                          for arch, p in section[probe].items()}
    n, t = host["threads"], min(max(threads, 1), host["threads"])
    out["overhead"] = _between(section["overhead_one_thread"], section["overhead"],
                               (t - 1) / (n - 1))
    return out


def _between(one: dict, many: dict, f: float) -> dict:
    """The nested dicts of seconds one and many, a fraction f of the way from one to many."""
    return {k: _between(one[k], v, f) if isinstance(v, dict) else one[k] + f * (v - one[k])
            for k, v in many.items()}


# ---------------------------------------------------------------------------- compute

# the short measurements: the median of this many rounds, spread over the calibration
ROUNDS = 3


def measure_device(device: torch.device, dtype: torch.dtype, quick: bool, step=_quiet) -> dict:
    """Compute constants of one device and dtype (see the module docstring). On a machine
    shared with other work a disturbance can last seconds, longer than one measurement's
    repeats (each the best of a few), so the short measurements run in ROUNDS rounds, one
    before and one after each long one, and keep their medians (`_median_of`): what a run of
    many steps meets. The long ones (the reorder, fixed costs, the engine probe) take the
    median of their own repeats."""
    from flexevict.core.model import onednn_usable
    pack = onednn_usable(device, dtype)
    kind = f"{device.type} {dtype_name(dtype)}"
    n_rounds = 1 if quick else ROUNDS
    def overheads():
        return {arch: measure_overheads(arch, device, dtype, quick) for arch in ARCHS}

    def overheads_on_one_thread():
        with _threads(1):
            return overheads()
    long = [("weight preparation", "prepare",
             lambda: measure_prepare(device, dtype, quick) if pack else {}),
            ("per-layer fixed costs", "overhead", overheads)]
    if device.type == "cpu" and torch.get_num_threads() > 1:
        long.append(("per-layer fixed costs on one thread", "overhead_one_thread",
                     overheads_on_one_thread))
    if device.type == "cpu":      # on a GPU the probe is this large already (PROBE_GPU)
        long.append(("a layer at a long prefill", "probe_long",
                     lambda: {arch: measure_probe(arch, device, dtype, quick, PROBE_LONG)
                              for arch in ARCHS}))
    if device.type == "cpu":      # on a GPU a model this small is launch-bound
        long.append(("the engine on a small model", "engine_probe",
                     lambda: {arch: measure_engine_probe(arch, device, dtype, quick)
                              for arch in ARCHS}))
    out, rounds = {"pack": pack}, []
    for r in range(max(n_rounds, len(long))):
        if r < n_rounds:
            step(f"products, bandwidth, quantization, attention, a layer"
                 f"{', one thread vs all' if device.type == 'cpu' else ''} ({kind}, round "
                 f"{r + 1}/{n_rounds})")
            rounds.append(_short_measurements(device, dtype, quick))
        if r < len(long):
            what, key, measure = long[r]
            step(f"{what} ({kind})")
            out[key] = measure()
    return out | _median_of(rounds)


def _short_measurements(device, dtype, quick: bool) -> dict:
    """One round of the measurements that take a second or two each."""
    out = measure_matmul(device, dtype, quick)
    if device.type == "cpu":
        out["thread_scaling"] = measure_thread_scaling(quick)
    out["mem_bw"] = measure_mem_bw(device, 256 * MB)     # quick too: more than the caches
    out.update(measure_quant(device, dtype, quick))
    out.update(measure_attention(device, dtype, quick))
    out["probe"] = {arch: measure_probe(arch, device, dtype, quick) for arch in ARCHS}
    return out


def _median_of(rounds: list):
    """Merge rounds of the same measurements: every number (and the rate column of a [size,
    rate] table) keeps its median; flags, sizes and strings are alike in every round."""
    first = rounds[0]
    if isinstance(first, dict):
        return {k: _median_of([r[k] for r in rounds]) for k in first}
    if isinstance(first, list) and first and isinstance(first[0], list):   # [[size, rate]]
        return [[row[0], _median([r[i][1] for r in rounds])] for i, row in enumerate(first)]
    if isinstance(first, list):                      # [seconds, ...]
        return [_median([r[i] for r in rounds]) for i in range(len(first))]
    if isinstance(first, bool) or not isinstance(first, (int, float)):
        return first
    return _median(rounds)


def _median(values):
    values = sorted(values)
    return values[len(values) // 2]


def _linear_op(device, dtype, pack: bool):
    """(prepare(w), apply(x, prepared)) on the engine's path for this device and dtype."""
    from flexevict.core.model import PackedWeight, linear
    if pack:
        return PackedWeight, linear
    return (lambda w: w), linear


def measure_matmul(device, dtype, quick: bool) -> dict:
    """gemm_flops: (M x K) x (K x N) flop/s at a prefill shape; gemv_bw: weight bytes/s at
    M = 4 over more weights than the caches hold (decode is a stream of the weights)."""
    from flexevict.core.model import onednn_usable
    prep, apply = _linear_op(device, dtype, onednn_usable(device, dtype))
    gpu = device.type == "cuda"
    m, k = (4096, 4096) if gpu else (512, 2048)     # quick: the same shape, fewer repeats
    w = prep(torch.randn(k, k, device=device, dtype=dtype))
    x = torch.randn(m, k, device=device, dtype=dtype)
    gemm = 2 * m * k * k / best_time(lambda: apply(x, w), device, 3 if quick else 5)
    n_out, n_in = (8192, 4096) if gpu else (3072, 768)
    total = (512 if gpu else 128) * MB      # quick too: a stream larger than a cache holds
    elem = torch.empty((), dtype=dtype).element_size()
    count = max(2, total // (n_out * n_in * elem))
    ws = [prep(torch.randn(n_out, n_in, device=device, dtype=dtype)) for _ in range(count)]
    x = torch.randn(4, n_in, device=device, dtype=dtype)
    t = best_time(lambda: [apply(x, w) for w in ws], device, repeats=3 if quick else 5)
    llc = last_level_cache(device)
    hot = ws[:max(1, (llc // 4) // (n_out * n_in * elem))]       # a quarter of the cache
    t_hot = best_time(lambda: [apply(x, w) for w in hot], device, repeats=3 if quick else 5)
    return {"gemm_flops": gemm, "gemv_bw": count * n_out * n_in * elem / t,
            "gemv_hot_bw": len(hot) * n_out * n_in * elem / t_hot, "llc_bytes": llc}


def last_level_cache(device) -> int:
    """Bytes of the last-level cache (the CPU's from sysfs, the GPU's L2): a layer's weights
    that fit stay there for the next GPU batch of the same layer (default 32 MB)."""
    if device.type == "cuda":
        return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 32 * MB
    best = 0
    for index in range(8):
        folder = f"/sys/devices/system/cpu/cpu0/cache/index{index}"
        try:
            with open(f"{folder}/level") as f:
                level = int(f.read())
            with open(f"{folder}/size") as f:
                text = f.read().strip()
        except (OSError, ValueError):
            continue
        size = int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1], 0)
        if level >= 2 and size > best:
            best = size
    return best or 32 * MB


def measure_prepare(device, dtype, quick: bool) -> dict:
    """The oneDNN reorder of streamed weights, cold, made as the engine makes it: on a lane
    thread, one layer's packed weights kept until the next layer's are ready -> {"layers":
    [[bytes of a layer's matrices, bytes/s], ...] for layers of hidden size D (q/k/v, output,
    up and down projections, streamed in that order: the allocator recycles buffers of mixed
    sizes less well than of one size), "big": [[bytes, bytes/s]] for one 128 MB matrix (an
    LM head: above glibc's mmap threshold every reorder writes fresh pages, page faults)}."""
    from flexevict.core.model import PackedWeight
    from flexevict.runtime.offload import Lane
    elem = torch.empty((), dtype=dtype).element_size()
    lane = Lane("calibrate-prepare", device, threaded=True)

    def rate(layers: list[list[torch.Tensor]]) -> float:
        def stream():
            held = [None]          # a layer's packed weights live until the next layer's are
            for mats in layers:
                held[0] = lane.submit(lambda m=mats: [PackedWeight(w) for w in m]).wait()
        nbytes = sum(w.numel() * elem for mats in layers for w in mats)
        return nbytes / best_time(stream, device, 2 if quick else 3, median=True)
    out = {"layers": [], "big": []}
    try:
        for d in PREPARE_HIDDEN[:2] if quick else PREPARE_HIDDEN:
            shapes = [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)]
            size = sum(a * b for a, b in shapes) * elem
            count = max(2, ((16 if quick else 64) * MB) // size)
            layers = [[torch.randn(*s, dtype=dtype) for s in shapes] for _ in range(count)]
            out["layers"].append([size, rate(layers)])
        if not quick:
            big = [[torch.randn(32768, 1024, dtype=dtype)] for _ in range(2)]
            out["big"].append([big[0][0].numel() * elem, rate(big)])
    finally:
        lane.close()
    return out


def measure_mem_bw(device, nbytes: int) -> float:
    """Bytes/s moved by an element-wise op (read + write) on data larger than the caches."""
    a = torch.ones(nbytes // 4, device=device)
    b = torch.empty_like(a)
    return 2 * nbytes / best_time(lambda: b.copy_(a), device)


def measure_quant(device, dtype, quick: bool) -> dict:
    """4-bit group quantisation (FlexGen's scheme) in full-precision bytes/s, each way."""
    from flexevict.core.kernels.quant import dequantize_4bit, quantize_4bit
    rows = 1024 if quick else 2048
    x = torch.randn(rows, 1024, device=device, dtype=dtype)
    p = quantize_4bit(x, dim=-1)
    nbytes = x.numel() * x.element_size()
    return {"quant_bw": nbytes / best_time(lambda: quantize_4bit(x, dim=-1), device, 3),
            "dequant_bw": nbytes / best_time(lambda: dequantize_4bit(p), device, 3)}


# Prefill attention is timed at several prompt lengths S, each as (query heads, tokens) of one
# sequence with two query heads per kv head: its rate grows with S (the per-row work of a blocked
# kernel and its launch are spread over more keys: on one thread of the 2-core CPU, beside other
# work, SDPA ran 22 GFLOP/s at 128 tokens, 34 at 512, 48 at 2048, 55-61 at 4096), so one rate taken
# at a short prompt and scaled by S^2 prices a long prompt too slow (a quick calibration's rate at
# 128 tokens put a 6144-token prefill at 33x its time). The cost model reads the rate at the run's
# S (`attention_rate`). Heads: enough work per shape to time, and at least four per core (with two
# heads at 4096 tokens two threads ran the scored pass no faster than one, and a run on one thread,
# scaled from it, was priced 1.6x too slow). On a GPU one shape that keeps it busy (at 2 x 8 x 512
# an H200 measured 9 TFLOP/s of launch overhead, and the cost model, scaling that rate to a 32k
# prompt, predicted the prefill 20x too slow). A quick calibration measures fewer lengths with
# fewer repeats, up to 2048 tokens: a long prompt's rate is measured, not a launch-bound one's.
PREFILL_LENGTHS = {"cpu": (128, 512, 2048, 4096), "cpu-quick": (128, 2048),
                   "cuda": (2048,), "cuda-quick": (2048,)}
PREFILL_GPU_HEADS = 128             # 4 sequences x 32 heads, as one batch of 128 heads
PREFILL_FLOPS = 2e9                 # per CPU shape: heads = this / (2 S^2 d), within bounds


def prefill_heads(device, s: int, d: int = 64) -> int:
    """Query heads (one sequence) the prefill-attention measurement at S = s tokens runs."""
    if torch.device(device).type == "cuda":
        return PREFILL_GPU_HEADS
    most = max(8, 2 * _cores())            # kv heads: two per core at least, as a run has
    return 2 * min(max(round(PREFILL_FLOPS / (2 * s * s * d) / 2), 2 * _cores()), most)


# Decode attention is timed at DECODE_SLOTS cached slots of K and V that come from memory, as in a
# run, where the rest of the model (a layer's weights, the other layers' caches) passes through the
# last-level cache between two reads of a layer's cache: one buffer timed over and over sat in the
# cache (a CPU with a 300 MB L3, beside other work: 350 ps a unit against 460-480 from memory, and a
# long context's decode step was priced a third too fast). Distinct K and V buffers in a ring of
# twice the last-level cache (at least 64 MB, at most DECODE_RING_MAX), at most DECODE_RING_CALLS of
# them. A quick calibration times fewer lengths, the same longest one.
DECODE_SLOTS = {False: (64, 512, 2048), True: (64, 2048)}
DECODE_RING_MAX = 512 * MB
DECODE_RING_CALLS = 128


DECODE_ROWS, DECODE_GROUP, DECODE_DIM = 32, 4, 64     # rows, query heads per row, head dim


def decode_ring_bytes(device) -> int:
    return min(max(2 * last_level_cache(torch.device(device)), 64 * MB), DECODE_RING_MAX)


def _ring(device, dtype) -> torch.Tensor:
    return torch.empty(decode_ring_bytes(device) // torch.empty((), dtype=dtype).element_size(),
                       device=device, dtype=dtype).fill_(0.01)


def _decode_ring(device, dtype, n: int, ring: torch.Tensor | None = None):
    """A call that runs decode attention over n slots of each pair of distinct K and V buffers
    of `ring` (a new one if None) in turn; its `calls` is how many."""
    from flexevict.core import kernels
    ring = _ring(device, dtype) if ring is None else ring
    r, g, d = DECODE_ROWS, DECODE_GROUP, DECODE_DIM
    q = torch.randn(r, g, d, device=device, dtype=dtype)
    size = n * r * d
    pairs = [(ring[2 * i * size:(2 * i + 1) * size].view(n, r, d),
              ring[(2 * i + 1) * size:(2 * i + 2) * size].view(n, r, d))
             for i in range(min(max(ring.numel() // (2 * size), 1), DECODE_RING_CALLS))]
    valid = torch.ones(n, r, dtype=torch.bool, device=device)
    score = torch.zeros(n, r, device=device)

    def attend():
        for k, v in pairs:
            kernels.split_decode_attention(q, k, v, valid, 0.1, score)   # the model's
    attend.calls = len(pairs)
    return attend


def _prefill_attention(device, dtype, s: int):
    """(SDPA, the scored pass): calls that run causal prefill attention over s tokens of
    `prefill_heads` heads, two per kv head; each call's `flops` is its work."""
    from flexevict.core import kernels
    from flexevict.core.model import causal_attention
    h, d = prefill_heads(device, s, DECODE_DIM), DECODE_DIM
    q = torch.randn(1, h, s, d, device=device, dtype=dtype)
    kv = torch.randn(1, h // 2, s, d, device=device, dtype=dtype)
    valid = torch.ones(1, s, dtype=torch.bool, device=device)

    def sdpa():
        causal_attention(q, kv, kv, None)

    def scored():
        kernels.prefill_attention_scores(q, kv, kv, valid, 0.1)
    sdpa.flops = scored.flops = 2 * h * s * s * d
    return sdpa, scored


def measure_attention(device, dtype, quick: bool) -> dict:
    """Decode attention (fixed + per slot x row x (g + 2) x d), and the flop/s of causal prefill
    attention (2 H S^2 d flops) at each of PREFILL_LENGTHS, on SDPA and on the pass that also
    collects the prompt's column sums (`kernels.prefill_attention_scores`, what a policy that
    ranks the prompt runs instead): "prefill_attn": {"sdpa": [[S, flop/s], ...], "scored":
    ...}; "sdpa_flops" and "scored_attn_flops" are the rates at the longest S."""
    units, times = [], []
    ring = _ring(device, dtype)
    for n in DECODE_SLOTS[quick]:
        attend = _decode_ring(device, dtype, n, ring)
        times.append(best_time(attend, device, 3) / attend.calls)
        units.append(n * DECODE_ROWS * (DECODE_GROUP + 2) * DECODE_DIM)
    attend = ring = None             # not held while prefill attention is timed
    fixed, per_unit = _fit(units, times)
    table = {"sdpa": [], "scored": []}
    kind = device.type + ("-quick" if quick else "")
    for s in PREFILL_LENGTHS[kind]:
        sdpa, scored = _prefill_attention(device, dtype, s)
        repeats = 2 if quick else 3
        table["sdpa"].append([s, sdpa.flops / best_time(sdpa, device, repeats)])
        table["scored"].append([s, scored.flops / best_time(scored, device, repeats)])
    return {"attn_decode": {"fixed_s": fixed, "per_unit_s": per_unit},
            "prefill_attn": table, "sdpa_flops": table["sdpa"][-1][1],
            "scored_attn_flops": table["scored"][-1][1]}


PREFILL_RATE_CAP = 2.0      # beyond the longest S measured, a rate at most this x its rate there


def attention_rate(section: dict, scored: bool, s: int) -> float:
    """Flop/s of causal prefill attention over an s-token prompt (`scored`: the pass that also
    collects the prompt's column sums), from a compute section's rates by prompt length
    (`measure_attention`). Between two measured lengths, and beyond the ends, the time per flop
    follows a + b / S through the nearest two (a kernel's time a S^2 + b S: work per pair of
    tokens, and per query row), never falling with S, and beyond the longest at most
    PREFILL_RATE_CAP x its rate there. A section without the table (a file made before it, a
    synthetic one): its one rate."""
    table = (section.get("prefill_attn") or {}).get("scored" if scored else "sdpa")
    if not table:
        return section["scored_attn_flops" if scored else "sdpa_flops"]
    if len(table) == 1:
        return table[0][1]
    xs = [row[0] for row in table]
    j = min(max(bisect.bisect_left(xs, s), 1), len(table) - 1)
    (s0, r0), (s1, r1) = table[j - 1], table[j]
    slope = max((1 / r0 - 1 / r1) / (1 / s0 - 1 / s1), 0.0)      # per-flop time against 1/S
    per_flop = 1 / r1 + slope * (1 / s - 1 / s1)
    if s > s1:
        per_flop = max(per_flop, 1 / (PREFILL_RATE_CAP * r1))
    return 1 / per_flop


# ---------------------------------------------------------------------------- fixed costs

def tiny_config(arch: str, layers: int):
    from flexevict.core.config import ModelConfig
    return ModelConfig(arch=arch, name=f"calibrate-{arch}", vocab_size=128, hidden_size=64,
                       num_layers=layers, num_heads=4, num_kv_heads=2 if arch == "llama" else 4,
                       ffn_size=128, max_positions=512, tie_embeddings=False)


def _tiny_steps(arch, layers, device, dtype, quick, **placement) -> tuple[float, float]:
    """(prefill seconds, decode step seconds) of the real engine on a tiny model, 2 GPU batches
    of 1 sequence, 16 prompt tokens: the step is the engine's fixed costs, nothing else. The
    smaller of two runs (one when quick)."""
    from flexevict.runtime.engine import Engine
    from flexevict.runtime.placement import Placement
    from flexevict.policies import get_policy
    from flexevict.io.weights import DummyWeights
    config = tiny_config(arch, layers)
    offload = tempfile.mkdtemp(prefix="flexevict-calibrate-")
    p = Placement(num_gpu_batches=2, offload_dir=offload, **placement)
    engine = Engine.load(config, DummyWeights(config, 0), p, device, dtype)
    prompts = [[5] * 16, [7] * 16]
    steps = 4 if quick else 8

    def greedy(i, k, h, head):
        return head(h[:, -1] if h.dim() == 3 else h).argmax(dim=-1)
    try:
        prefill, decode = math.inf, math.inf
        for _ in range(1 if quick else 2):
            st = engine.run(prompts, steps, get_policy("full"), greedy).stats.step_seconds
            tail = sorted(st[2:])
            prefill, decode = min(prefill, st[0]), min(decode, tail[len(tail) // 2])
    finally:
        engine.close()
        os.rmdir(offload) if os.path.isdir(offload) and not os.listdir(offload) else None
    return prefill, decode


def measure_overheads(arch: str, device, dtype, quick: bool) -> dict:
    """Seconds per schedule-layer cell that do not scale with the model, per phase: per block
    (attention and MLP halves, their cells included) and per embed + head, per GPU batch; per
    lane job for streamed weights (per stage, a tiny reorder included) and for an offloaded
    cache (per cell: load + store). From differences of tiny-model step times (L and 2L
    layers; weights or cache moved to the cpu tier)."""
    lo, hi = (2, 4) if quick else (4, 8)
    a = _tiny_steps(arch, lo, device, dtype, quick)
    b = _tiny_steps(arch, hi, device, dtype, quick)
    w = _tiny_steps(arch, hi, device, dtype, quick, w_gpu=0, w_cpu=100)
    kv = _tiny_steps(arch, hi, device, dtype, quick, cache_gpu=0, cache_cpu=100)
    out = {}
    for phase, i in (("prefill", 0), ("decode", 1)):
        block = max(b[i] - a[i], 0.0) / (2 * (hi - lo))            # 2 GPU batches
        out[phase] = {"block_s": block, "ends_s": max(a[i] - 2 * lo * block, 0.0) / 2,
                      "weight_job_s": max(w[i] - b[i], 0.0) / (2 * hi + 2),
                      "cache_job_s": max(kv[i] - b[i], 0.0) / (2 * hi)}
    return out


# the probe's prefill size; on a GPU one large enough that its element-wise passes are not
# launch overhead (at 2 x 128 an H200's probe was, and the cost model scaled it to 131k tokens)
PROBE = {"batch": 2, "prompt": 128}
PROBE_GPU = {"batch": 8, "prompt": 2048}
# on a CPU the probe again at a long prefill's token count, measured once (a long measurement):
# the element-wise work per token grows with the tensors (the passes fitted to 2 x 128 tokens on
# the 2-core CPU were a third of those at 8192 and a 4096 x 4 prefill's element-wise ops took 12 s
# where 4 were predicted); the cost model interpolates between the two by tokens
PROBE_LONG = {"batch": 32, "prompt": 256}


def probe_config(arch: str, prompt: int = PROBE["prompt"]):
    """A one-layer model of realistic width: its measured prefill halves let the cost model
    count the element-wise work a layer does besides its matmuls and attention."""
    from flexevict.core.config import ModelConfig
    return ModelConfig(arch=arch, name=f"probe-{arch}", vocab_size=128, hidden_size=512,
                       num_layers=1, num_heads=8, num_kv_heads=2 if arch == "llama" else 8,
                       ffn_size=1536, max_positions=max(512, prompt), tie_embeddings=False)


def measure_probe(arch: str, device, dtype, quick: bool, size: dict | None = None) -> dict:
    """Seconds of the probe model's attention and MLP halves in a prefill of `size`'s batch and
    prompt (default PROBE's, PROBE_GPU's on a GPU; policy full), each the best of a few."""
    from flexevict.runtime.engine import allocate
    from flexevict.core.model import Transformer
    from flexevict.policies import get_policy
    from flexevict.io.weights import DummyWeights
    size = size or (PROBE_GPU if device.type == "cuda" and not quick else PROBE)
    config = probe_config(arch, size["prompt"])
    model = Transformer.load(config, DummyWeights(config, 0), device=device, dtype=dtype)
    b, s = size["batch"], size["prompt"]
    tokens = torch.randint(4, config.vocab_size, (b, s), device=device)
    pos = torch.arange(s, device=device).expand(b, s)
    valid = torch.ones(b, s, dtype=torch.bool, device=device)
    policy = get_policy("full")
    layout = policy.layout(s, 1)
    with torch.inference_mode():
        inp = model.step_input(pos, valid)
        h = model.embed(tokens, inp)
        w = model.layers[0]

        def attn():
            model.attention_half(w, h, inp, allocate(model, layout, b)[0], policy)
        mid = model.attention_half(w, h, inp, allocate(model, layout, b)[0], policy)
        repeats = 2 if size is PROBE_LONG else 3 if quick else 7
        return {"attn_s": best_time(attn, device, repeats),
                "mlp_s": best_time(lambda: model.mlp_half(w, mid), device, repeats), **size}


ENGINE_PROBE = {"layers": 6, "gpu_batch_size": 4, "num_gpu_batches": 2, "prompt": 128, "gen": 6}
ENGINE_PROBE_QUICK = ENGINE_PROBE | {"prompt": 64, "gen": 4}


def engine_probe_config(arch: str):
    """A six-layer model of a small LLM's width (OPT-125M's hidden size): the real engine's
    steps on it, with every weight in memory and with every weight streamed from the cpu tier,
    are what the cost model is checked against at calibration time (see
    costmodel.CostModel._efficiency)."""
    import dataclasses
    return dataclasses.replace(probe_config(arch), name=f"engine-probe-{arch}",
                               num_layers=ENGINE_PROBE["layers"], vocab_size=4096,
                               hidden_size=768, ffn_size=2304, num_heads=12,
                               num_kv_heads=4 if arch == "llama" else 12)


def measure_engine_probe(arch: str, device, dtype, quick: bool) -> dict:
    """{placement: [prefill seconds, median decode step seconds]} of the real engine on the
    engine probe, for "memory" (all in memory) and "stream" (weights on the cpu tier): two
    runs, each its prefill and the median of its steps after the second (streaming settles
    over a few steps: the allocator learns to recycle the reordered weights' buffers), and
    the smaller of the two (the first run warms up; a disturbance rarely hits both); quick:
    one shorter run (the short measurements before it ran the model's ops once already)."""
    from flexevict.runtime.engine import Engine
    from flexevict.runtime.placement import Placement
    from flexevict.policies import get_policy
    from flexevict.io.weights import DummyWeights
    config = engine_probe_config(arch)
    e = ENGINE_PROBE_QUICK if quick else ENGINE_PROBE
    n = e["gpu_batch_size"] * e["num_gpu_batches"]
    prompts = torch.randint(4, config.vocab_size, (n, e["prompt"])).tolist()

    def greedy(i, k, h, head):
        return head(h[:, -1] if h.dim() == 3 else h).argmax(dim=-1)
    out = {**e}
    for label, percent in (("memory", (100, 0, 100, 0, 100, 0)),
                           ("stream", (0, 100, 100, 0, 100, 0))):
        p = Placement(*percent, gpu_batch_size=e["gpu_batch_size"],
                      num_gpu_batches=e["num_gpu_batches"])
        engine = Engine.load(config, DummyWeights(config, 0), p, device, dtype)
        runs = []
        try:
            for _ in range(1 if quick else 2):
                st = engine.run(prompts, e["gen"], get_policy("full"), greedy).stats.step_seconds
                runs.append([st[0], _median(st[2:])])
        finally:
            engine.close()
        out[label] = [min(r[0] for r in runs), min(r[1] for r in runs)]
    return out


# ---------------------------------------------------------------------------- policies

# the version of what a policy's measured costs include, the end of its key in a calibration
# file: v2 counts the in-cache RoPE rotation (`_policy_decode`), v3 times it with queries that
# drift from step to step (`drifted`); an older entry is measured again
POLICY_COSTS = ":v3"
DECODE_STEPS = 24       # decode steps a policy's hooks are timed over (a third when quick)
QUERY_DRIFT = 0.95      # a decode step's query: QUERY_DRIFT x the last one's + noise / 3


def drifted(q: torch.Tensor) -> torch.Tensor:
    """The next decode step's query after q (R, g, d): a run's queries change gradually, so
    what a policy keeps from step to step (recall: about 80% of its pages, bench/README.md) is
    kept when timed too; a fresh random query every step would make recall fetch every page."""
    return QUERY_DRIFT * q + torch.randn_like(q) / 3


@functools.cache
def hook_code(name: str) -> str:
    """A digest of the code policy `name`'s hooks run (`hook_modules`). A cost measured with
    other code is measured again, so a changed policy is never priced by its old self."""
    digest = hashlib.sha256()
    for path in sorted(m.__file__ for m in hook_modules(name)):
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


def hook_modules(name: str) -> set:
    """The modules of policy `name`'s class and of its bases, the KV buffer's and the kernels'
    (on a CPU their PyTorch reference), and the model's for a policy whose keys it rotates to
    their in-cache ranks (timed with the hooks)."""
    from flexevict.core import kernels, kv, model
    from flexevict.core.kernels import reference
    from flexevict.policies import POLICIES
    cls = POLICIES[name]
    modules = {inspect.getmodule(c) for c in cls.__mro__} | {kv, kernels, reference}
    if cls.rope_in_cache:
        modules.add(model)
    return {m for m in modules if m.__name__.startswith("flexevict.")}


def measure_policy(spec, device, dtype, quick: bool) -> dict:
    """A policy's hooks on a bare KV buffer: per decode step (before + after attention, the
    fused score accumulation included) fixed + per (slot x row); prefill (compaction of a
    prompt twice the buffer) fixed + per (prompt token x row)."""
    rows, d, g = 16, 64, 2
    caps = (64, 512)          # quick too (fewer steps): a long cache's hooks are priced by them
    dec, pre = [], []
    for cap in caps:
        dec.append(_policy_decode(spec, device, dtype, rows, d, g, cap, quick))
        pre.append(_policy_prefill(spec, device, dtype, rows, d, g, cap))
    df, dp = _fit([c * rows for c in caps], dec)
    pf, pp = _fit([_prompt_len(spec, c) * rows for c in caps], pre)
    return {"decode": {"fixed_s": df, "per_slot_row_s": dp},
            "prefill": {"fixed_s": pf, "per_token_row_s": pp}}


def _prompt(device, dtype, s, rows, d, g):
    k = torch.randn(s, rows, d, device=device, dtype=dtype)
    pos = torch.arange(s, device=device, dtype=torch.int32)[:, None].expand(s, rows).contiguous()
    valid = torch.ones(s, rows, dtype=torch.bool, device=device)
    scores = torch.rand(s, rows, device=device)
    q = torch.randn(s, rows, g, d, device=device, dtype=dtype)
    return k, pos, valid, scores, q


def _fresh(spec, device, dtype, rows, d, cap, s):
    """A policy from spec with cap committed slots for an s-token prompt (a policy that keeps
    every token gets room for all of them), and its buffer -> (policy, buffer)."""
    import dataclasses
    from flexevict.core.kv import KVBuffer
    try:
        policy = dataclasses.replace(spec, budget=None, budget_tokens=cap + 1).make()
        layout = policy.layout(s, DECODE_STEPS)     # recall's history holds every step
    except UserError:                  # `full`: no budget; its buffer holds prompt + decode
        policy = dataclasses.replace(spec, budget=None, budget_tokens=None).make()
        layout = policy.layout(s, cap - s + 1)
    return policy, KVBuffer(layout, rows, d, dtype, device, kv_heads=1,
                            fields=policy.fields(layout))


def _prompt_len(spec, cap) -> int:
    """Prompt tokens for the measurement: twice the buffer (a compaction), or half of it for a
    policy that keeps every token."""
    keeps_all = spec.budget is None and spec.budget_tokens is None
    return cap // 2 if keeps_all else 2 * cap


def _prefill(policy, buf, k, pos, valid, scores, q):
    extra = {"q": q} if policy.needs_prompt_queries else {}
    policy.prefill(buf, k, k, pos, valid, scores, **extra)


def _policy_prefill(spec, device, dtype, rows, d, g, cap) -> float:
    s = _prompt_len(spec, cap)
    k, pos, valid, scores, q = _prompt(device, dtype, s, rows, d, g)

    def run():
        policy, buf = _fresh(spec, device, dtype, rows, d, cap, s)
        _prefill(policy, buf, k, pos, valid, scores, q)
    return best_time(run, device, 3)


def _policy_decode(spec, device, dtype, rows, d, g, cap, quick) -> float:
    """Seconds per decode step of the policy's work alone once the buffer is full: the model's
    own decode step (`model.cache_attention`) with a clock around what it counts as eviction,
    the hooks (the fused score accumulation included) and, for a policy that keeps keys before
    RoPE, the rotation of the attended keys to their in-cache ranks (Cascade's step is 1.5x
    h2o's on a CPU)."""
    from flexevict.core.model import cache_attention, rank_table, rope_inv_freq
    s = _prompt_len(spec, cap)
    k, pos, valid, scores, q = _prompt(device, dtype, s, rows, d, g)
    policy, buf = _fresh(spec, device, dtype, rows, d, cap, s)
    _prefill(policy, buf, k, pos, valid, scores, q)
    table = None
    if buf.layout.rope_in_cache:             # the probe layer's RoPE (head dim d), every rank
        table = rank_table(rope_inv_freq(probe_config("llama")).to(device), buf.layout.slots,
                           dtype)
    steps = DECODE_STEPS // 3 if quick else DECODE_STEPS
    clock = _Stopwatch(device)
    spent, query = [], torch.randn(rows, g, d, device=device, dtype=dtype)
    for i in range(steps):
        query = drifted(query)
        kv = torch.randn(rows, d, device=device, dtype=dtype)
        slot = buf.incoming_slot()
        buf.write(slot, kv, kv, torch.full((rows,), s + i, dtype=torch.int32, device=device))
        rotate = None if table is None else functools.partial(
            _rotate_bare, buf=buf, table=table, pos_end=s + i + 1)
        cache_attention(query, buf, slot, policy, d ** -0.5, rotate, clock)
        spent.append(clock.take())
    tail = sorted(spent[2:])
    return tail[len(tail) // 4]                       # a low quantile: the least disturbed


def _rotate_bare(q, n, buf, table, pos_end):
    """`model.cache_attention`'s rotate for a bare buffer: every rank from one table."""
    from flexevict.core.model import rotate_in_cache
    return rotate_in_cache(q, buf, n, table, pos_end)


class _Stopwatch:
    """A clock for `model.cache_attention` that adds up the seconds spent inside it, the
    device synchronized at each edge; `take()` reads and resets."""

    def __init__(self, device):
        self.device, self.spent = device, 0.0

    def __enter__(self):
        _sync(self.device)
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        _sync(self.device)
        self.spent += time.perf_counter() - self.t0

    def take(self) -> float:
        spent, self.spent = self.spent, 0.0
        return spent


def synthetic_policy(data: dict) -> dict:
    """Hook costs where none were measured (a synthetic calibration): launch-bound constants."""
    return {"decode": {"fixed_s": 60e-6, "per_slot_row_s": 0.0},
            "prefill": {"fixed_s": 200e-6, "per_token_row_s": 0.0}}


# ---------------------------------------------------------------------------- synthetic

def synthetic(kind: str) -> dict:
    """A calibration from datasheet numbers (marked synthetic): plans for a machine you do not
    have (the H2O check of OPT-6.7B on an 80 GB GPU uses kind 'h100')."""
    if kind not in SYNTHETIC:
        raise UserError(f"{setting('synthetic')} {kind}: known kinds are {', '.join(SYNTHETIC)}")
    s = SYNTHETIC[kind]
    launch = {"block_s": 150e-6, "ends_s": 100e-6, "weight_job_s": 30e-6,
              "cache_job_s": 60e-6}
    gpu = {"pack": False, "gemm_flops": s["gemm"], "gemv_bw": s["mem"], "prepare": {},
           "gemv_hot_bw": s["mem"], "llc_bytes": 50 * MB,
           "mem_bw": s["mem"], "quant_bw": s["mem"] / 4, "dequant_bw": s["mem"] / 4,
           "attn_decode": {"fixed_s": 10e-6, "per_unit_s": 2 / s["mem"]},
           "sdpa_flops": s["gemm"] / 2, "scored_attn_flops": s["gemm"] / 4,
           "overhead": {a: {"prefill": launch, "decode": launch} for a in ARCHS}}
    cpu = {**gpu, "gemm_flops": s["cpu_gemm"], "gemv_bw": s["cpu_mem"] / 2,
           "mem_bw": s["cpu_mem"] / 2, "quant_bw": 5e9, "dequant_bw": 5e9,
           "attn_decode": {"fixed_s": 20e-6, "per_unit_s": 2 / (s["cpu_mem"] / 2)},
           "sdpa_flops": s["cpu_gemm"] / 2, "scored_attn_flops": s["cpu_gemm"] / 3}
    links = {k: s[k] for k in ("h2d_pinned", "h2d_pageable", "d2h_pinned", "d2h_pageable",
                               "disk_read", "disk_write")}
    return {"schema": SCHEMA, "synthetic": True, "quick": False,
            "machine": {"device": s["name"], "torch": "n/a", "threads": s["cpu_cores"]},
            "gpu_memory_gb": s["memory_gb"], "host_memory_gb": s["host_memory_gb"],
            "links": links,
            "host": {"cores": s["cpu_cores"], "parallel": s["cpu_cores"], "lane_job_s": 30e-6,
                     "disk_note": "synthetic: datasheet numbers, not measured"},
            "devices": {"cuda:float16": gpu, "cuda:bfloat16": gpu, "cpu:float32": cpu,
                        "cpu:float16": cpu, "cpu:bfloat16": cpu}}
