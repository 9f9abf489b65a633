"""CUDA graphs for the steady decode steps of an evicting run with everything on one GPU.

Why: at OPT-6.7B a decode step launches about a thousand small kernels, and Python dispatch
costs more than the GPU work they do (the first H200 run: 18 ms per step against a 5.4 ms memory
floor). A graph launches a captured step's kernels in one call.

When a step can be replayed: a step's launches depend only on the buffers' host-side state
(their int attributes: fill count, ...) and on tensor contents. So graphs are kept per
distinct host state (`host_state`). The counters that move every step are kept on the device
for a graphed run (`KVBuffer.keep_counters_on_device`): a ring policy's cursor, which the
commits read and advance there, and a filling buffer's fill count, where the new token is
written and counted. Neither is part of the host state; beside it, a graph is keyed by a
filling buffer's attention span (`spans`: the fill rounded up to `FILL_SPAN` slots). So one
graph serves every ring position, and one every FILL_SPAN steps of a filling buffer. Replay
runs no Python, so the host state a step leaves behind is recorded at capture and set again
after each replay, and each counter the step moved is moved on the host too (its mirror). A
policy whose host-held state moves every step by its rules alone (BUZZ's counts, which say
when a pass runs and the fill count after it) names it (`KVBuffer.mirrored`): it is left out
of the key like the counters, and the policy moves it after each replay
(`KVBuffer.replay_host`), its device-side results (the fill count after a pass) having been
kept on the device by the replayed kernels.

What a policy must do to allow it (`Policy.graph_safe`): its decode hooks change buffer
tensors in place only (a tensor reassigned during a step would be the capture's, not the
replay's: `capture` refuses it), keep all other state in the buffers' int/float/bool/str
attributes, and never synchronise with the host (a capture cannot). Steps of a buffer that
still fills are replayed only for a policy whose hooks leave the new token to `KVBuffer.write`
and `commit_appended` (`Policy.graph_safe_filling`: `full`); others run them eagerly. Every
GPU step of a filling buffer attends over its span, graphed or not, so replays give the eager
bits.

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
    mirrored = {name for name, kept in (("cursor", buf.cursor_at), ("used", buf.used_at))
                if kept is not None}                                  # the device's is read
    attrs = tuple((k, v) for k, v in vars(buf).items()
                  if isinstance(v, HOST_TYPES) and k not in mirrored)
    fields = tuple((k, v) for k, v in buf.policy_state.items()
                   if isinstance(v, HOST_TYPES) and k not in buf.mirrored)
    tensors = [*buf.tensors(), *buf.policy_state.values()]
    return attrs, fields, tuple(t.data_ptr() for t in tensors if isinstance(t, torch.Tensor))


def set_host_state(bufs, state: tuple) -> None:
    """Put back the scalar state `host_state` read (the addresses are checked, not set)."""
    for buf, (attrs, fields, _) in zip(bufs, state):
        for k, v in attrs:
            setattr(buf, k, v)
        buf.policy_state.update(fields)


def spans(bufs) -> tuple:
    """The attention spans of the buffers that keep their fill count on the device: with
    `host_state`, what a step's launches depend on."""
    return tuple(b.attended(b.incoming_slot()) for b in bufs if b.used_at is not None)


def mirrors(bufs) -> list[tuple | None]:
    """The host mirrors (cursor, used, the policy's own `KVBuffer.mirrored` values) of the
    buffers that own their counters (a stacked layer's are its stack's)."""
    return [(b.cursor, b.used, tuple(b.policy_state[f] for f in b.mirrored))
            if b.stack is None else None for b in bufs]


def restore_mirrors(bufs, saved: list[tuple | None]) -> None:
    for b, m in zip(bufs, saved):
        if m is not None:
            b.cursor, b.used = m[:2]
            b.policy_state.update(zip(b.mirrored, m[2]))


def moved_mirrors(bufs, before: list[tuple | None]) -> tuple:
    """Per buffer, which device-kept counters a step moved: (cursor advanced, token appended),
    or "policy" where the policy moves its mirrors itself (`KVBuffer.replay_host`)."""
    return tuple(m is not None and ("policy" if b.replay_host is not None else
                                    (b.cursor_at is not None and b.cursor != m[0],
                                     b.used_at is not None and b.used != m[1]))
                 for b, m in zip(bufs, before))


def advance_mirrors(bufs, moved: tuple) -> None:
    """Move the host mirrors as a replayed step moved the device's counters."""
    for b, m in zip(bufs, moved):
        if m == "policy":
            b.replay_host(b)
            continue
        if m and m[0]:
            b.cursor = b.next_cursor()
        if m and m[1]:
            b.used += 1


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
    moved: tuple            # per buffer: the device counters the step moved (moved_mirrors)


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
                b.keep_counters_on_device()
            return self._eager(body, inputs)
        state = host_state(bufs)
        key = state, spans(bufs)
        if self.static is None:
            self.static = clone_inputs(inputs)
        else:
            copy_into(self.static, inputs)
        captured = self.graphs.get(key)
        fresh = captured is None
        if fresh:                        # its Python ran: the host is at the step's after
            captured = self.graphs[key] = self.capture(bufs, state, body)
        captured.graph.replay()
        set_host_state(bufs, captured.after)
        if not fresh:
            advance_mirrors(bufs, captured.moved)
        self.replays += 1
        return captured.outputs

    def capture(self, bufs, state: tuple, body: Callable) -> Captured:
        """Capture body(static inputs) from host state `state`; its kernels run at the replay
        that follows (the Python ran here, so the host state is already the step's after)."""
        before = mirrors(bufs)
        try:
            graph, outputs = self._record(body)
        except RuntimeError as e:        # e.g. an op the capture does not allow: no kernel
            set_host_state(bufs, state)  # ran, so putting the host state back undoes the step
            restore_mirrors(bufs, before)
            raise CaptureFailed(str(e).splitlines()[0]) from e
        after = host_state(bufs)
        if [a[2] for a in after] != [b[2] for b in state]:
            raise RuntimeError("a decode step reassigned a KV buffer tensor, which a CUDA graph "
                               "cannot replay: the policy is not graph_safe (change its "
                               "tensors in place), or run with --cuda-graphs false")
        self.captures += 1
        return Captured(graph, outputs, after, moved_mirrors(bufs, before))

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
