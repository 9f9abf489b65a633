"""Seeded dummy weights kept on disk from one run to the next.

Dummy weights are a pure function of the model, the seed and the dtype, so the disk-tier
weights one run writes are the ones the next run would write again (OPT-30B at 80% on disk:
48 GB, about a quarter of an hour). Instead of a run folder (`rundir`), such weights go to
`<offload-dir>/weights/<model>-seed<seed>-<dtype>[-4bit]/`, one file per weight tensor
(`<layer>.<key>.bin`; a 4-bit weight has `.data`, `.min` and `.scale` files), and the next run
maps the files it finds instead of making those weights at all. A file is written as
`.part` and renamed when complete, so a stopped run leaves only whole files behind.

The folders of all models together stay under a size cap (`FLEXEVICT_WEIGHT_CACHE_GIB`, default
100; 0 keeps none): before a new file would pass it, the least recently used other folders are
removed; a weight that still would not fit goes to the run folder as without the cache. Each
removal, and the first weight not kept, is one line on stderr. `--no-weight-cache`
(Placement.weight_cache False) turns the cache off; removing the folder is always safe.

Nothing here is silent about disk space: when a process that used the cache exits (normally, on
an error, Ctrl-C or SIGTERM), one stderr line says how much is kept where, and how to turn it
off (`kept_line`).
"""
from __future__ import annotations

import atexit
import contextlib
import math
import os
import shutil
import sys

import torch

from flexevict.core.kernels.quant import Packed4bit, quantize_4bit
from flexevict.errors import UserError, setting
from flexevict.runtime import rundir
from flexevict.runtime.offload import map_file

FOLDER = "weights"
CAP_ENV = "FLEXEVICT_WEIGHT_CACHE_GIB"
DEFAULT_CAP_GIB = 100.0
MISSPELT = "FLEXEVICT_WEIGHT_CACHE_GB"     # not read: refused, so a cap is never ignored
PARTS = ("data", "min", "scale")           # the files of a 4-bit weight
_used_roots: dict[str, int] = {}           # cache root -> cap, of this process: said at exit


class WeightCache:
    """The kept disk-tier weights of one (model, seed, dtype, compression)."""

    def __init__(self, offload_dir: str, name: str, cap_bytes: int):
        self.root = os.path.abspath(os.path.join(os.path.expanduser(offload_dir), FOLDER))
        self.folder = os.path.join(self.root, name)
        self.cap_bytes = cap_bytes
        self.full_said = False                                 # "not kept" said once a run
        os.makedirs(self.folder, exist_ok=True)
        os.utime(self.folder)                                  # most recently used now
        remove_orphans(self.folder)
        self.total = folder_bytes(self.root)
        _used_roots[self.root] = cap_bytes

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
            self._say_full()
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
            size = folder_bytes(path)
            self.total -= size
            shutil.rmtree(path, ignore_errors=True)
            print(f"flexevict: removed kept dummy weights {os.path.basename(path)} "
                  f"({_size(size)}, the least recently used) to stay under "
                  f"{_cap_setting(self.cap_bytes)}", file=sys.stderr)
            if self.total + need <= self.cap_bytes:
                return True
        return False

    def _say_full(self) -> None:
        if not self.full_said:
            self.full_said = True
            print(f"flexevict: {_cap_setting(self.cap_bytes)} is reached ({_size(self.total)} "
                  f"kept in {self.root}): some of this run's disk-tier dummy weights are not "
                  f"kept for the next run; raise {CAP_ENV} to keep them", file=sys.stderr)


def cap_bytes() -> int:
    """The cache's size cap in bytes: FLEXEVICT_WEIGHT_CACHE_GIB (a number of GiB, >= 0; inf:
    no cap; default 100). Anything else, or the unread FLEXEVICT_WEIGHT_CACHE_GB, is a
    UserError naming the fix."""
    if MISSPELT in os.environ:
        raise UserError(f"{MISSPELT} is not read: the dummy-weight cache's cap is {CAP_ENV}, "
                        f"in GiB; set {CAP_ENV}={os.environ[MISSPELT]} instead")
    raw = os.environ.get(CAP_ENV, "").strip()
    if not raw:
        return int(DEFAULT_CAP_GIB * 2 ** 30)
    try:
        gib = float(raw)
    except ValueError:
        gib = math.nan
    if not gib >= 0:                          # also NaN
        raise UserError(f"{CAP_ENV}={raw!r} is not a size in GiB; set it to a number >= 0 "
                        f"(e.g. 100; 0 keeps no dummy weights) or unset it for the default "
                        f"{DEFAULT_CAP_GIB:g}")
    return round(min(gib * 2 ** 30, 2 ** 62))


def kept_line(root: str, cap: int) -> str | None:
    """The line that says what the cache at `root` holds, or None when it holds nothing."""
    size = folder_bytes(root) if os.path.isdir(root) else 0
    if not size:
        return None
    return (f"flexevict: {_size(size)} of dummy weights kept in {root} for the next run "
            f"({_cap_setting(cap)} caps them; --no-weight-cache keeps none; "
            "safe to delete)")


@atexit.register
def _say_kept() -> None:
    """At exit (after a run, an error, Ctrl-C or SIGTERM): `kept_line` for each cache used."""
    for root, cap in sorted(_used_roots.items()):
        line = kept_line(root, cap)
        if line:
            print(line, file=sys.stderr)
    _used_roots.clear()


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if nbytes >= 2 ** (shift - 1):
            return f"{nbytes / 2 ** shift:.1f} {unit}"
    return f"{nbytes / 2 ** 10:.1f} KiB"


def _cap_setting(cap: int) -> str:
    return f"{CAP_ENV}={cap / 2 ** 30:.3g}"


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
