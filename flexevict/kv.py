"""The per-layer KV buffer: preallocated once per `generate`, never grown or concatenated.

Layout (sequence-major, like FlexGen): K and V are `(capacity + 1, rows, head_dim)` with
`rows = batch * kv_heads` (row `b * kv_heads + h`). Per slot and row: an fp32 `score` (what
score-based policies accumulate), an int32 absolute `pos` (-1 = empty) and a `valid` flag (empty
and padding slots are never attended). Slot `capacity` is the scratch slot: once the committed
slots are full, the token being decoded is written there, attended, and then committed by the
policy into a victim slot (or dropped). Until then, it goes straight into the next free slot.
"""
from __future__ import annotations

import torch


class KVBuffer:
    def __init__(self, capacity: int, rows: int, head_dim: int, dtype, device):
        n = capacity + 1
        self.capacity = capacity
        self.k = torch.zeros(n, rows, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(n, rows, head_dim, dtype=dtype, device=device)
        self.score = torch.zeros(n, rows, dtype=torch.float32, device=device)
        self.pos = torch.full((n, rows), -1, dtype=torch.int32, device=device)
        self.valid = torch.zeros(n, rows, dtype=torch.bool, device=device)
        self.used = 0        # committed slots filled (the same for every row)

    @property
    def scratch(self) -> int:
        return self.capacity

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.k, self.v, self.score, self.pos, self.valid))

    def store_prompt(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                     valid: torch.Tensor) -> None:
        """Put a prompt's K/V into slots [0, S). k, v: (S, rows, d); pos, valid: (S, rows)."""
        s = k.shape[0]
        if s > self.capacity:
            raise ValueError(f"prompt of {s} tokens does not fit {self.capacity} slots")
        self.k[:s].copy_(k)
        self.v[:s].copy_(v)
        self.pos[:s].copy_(pos)
        self.valid[:s].copy_(valid)
        self.score[:s].zero_()
        self.used = s

    def incoming_slot(self) -> int:
        """Where the token being decoded goes before attention: the next free slot, or scratch."""
        return self.used if self.used < self.capacity else self.scratch

    def write(self, slot: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Write one token for every row. k, v: (rows, d); pos: (rows,)."""
        self.k[slot].copy_(k)
        self.v[slot].copy_(v)
        self.pos[slot].copy_(pos)
        self.valid[slot] = True
        self.score[slot] = 0.0

    def attended(self, slot: int) -> int:
        """Number of leading slots attention reads when the new token sits in `slot`."""
        return max(self.used, slot + 1)

    def commit_appended(self, slot: int) -> None:
        """The token written to a free slot stays there."""
        if slot == self.used:
            self.used += 1

    def commit_to(self, victims: torch.Tensor) -> None:
        """Move the scratch token into `victims` (rows,) per row; victim == scratch drops it."""
        rows = torch.arange(victims.numel(), device=victims.device)
        for t in (self.k, self.v, self.score, self.pos, self.valid):
            t[victims, rows] = t[self.scratch, rows]
        self.valid[self.scratch] = False
