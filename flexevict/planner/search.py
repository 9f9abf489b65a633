"""The placement search behind every `auto` placement flag and `python -m flexevict.plan`:
the placement the cost model (costmodel.py) predicts fastest within the memory limits, and the
lines that explain it.

The search is exact over a discrete space (`search`): weight and cache percents in steps of 10
(reduced to the distinct placements the engine's tier rules make of them: tensors go whole to a
tier, the cache splits by whole GPU batches), activations on the GPU or the CPU, each switch on
or off, GPU batch sizes 1, 2, 3, 4, 6, 8, 12, ... 512 and 1, 2, 4, 8, 16 GPU batches. Every
candidate is checked with the same MemoryPlan as the run's preflight, so a chosen plan passes
it. Two prunings keep it under a few seconds, and neither drops a candidate that could win:
per batch shape, the all-on-GPU placement bounds every placement's predicted throughput (every
offload only adds to a term of the model's maxima), so shapes whose bound is below the k-th best
found are skipped; and within a shape, a placement whose every tensor and cache buffer sits on
a tier at most as fast as another feasible placement's (with the same switches) is dominated.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import sys
from dataclasses import dataclass

import torch

from flexevict.errors import UserError, as_flag, setting
from flexevict.planner.calibration import load as load_calibration
from flexevict.planner.costmodel import CostModel, Estimate
from flexevict.runtime.machine import device_name
from flexevict.runtime.memory import (GIB, _mem_available, disk_free, host_need, overflow,
                                      process_anon, stage_weights)
from flexevict.runtime.placement import DEFAULT_OFFLOAD_DIR, Placement

WEIGHT_STEP = CACHE_STEP = 10          # percent steps searched
GPU_BATCH_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
NUM_GPU_BATCHES = (1, 2, 4, 8, 16)
RANK = {"disk": 0, "cpu": 1, "gpu": 2}
# Host memory the process may still grow by between the plan and the run's preflight (which
# counts the process's memory again): the plan keeps this much below --cpu-mem-limit.
BASELINE_MARGIN = 64 << 20
SWITCHES = ("compress_weight", "compress_cache", "cpu_cache_compute")


@dataclass(frozen=True)
class PlacementRequest:
    """What to plan: each field a value, or None where the search chooses it."""
    percent: tuple | None = None
    gpu_batch_size: int | None = None
    num_gpu_batches: int | None = None
    compress_weight: bool | None = False
    compress_cache: bool | None = False
    cpu_cache_compute: bool | None = False
    overlap: bool = True
    sep_layer: bool = True
    pin_weight: bool = True
    offload_dir: str = DEFAULT_OFFLOAD_DIR
    max_batch: int | None = None      # at most this many sequences in a block (the prompts)

    def freed(self, name: str) -> "PlacementRequest":
        return dataclasses.replace(self, **{name: None})


@dataclass(frozen=True)
class Limits:
    """Bytes each resource may hold (None: no limit): the compute GPU's memory, host memory
    (anonymous memory of the process, `baseline` of it already in use), free disk."""
    gpu: int | None = None
    cpu: int | None = None
    disk: int | None = None
    baseline: int = 0

    def raised(self, resource: str, factor: float) -> "Limits":
        field = {"GPU": "gpu", "CPU": "cpu", "disk": "disk"}[resource]
        value = getattr(self, field)
        return dataclasses.replace(self, **{field: None if value is None else
                                            int(value * factor)})


@dataclass
class Plan:
    """A search's outcome: the ranked feasible estimates (best first)."""
    model: CostModel
    request: PlacementRequest
    limits: Limits
    ranked: list
    evaluated: int

    @property
    def best(self) -> Estimate:
        return self.ranked[0]


class Infeasible(Exception):
    """No candidate fits: (resource, bytes needed by the least demanding candidate, allowed)."""

    def __init__(self, resource: str, need: int, have: int):
        super().__init__(resource)
        self.resource, self.need, self.have = resource, need, have


# ---------------------------------------------------------------------------- the search

def search(model: CostModel, request: PlacementRequest, limits: Limits, top: int = 5) -> Plan:
    """The `top` feasible placements with the highest predicted throughput -> Plan; raises
    Infeasible when none fits."""
    _check_fixed(request)
    shapes = []
    for gbs, nb in _batch_shapes(request):
        bound = model.estimate(_all_gpu(request, gbs, nb), gbs * nb).throughput
        shapes.append((bound, gbs, nb))
    shapes.sort(reverse=True)
    ranked, evaluated, tightest = [], 0, None
    for bound, gbs, nb in shapes:
        if len(ranked) >= top and bound < ranked[top - 1].throughput * (1 - 1e-3):
            continue                          # no placement of this shape can enter the top
        frontier, closest = _frontier(model, request, limits, gbs, nb)
        if closest and (tightest is None or closest[1] / closest[2] < tightest[1] / tightest[2]):
            tightest = closest
        for placement, plan in frontier:
            ranked.append(model.estimate(placement, gbs * nb, plan))
            evaluated += 1
        ranked.sort(key=_rank)
        del ranked[top:]
    if not ranked and tightest is None:
        raise UserError("no placement satisfies the fixed placement flags together; set one "
                        "of them to auto")
    if not ranked:
        raise Infeasible(*tightest)
    return Plan(model, request, limits, ranked, evaluated)


def _check_fixed(request: PlacementRequest) -> None:
    """A fixed --percent must be one Placement accepts (the same one-line errors)."""
    if request.percent is not None:
        Placement(*request.percent, compress_cache=bool(request.compress_cache)).checked()
    for name in ("gpu_batch_size", "num_gpu_batches"):
        value = getattr(request, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1 or auto (got {value})")


def _rank(e: Estimate) -> tuple:
    """Highest predicted throughput first; within 0.1% of each other (3 significant digits),
    the smaller batch, then the less memory."""
    return -float(f"{e.throughput:.3g}"), e.n, e.memory["gpu"] + e.memory["cpu"]


def _batch_shapes(request: PlacementRequest) -> list[tuple[int, int]]:
    sizes = [request.gpu_batch_size] if request.gpu_batch_size else GPU_BATCH_SIZES
    counts = [request.num_gpu_batches] if request.num_gpu_batches else NUM_GPU_BATCHES
    shapes = [(g, n) for g in sizes for n in counts
              if request.max_batch is None or g * n <= max(request.max_batch, 1)
              or (g, n) == (min(sizes), min(counts))]
    return shapes


def _all_gpu(request: PlacementRequest, gbs: int, nb: int) -> Placement:
    return _placement(request, (100, 0, 100, 0, 100, 0), gbs, nb, False, False, False)


def _placement(request, percent, gbs, nb, cw, cc, ccc) -> Placement:
    return Placement(*percent, gpu_batch_size=gbs, num_gpu_batches=nb, overlap=request.overlap,
                     sep_layer=request.sep_layer, pin_weight=request.pin_weight,
                     cpu_cache_compute=ccc, compress_weight=cw, compress_cache=cc,
                     offload_dir=request.offload_dir)


def _frontier(model: CostModel, request: PlacementRequest, limits: Limits, gbs: int, nb: int):
    """Feasible placements of one batch shape that no other feasible one dominates ->
    (list of (placement, its MemoryPlan), the least overflowing (resource, need, have)).

    Memory is MemoryPlan's, added up from its three parts (weights, cache, activations), each
    computed once per option instead of once per combination."""
    out, closest = [], None
    pinned = request.pin_weight and model.cuda
    weights, caches = _weight_options(model.config, request), _cache_options(request, nb)
    part = lambda pct, cw=False, cc=False, ccc=False: model.memory_plan(   # noqa: E731
        _placement(request, pct, gbs, nb, cw, cc, ccc), gbs * nb)
    w_parts, c_parts = {}, {}
    for act, cw, cc, ccc in itertools.product(_act_options(request), *_switch_options(request)):
        a_part = part((100, 0, 100, 0, *act)).activation_part(pinned)
        feasible = []
        for cp, c_ranks in caches:
            if not _valid(request, (100, 0, *cp, *act), cc, ccc):
                continue
            if (cp, cc, ccc) not in c_parts:
                c_parts[cp, cc, ccc] = part((100, 0, *cp, 100, 0), cc=cc, ccc=ccc).cache_part(
                    pinned)
            c_part = c_parts[cp, cc, ccc]
            for wp, w_ranks in weights:
                if (wp, cw) not in w_parts:
                    w_parts[wp, cw] = part((*wp, 100, 0, 100, 0), cw=cw).weight_part(pinned)
                w = w_parts[wp, cw]
                need = {t: w[t] + c_part[t] + a_part[t] for t in w}
                over = overflow(need, model.device, limits.gpu, limits.cpu, limits.disk,
                                limits.baseline)
                if over is None:
                    feasible.append((w_ranks + c_ranks, (*wp, *cp, *act)))
                elif closest is None or over[1] / over[2] < closest[1] / closest[2]:
                    closest = over
        for percent in _maximal(feasible):
            p = _placement(request, percent, gbs, nb, cw, cc, ccc)
            out.append((p, model.memory_plan(p, gbs * nb)))
    return out, closest


def _valid(request, percent, cc: bool, ccc: bool) -> bool:
    """A placement Placement.checked accepts, and one where --cpu-cache-compute matters."""
    if ccc and percent[2] == 100:
        return False
    try:
        Placement(*percent, compress_cache=cc, cpu_cache_compute=ccc).checked()
    except UserError:
        return False
    return True


def _maximal(feasible: list) -> list:
    """The percents of the (ranks, percent) entries no other entry dominates (every rank at
    least as high, one higher): sorted by rank sum, a dominating entry comes first."""
    feasible.sort(key=lambda e: -sum(e[0]))
    kept = []
    for ranks, percent in feasible:
        if not any(_dominates(k, ranks) for k, _ in kept):
            kept.append((ranks, percent))
    return [percent for _, percent in kept]


def _dominates(a: tuple, b: tuple) -> bool:
    return a != b and all(x >= y for x, y in zip(a, b))


def _act_options(request):
    return [tuple(request.percent[4:])] if request.percent else [(100, 0), (0, 100)]


def _switch_options(request):
    return [[v] if v is not None else [False, True]
            for v in (request.compress_weight, request.compress_cache, request.cpu_cache_compute)]


def _pairs(step: int):
    """(gpu, cpu) percent pairs in steps of `step`, purest first (a value of 0 or 100
    preferred), so that among pairs the tier rules make alike the plainest one is kept."""
    pairs = [(g, c) for g in range(0, 101, step) for c in range(0, 101 - g, step)]
    return sorted(pairs, key=lambda gc: (-max(gc[0], gc[1], 100 - sum(gc)), -gc[0], -gc[1]))


def _weight_options(config, request) -> list[tuple[tuple, tuple]]:
    """Distinct weight placements -> [((gpu %, cpu %), tier rank of every tensor)]."""
    if request.percent:
        pairs = [tuple(request.percent[:2])]
    else:
        pairs = _pairs(WEIGHT_STEP)
    stages = stage_weights(config, request.sep_layer)
    kinds = [stages[0], stages[1], stages[2] if request.sep_layer else stages[1], stages[-1]]
    seen, out = set(), []
    for g, c in pairs:
        p = Placement(g, c)
        ranks = tuple(RANK[t] for st in kinds
                      for t in p.weight_tiers([math.prod(s) for _, s in st]))
        if ranks not in seen:
            seen.add(ranks)
            out.append(((g, c), ranks))
    return out


def _cache_options(request, nb: int) -> list[tuple[tuple, tuple]]:
    """Distinct cache placements over nb GPU batches -> [((gpu %, cpu %), rank per batch)]."""
    pairs = [tuple(request.percent[2:4])] if request.percent else _pairs(CACHE_STEP)
    seen, out = set(), []
    for g, c in pairs:
        ranks = tuple(RANK[t] for t in Placement(100, 0, g, c).cache_tiers(nb))
        if ranks not in seen:
            seen.add(ranks)
            out.append(((g, c), ranks))
    return out


# ---------------------------------------------------------------------------- explaining

def flags(p: Placement, named=as_flag) -> str:
    """The command-line flags that give placement p (switches only where on); named=setting:
    the settings, for a UserError message."""
    out = [f"{named('percent')} {' '.join(map(str, p.percent))}",
           f"{named('gpu_batch_size')} {p.gpu_batch_size}",
           f"{named('num_gpu_batches')} {p.num_gpu_batches}"]
    out += [named(name) for name in SWITCHES if getattr(p, name)]
    return " ".join(out)


def wall_time(seconds: float) -> str:
    """A predicted duration in the unit a person plans with: "about 40 s", "about 12 min",
    "about 17 h", "about 3 days"."""
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size or (unit != "days" and seconds >= size):
            return f"about {seconds / size:.0f} {unit}"
    return f"about {seconds:.0f} s"


def _gib(x) -> str:
    return "no limit" if x is None else f"{x / GIB:.1f} GiB"


def memory_line(e: Estimate, device, baseline: int = 0) -> str:
    """Memory per resource as the limits count it (host: the process's own `baseline` too)."""
    m = e.memory
    gpu = "" if torch.device(device).type == "cpu" else f"GPU {_gib(m['gpu'])}, "
    return (f"{gpu}CPU {_gib(host_need(m, device, baseline))} (cpu tier {_gib(m['cpu'])}), "
            f"disk {_gib(m['disk'])}")


def bound_line(e: Estimate) -> str:
    """What bounds each phase that takes time: the term and its share."""
    parts = []
    for phase in ("decode", "prefill"):
        if not (e.decode_terms if phase == "decode" else e.prefill_terms):
            continue
        name, share = e.bound(phase)
        parts.append(f"{phase}: {100 * share:.0f}% of the {'step' if phase == 'decode' else 'pass'}"
                     f" is bound by {name}")
    return "; ".join(parts)


def next_best(plan: Plan) -> str | None:
    """The one change outside the plan's reach that predicts the most gain: a flag the request
    fixed, set free, or twice the binding memory limit -> a line, or None."""
    best, what = plan.best.throughput * 1.02, None
    for name in ("percent", "gpu_batch_size", "num_gpu_batches", *SWITCHES):
        if getattr(plan.request, name) is None:
            continue
        try:
            alt = search(plan.model, plan.request.freed(name), plan.limits, top=1).best
        except Infeasible:
            continue
        if alt.throughput > best:
            best, what = alt.throughput, _change(alt.placement, name)
    for resource in ("GPU", "CPU"):
        limits = plan.limits.raised(resource, 2.0)
        if limits == plan.limits:
            continue
        try:
            alt = search(plan.model, plan.request, limits, top=1).best
        except Infeasible:
            continue
        if alt.throughput > best:
            best = alt.throughput
            what = f"twice the {resource} memory limit ({flags(alt.placement)})"
    if what is None:
        return None
    return f"next best: {what}, {best / plan.best.throughput:.2f}x predicted"


def _change(new: Placement, name: str, named=as_flag) -> str:
    """The flag (named=setting: the setting) that gives `new` its value of the placement field
    `name`."""
    if name == "percent":
        return f"{named('percent')} {' '.join(map(str, new.percent))}"
    if name in SWITCHES:
        return f"{named(name)} {str(getattr(new, name)).lower()}"
    return f"{named(name)} {getattr(new, name)}"


def report(plan: Plan, top: int = 5, alternatives: bool = True) -> list[str]:
    e, m = plan.best, plan.model
    lines = [f"placement: {flags(e.placement)}",
             f"predicted: {e.throughput:.3f} token/s total (batch {e.n}: prefill {e.prefill_s:.3f}"
             f" s, decode step {e.step_s:.4f} s, total {e.total_s:.3f} s: "
             f"{wall_time(e.total_s)})" + (f", from {_caveat(m.cal)}" if _caveat(m.cal) else ""),
             f"memory: {memory_line(e, m.device, plan.limits.baseline)}",
             f"bound: {bound_line(e)}"]
    nb = next_best(plan) if alternatives else None
    if nb:
        lines.append(nb)
    if alternatives and len(plan.ranked) > 1:
        lines.append(f"top {min(top, len(plan.ranked))} of {plan.evaluated} evaluated placements:")
        for k, alt in enumerate(plan.ranked[:top], 1):
            lines.append(f"  {k}. {alt.throughput:10.3f} token/s ({wall_time(alt.total_s)} "
                         f"for batch {alt.n})  "
                         f"{memory_line(alt, m.device, plan.limits.baseline)}"
                         f"  {flags(alt.placement)}")
    return lines


def header(model: CostModel, limits: Limits) -> str:
    cal = model.cal
    tag = " [synthetic]" if cal.synthetic else " [quick]" if cal.quick else ""
    return (f"plan for {model.config.name}: prompt {model.P} + gen {model.G}, policy "
            f"{model.spec.name} ({model.slots} slots), {model.device.type} "
            f"{str(model.dtype).replace('torch.', '')}; limits GPU {_gib(limits.gpu)}, "
            f"CPU {_gib(limits.cpu)}, disk {_gib(limits.disk)}; calibration "
            f"{cal.data['machine']['device']}{tag}")


def infeasible_line(model: CostModel, request: PlacementRequest, limits: Limits,
                    err: Infeasible) -> str:
    """One line: the binding resource, and the smallest change that fits (`smallest_fit`), else
    the memory it would take."""
    fit = smallest_fit(model, request, limits)
    basis = _caveat(model.cal)
    return f"{infeasible_head(err)}; {fit_line(fit, basis) if fit else no_fit_line(err)}"


def _caveat(cal) -> str:
    """What a prediction from `cal` says it rests on where that is a quick calibration (it
    measured less: its predictions are rougher); '' otherwise (the header names the rest)."""
    return f"the quick calibration {cal.path}" if cal.quick else ""


def infeasible_head(err: Infeasible) -> str:
    flag = {"GPU": setting("gpu_mem_limit"), "CPU": setting("cpu_mem_limit"),
            "disk": f"free disk under {setting('offload_dir')}"}[err.resource]
    return (f"does not fit: {err.resource} memory binds (the closest placement needs "
            f"{_gib(err.need)}, the limit is {_gib(err.have)}: {flag})")


def smallest_fit(model: CostModel, request: PlacementRequest,
                 limits: Limits) -> tuple[Estimate, str] | None:
    """What `plan` answers a request that does not fit: the one fixed flag that, set free,
    fits with the highest predicted throughput; if none does, where the weights and cache live
    and the switches at once, the batch kept (the work asked for); else every placement flag ->
    (its estimate, the change in settings), or None when nothing fits."""
    fixes = []
    for name in ("gpu_batch_size", "num_gpu_batches", "percent", *SWITCHES):
        if getattr(request, name) is None:
            continue
        try:
            alt = search(model, request.freed(name), limits, top=1).best
            fixes.append((alt, _change(alt.placement, name, setting)))
        except Infeasible:
            pass
    for free, what in ((("percent", *SWITCHES), "the batch kept"),
                       (("percent", "gpu_batch_size", "num_gpu_batches", *SWITCHES),
                        "every placement flag auto")):
        if fixes or all(getattr(request, n) is None for n in free):
            break
        try:
            alt = search(model, dataclasses.replace(request, **dict.fromkeys(free)), limits,
                         top=1).best
            fixes.append((alt, f"{flags(alt.placement, setting)} ({what})"))
        except Infeasible:
            pass
    return max(fixes, key=lambda f: (f[0].throughput, f[1])) if fixes else None


def fit_line(fit: tuple[Estimate, str], basis: str = "") -> str:
    """`smallest_fit`'s answer as a line; basis: what its prediction rests on."""
    e, change = fit
    basis = f", from {basis}" if basis else ""
    return (f"smallest change that fits: {change} (predicted {e.throughput:.3f} token/s, "
            f"{wall_time(e.total_s)} for the batch{basis})")


def no_fit_line(err: Infeasible) -> str:
    return (f"no placement fits: give {err.resource} memory of at least {_gib(err.need)}, "
            f"or lower {setting('prompt_len')} / {setting('gen_len')} or {setting('budget')}")


# ---------------------------------------------------------------------------- entry points

def limits_for(device, offload_dir: str, gpu_bytes: int | None = None,
               cpu_bytes: int | None = None, calibration=None) -> Limits:
    """The memory a plan may use: gpu_bytes (default: the GPU's memory), cpu_bytes (default:
    the host memory available now), and free disk under offload_dir. Planning for another
    machine (a calibration made elsewhere, or synthetic), the defaults are that machine's."""
    device = torch.device(device)
    elsewhere = calibration is not None and _elsewhere(calibration, device)
    gpu = gpu_bytes if device.type == "cuda" else None       # a CPU run has no GPU limit
    if device.type == "cuda" and gpu is None:
        if elsewhere and calibration.data.get("gpu_memory_gb"):
            gpu = int(calibration.data["gpu_memory_gb"] * GIB)
        elif torch.cuda.is_available():
            gpu = torch.cuda.get_device_properties(device).total_memory
    baseline = process_anon() + BASELINE_MARGIN
    cpu = cpu_bytes
    if cpu is None:
        if elsewhere and calibration.data.get("host_memory_gb"):
            cpu = int(calibration.data["host_memory_gb"] * GIB)
        else:
            available = _mem_available()
            cpu = None if available is None else available + baseline
    return Limits(gpu=gpu, cpu=cpu, disk=disk_free(offload_dir), baseline=baseline)


def _elsewhere(calibration, device) -> bool:
    """The calibration describes another machine than this one (or none: synthetic)."""
    if calibration.synthetic:
        return True
    if device.type == "cuda" and not torch.cuda.is_available():
        return True
    return calibration.data.get("machine", {}).get("device") != device_name(device)


@dataclass(frozen=True)
class Workload:
    """What is planned for: the model, the run's lengths, the policy (a PolicySpec), where it
    computes and in what dtype."""
    config: object
    prompt_len: int
    gen_len: int
    spec: object
    device: object
    dtype: object


def cost_model_for(work: Workload, calibration_path: str | None = None,
                   threads: int | None = None, offload_dir: str = DEFAULT_OFFLOAD_DIR,
                   log=print) -> CostModel:
    """The CostModel of `work` with the calibration at calibration_path, else this machine's
    cache (measured now when there is none; threads: the CPU threads it is for)."""
    device = torch.device(work.device)
    if device.type == "cuda" and not torch.cuda.is_available() and not calibration_path \
            and not os.environ.get("FLEXEVICT_CALIBRATION"):
        raise UserError("planning for a GPU on a machine without one needs "
                        f"{setting('calibration')} FILE "
                        "(`python -m flexevict.calibrate --out FILE` on that machine, or "
                        f"{setting('synthetic')} h100)")
    cal = load_calibration(device, threads, offload_dir, path=calibration_path, log=log)
    return with_calibration(work, cal)


def with_calibration(work: Workload, cal) -> CostModel:
    return CostModel(work.config, cal, work.device, work.dtype, work.prompt_len, work.gen_len,
                     work.spec)


def resolve(model: CostModel, request: PlacementRequest, limits: Limits,
            log=print) -> tuple[Placement, Plan]:
    """The request with every free field chosen by the search -> (placement, plan). Prints the
    choice, its prediction and what binds it to stderr."""
    try:
        plan = search(model, request, limits)
    except Infeasible as e:
        raise UserError(infeasible_line(model, request, limits, e)) from None
    for line in [header(model, limits)] + report(plan, alternatives=False):
        log(f"auto {line}", file=sys.stderr)
    nb = next_best(plan)
    if nb:
        log(f"auto {nb}", file=sys.stderr)
    return plan.best.placement, plan
