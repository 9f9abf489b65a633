"""4-bit asymmetric group quantisation (FlexGen's scheme), reference and dispatch.

Every `group` (default 64) consecutive elements along one dim share a minimum and a scale;
each element is stored as a 4-bit code, x ~= code * scale + min, code = round((x - min) / scale)
in [0, 15], scale = (max - min) / 15. Two codes per byte: element 2i of a group in the low
nibble, 2i + 1 in the high one. A dim whose size is not a multiple of `group` is padded by
repeating its last element (so the last group's range is its own, unlike FlexGen's zero
padding). Any dim can be grouped; the CUDA kernel works in place of a transpose.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flexevict.core.kernels import ext

LEVELS = 15
GROUP = 64              # elements per group by default (FlexGen's): weights and the KV cache
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Packed4bit:
    """A tensor x quantised to 4 bits in groups along `dim`.

    data: uint8, x's shape with `dim` -> groups * group // 2 (two codes per byte)
    min, scale: x's dtype, x's shape with `dim` -> groups (groups = ceil(size / group))
    shape: x's shape; dim: the grouped dim (non-negative); group: elements per group
    """
    data: torch.Tensor
    min: torch.Tensor
    scale: torch.Tensor
    shape: torch.Size
    dim: int
    group: int

    @property
    def dtype(self) -> torch.dtype:
        return self.min.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.min, self.scale))

    def to(self, device, non_blocking: bool = False) -> "Packed4bit":
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return Packed4bit(move(self.data), move(self.min), move(self.scale), self.shape,
                          self.dim, self.group)


def _layout(shape, dim: int):
    """x viewed as (outer, length, inner) around `dim`."""
    outer = 1
    for s in shape[:dim]:
        outer *= s
    inner = 1
    for s in shape[dim + 1:]:
        inner *= s
    return outer, shape[dim], inner


def _check(x: torch.Tensor, group: int, dim: int) -> int:
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOATS:
        raise ValueError(f"quantize_4bit: x must be a float32/float16/bfloat16 tensor (got "
                         f"{getattr(x, 'dtype', type(x).__name__)})")
    if not isinstance(group, int) or group < 2 or group % 2:
        raise ValueError(f"quantize_4bit: group must be an even int >= 2 (got {group!r})")
    if x.dim() == 0 or not -x.dim() <= dim < x.dim():
        raise ValueError(f"quantize_4bit: dim {dim} is out of range for a {x.dim()}-d tensor")
    return dim % x.dim()


def quantize_4bit(x: torch.Tensor, group: int = GROUP, dim: int = -1) -> Packed4bit:
    """Quantise x (any shape, float32/16, bfloat16) in groups of `group` along `dim`."""
    dim = _check(x, group, dim)
    outer, length, inner = _layout(x.shape, dim)
    groups = -(-length // group)
    data_shape = (*x.shape[:dim], groups * group // 2, *x.shape[dim + 1:])
    stat_shape = (*x.shape[:dim], groups, *x.shape[dim + 1:])
    module = ext.module_for(x)
    if module is None:
        return _quantize_reference(x, group, dim, data_shape, stat_shape)
    data, mins, scales = module.quantize_4bit(x.contiguous(), outer, length, inner, group,
                                              ext.stream(x))
    return Packed4bit(data.view(data_shape), mins.view(stat_shape), scales.view(stat_shape),
                      x.shape, dim, group)


def dequantize_4bit(p: Packed4bit) -> torch.Tensor:
    """The tensor a Packed4bit stands for, in its original shape and dtype."""
    if not isinstance(p, Packed4bit):
        raise ValueError(f"dequantize_4bit: expected a Packed4bit (got {type(p).__name__})")
    module = ext.module_for(p.data)
    if module is None:
        return _dequantize_reference(p)
    outer, length, inner = _layout(p.shape, p.dim)
    out = module.dequantize_4bit(p.data.contiguous(), p.min.contiguous(), p.scale.contiguous(),
                                 outer, length, inner, p.group, ext.stream(p.data))
    return out.view(p.shape)


def _quantize_reference(x, group, dim, data_shape, stat_shape) -> Packed4bit:
    xt = x.movedim(dim, -1).float()                                  # (..., length)
    length = xt.shape[-1]
    pad = -length % group
    if pad and length:                                              # repeat the last element
        xt = torch.cat([xt, xt[..., -1:].expand(*xt.shape[:-1], pad)], dim=-1)
    g = xt.reshape(*xt.shape[:-1], -1, group)                        # (..., groups, group)
    low = g.amin(dim=-1, keepdim=True)
    # divided by a tensor, not a Python number: torch's CUDA division by a scalar multiplies by
    # its reciprocal, one rounding off the kernel's (and the CPU's) true division
    spread = g.amax(dim=-1, keepdim=True) - low
    scale = (spread / torch.full_like(spread, LEVELS)).to(x.dtype)
    step = scale.float()
    codes = torch.where(step > 0, ((g - low) / step).round().clamp(0, LEVELS), 0.0)
    codes = codes.to(torch.uint8).flatten(-2)
    data = codes[..., 0::2] | (codes[..., 1::2] << 4)
    back = lambda t, shape: t.movedim(-1, dim).contiguous().view(shape)   # noqa: E731
    return Packed4bit(back(data, data_shape), back(low.squeeze(-1).to(x.dtype), stat_shape),
                      back(scale.squeeze(-1), stat_shape), x.shape, dim, group)


def _dequantize_reference(p: Packed4bit) -> torch.Tensor:
    data = p.data.movedim(p.dim, -1)
    codes = torch.stack([data & 0xF, data >> 4], dim=-1).flatten(-2).float()
    codes = codes.view(*codes.shape[:-1], -1, p.group)               # (..., groups, group)
    low = p.min.movedim(p.dim, -1).float().unsqueeze(-1)
    scale = p.scale.movedim(p.dim, -1).float().unsqueeze(-1)
    x = (codes * scale + low).flatten(-2)[..., :p.shape[p.dim]]
    return x.to(p.dtype).movedim(-1, p.dim).contiguous()
