"""The per-layer KV buffer: preallocated once per `generate`, never grown or concatenated.

Layout (sequence-major, like FlexGen): K and V are `(slots, rows, head_dim)` with
`rows = batch * kv_heads` (row `b * kv_heads + h`). Per slot and row: an fp32 `score` (what
score-based policies accumulate), an int32 absolute `pos` (-1 = empty), a `valid` flag (empty
and padding slots are never attended) and `state`, an fp32 scratchpad a policy may use (EMA,
counters, value norms).

Slots `[0, capacity)` hold committed tokens; slot `capacity` (the last) is the scratch slot.
While committed slots are free, a decoded token goes straight into the next one; once they are
full it is written to scratch, attended, and committed by the policy. Ring policies split the
committed slots into a pinned prefix `[0, ring_start)` and a circular recent queue
`[ring_start, capacity)` whose oldest entry sits at `cursor`.

A policy that keeps more than `score` and `state` declares it (`Policy.fields`, a tuple of
`Field`): the buffer allocates each declared tensor with the same allocator as K and V, and
offloading (`flexevict.runtime.offload.load_into` / `store_into`) moves exactly the core
tensors, the counters and the declared fields. The buffer's regions are its `Layout`, which the
policy resolves once per run (`Policy.layout`) and which never changes. Constants a policy
derives from its arguments and the layer (HashEvict's projection) are not state: `constant`
makes them once per buffer family and device, and they never travel.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Layout:
    """How a run's budget divides every buffer of the run (frozen; `Policy.layout` makes it).

    slots: per (sequence, kv-head) row, the scratch slot included (`capacity` = slots - 1
    committed); evicts: slots < prompt_len + gen_len; prefix, ring: a ring policy's pinned
    prefix and recent queue (prefix + ring = capacity; 0, 0 otherwise); rope_in_cache: LLaMA
    keys are cached before RoPE and rotated by in-cache rank. Policies with more regions
    (BUZZ, Cascade) extend it."""
    slots: int
    evicts: bool = False
    prefix: int = 0
    ring: int = 0
    rope_in_cache: bool = False
    prompt_len: int = 0
    gen_len: int = 0

    @property
    def capacity(self) -> int:
        return self.slots - 1

    @property
    def home_tokens(self) -> int:
        """Tokens of K/V per row a policy keeps with the cache's home besides the buffer
        (recall's history); memory plans count them. 0 by default."""
        return 0

    @property
    def written_per_step(self) -> int:
        """K/V slots per row a decode step writes (and a lossless cache home stores back): the
        new token's, and recall's recalled region. The cost model prices the store by it."""
        return 1

    def held(self, steps: int) -> list[int]:
        """Tokens an unpadded row holds after the prefill and after each of `steps` decode
        steps: every token, up to the capacity. Decode step i attends held[i - 1] + 1 (the
        new token too), so its time grows with it: the cost model and the benchmark's
        projection of unmeasured steps read it. BUZZ's middle saws (`BuzzLayout`)."""
        return [min(self.prompt_len + i, self.capacity) for i in range(steps + 1)]

    def attended_per_step(self, steps: int) -> list[int]:
        """Tokens decode steps 1 .. steps attend, the new one's included (`held`)."""
        return [n + 1 for n in self.held(max(steps - 1, 0))][:steps]

    def describe(self) -> dict:
        """The resolved budget as printed by every CLI and JSON result."""
        d = {"slots": self.slots}
        if self.ring:
            d.update(prefix=self.prefix, ring=self.ring, scratch=1)
        return d


KV = "kv"               # a Field's dtype: the buffer's K/V dtype
FILL_SPAN = 256          # slots a filling buffer's step attends in one bucket on a GPU: one
                         # CUDA graph per 256 steps, at most 255 masked slots read (`attended`)
SPAN_DEVICES = ("cuda",)  # where: every GPU path alike (graphed or not, any cache home), so a
                          # GPU's output never depends on them; a CPU attends the exact fill


@dataclass(frozen=True)
class Field:
    """One piece of per-buffer policy state.

    A tensor: `shape` holds ints and the names "slots" (every slot, scratch included), "rows"
    and "d" (the head dim), `dtype` its type (KV: the K/V dtype), zero-filled. A host value
    (`dtype` None): a Python value the policy replaces (never mutates in place), starting as
    `init`.
    home: the tensor lives with the buffer's home in the cache tier and is never copied: a
    working buffer on the compute device refers to its home's tensor (recall's history)."""
    name: str
    shape: tuple = ()
    dtype: torch.dtype | str | None = None
    init: object = None
    home: bool = False

    def allocate(self, sizes: dict, device, alloc, kv_dtype=None):
        """sizes: the buffer's "slots", "rows" and "d"."""
        if self.dtype is None:
            return self.init
        size = tuple(sizes.get(x, x) for x in self.shape)
        return alloc(size, kv_dtype if self.dtype == KV else self.dtype, device)


def zeros(shape, dtype, device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


Allocator = Callable[[tuple, torch.dtype, "torch.device | str"], torch.Tensor]


@dataclass(frozen=True)
class Memory:
    """Where a buffer's tensors live: `device`, made by `alloc(shape, dtype, device)` -> a zeroed
    tensor (the offloading engine passes pinned or file-backed allocators, which may ignore
    `device`: tensors made here follow the allocated metadata, so a CPU or disk home indexes on
    the CPU whatever the compute device is); `kv_alloc`: the same for K and V, when they are to
    live elsewhere (None: alloc)."""
    device: torch.device | str
    alloc: Allocator = zeros
    kv_alloc: Allocator | None = None


class KVBuffer:
    stack: "KVBuffer | None" = None    # LayerRows: the buffer holding every layer's rows
    # the K/V this buffer carries between steps come back through a lossy home (a 4-bit
    # compressed cache), not bit for bit as written: set by each load (recall copies its
    # pages again rather than keep them)
    lossy_home: bool = False
    # a policy whose host-held state moves every step by its rules alone (BUZZ's counts, and
    # with them the fill count) names that state in `policy_state` and gives the host's part of
    # a decode step: a graphed run keeps the counters on the device, replays a step without its
    # Python, and then moves these host mirrors by `replay_host(buf)` (runtime/graphs.py)
    mirrored: tuple[str, ...] = ()
    replay_host: "Callable[[KVBuffer], None] | None" = None

    def __init__(self, layout: Layout, rows: int, head_dim: int, dtype, where: Memory | str,
                 kv_heads: int = 1, layer: int = 0, fields: tuple[Field, ...] = ()):
        """layout: the run's regions (`capacity` = layout.slots - 1 committed slots + scratch);
        where: a `Memory`, or just a device (ordinary zeroed tensors there); fields: the
        policy's declared state (`Field`). `constants` starts empty: a working copy of another
        layer's buffer shares that buffer's dict (see `constant`)."""
        memory = where if isinstance(where, Memory) else Memory(where)
        n, device, alloc = layout.slots, memory.device, memory.alloc
        self.layout = layout
        self.kv_heads = kv_heads  # rows = batch * kv_heads, row b * kv_heads + h
        self.layer = layer        # lets a policy keep per-layer constants (HashEvict's projection)
        self.head_dim, self.dtype = head_dim, dtype
        kv_alloc = memory.kv_alloc or alloc
        self.k = kv_alloc((n, rows, head_dim), dtype, device)
        self.v = kv_alloc((n, rows, head_dim), dtype, device)
        self.score = alloc((n, rows), torch.float32, device)
        self.state = alloc((n, rows), torch.float32, device)
        self.pos = alloc((n, rows), torch.int32, device)
        self.pos.fill_(-1)
        self.valid = alloc((n, rows), torch.bool, device)
        self.used = 0            # committed slots filled (the same for every row)
        self.ring_start = 0      # ring policies: first slot of the recent queue
        self.cursor = 0          # ring policies: slot of the oldest recent token
        self.cursor_at: torch.Tensor | None = None   # `cursor` on the device, where kept there
        self.used_at: torch.Tensor | None = None     # `used` on the device, where kept there
        self.rows_index = torch.arange(rows, device=self.valid.device)
        self.dirty: list | None = None   # K/V slots written since the last store (None: all)
        self.fields = fields
        sizes = {"slots": n, "rows": rows, "d": head_dim}
        self.policy_state = {f.name: f.allocate(sizes, device, alloc, dtype) for f in fields}
        self.constants: dict = {}   # (name, device) -> a per-layer constant (`constant`)

    def layers(self, count: int) -> list["LayerRows"]:
        """This buffer's rows as `count` equal consecutive blocks, one per layer: views that
        share this buffer's counters (`LayerRows`). A stack is made with `layer` None: it
        has no per-layer constants."""
        rows = self.valid.shape[1] // count
        return [LayerRows(self, j, j * rows, (j + 1) * rows) for j in range(count)]

    def constant(self, name: str, make):
        """A policy constant for this layer on this buffer's device: make(device) once per
        device; shared (not copied) by every buffer given the same `constants` dict."""
        key = (name, str(self.score.device))
        if key not in self.constants:
            self.constants[key] = make(self.score.device)
        return self.constants[key]

    @property
    def capacity(self) -> int:
        """Committed slots, `[0, capacity)`; the scratch slot is `capacity`."""
        return self.layout.capacity

    @property
    def scratch(self) -> int:
        return self.capacity

    def tensors(self):
        return (self.k, self.v, self.score, self.state, self.pos, self.valid)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() if isinstance(t, torch.Tensor) else t.nbytes
                   for t in self.tensors())          # K/V may be 4-bit codes (Packed4bit)

    @property
    def device(self) -> torch.device:
        return self.k.device

    # ------------------------------------------------------------------ dirty tracking
    # An offloaded cache is copied to the compute device whole (it is budget-sized) but written
    # back only where K/V changed: the slots written or moved into since the last store.
    def mark(self, slots) -> None:
        """K/V changed at `slots`: an int (every row) or an index tensor (..., rows)."""
        if self.dirty is not None:
            self.dirty.append(slots)

    def touch_all(self) -> None:
        """K/V changed anywhere (prefill, compaction): the next store copies everything."""
        self.dirty = None

    # ------------------------------------------------------------------ prompt
    def store_prompt(self, k, v, pos, valid, score=None, keep: torch.Tensor | None = None):
        """Store prompt tokens. k, v: (S, rows, d); pos, valid, score: (S, rows).

        keep (n, rows) selects, per row, which prompt slots to store (in order) into slots
        [0, n); default: every token. Rows are left-aligned first (real tokens before pads),
        so every policy sees a row's real tokens at slots [0, n_real).
        """
        order = left_aligned(valid)
        if keep is not None:
            order = order.gather(0, keep)
        n = order.shape[0]
        if n > self.capacity:
            raise ValueError(f"{n} prompt tokens do not fit {self.capacity} slots")
        k, v, pos, valid, score = gather_prompt(order, k, v, pos, valid, score)
        self.k[:n], self.v[:n], self.pos[:n], self.valid[:n] = k, v, pos, valid
        self.score[:n] = score if score is not None else 0.0
        self.state[:n] = 0.0
        self.used = n
        self.touch_all()

    # ------------------------------------------------------------------ decode
    def incoming_slot(self) -> int:
        """Where the token being decoded goes before attention: the next free slot, or scratch."""
        return self.used if self.used < self.capacity else self.scratch

    def write(self, slot: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Write one token for every row. k, v: (rows, d); pos: (rows,). The next free slot is
        indexed by `used_at` where the fill count is kept on the device (a graphed step)."""
        self.mark(slot)
        if not self._appends_on_device(slot):
            self.k[slot], self.v[slot], self.pos[slot] = k, v, pos
            self.valid[slot], self.score[slot], self.state[slot] = True, 0.0, 0.0
            return
        at = self.used_at
        for t, value in ((self.k, k), (self.v, v), (self.pos, pos)):
            t.index_copy_(0, at, value.unsqueeze(0))
        for t, value in ((self.valid, True), (self.score, 0.0), (self.state, 0.0)):
            t.index_fill_(0, at, value)

    def attended(self, slot: int) -> int:
        """Number of leading slots attention reads when the new token sits in `slot`. On a GPU
        a filling buffer's span is rounded up to `FILL_SPAN` slots (those past the new token
        are invalid, so masked): the span, not the fill count, then shapes the step, so one
        CUDA graph serves FILL_SPAN filling steps, and an eager step attends as a graphed one
        does (the same bits)."""
        n = max(self.used, slot + 1)
        if not self._appends(slot) or self.device.type not in SPAN_DEVICES:
            return n
        return min(self.capacity, -(-n // FILL_SPAN) * FILL_SPAN)

    def _appends(self, slot: int) -> bool:
        """The token in `slot` is appended: it takes the next free slot of a filling buffer."""
        return slot == self.used < self.capacity

    def _appends_on_device(self, slot: int) -> bool:
        """The token in `slot` is appended at the fill count kept on the device."""
        return self.used_at is not None and self._appends(slot)

    def commit_appended(self, slot: int) -> None:
        """The token written to a free slot stays there."""
        if self._appends_on_device(slot):
            self.used_at.add_(1)
        if slot == self.used:
            self.used += 1

    def move(self, src: torch.Tensor | int, dst: torch.Tensor | int) -> None:
        """Per row, copy slot src[r] into slot dst[r] (all per-slot state travels along). A
        slot given as an int is the same for every row: a plain slice, with no gather, and
        int to int is one copy."""
        rows = self.rows_index
        for t in self.tensors():
            if isinstance(dst, int):
                t[dst] = t[src] if isinstance(src, int) else t[src, rows]
            else:    # a slice read would alias the slots written (index_put refuses that)
                t[dst, rows] = t[src].clone() if isinstance(src, int) else t[src, rows]
        self.mark(dst)

    def replace(self, victims: torch.Tensor) -> None:
        """Commit the scratch token into `victims` (rows,); a victim equal to scratch drops it."""
        self.move(self.scratch, victims)
        self.valid[self.scratch] = False

    def keep_counters_on_device(self) -> None:
        """Keep the ring cursor on the buffer's device as well (`cursor_at`, (1,) int64), where
        the ring's commits read and advance it, and, while the buffer fills (or whenever its
        policy moves the fill count itself, `replay_host`: BUZZ's passes), the fill count
        (`used_at`), where a new token is written and counted: a decode step's launches then no
        longer depend on their host values, so one CUDA graph serves every ring position and
        `FILL_SPAN` filling steps (runtime/graphs.py). `cursor` and `used` stay their host
        mirrors. One element, not a 0-dim tensor: torch reads a 0-dim index on the host (a GPU
        sync), and indexes with a (1,) one on the device."""
        if self.cursor_at is None:
            self.cursor_at = torch.full((1,), self.cursor, dtype=torch.int64, device=self.device)
        if self.used_at is None and (self.used < self.capacity or self.replay_host is not None):
            self.used_at = torch.full((1,), self.used, dtype=torch.int64, device=self.device)

    def ring_cursor(self) -> torch.Tensor | int:
        """The ring's oldest slot as a commit indexes it: `cursor_at` where kept, else `cursor`."""
        return self.cursor if self.cursor_at is None else self.cursor_at

    def ring_commit(self, victims: torch.Tensor) -> None:
        """Commit the scratch token into the recent queue.

        victims (rows,): a prefix slot, or `cursor` (the oldest recent token). The oldest recent
        token moves into a prefix victim (so it survives as a heavy hitter), the scratch token
        takes its ring slot, and the cursor advances.
        """
        self.move(self.ring_cursor(), victims)   # no-op on rows whose victim is the cursor
        self.ring_push()

    def ring_push(self) -> None:
        """The scratch token replaces the ring's oldest (at `cursor`), and the cursor advances:
        a sliding window's commit, and the second half of `ring_commit`."""
        self.move(self.scratch, self.ring_cursor())
        self.valid[self.scratch] = False
        self.advance_cursor()

    def advance_cursor(self) -> None:
        """The ring's next oldest slot (ring_commit here, and the commit kernels after theirs),
        on the host and, where it is kept there, on the device."""
        self.cursor = self.next_cursor()
        if self.cursor_at is not None:    # (c + 1 - ring_start) mod ring + ring_start
            ring = self.capacity - self.ring_start
            self.cursor_at.sub_(self.ring_start - 1).remainder_(ring).add_(self.ring_start)

    def next_cursor(self) -> int:
        """The slot after `cursor`, wrapping from the last committed slot to ring_start."""
        return self.cursor + 1 if self.cursor + 1 < self.capacity else self.ring_start


def _shared(name: str) -> property:
    """A counter of `LayerRows` that lives on its stack."""
    return property(lambda self: getattr(self.stack, name),
                    lambda self, value: setattr(self.stack, name, value))


class LayerRows(KVBuffer):
    """Layer `layer`'s rows [start, stop) of `stack`, a buffer holding every layer's rows
    (`KVBuffer.layers`). Its tensors and declared state are views of the stack's; its
    counters (`used`, `ring_start`, `cursor` and their device copies) are the stack's, since
    every layer is at the same point of a token step: per-layer work (writing the new token,
    attention, a policy's `before_attention` and `observe`) reads them, and only a prefill
    (every layer setting the same values) or the stack's commit, once per step, moves them."""
    used, ring_start, cursor = _shared("used"), _shared("ring_start"), _shared("cursor")
    cursor_at, used_at = _shared("cursor_at"), _shared("used_at")

    def __init__(self, stack: KVBuffer, layer: int, start: int, stop: int):
        if any(not isinstance(v, torch.Tensor) for v in stack.policy_state.values()):
            raise ValueError("a policy with host-held state cannot stack its layers")
        self.stack, self.layout, self.layer = stack, stack.layout, layer
        self.kv_heads, self.head_dim, self.dtype = stack.kv_heads, stack.head_dim, stack.dtype
        for name in ("k", "v", "score", "state", "pos", "valid"):
            setattr(self, name, getattr(stack, name)[:, start:stop])
        self.rows_index = torch.arange(stop - start, device=self.valid.device)
        self.dirty, self.fields, self.constants = None, stack.fields, {}
        self.policy_state = {f.name: stack.policy_state[f.name].narrow(
            f.shape.index("rows"), start, stop - start) for f in stack.fields}


def left_aligned(valid: torch.Tensor) -> torch.Tensor:
    """Per row (column), slot order that puts real tokens first: (S, rows) int64 indices."""
    return torch.sort((~valid).to(torch.int8), dim=0, stable=True).indices


def gather_prompt(order: torch.Tensor, k, v, pos, valid, scores=None):
    """Prompt tensors reordered along slots, per row, by order (n, rows).

    k, v: (S, rows, d); pos, valid, scores: (S, rows) -> the same with n slots."""
    take = lambda t: t.gather(0, order.unsqueeze(-1).expand(-1, -1, t.shape[-1]))  # noqa: E731
    return (take(k), take(v), pos.gather(0, order), valid.gather(0, order),
            None if scores is None else scores.gather(0, order))
