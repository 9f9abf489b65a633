"""What a run will cost here, said before anything loads: the thread count `--threads auto`
picks, the warning for a run predicted to take longer than SLOW_S, and what runs in reasonable
time instead (a smaller model with the same policy here, or the same model on a GPU with the
placement the search picks there).

An estimate rests on a calibration (calibration.py) and says which (`source`). Where this
machine has none, the probe (probe.py: well under a second, cached) gives a rough time from the
model's size and this machine's measured speed; only a run that rough time puts near SLOW_S, or
one that does not fit, is worth a quick calibration (a few seconds, cached like a full one).
"""
from __future__ import annotations

import math
import sys

import torch

from flexevict.core.config import REGISTRY
from flexevict.planner import calibration, probe
from flexevict.planner.costmodel import CostModel
from flexevict.errors import UserError, as_flag, setting
from flexevict.planner.search import (Infeasible, Limits, PlacementRequest, fit_line, flags,
                                      limits_for, search, smallest_fit, wall_time)
from flexevict.runtime.memory import overflow
from flexevict.runtime.placement import Placement

SLOW_S = 600.0         # a run predicted to take longer is said, with what runs faster
ROUGH_MARGIN = 4.0     # the probe's rough time can be this far low: above SLOW_S / it, calibrate
GPU = "h100"           # the GPU the alternative is planned for (calibration.SYNTHETIC)
# --threads auto first looks this long at what else the cores are doing: the cached numbers
# are a quiet machine's, and a thread that shares a core with other work makes every op wait
# (a 2-core machine with a test suite beside it: 32 tokens of smollm2-135m in 70 s on 2
# threads, 3 s on one)
BUSY_SAMPLE_S = 0.2


# ---------------------------------------------------------------------------- calibrations

def here(device, path: str | None = None, threads: int | None = None):
    """The calibration an estimate reads, never measuring: `path`, else $FLEXEVICT_CALIBRATION
    or this machine's cache; None when there is none."""
    if path:
        return calibration.read_file(path, threads)
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"{setting('device')} {device}: this machine has no CUDA GPU to "
                        "calibrate; plan for one from a calibration file (`python -m "
                        "flexevict.calibrate --synthetic h100 --out h100.json`, then "
                        f"{setting('calibration')} h100.json)")
    return calibration.cached(device, threads)


def here_or_quick(device, threads: int | None, offload_dir: str, log=print):
    """`here`, else a quick calibration of this machine measured now (a few seconds, every
    step printed) and cached, so that `python -m flexevict.plan` answers from the same one."""
    cal = here(device, None, threads)
    if cal is None:
        cal = calibration.load(torch.device(device), threads, offload_dir, quick=True, log=log)
    return cal


def source(cal) -> str:
    """What an estimate rests on, said with it."""
    if cal.synthetic:
        return f"the synthetic calibration {cal.path or GPU} (datasheet rates, not measured)"
    return f"the {'quick ' if cal.quick else ''}calibration {cal.path}"


# ---------------------------------------------------------------------------- threads

def best_threads(work, cal, placement: Placement, n: int) -> tuple[int, str]:
    """The faster of one torch thread and one per core for `work` (a search.Workload) with n
    sequences under `placement` -> (threads, why): the cost model's prediction where the
    calibration `cal` measured one thread against all, else the probe's. On a GPU, torch's
    default: the CPU there only feeds the device."""
    if torch.device(work.device).type == "cuda":
        return torch.get_num_threads(), "auto: torch's default, one per core; the GPU computes"
    cores = calibration._cores()
    if cores == 1:
        return 1, "auto: this machine has one core"
    busy = calibration.other_work_cores(BUSY_SAMPLE_S)
    if busy >= calibration.BUSY_CORES:
        free = max(1, cores - math.ceil(busy))
        return free, (f"auto: other work keeps {busy:.1f} of {cores} cores busy now, and a "
                      "thread that waits for a busy core stalls every op")
    counts, seconds = (1, cores), None
    if _measures_threads(cal, work.dtype):
        try:
            seconds = {t: _cost_model(work, cal, t).estimate(placement, n).total_s
                       for t in counts}
            basis = source(cal)
        except UserError:        # e.g. a policy section a calibration file cannot measure
            pass
    if seconds is None:
        seconds = {t: probe.rough_seconds(work.config, work.prompt_len, work.gen_len, n, t,
                                          placement.num_gpu_batches) for t in counts}
        basis = f"a quick probe of this machine, cached in {probe.path()}"
    best = min(counts, key=lambda t: seconds[t])
    other = cores if best == 1 else 1
    ratio = seconds[other] / seconds[best]
    than = f"{ratio:.1f}x as fast as" if ratio >= 1.05 else "about as fast as"
    return best, (f"auto: predicted {than} {other} for {work.config.name} here, by {basis}")


def _measures_threads(cal, dtype) -> bool:
    """Whether `cal` measured one thread against all on this CPU in `dtype`."""
    if cal is None:
        return False
    section = cal.data.get("devices", {}).get(f"cpu:{calibration.dtype_name(dtype)}", {})
    return "thread_scaling" in section and "overhead_one_thread" in section


def _cost_model(work, cal, threads: int) -> CostModel:
    """`work`'s cost model with `cal` scaled to `threads`, read only."""
    cal = calibration.Calibration(cal.data, cal.path, measure_ok=False, threads=threads)
    return CostModel(work.config, cal, work.device, work.dtype, work.prompt_len, work.gen_len,
                     work.spec)


def rough_seconds(work, placement: Placement, n: int, threads: int) -> float:
    """The probe's time for `work` (a search.Workload) with n sequences under `placement`:
    on a CPU with the weights in memory, `probe.rough_seconds`; on a GPU with everything on
    it, 0 (not slow); anything else infinity (the probe measured neither disk nor links)."""
    on_device = placement.percent == (100, 0, 100, 0, 100, 0)
    if torch.device(work.device).type == "cuda":
        return 0.0 if on_device else float("inf")
    if placement.uses_disk:
        return float("inf")
    return probe.rough_seconds(work.config, work.prompt_len, work.gen_len, n, threads,
                               placement.num_gpu_batches)


# ---------------------------------------------------------------------------- slow runs

def slow_line(model: CostModel, seconds: float, n: int, limits: Limits, offload_dir: str,
              runs: float = 1.0) -> str | None:
    """A run of `runs` batches of n sequences, predicted to take `seconds` in all: over SLOW_S,
    one line with the time, what it rests on and what runs here in reasonable time; None when
    it is not slow."""
    if seconds <= SLOW_S:
        return None
    return (f"slow: predicted {wall_time(seconds)} here (from {source(model.cal)})"
            + faster(model, n, limits, offload_dir, runs))


def does_not_fit(model: CostModel, request: PlacementRequest, limits: Limits, head: str,
                 runs: float = 1.0) -> str | None:
    """A request that does not fit (head: what overflows) -> head with `python -m
    flexevict.plan`'s answer (search.smallest_fit) and what its prediction rests on, and where
    that answer is slow, what runs here in reasonable time (settings named by `setting`, for
    a UserError); None when nothing fits."""
    fit = smallest_fit(model, request, limits)
    if fit is None:
        return None
    line = f"{head}; {fit_line(fit, source(model.cal))}"
    if fit[0].total_s * runs > SLOW_S:
        line += faster(model, fit[0].n, limits, request.offload_dir, runs, setting)
    return line


def faster(model: CostModel, n: int, limits: Limits, offload_dir: str, runs: float = 1.0,
           named=as_flag) -> str:
    """'; in reasonable time: ...' naming a smaller model with the same policy that runs here
    within SLOW_S, and (from a CPU) this model on a GPU with the placement the search picks
    there, each for `runs` batches of n sequences; '' when neither is found."""
    found = [x for x in (_smaller_model(model, n, limits, runs),
                         _on_a_gpu(model, n, offload_dir, runs, named)) if x]
    return f"; in reasonable time: {', or '.join(found)}" if found else ""


def _smaller_model(model: CostModel, n: int, limits: Limits, runs: float) -> str | None:
    """The largest registry model smaller than model's (same architecture first) that runs
    here with everything in memory within SLOW_S: same lengths, policy and batch."""
    size = model.config.num_params()
    smaller = sorted((c for c in REGISTRY.values() if c.num_params() < size
                      and model.P + model.G - 1 <= c.max_positions),
                     key=lambda c: (c.arch != model.config.arch, -c.num_params()))
    placement = Placement(gpu_batch_size=n)
    for config in smaller:
        try:
            e = CostModel(config, model.cal, model.device, model.dtype, model.P, model.G,
                          model.spec).estimate(placement, n)
        except UserError:     # e.g. a calibration file that cannot measure what it lacks
            continue
        fits = overflow(e.memory, model.device, limits.gpu, limits.cpu, limits.disk,
                        limits.baseline) is None
        if fits and e.total_s * runs <= SLOW_S:
            return (f"{config.name} with the same policy here ({wall_time(e.total_s * runs)}, "
                    "everything in memory)")
    return None


def _on_a_gpu(model: CostModel, n: int, offload_dir: str, runs: float, named) -> str | None:
    """From a CPU: this run on an 80 GB GPU (the synthetic H100 calibration), its batch of n
    as one GPU batch and the rest of the placement chosen by the search."""
    if model.cuda:
        return None
    cal = calibration.Calibration(calibration.synthetic(GPU), None, measure_ok=False)
    cuda = torch.device("cuda")
    gpu = CostModel(model.config, cal, cuda, torch.float16, model.P, model.G, model.spec)
    request = PlacementRequest(gpu_batch_size=n, num_gpu_batches=1, compress_weight=None,
                               compress_cache=None, cpu_cache_compute=None,
                               offload_dir=offload_dir)
    try:
        best = search(gpu, request, limits_for(cuda, offload_dir, calibration=cal), top=1).best
    except Infeasible:
        return None
    name = cal.data["machine"]["device"].replace(" (synthetic)", "")
    return (f"{model.config.name} on an {name} ({named('device')} cuda "
            f"{flags(best.placement, named)}: {wall_time(best.total_s * runs)}, from its "
            "synthetic calibration)")


def warn(line: str | None, log=print) -> None:
    if line:
        log(line, file=sys.stderr)
