"""CUDA graphs for the steady decode steps of an evicting run with everything on one GPU.

Why: at OPT-6.7B a decode step launches about a thousand small kernels, and Python dispatch
costs more than the GPU work they do (the first H200 run: 18 ms per step against a 5.4 ms memory
floor). A graph launches a captured step's kernels in one call.

When a step can be replayed: once every KV buffer is full, a step's launches depend only on
the buffers' host-side state (their int attributes: fill count, ...) and on tensor contents.
So graphs are kept per distinct host state (`host_state`). The one counter that moves every
step, a ring policy's cursor, is kept on the device for a graphed run
(`KVBuffer.keep_cursor_on_device`): the commits read and advance it there, so it is no part of
the host state and one graph serves every ring position. Replay runs no Python, so the host
state a step leaves behind is recorded at capture and set again after each replay, and each
ring cursor the step advanced is advanced on the host too (its mirror).

What a policy must do to allow it (`Policy.graph_safe`): its decode hooks change buffer
tensors in place only (a tensor reassigned during a step would be the capture's, not the
replay's: `capture` refuses it), keep all other state in the buffers' int/float/bool/str
attributes, and never synchronise with the host (a capture cannot).

Graphs share one memory pool: replays run one at a time on one stream, so a graph's
intermediates may reuse another's; each graph's outputs stay allocated with it.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

HOST_TYPES = (int, float, bool, str, type(None))


def host_state(bufs) -> tuple:
    """The host-side state of KV buffers: per buffer, its scalar attributes, the scalar values
    of its policy state, and the addresses of its tensors (a step must not reassign them)."""
    return tuple(_buffer_state(b) for b in bufs)


def _buffer_state(buf) -> tuple:
    mirrored = {"cursor"} if buf.cursor_at is not None else set()    # the device's is read
    attrs = tuple((k, v) for k, v in vars(buf).items()
                  if isinstance(v, HOST_TYPES) and k not in mirrored)
    fields = tuple((k, v) for k, v in buf.policy_state.items() if isinstance(v, HOST_TYPES))
    tensors = [*buf.tensors(), *buf.policy_state.values()]
    return attrs, fields, tuple(t.data_ptr() for t in tensors if isinstance(t, torch.Tensor))


def set_host_state(bufs, state: tuple) -> None:
    """Put back the scalar state `host_state` read (the addresses are checked, not set)."""
    for buf, (attrs, fields, _) in zip(bufs, state):
        for k, v in attrs:
            setattr(buf, k, v)
        buf.policy_state.update(fields)


def cursors(bufs) -> list[int | None]:
    """The host ring cursors of the buffers that own one (a stacked layer's is its stack's)."""
    return [b.cursor if b.stack is None else None for b in bufs]


def restore_cursors(bufs, saved: list[int | None]) -> None:
    for b, c in zip(bufs, saved):
        if c is not None:
            b.cursor = c


def copy_into(dst, src) -> None:
    """Copy step inputs (tensors, tuples of them, dataclasses of them; None stays None) into
    the static ones a graph reads."""
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            copy_into(d, s)
    elif dataclasses.is_dataclass(dst):
        for f in dataclasses.fields(dst):
            copy_into(getattr(dst, f.name), getattr(src, f.name))


def clone_inputs(x):
    """Static copies of step inputs (the structure of `copy_into`)."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, (tuple, list)):
        return type(x)(clone_inputs(t) for t in x)
    if dataclasses.is_dataclass(x):
        return dataclasses.replace(x, **{f.name: clone_inputs(getattr(x, f.name))
                                         for f in dataclasses.fields(x)})
    return x


class CaptureFailed(Exception):
    """A step could not be captured; nothing of it ran, and the buffers are as before it."""


@dataclasses.dataclass
class Captured:
    graph: object           # .replay() runs the step's kernels
    outputs: object         # what the step returned at capture, rewritten by each replay
    after: tuple            # the host state the step leaves
    advanced: tuple         # per buffer: the step advanced its ring cursor (on the device)


class DecodeGraphs:
    """One run's decode-step graphs. `step(bufs, inputs, body)` runs body(inputs) -> outputs:
    eagerly on the capture stream the first time (libraries allocate their workspaces there
    before any capture), then from the graph of the buffers' host state, captured on first
    sight. Counts: `captures`, `replays`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.graphs: dict[tuple, Captured] = {}
        self.static = None              # the inputs every graph reads, copied in per step
        self.captures = self.replays = 0
        self._warm = False
        self._stream = torch.cuda.Stream(device)
        self._pool = torch.cuda.graph_pool_handle()

    @staticmethod
    def supports(device: torch.device) -> bool:
        return device.type == "cuda"

    def step(self, bufs, inputs, body: Callable):
        if not self._warm:
            self._warm = True
            for b in bufs:
                b.keep_cursor_on_device()
            return self._eager(body, inputs)
        key = host_state(bufs)
        if self.static is None:
            self.static = clone_inputs(inputs)
        else:
            copy_into(self.static, inputs)
        captured = self.graphs.get(key)
        if captured is None:             # its Python ran: the host is at the step's after
            captured = self.capture(bufs, key, body)
        else:
            for b, moved in zip(bufs, captured.advanced):
                if moved:
                    b.cursor = b.next_cursor()
        captured.graph.replay()
        set_host_state(bufs, captured.after)
        self.replays += 1
        return captured.outputs

    def capture(self, bufs, key: tuple, body: Callable) -> Captured:
        """Capture body(static inputs) from host state `key`; its kernels run at the replay
        that follows (the Python ran here, so the host state is already the step's after)."""
        before = cursors(bufs)
        try:
            graph, outputs = self._record(body)
        except RuntimeError as e:        # e.g. an op the capture does not allow: no kernel
            set_host_state(bufs, key)    # ran, so putting the host state back undoes the step
            restore_cursors(bufs, before)
            raise CaptureFailed(str(e).splitlines()[0]) from e
        after = host_state(bufs)
        if [a[2] for a in after] != [b[2] for b in key]:
            raise RuntimeError("a decode step reassigned a KV buffer tensor, which a CUDA graph "
                               "cannot replay: the policy is not graph_safe (change its "
                               "tensors in place), or run with --cuda-graphs false")
        advanced = tuple(c is not None and b.cursor != c for b, c in zip(bufs, before))
        captured = self.graphs[key] = Captured(graph, outputs, after, advanced)
        self.captures += 1
        return captured

    def _eager(self, body: Callable, inputs):
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            out = body(inputs)
        current.wait_stream(self._stream)
        return out

    def _record(self, body: Callable):
        """-> (graph, outputs): body(static inputs) captured, not run."""
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            graph.capture_begin(pool=self._pool)
            try:
                outputs = body(self.static)
            finally:
                graph.capture_end()
        current.wait_stream(self._stream)
        return graph, outputs
