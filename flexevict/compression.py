"""FlexGen's 4-bit compression: asymmetric min-max quantisation in groups of 64 along the last
dimension, two 4-bit codes per byte, an fp scale and minimum per group.

Weights are compressed once at load and stay compressed in their tier and across the link;
they are decompressed on the compute device right before use. A compressed KV cache keeps its
K/V codes in the home buffer and is decompressed into the working buffer attention reads.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 64
LEVELS = 15                          # 4 bits


@dataclass
class Packed4:
    """codes (..., G, GROUP/2) uint8; scale, low (..., G, 1); n = the last dim's true size."""
    codes: torch.Tensor
    scale: torch.Tensor
    low: torch.Tensor
    n: int

    def to(self, device, non_blocking: bool = False) -> "Packed4":
        mv = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return Packed4(mv(self.codes), mv(self.scale), mv(self.low), self.n)

    def map(self, fn) -> "Packed4":
        """Apply fn to every tensor (e.g. place it in a tier)."""
        return Packed4(fn(self.codes), fn(self.scale), fn(self.low), self.n)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.low))


def quantize(x: torch.Tensor, group: int = GROUP) -> Packed4:
    """x (..., n) float -> Packed4 with ceil(n / group) groups per row (the last is padded
    with its row's last value, which leaves min and max unchanged)."""
    n = x.shape[-1]
    pad = -n % group
    xf = x.float()
    if pad:
        xf = torch.cat([xf, xf[..., -1:].expand(*xf.shape[:-1], pad)], dim=-1)
    xf = xf.view(*x.shape[:-1], -1, group)
    low = xf.amin(dim=-1, keepdim=True)
    scale = (xf.amax(dim=-1, keepdim=True) - low) / LEVELS
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))   # a constant group codes 0
    q = ((xf - low) / safe).round_().clamp_(0, LEVELS).to(torch.uint8)
    codes = q[..., 0::2] | (q[..., 1::2] << 4)
    return Packed4(codes, scale.to(x.dtype), low.to(x.dtype), n)


def dequantize(p: Packed4) -> torch.Tensor:
    """Packed4 -> (..., n) in the scale's dtype."""
    q = torch.stack([p.codes & 0xF, p.codes >> 4], dim=-1).flatten(-2)   # (..., G, group)
    x = q.to(p.scale.dtype) * p.scale + p.low
    return x.flatten(-2)[..., :p.n]
