"""Memory tiers and the copy engine the block schedule runs on.

Tiers: "gpu" (the compute device), "cpu" (host memory, pinned when the compute device is a GPU
and pinning is asked for) and "disk" (files under the offload directory, memory-mapped).

Pinned host memory is registered with CUDA one allocation at a time (`PinnedHost`), so the
tier page-locks what it holds rounded to whole pages, not to the power-of-two blocks of torch's
pinned allocator; `pinned_size` is that rounding, shared with the memory plan (memory.py).

Copies run on lanes. On a CUDA device a lane is a CUDA stream: copies are enqueued without
blocking and a `Ticket` carries the event that marks their completion; the consumer's stream
waits on that event (no device-wide synchronize). Without CUDA, and for anything that reads or
writes disk, a lane is a pool of worker threads and the ticket is a future. Either way a lane
runs the jobs submitted with one key in submission order (see `Lane`).
"""
from __future__ import annotations

import contextlib
import math
import mmap
import os
import threading
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from flexevict.core.kernels.quant import Packed4bit, dequantize_4bit, quantize_4bit
from flexevict.core.kv import KVBuffer
from flexevict.runtime import rundir
from flexevict.errors import UserError, setting

PAGE = mmap.PAGESIZE


def can_pin(compute: torch.device) -> bool:
    """Host memory is page-locked only for a CUDA compute device (copies to it go faster)."""
    return compute.type == "cuda"


class Tiers:
    """Allocates zeroed tensors in a tier. `compute` is the compute device."""

    def __init__(self, compute: torch.device, offload_dir: str, pin: bool):
        self.compute = compute
        self.pin = pin and can_pin(compute)
        self.pinned = PinnedHost() if self.pin else None     # the pinned cpu tier
        self.offload_dir = os.path.expanduser(offload_dir)
        self._run_dir = None
        self._files = 0
        self._lock = threading.Lock()

    def device(self, tier: str) -> torch.device:
        return self.compute if tier == "gpu" else torch.device("cpu")

    def alloc(self, tier: str):
        """-> alloc(shape, dtype, device) for KVBuffer; `device` is ignored (the tier decides)."""
        return lambda shape, dtype, device=None: self.zeros(tier, shape, dtype)

    def zeros(self, tier: str, shape, dtype) -> torch.Tensor:
        if tier == "disk":
            return self._file_tensor(shape, dtype)
        if tier == "cpu" and self.pin:
            return self.pinned.zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=self.device(tier))

    def run_scope(self):
        """Context for one run: the pinned memory allocated inside (its KV homes) is recycled
        when it ends (see PinnedHost.scope)."""
        return self.pinned.scope() if self.pinned is not None else contextlib.nullcontext()

    def park(self, t: torch.Tensor) -> torch.Tensor:
        """A short-lived host copy of t (activations parked between layers). It comes from
        torch's pinned caching allocator when pinning: blocks are recycled step after step (no
        registration per step), each rounded up to a power of two (`park_bytes`)."""
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin)
        out.copy_(t)
        return out

    def put(self, tier: str, t: torch.Tensor) -> torch.Tensor:
        """A copy of t living in `tier` (weights at load time)."""
        if tier == "gpu":
            return t.to(self.compute)
        out = self.zeros(tier, t.shape, t.dtype)
        out.copy_(t)
        return out

    def _file_tensor(self, shape, dtype) -> torch.Tensor:
        with self._lock:
            if self._run_dir is None:
                self._run_dir = rundir.create(self.offload_dir)
            self._files += 1
            path = os.path.join(self._run_dir, f"t{self._files}.bin")
        nbytes = max(math.prod(shape) * torch.empty((), dtype=dtype).element_size(), 1)
        try:
            with open(path, "wb") as f:
                f.truncate(nbytes)                       # sparse file, reads as zeros
            return map_file(path, shape, dtype)
        except OSError as e:
            raise UserError(f"{setting('offload_dir')} {self.offload_dir}: cannot write {path} "
                            f"({e.strerror}); free disk space or choose another "
                            "directory") from None

    def close(self):
        if self.pinned is not None:
            self.pinned.close()
        rundir.remove(self._run_dir)
        self._run_dir = None


def map_file(path: str, shape, dtype, shared: bool = True) -> torch.Tensor:
    """The file at `path` as a tensor of `shape` and `dtype`, memory-mapped (shared: writes
    reach the file; else copy-on-write). An empty shape maps one element: torch cannot map
    nothing."""
    numel = math.prod(shape)
    return torch.from_file(path, shared=shared, size=max(numel, 1), dtype=dtype)[:numel] \
        .view(shape)


# ---------------------------------------------------------------------------- pinned host memory

def pinned_size(nbytes: int) -> int:
    """Bytes page-locked for one pinned allocation of nbytes: whole pages."""
    return -(-nbytes // PAGE) * PAGE


def host_bytes(sizes, pinned: bool) -> int:
    """Host memory the cpu tier holds for allocations of these byte sizes (PinnedHost.nbytes
    after allocating them, when pinned)."""
    return sum(pinned_size(n) for n in sizes) if pinned else sum(sizes)


def park_bytes(nbytes: int, pinned: bool) -> int:
    """Host memory of one parked activation (Tiers.park): torch's pinned caching allocator
    rounds each block up to a power of two."""
    return 1 << (nbytes - 1).bit_length() if pinned and nbytes > 0 else nbytes


@dataclass
class _Block:
    """One registered allocation: an anonymous mapping (page-aligned, zero-filled) and the
    uint8 tensor over it."""
    mapping: mmap.mmap
    data: torch.Tensor

    @property
    def size(self) -> int:
        return self.data.numel()


class PinnedHost:
    """Page-locked host memory without power-of-two rounding.

    Each allocation is its own anonymous mapping, registered with CUDA (cudaHostRegister), so
    it page-locks `pinned_size(nbytes)` bytes; torch's pinned allocator would lock the next
    power of two (about 22 GB for the 12.4 GB of OPT-6.7B's weights). `nbytes` counts what is
    locked now.

    Allocations made inside `scope()` (a run's KV homes) go back to a free list when the scope
    ends, and an allocation of the same size reuses one (zeroed): repeated runs of one shape
    register nothing. Memory a run did not reuse is unregistered: all of the free list at the
    first allocation that finds no match in it, and what is left of it when the scope ends. So
    besides what is in use, at most the previous run's memory stays locked, and only until
    the next run allocates something of another size. Everything is unregistered at `close()`
    (the tensors stay usable, as ordinary memory).
    """

    def __init__(self):
        self.nbytes = 0
        self._kept: list[_Block] = []             # until close (weights)
        self._scoped: list[_Block] | None = None  # the open scope's allocations
        self._free: dict[int, list[_Block]] = {}  # size -> recycled blocks
        self._lock = threading.Lock()

    def zeros(self, shape, dtype) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.zeros(shape, dtype=dtype)
        size = pinned_size(nbytes)
        with self._lock:
            block = self._reuse(size) or self._new(size)
            (self._kept if self._scoped is None else self._scoped).append(block)
        return block.data[:nbytes].view(dtype).view(shape)

    @contextlib.contextmanager
    def scope(self):
        with self._lock:
            outer, self._scoped = self._scoped, []
        try:
            yield
        finally:
            with self._lock:
                self._trim()                            # what this scope did not reuse
                for block in self._scoped:
                    self._free.setdefault(block.size, []).append(block)
                self._scoped = outer

    def close(self) -> None:
        with self._lock:
            blocks = self._kept + (self._scoped or []) + [b for bs in self._free.values()
                                                          for b in bs]
            self._kept, self._free = [], {}
            self._scoped = None if self._scoped is None else []
            for block in blocks:
                self._drop(block)

    def _reuse(self, size: int) -> _Block | None:
        blocks = self._free.get(size)
        if not blocks:
            self._trim()
            return None
        block = blocks.pop()
        block.data.zero_()
        return block

    def _trim(self) -> None:
        for block in [b for bs in self._free.values() for b in bs]:
            self._drop(block)
        self._free = {}

    def _new(self, size: int) -> _Block:
        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        block = _Block(mapping, torch.frombuffer(mapping, dtype=torch.uint8))
        _register(block.data.data_ptr(), size)
        self.nbytes += size
        return block

    def _drop(self, block: _Block) -> None:
        """Unregister a block; its memory is unmapped once no tensor uses it any more."""
        _unregister(block.data.data_ptr())
        self.nbytes -= block.size


def _register(ptr: int, size: int) -> None:
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, size, 1))    # 1: cudaHostRegisterPortable
    if err != 0:
        raise RuntimeError(f"pinned host allocation of {size} bytes failed: cudaHostRegister "
                           f"returned cudaError {err}")


def _unregister(ptr: int) -> None:
    # a failure leaves the pages locked until the process exits: nothing to undo here
    torch.cuda.cudart().cudaHostUnregister(ptr)


class Ticket:
    """Completion of a submitted copy: `wait()` makes the current stream (or thread) wait for it
    and returns the copy's result. Any number of threads may wait on one ticket (a load job
    waits on a store's ticket while the compute thread waits on it at the end of the step):
    waiting changes nothing in the ticket, and orders each waiter's stream after the copy."""

    def __init__(self, value=None, event=None, future: Future | None = None):
        self.value, self.event, self.future = value, event, future

    def wait(self):
        value, event = self.value, self.event
        if self.future is not None:
            value = self.future.result()
            if isinstance(value, _OnStream):
                value, event = value.value, value.done
        if event is not None:
            stream = torch.cuda.current_stream()
            stream.wait_event(event)
            _record_stream(value, stream)      # the allocator must not recycle it early
        return value


DONE = Ticket()


@dataclass
class _OnStream:
    """What a threaded CUDA job returns: its value and the event its copies complete at."""
    value: object
    done: torch.cuda.Event


def _record_stream(value, stream):
    if isinstance(value, torch.Tensor) and value.is_cuda:
        value.record_stream(stream)
    elif isinstance(value, dict):
        for v in value.values():
            _record_stream(v, stream)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _record_stream(v, stream)


class Lane:
    """An ordered copy queue: a CUDA stream, or worker threads (CPU compute, disk I/O).

    Jobs submitted with the same key run in submission order: each starts after the previous
    job of its key has finished, its copies included. key=None is one key for the whole lane,
    so a lane used without keys is a queue, like a stream. On a lane with several threads, jobs
    with different keys may run at the same time (the engine's store lane keys by home: stores
    to different homes overlap, two stores to one home never swap).
    """

    def __init__(self, name: str, compute: torch.device, threads: int = 1, threaded=False):
        """threaded: run copies on worker threads even on CUDA (disk I/O, and device-to-host
        stores, which block the issuing thread until they land)."""
        self.name, self.compute = name, compute
        cuda = compute.type == "cuda"
        self.stream = torch.cuda.Stream(compute) if cuda else None
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix=name) \
            if (not cuda or threaded or threads > 1) else None
        self.pending: list[Future] = []
        self._last: dict = {}            # key -> the future of its latest job

    def submit(self, fn, *args, key=None) -> Ticket:
        """Run fn(*args) on the lane after the compute work issued so far and after the jobs
        submitted earlier with the same key."""
        self.pending = [f for f in self.pending if not f.done()]
        ready = None
        if self.stream is not None:
            ready = torch.cuda.Event()
            ready.record()                            # inputs produced by compute so far
        if self.pool is None:                         # one stream: in order by construction
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(ready)
                value = fn(*args)
                done = torch.cuda.Event()
                done.record(self.stream)
            return Ticket(value, done)
        # A job waits only for an earlier one, which the pool (first in, first out) has already
        # handed to a thread: waiting cannot deadlock.
        future = self.pool.submit(self._job, self._last.get(key), ready, fn, args)
        self._last[key] = future
        self.pending.append(future)
        return Ticket(future=future)

    def _job(self, before: Future | None, ready, fn, args):
        """fn(*args) on a worker thread, after `before` (its key's previous job)."""
        earlier = _outcome(before)
        if self.stream is None:
            return _in_inference_mode(fn, args)
        stream = _thread_stream(self.compute)
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            if isinstance(earlier, _OnStream):
                stream.wait_event(earlier.done)       # its copies, not just its issuing
            value = _in_inference_mode(fn, args)
            done = torch.cuda.Event()
            done.record(stream)
        return _OnStream(value, done)

    def drain(self):
        """Wait for everything submitted so far; re-raises a copy's error."""
        pending, self.pending, self._last = self.pending, [], {}
        for f in pending:
            f.result()

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(wait=True)


def _outcome(future: Future | None):
    """The result of a finished-or-running job once it is done (None if it failed: its own
    ticket reports the error)."""
    if future is None:
        return None
    try:
        return future.result()
    except Exception:
        return None


_local = threading.local()


def _in_inference_mode(fn, args):
    """Worker threads do not inherit the caller's inference mode (it is thread-local)."""
    with torch.inference_mode():
        return fn(*args)


def _thread_stream(device):
    """Each worker thread issues its copies on a stream of its own."""
    if getattr(_local, "stream", None) is None:
        _local.stream = torch.cuda.Stream(device)
    return _local.stream


class Traffic:
    """Bytes moved per link ("cpu->gpu", "disk->gpu", "gpu->cpu", ...); copy lanes add from
    their threads."""

    def __init__(self):
        self.bytes = defaultdict(int)
        self._lock = threading.Lock()

    def add(self, src: str, dst: str, nbytes: int):
        if src != dst and nbytes:
            with self._lock:
                self.bytes[f"{src}->{dst}"] += nbytes

    def as_dict(self) -> dict:
        return dict(sorted(self.bytes.items()))


# ------------------------------------------------------------------------------ KV buffers
# What a KV buffer's state is: its core tensors and counters, and the fields its policy
# declared (kv.Field). Nothing else moves: constants are shared, indices are rebuilt.
COUNTERS = ("used", "ring_start", "cursor")


def load_into(work: KVBuffer, home: KVBuffer) -> int:
    """Copy a home buffer (any tier, K/V possibly 4-bit compressed) into a working buffer of
    the same shape on the compute device: every slot, the counters and the declared state.
    -> bytes read from the home."""
    for name in ("k", "v"):
        value = getattr(home, name)
        if isinstance(value, Packed4bit):
            value = dequantize_4bit(value.to(work.device, non_blocking=True))
        getattr(work, name).copy_(value, non_blocking=True)
    for mine, value in zip(work.tensors()[2:], home.tensors()[2:]):
        mine.copy_(value, non_blocking=True)
    state = _copy_state(work.policy_state, home.policy_state, home.fields, non_blocking=True)
    for name in COUNTERS:
        setattr(work, name, getattr(home, name))
    work.layer, work.constants, work.dirty = home.layer, home.constants, []
    work.lossy_home = isinstance(home.k, Packed4bit)
    return home.nbytes() + state


def store_into(home: KVBuffer, work: KVBuffer) -> int:
    """Write a working buffer back to its home: K/V only where they changed, everything else
    whole (scores, positions and policy state are a few bytes per slot). -> bytes copied."""
    moved = 0
    for mine, value in zip(home.tensors()[2:], work.tensors()[2:]):
        mine.copy_(value)
        moved += value.numel() * value.element_size()
    moved += _copy_state(home.policy_state, work.policy_state, home.fields)
    for name in COUNTERS:
        setattr(home, name, getattr(work, name))
    for slots in ([slice(None)] if work.dirty is None else work.dirty):
        if isinstance(slots, torch.Tensor):            # one slot per row: (..., rows)
            src, dst = (slots, work.rows_index), (slots.to(home.device), home.rows_index)
        else:
            src = dst = slots
        for mine, value in ((home.k, work.k), (home.v, work.v)):
            moved += _assign(mine, dst, value[src])
    work.dirty = []
    return moved


def _copy_state(dst: dict, src: dict, fields, non_blocking: bool = False) -> int:
    """Declared policy state src -> dst (same fields): tensors copied in place, host values
    (immutable by contract) and tensors that stay home (`Field.home`) assigned. -> bytes
    copied."""
    moved = 0
    stays = {f.name for f in fields if f.home}
    for name, value in src.items():
        if isinstance(value, torch.Tensor) and name not in stays:
            dst[name].copy_(value, non_blocking=non_blocking)
            moved += value.numel() * value.element_size()
        else:
            dst[name] = value
    return moved


def _assign(dst, index, src: torch.Tensor) -> int:
    """dst[index] = src, for a tensor or 4-bit codes (src quantised first) -> bytes written."""
    if isinstance(dst, Packed4bit):
        p = quantize_4bit(src, group=dst.group, dim=-1)
        parts = ((dst.data, p.data), (dst.scale, p.scale), (dst.min, p.min))
    else:
        parts = ((dst, src),)
    for d, s in parts:
        d[index] = s.to(d.device)
    return sum(s.numel() * s.element_size() for _, s in parts)
