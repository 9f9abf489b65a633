"""Seeded dummy weights kept on disk from one run to the next.

Dummy weights are a pure function of the model, the seed and the dtype, so the disk-tier
weights one run writes are the ones the next run would write again (OPT-30B at 80% on disk:
48 GB, about a quarter of an hour). Instead of a run folder (`rundir`), such weights go to
`<offload-dir>/weights/<model>-seed<seed>-<dtype>[-4bit]/`, one file per weight tensor
(`<layer>.<key>.bin`; a 4-bit weight has `.data`, `.min` and `.scale` files), and the next run
maps the files it finds instead of making those weights at all. A file is written as
`.part` and renamed when complete, so a stopped run leaves only whole files behind.

The folders of all models together stay under a size cap (`FLEXEVICT_WEIGHT_CACHE_GIB`, default
100): before a new file would pass it, the least recently used other folders are removed; a
weight that still would not fit goes to the run folder as without the cache. `--no-weight-cache`
(Placement.weight_cache False) turns the cache off; removing the folder is always safe.
"""
from __future__ import annotations

import contextlib
import os
import shutil

import torch

from flexevict.core.kernels.quant import Packed4bit, quantize_4bit
from flexevict.errors import UserError, setting
from flexevict.runtime import rundir
from flexevict.runtime.offload import map_file

FOLDER = "weights"
CAP_ENV = "FLEXEVICT_WEIGHT_CACHE_GIB"
DEFAULT_CAP_GIB = 100.0
PARTS = ("data", "min", "scale")           # the files of a 4-bit weight


class WeightCache:
    """The kept disk-tier weights of one (model, seed, dtype, compression)."""

    def __init__(self, offload_dir: str, name: str, cap_bytes: int):
        self.root = os.path.join(os.path.expanduser(offload_dir), FOLDER)
        self.folder = os.path.join(self.root, name)
        self.cap_bytes = cap_bytes
        os.makedirs(self.folder, exist_ok=True)
        os.utime(self.folder)                                  # most recently used now
        remove_orphans(self.folder)
        self.total = folder_bytes(self.root)

    @classmethod
    def for_run(cls, source, placement, dtype) -> "WeightCache | None":
        """The cache for a run of `source` under `placement`, or None: real weights, no
        weight on disk, or the cache turned off."""
        key = getattr(source, "cache_key", None)
        if key is None or not placement.weight_cache or placement.w_gpu + placement.w_cpu >= 100:
            return None
        name = f"{key}-{str(dtype).replace('torch.', '')}"
        if placement.compress_weight:
            name += "-4bit"
        return cls(placement.offload_dir, name, cap_bytes())

    def _path(self, layer: int, key: str, part: str = "") -> str:
        return os.path.join(self.folder, f"{layer}.{key}{'.' + part if part else ''}.bin")

    def has(self, layer: int, key: str, compress: bool) -> bool:
        """Whether the weight's files are all there."""
        parts = PARTS if compress else ("",)
        return all(os.path.exists(self._path(layer, key, p)) for p in parts)

    def open(self, layer: int, key: str, meta: torch.Tensor, compress: bool):
        """The kept weight shaped like `meta` (a tensor on the meta device), memory-mapped."""
        if not compress:
            return _mapped(self._path(layer, key), meta)
        like = quantize_4bit(meta, dim=-1)                      # shapes and dtypes only
        parts = [_mapped(self._path(layer, key, p), getattr(like, p)) for p in PARTS]
        return Packed4bit(*parts, like.shape, like.dim, like.group)

    def store(self, layer: int, key: str, t, put):
        """Keep weight `t` (a tensor, or Packed4bit when compressed) and return its mapped
        copy; when it does not fit under the cap, put(t) places it as without the cache."""
        parts = [(p, getattr(t, p)) for p in PARTS] if isinstance(t, Packed4bit) else [("", t)]
        need = sum(x.numel() * x.element_size() for _, x in parts)
        if not self._make_room(need):
            return put(t)
        mapped = [_write(self._path(layer, key, p), x) for p, x in parts]
        self.total += need
        if isinstance(t, Packed4bit):
            return Packed4bit(*mapped, t.shape, t.dim, t.group)
        return mapped[0]

    def _make_room(self, need: int) -> bool:
        """Remove the least recently used other folders until `need` more bytes fit."""
        if self.total + need <= self.cap_bytes:
            return True
        others = sorted((os.path.getmtime(p), p) for p in _folders(self.root) if p != self.folder)
        for _, path in others:
            self.total -= folder_bytes(path)
            shutil.rmtree(path, ignore_errors=True)
            if self.total + need <= self.cap_bytes:
                return True
        return False


def cap_bytes() -> int:
    """The cache's size cap in bytes (FLEXEVICT_WEIGHT_CACHE_GIB, default 100)."""
    return int(float(os.environ.get(CAP_ENV, DEFAULT_CAP_GIB)) * 2 ** 30)


def folder_bytes(path: str) -> int:
    """Bytes of the files under `path`."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path)
               for f in files)


def remove_orphans(folder: str) -> None:
    """Remove the `.part` files of runs that are gone (killed while writing)."""
    for name in os.listdir(folder):
        if name.endswith(".part") and not rundir.alive(int(name.split(".")[-2])):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, name))


def _folders(root: str) -> list[str]:
    return [os.path.join(root, n) for n in os.listdir(root)
            if os.path.isdir(os.path.join(root, n))]


def _mapped(path: str, like: torch.Tensor) -> torch.Tensor:
    """The file as a tensor of like's shape and dtype (copy-on-write map: never written)."""
    return map_file(path, like.shape, like.dtype, shared=False)


def _write(path: str, t: torch.Tensor) -> torch.Tensor:
    """t written to `path` (via `.part`, renamed when whole) -> the file mapped. The space is
    reserved first: a full disk is one line here, not a bus error while writing the map."""
    part = f"{path}.{os.getpid()}.part"
    try:
        with open(part, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, max(t.numel(), 1) * t.element_size())
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(part)
        raise UserError(f"{setting('offload_dir')}: cannot keep dummy weights in "
                        f"{os.path.dirname(path)} ({e.strerror}); free disk space there or "
                        f"turn the weight cache off ({setting('weight_cache')})") from None
    out = map_file(part, t.shape, t.dtype)
    out.copy_(t)
    os.replace(part, path)
    return out
