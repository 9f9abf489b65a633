"""Memory tiers and the copy engine the block schedule runs on.

Tiers: "gpu" (the compute device), "cpu" (host memory, pinned when the compute device is a GPU
and pinning is asked for) and "disk" (files under the offload directory, memory-mapped).

Copies run on lanes. On a CUDA device a lane is a CUDA stream: copies are enqueued without
blocking and a `Ticket` carries the event that marks their completion; the consumer's stream
waits on that event (no device-wide synchronize). Without CUDA, and for anything that reads or
writes disk, a lane is a pool of worker threads and the ticket is a future. Either way a lane
preserves the order of what is submitted to it, like a stream.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .errors import UserError


class Tiers:
    """Allocates zeroed tensors in a tier. `compute` is the compute device."""

    def __init__(self, compute: torch.device, offload_dir: str, pin: bool):
        self.compute = compute
        self.pin = pin and compute.type == "cuda"
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
            return torch.zeros(shape, dtype=dtype, pin_memory=True)
        return torch.zeros(shape, dtype=dtype, device=self.device(tier))

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
                try:
                    os.makedirs(self.offload_dir, exist_ok=True)
                    self._run_dir = tempfile.mkdtemp(prefix="run-", dir=self.offload_dir)
                except OSError as e:
                    raise UserError(f"--offload-dir {self.offload_dir}: cannot create it "
                                    f"({e.strerror}); give a writable directory") from None
            self._files += 1
            path = os.path.join(self._run_dir, f"t{self._files}.bin")
        numel = 1
        for s in shape:
            numel *= s
        nbytes = max(numel * torch.empty((), dtype=dtype).element_size(), 1)
        try:
            with open(path, "wb") as f:
                f.truncate(nbytes)                       # sparse file, reads as zeros
            t = torch.from_file(path, shared=True, size=max(numel, 1), dtype=dtype)
        except OSError as e:
            raise UserError(f"--offload-dir {self.offload_dir}: cannot write {path} "
                            f"({e.strerror}); free disk space or choose another directory") from None
        return t[:numel].view(shape)

    def close(self):
        if self._run_dir is not None:
            shutil.rmtree(self._run_dir, ignore_errors=True)
            self._run_dir = None


class Ticket:
    """Completion of a submitted copy: `wait()` makes the current stream (or thread) wait for it
    and returns the copy's result."""

    def __init__(self, value=None, event=None, future: Future | None = None):
        self.value, self.event, self.future = value, event, future

    def wait(self):
        if self.future is not None:
            self.value, self.event = self.future.result(), None
            if isinstance(self.value, tuple) and len(self.value) == 2 and \
                    isinstance(self.value[1], torch.cuda.Event):
                self.value, self.event = self.value
            self.future = None
        if self.event is not None:
            stream = torch.cuda.current_stream()
            stream.wait_event(self.event)
            _record_stream(self.value, stream)     # the allocator must not recycle it early
            self.event = None
        return self.value


DONE = Ticket()


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
    """An ordered copy queue: a CUDA stream, or worker threads (CPU compute, disk I/O)."""

    def __init__(self, name: str, compute: torch.device, threads: int = 1, threaded=False):
        """threaded: run copies on worker threads even on CUDA (disk I/O, and device-to-host
        stores, which block the issuing thread until they land)."""
        self.name, self.compute = name, compute
        cuda = compute.type == "cuda"
        self.stream = torch.cuda.Stream(compute) if cuda else None
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix=name) \
            if (not cuda or threaded or threads > 1) else None
        self.pending: list[Future] = []

    def submit(self, fn, *args) -> Ticket:
        """Run fn(*args) on the lane after the compute work issued so far."""
        self.pending = [f for f in self.pending if not f.done()]
        if self.stream is None:                       # CPU: a worker thread
            self.pending.append(self.pool.submit(_in_inference_mode, fn, args))
            return Ticket(future=self.pending[-1])
        ready = torch.cuda.Event()
        ready.record()                                # inputs produced by compute so far
        if self.pool is None:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(ready)
                value = fn(*args)
                done = torch.cuda.Event()
                done.record(self.stream)
            return Ticket(value, done)
        self.pending.append(self.pool.submit(self._threaded, ready, fn, args))
        return Ticket(future=self.pending[-1])

    def _threaded(self, ready, fn, args):
        stream = _thread_stream(self.compute)
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            value = _in_inference_mode(fn, args)
            done = torch.cuda.Event()
            done.record(stream)
        return value, done

    def drain(self):
        """Wait for everything submitted so far; re-raises a copy's error."""
        pending, self.pending = self.pending, []
        for f in pending:
            f.result()

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(wait=True)


_local = threading.local()


def _in_inference_mode(fn, args):
    """Worker threads do not inherit the caller's inference mode (it is thread-local)."""
    with torch.inference_mode():
        return fn(*args)


def _thread_stream(device):
    if getattr(_local, "stream", None) is None:
        _local.stream = torch.cuda.Stream(device)
    return _local.stream


class Traffic:
    """Bytes moved per link ("cpu->gpu", "disk->gpu", "gpu->cpu", ...), counted at submit time."""

    def __init__(self):
        self.bytes = defaultdict(int)
        self._lock = threading.Lock()

    def add(self, src: str, dst: str, nbytes: int):
        if src != dst and nbytes:
            with self._lock:
                self.bytes[f"{src}->{dst}"] += nbytes

    def as_dict(self) -> dict:
        return dict(sorted(self.bytes.items()))
