"""How much memory a run needs in each tier, checked before anything is allocated, so that an
impossible setting gets the estimate and the setting to change instead of a traceback."""
from __future__ import annotations

import contextlib
import math
import os
import shutil

import torch

from .engine import POOL, split_weights, stages_for
from . import rundir
from .errors import UserError
from .model import load_layer_weights, load_outer_weights
from .offload import can_pin, host_bytes, park_bytes

GIB = 1 << 30


class _MetaSource:
    """Weights with shapes and no data: the placement rule runs on them exactly as on real ones."""

    def __init__(self, config):
        self.shapes = config.param_shapes_cached()

    def load(self, name, device="meta", dtype=torch.float16):
        return torch.empty(self.shapes[name], device="meta", dtype=dtype)


class MemoryPlan:
    """Estimated bytes per tier for one run: n sequences of prompt_len + gen_len tokens with
    `slots` KV slots per (sequence, layer, kv head)."""

    def __init__(self, config, placement, dtype, n, prompt_len, gen_len, slots):
        self.config, self.placement, self.dtype = config, placement, dtype
        self.n, self.prompt_len, self.gen_len, self.slots = n, prompt_len, gen_len, slots
        self.elem = torch.empty((), dtype=dtype).element_size()
        self.sizes = placement.batch_split(n)

    def pinned(self, device=None) -> bool:
        """Whether the cpu tier is page-locked (device None: assume a CUDA device)."""
        return self.placement.pin_weight and (device is None or can_pin(torch.device(device)))

    def weight_bytes(self, pinned: bool = False) -> tuple[dict, int]:
        """-> (bytes per tier, the largest schedule layer's streamed bytes); a pinned cpu tier
        counts whole pages per tensor, as it locks them (offload.pinned_size)."""
        c, p, src = self.config, self.placement, _MetaSource(self.config)
        tiers, largest = {"gpu": 0, "cpu": 0, "disk": 0}, 0
        outer = load_outer_weights(c, src, "meta", self.dtype)
        layer = load_layer_weights(c, src, 0, "meta", self.dtype)     # every layer alike
        for s in stages_for(c.num_layers, p.sep_layer):
            w = {k: t for k, t in split_weights(s, layer if s.layer >= 0 else {}, outer).items()
                 if t is not None}
            streamed = 0
            for t, tier in zip(w.values(), p.weight_tiers([t.numel() for t in w.values()])):
                tiers[tier] += host_bytes(self._stored(t), pinned and tier == "cpu")
                streamed += t.numel() * self.elem if tier != "gpu" else 0
            largest = max(largest, streamed)
        return tiers, largest

    def _stored(self, t) -> list[int]:
        """Bytes of the tensors one weight is stored as: itself, or its 4-bit parts."""
        if self.placement.compress_weight and t.dim() == 2:
            return self._packed(t.shape[0], t.shape[1])
        return [t.numel() * self.elem]

    def _packed(self, outer: int, last: int) -> list[int]:
        """4-bit parts (codes, min, scale) of outer rows of `last` values, groups of 64."""
        groups = outer * math.ceil(last / 64)
        return [groups * 32, groups * self.elem, groups * self.elem]

    def _buffer_tensors(self, batch: int, compressed: bool) -> list[int]:
        """Bytes of each tensor of one layer's KV buffer for `batch` sequences (slots include
        the scratch slot): K and V (or their 4-bit parts), score, state, pos, valid."""
        n = self.slots * batch * self.config.num_kv_heads
        d = self.config.dim_head
        kv = self._packed(n, d) if compressed else [n * d * self.elem]
        return 2 * kv + [4 * n, 4 * n, 4 * n, n]

    def _buffer_bytes(self, batch: int, compressed: bool, pinned: bool = False) -> int:
        return host_bytes(self._buffer_tensors(batch, compressed), pinned)

    def cache_bytes(self) -> int:
        return sum(self.config.num_layers * self._buffer_bytes(b, self.placement.compress_cache)
                   for b in self.sizes)

    def needs(self, device=None) -> dict:
        """Estimated bytes in each tier: homes plus the compute device's working set (on
        `device`; None: a CUDA device, with the cpu tier pinned if the placement asks)."""
        c, p, pinned = self.config, self.placement, self.pinned(device)
        tiers, streamed = self.weight_bytes(pinned)
        for tier, b in zip(p.cache_tiers(len(self.sizes)), self.sizes):
            tiers[tier] += c.num_layers * self._buffer_bytes(b, p.compress_cache,
                                                              pinned and tier == "cpu")
        gbs = max(self.sizes)
        staged = p.compress_cache or p.cache_gpu < 100
        on_cpu = p.cpu_cache_compute and p.cache_gpu == 0 and not p.compress_cache
        work = POOL * self._buffer_bytes(gbs, False) if staged and not on_cpu else 0
        s = self.prompt_len
        act = gbs * s * (6 * c.hidden_size + 2 * c.ffn_size) * self.elem
        attn = 2 * gbs * c.num_heads * min(s, 256) * s * 4          # blockwise prompt scores
        hidden = len(self.sizes) * gbs * s * c.hidden_size * self.elem if p.act_gpu else 0
        tiers["gpu"] += 2 * streamed + work + act + attn + hidden + gbs * c.vocab_size * 4
        if not p.act_gpu:      # each batch's parked hidden states, and the one being parked
            parked = park_bytes(gbs * s * c.hidden_size * self.elem, pinned)
            tiers["cpu"] += (len(self.sizes) + 1) * parked
        return tiers

    def check(self, device: torch.device, gpu_limit: int | None) -> None:
        need = self.needs(device)
        if device.type == "cuda" and need["gpu"] > gpu_limit:
            raise UserError(self._message("GPU", need, gpu_limit))
        host = need["cpu"] + (need["gpu"] if device.type == "cpu" else 0)
        available = _mem_available()
        if available is not None and host > available:
            raise UserError(self._message("CPU", need, available, host))
        if need["disk"]:
            rundir.check_writable(self.placement.offload_dir)
            free = shutil.disk_usage(_existing_parent(self.placement.offload_dir)).free
            if need["disk"] > free:
                raise UserError(f"not enough disk: about {need['disk'] / GIB:.1f} GiB needed under "
                                f"--offload-dir but {free / GIB:.1f} GiB free; choose another "
                                "--offload-dir or keep more on the CPU (--percent)")

    def _message(self, what: str, need: dict, have: int, total: int | None = None) -> str:
        p = self.placement
        total = need["gpu"] if total is None else total
        return (f"out of {what} memory: {self.config.name} with {len(self.sizes)} GPU batch(es) "
                f"of {max(self.sizes)} at --percent {' '.join(map(str, p.percent))} needs about "
                f"{total / GIB:.1f} GiB of {what} memory but {have / GIB:.1f} GiB are available; "
                "move weights or cache to a lower tier with --percent, lower --gpu-batch-size / "
                "--num-gpu-batches or --budget, or add --compress-weight / --compress-cache")


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
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _existing_parent(path: str) -> str:
    path = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path
