"""How much memory a run needs in each tier, checked before anything is allocated, so that an
impossible setting gets the estimate and the setting to change instead of a traceback."""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
import shutil

import torch

from flexevict.runtime.engine import POOL, split_weights, stages_for
from flexevict.runtime import rundir
from flexevict.errors import UserError, setting
from flexevict.core.kernels.quant import GROUP
from flexevict.core.model import load_layer_weights, load_outer_weights
from flexevict.io.weights import MetaWeights
from flexevict.runtime.offload import can_pin, host_bytes, park_bytes

GIB = 1 << 30


class DoesNotFit(UserError):
    """A run too big for a memory limit; `fits` is a placement of the same batch that does fit
    (MemoryPlan.fitting), or None; `head` is the message's first part, what does not fit (for a
    caller with advice of its own)."""

    def __init__(self, message: str, fits=None, head: str | None = None):
        super().__init__(message)
        self.fits, self.head = fits, head or message


def stage_weights(config, sep_layer: bool) -> list[list[tuple]]:
    """The weights each schedule layer reads, in declaration order (absent biases left out),
    computed once per config: [[(name, shape), ...] per stage of stages_for]."""
    key = ("stages", shape_key(config), sep_layer)
    if key not in _CACHE:
        src = MetaWeights(config)
        outer = load_outer_weights(config, src, "meta", torch.float16)
        layer = load_layer_weights(config, src, 0, "meta", torch.float16)   # every layer alike
        _CACHE[key] = [
            [(name, tuple(t.shape)) for name, t in
             split_weights(s, layer if s.layer >= 0 else {}, outer, config.family).items()
             if t is not None]
            for s in stages_for(config.num_layers, sep_layer)]
    return _CACHE[key]


_CACHE: dict = {}      # per model shape: stage weights, and weight bytes per placement


def shape_key(config) -> str:
    """Every field that decides the weights' shapes (a config's `extra` dict can be shared by
    copies made with dataclasses.replace, so it cannot key a cache)."""
    return repr([getattr(config, f.name) for f in dataclasses.fields(config) if f.compare])


def _numel(shape) -> int:
    return math.prod(shape)


class MemoryPlan:
    """Estimated bytes per tier for one run: n sequences of prompt_len + gen_len tokens with
    `slots` KV slots per (sequence, layer, kv head) (an int: every layer's; a list: each
    layer's own, `layers.layer_slots`: a sliding layer's window), and `history` tokens of K/V
    per row that stay with each cache home besides its buffer (recall's,
    `Layout.home_tokens`)."""

    def __init__(self, config, placement, dtype, n, prompt_len, gen_len, slots, history=0):
        self.config, self.placement, self.dtype = config, placement, dtype
        self.layer_slots = ([slots] * config.num_layers if isinstance(slots, int)
                            else list(slots))
        self.n, self.prompt_len, self.gen_len = n, prompt_len, gen_len
        self.slots = max(self.layer_slots)            # the largest layer's
        self.slot_counts = collections.Counter(self.layer_slots)   # layers alike are priced once
        self.history = history
        self.elem = torch.empty((), dtype=dtype).element_size()
        self.sizes = placement.batch_split(n)

    def pinned(self, device=None) -> bool:
        """Whether the cpu tier is page-locked (device None: assume a CUDA device)."""
        return self.placement.pin_weight and (device is None or can_pin(torch.device(device)))

    def weight_bytes(self, pinned: bool = False) -> tuple[dict, int]:
        """-> (bytes per tier, the largest schedule layer's streamed bytes); a pinned cpu tier
        counts whole pages per tensor, as it locks them (offload.pinned_size). Streamed: what
        the engine copies to the compute device per use, at full size (offloaded weights, and
        compressed ones on any tier: they are decompressed on use)."""
        p = self.placement
        key = ("weights", shape_key(self.config), p.w_gpu, p.w_cpu, p.compress_weight,
               p.sep_layer, pinned, self.elem)
        if key not in _CACHE:         # the search asks for a few over and over
            tiers, largest = {"gpu": 0, "cpu": 0, "disk": 0}, 0
            for stage in stage_weights(self.config, p.sep_layer):
                shapes = [shape for _, shape in stage]
                streamed = 0
                for shape, tier in zip(shapes, p.weight_tiers([_numel(s) for s in shapes])):
                    tiers[tier] += host_bytes(self._stored(shape), pinned and tier == "cpu")
                    if tier != "gpu" or (p.compress_weight and len(shape) == 2):
                        streamed += _numel(shape) * self.elem
                largest = max(largest, streamed)
            _CACHE[key] = (tiers, largest)
        tiers, largest = _CACHE[key]
        return dict(tiers), largest

    def _stored(self, shape) -> list[int]:
        """Bytes of the tensors one weight is stored as: itself, or its 4-bit parts."""
        if self.placement.compress_weight and len(shape) == 2:
            return self._packed(shape[0], shape[1])
        return [_numel(shape) * self.elem]

    def _packed(self, outer: int, last: int) -> list[int]:
        """4-bit parts (codes, min, scale) of outer rows of `last` values, groups of GROUP."""
        groups = outer * math.ceil(last / GROUP)
        return [groups * GROUP // 2, groups * self.elem, groups * self.elem]

    def _buffer_tensors(self, batch: int, compressed: bool, slots: int | None = None
                        ) -> list[int]:
        """Bytes of each tensor of one layer's KV buffer of `slots` (default: the largest
        layer's, scratch included) for `batch` sequences: K and V (or their 4-bit parts),
        score, state, pos, valid."""
        n = (slots or self.slots) * batch * self.config.num_kv_heads
        d = self.config.dim_head
        kv = self._packed(n, d) if compressed else [n * d * self.elem]
        return 2 * kv + [4 * n, 4 * n, 4 * n, n]

    def kv_bytes(self, batch: int, slots: int | None = None) -> int:
        """Bytes of K and V at full size in one layer's buffer of `slots` (default: the largest
        layer's) for `batch` sequences (`_buffer_tensors`' first two)."""
        return sum(self._buffer_tensors(batch, False, slots)[:2])

    def _buffer_bytes(self, batch: int, compressed: bool, pinned: bool = False,
                      slots: int | None = None) -> int:
        return host_bytes(self._buffer_tensors(batch, compressed, slots), pinned)

    def _layers_bytes(self, batch: int, compressed: bool, pinned: bool = False) -> int:
        """Every layer's buffer for `batch` sequences, each at its own slots."""
        return sum(count * self._buffer_bytes(batch, compressed, pinned, s)
                   for s, count in self.slot_counts.items())

    def cache_bytes(self) -> int:
        return sum(self._layers_bytes(b, self.placement.compress_cache) for b in self.sizes)

    def needs(self, device=None) -> dict:
        """Estimated bytes in each tier: homes plus the compute device's working set (on
        `device`; None: a CUDA device, with the cpu tier pinned if the placement asks). The sum
        of three parts that each depend on one part of the placement (the search adds them up
        for many placements without rebuilding a plan per placement)."""
        pinned = self.pinned(device)
        parts = (self.weight_part(pinned), self.cache_part(pinned), self.activation_part(pinned))
        return {t: sum(part[t] for part in parts) for t in ("gpu", "cpu", "disk")}

    def weight_part(self, pinned: bool) -> dict:
        """Weights' homes, and the two streamed layers' working copies on the device."""
        tiers, streamed = self.weight_bytes(pinned)
        tiers["gpu"] += 2 * streamed
        return tiers

    def cache_part(self, pinned: bool) -> dict:
        """The KV homes, and the pool of working buffers each tier that computes on a copy of
        a home holds (engine._load_cache: every GPU batch whose home is not used in place)."""
        c, p = self.config, self.placement
        tiers = {"gpu": 0, "cpu": 0, "disk": 0}
        homes = p.cache_tiers(len(self.sizes))
        history = 2 * self.history * c.num_kv_heads * c.dim_head * self.elem   # K and V
        for tier, b in zip(homes, self.sizes):
            tiers[tier] += (self._layers_bytes(b, p.compress_cache, pinned and tier == "cpu")
                            + c.num_layers * b * history)
        for work in {p.work_tier(t) for t in homes if not p.in_place(t)}:
            tiers[work] += POOL * self._buffer_bytes(max(self.sizes), False)
        return tiers

    def activation_part(self, pinned: bool) -> dict:
        """A layer's activations and prompt scores, the GPU batches' hidden states (or their
        parked copies on the CPU), and the logits."""
        c, p, s = self.config, self.placement, self.prompt_len
        gbs = max(self.sizes)
        act = gbs * s * (6 * c.hidden_size + 2 * c.ffn_size) * self.elem
        attn = 2 * gbs * c.num_heads * min(s, 256) * s * 4          # blockwise prompt scores
        hidden = len(self.sizes) * gbs * s * c.hidden_size * self.elem if p.act_gpu else 0
        tiers = {"gpu": act + attn + hidden + gbs * c.vocab_size * 4, "cpu": 0, "disk": 0}
        if not p.act_gpu:      # each batch's parked hidden states, and the one being parked
            parked = park_bytes(gbs * s * c.hidden_size * self.elem, pinned)
            tiers["cpu"] += (len(self.sizes) + 1) * parked
        return tiers

    def host_need(self, device, baseline: int = 0) -> int:
        """Host memory the run holds: the cpu tier, the gpu tier too when the compute device is
        the CPU, plus `baseline` (the process before loading: interpreter, torch)."""
        return host_need(self.needs(device), device, baseline)

    def overflow(self, device, gpu_limit: int | None, cpu_limit: int | None,
                 disk_free: int | None = None, baseline: int = 0) -> tuple | None:
        """The first limit this run exceeds -> (resource, bytes needed, bytes allowed), or None
        when it fits (see `overflow`)."""
        return overflow(self.needs(device), device, gpu_limit, cpu_limit, disk_free, baseline)

    def check(self, device: torch.device, gpu_limit: int | None,
              cpu_limit: int | None = None) -> None:
        """Raise the one-line advice if the run cannot fit: the GPU limit, --cpu-mem-limit
        (counting this process's memory so far, `process_anon`), the memory available now,
        and the free disk under --offload-dir. The advice names a --percent that fits."""
        need = self.needs(device)
        available = _mem_available()
        host_limit = min(x for x in (cpu_limit, available, float("inf")) if x is not None)
        host = need["cpu"] + (need["gpu"] if device.type == "cpu" else 0)
        if device.type == "cuda" and gpu_limit is not None and need["gpu"] > gpu_limit:
            self._does_not_fit(device, gpu_limit, host_limit, "GPU", need, gpu_limit)
        if cpu_limit is not None and host + process_anon() > cpu_limit:
            self._does_not_fit(device, gpu_limit, host_limit, "CPU", need, cpu_limit,
                               host + process_anon(), setting("cpu_mem_limit"))
        if available is not None and host > available:
            self._does_not_fit(device, gpu_limit, host_limit, "CPU", need, available, host)
        if need["disk"]:
            rundir.check_writable(self.placement.offload_dir)
            free = disk_free(self.placement.offload_dir)
            if need["disk"] > free:
                raise UserError(f"not enough disk: about {need['disk'] / GIB:.1f} GiB needed under "
                                f"{setting('offload_dir')} but {free / GIB:.1f} GiB free; choose "
                                f"another {setting('offload_dir')} or keep more on the CPU "
                                f"({setting('percent')})")

    def _does_not_fit(self, device, gpu_limit, host_limit: float, *message) -> None:
        """Raise DoesNotFit: `_message(*message)` with the placement `fitting` finds."""
        fits = self.fitting(device, gpu_limit, host_limit - process_anon())
        raise DoesNotFit(self._message(*message, fits=fits or False), fits,
                         self._head(*message))

    def fitting(self, device, gpu_limit: int | None, host_limit: float, step: int = 10):
        """The placement flags, --percent in steps of `step`, that fit the limits with this
        run's batch and activations and keep the most bytes on the GPU, then on the CPU (the
        least offloading; `python -m flexevict.plan` ranks by predicted speed instead): with
        the run's own switches, else adding --compress-weight, then --compress-cache too ->
        the Placement, or None when nothing fits. Memory only: no calibration needed.
        host_limit: host bytes the run's tiers may take. Like the search (`_frontier`), it adds
        up `needs`' three parts, each computed once per option."""
        p, pinned = self.placement, self.pinned(device)
        free = disk_free(p.offload_dir)
        plan = lambda **change: MemoryPlan(self.config, dataclasses.replace(p, **change),  # noqa: E731
                                           self.dtype, self.n, self.prompt_len, self.gen_len,
                                           self.layer_slots)
        act = self.activation_part(pinned)
        pairs = [(g, c) for g in range(0, 101, step) for c in range(0, 101 - g, step)]
        for cw, cc in dict.fromkeys([(p.compress_weight, p.compress_cache),
                                     (True, p.compress_cache), (True, True)]):
            weights = {(g, c): plan(w_gpu=g, w_cpu=c, compress_weight=cw).weight_part(pinned)
                       for g, c in pairs}
            caches = {}
            for g, c in pairs:
                cache = plan(cache_gpu=g, cache_cpu=c, compress_cache=cc)
                try:
                    cache.placement.checked()         # --compress-cache wants one tier
                except UserError:
                    continue
                caches[g, c] = cache.cache_part(pinned)
            best, best_key = None, None
            for wp, w in weights.items():
                for cp, c in caches.items():
                    need = {t: w[t] + c[t] + act[t] for t in w}
                    if overflow(need, device, gpu_limit, host_limit, free) is None:
                        key = (need["gpu"], need["cpu"])
                        if best_key is None or key > best_key:
                            best, best_key = (*wp, *cp), key
            if best is not None:
                wg, wc, cg, ccpu = best
                return dataclasses.replace(p, w_gpu=wg, w_cpu=wc, cache_gpu=cg, cache_cpu=ccpu,
                                           compress_weight=cw, compress_cache=cc)
        return None

    def flags_of(self, q) -> str:
        """The settings that turn this run's placement into q (a `fitting` result), named by
        `setting` (flags on the command line)."""
        added = [setting(n) for n in ("compress_weight", "compress_cache")
                 if getattr(q, n) and not getattr(self.placement, n)]
        return " ".join([f"{setting('percent')} {' '.join(map(str, q.percent))}", *added])

    def _message(self, what: str, need: dict, have: int, total: int | None = None,
                 limit: str | None = None, fits=None) -> str:
        """The one-line advice: `_head`, then the fix; fits: a placement that fits (`fitting`),
        False when none does, None when none was looked for (an allocation failed)."""
        percent, batch = setting("percent"), (f"{setting('gpu_batch_size')} / "
                                              f"{setting('num_gpu_batches')} or "
                                              f"{setting('budget')}")
        if fits:
            fix = (f"{self.flags_of(fits)} fits (same batch; `{percent} auto` picks the fastest "
                   "placement that fits)")
        else:
            fix = (f"no {percent} fits this batch, even compressed: lower {batch}, or give "
                   f"{setting('offload_dir')} a disk with more room"
                   if fits is False else f"move weights or cache to a lower tier with {percent}, "
                   f"lower {batch}, or add {setting('compress_weight')} / "
                   f"{setting('compress_cache')}")
        return f"{self._head(what, need, have, total, limit)}; {fix}"

    def _head(self, what: str, need: dict, have: int, total: int | None = None,
              limit: str | None = None) -> str:
        """What does not fit: the run, the memory it needs and what there is."""
        total = need["gpu"] if total is None else total
        where = f"the {limit} of {have / GIB:.1f} GiB" if limit else \
            f"{have / GIB:.1f} GiB are available"
        return (f"out of {what} memory: {self.config.name} with {len(self.sizes)} GPU batch(es) "
                f"of {max(self.sizes)} at {setting('percent')} "
                f"{' '.join(map(str, self.placement.percent))} needs about {total / GIB:.1f} GiB "
                f"of {what} memory but {where}")



def host_need(need: dict, device, baseline: int = 0) -> int:
    """Host memory of a run needing `need` bytes per tier (MemoryPlan.needs): the cpu tier, the
    gpu tier too when the compute device is the CPU, and `baseline` (the process before it
    loads anything: interpreter, torch)."""
    return baseline + need["cpu"] + (need["gpu"] if torch.device(device).type == "cpu" else 0)


def overflow(need: dict, device, gpu_limit: int | None, cpu_limit: int | None,
             disk_free: int | None = None, baseline: int = 0) -> tuple | None:
    """The first limit a run needing `need` bytes per tier exceeds -> (resource, bytes needed,
    bytes allowed), or None when it fits. resource is "GPU" (the compute device's memory, CUDA
    only), "CPU" (host memory, `host_need`) or "disk" (under --offload-dir); a None limit is no
    limit."""
    if torch.device(device).type == "cuda" and gpu_limit is not None and need["gpu"] > gpu_limit:
        return "GPU", need["gpu"], gpu_limit
    host = host_need(need, device, baseline)
    if cpu_limit is not None and host > cpu_limit:
        return "CPU", host, cpu_limit
    if disk_free is not None and need["disk"] > disk_free:
        return "disk", need["disk"], disk_free
    return None


def disk_free(offload_dir: str) -> int:
    """Free bytes on the file system that holds (or will hold) offload_dir."""
    return shutil.disk_usage(_existing_parent(offload_dir)).free


def process_anon() -> int:
    """Anonymous memory this process holds now (RssAnon; 0 without /proc): the baseline a
    --cpu-mem-limit counts besides the run's tiers."""
    return _proc_bytes("/proc/self/status", "RssAnon:") or 0


@contextlib.contextmanager
def out_of_memory(plan: MemoryPlan, device: torch.device, gpu_limit: int | None):
    """Turn an allocation failure the estimate missed into the same one-line advice."""
    try:
        yield
    except torch.cuda.OutOfMemoryError:
        raise UserError(plan._message("GPU", plan.needs(), gpu_limit or 0)) from None
    except (MemoryError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and "alloc" not in str(e).lower():
            raise
        raise UserError(plan._message("CPU", plan.needs(), _mem_available() or 0)) from None


def _mem_available() -> int | None:
    return _proc_bytes("/proc/meminfo", "MemAvailable:")


def _proc_bytes(path: str, key: str) -> int | None:
    """The `key` line of a /proc file that counts kB, in bytes; None without it (no /proc)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _existing_parent(path: str) -> str:
    path = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path
