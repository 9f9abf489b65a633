"""Seeded, approximately normal random numbers, the same bits on every device: dummy weights.

The numbers are a pure function of (key, index), so a tensor can be made in any number of
pieces, in parallel, on the CPU or on a GPU, and come out bit-identical:

    word j     = splitmix64(splitmix64(key) + j * gamma)                    (64-bit, wrapping)
    element 2j = the sum of the four bytes of word j's low 32 bits, element 2j + 1 of its high
                 32 bits: Irwin-Hall with n = 4 on 0..255, an integer in [0, 1020] with mean
                 510 and standard deviation sqrt(21845) = 147.8 (bounded by 3.45 sigma)
    value      = float32(sum - 510) * float32(scale / 147.8) + float32(base), then rounded
                 once (to nearest even) to the tensor's dtype; `+ base` only when base != 0

Every step is integer arithmetic that wraps the same way everywhere, an exact int -> float32
conversion, or a correctly rounded IEEE float32 operation: no transcendental function whose last
bit could differ between CPU and CUDA. One 64-bit hash makes two elements (the scheme before
this one spent a hash on each, as four 16-bit lanes): half the work, 1021 distinct values
instead of 262141, the same distribution family (Irwin-Hall n = 4, kurtosis 2.7).

On a CPU the numbers are made with numpy (unsigned 64-bit arithmetic, no masks for logical
shifts, lower per-call overhead than torch) in cache-sized chunks, on torch.get_num_threads()
threads, each chunk's byte sums turned into the tensor's dtype by one gather from a table of
the 1021 values they can take; elsewhere with the same steps in torch int64 (`_fill_torch`,
which also runs on a CPU and is tested against the numpy path there).
"""
from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

# splitmix64's constants ("Fast splittable pseudorandom number generators", Steele, Lea and
# Flood, OOPSLA 2014, section 3)
_GAMMA, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_U64 = (1 << 64) - 1
_BYTES = 0x00FF00FF00FF00FF        # bytes 0, 2, 4, 6 of a word, each in its own 16-bit lane
MEAN, STD = 510, (4 * (256 ** 2 - 1) / 12) ** 0.5    # of the sum of four uniform bytes

SCHEME = "bytes4"          # names the scheme above; in the weight cache's key (io/weights.py)
CPU_CHUNK = 1 << 15       # elements per numpy step: temporaries stay in L2
DEVICE_CHUNK = 1 << 22    # elements per torch step on a GPU: ~100 MB of temporaries at most
CPU_BLOCK = 1 << 21       # elements per CPU thread task (a multiple of the chunk)


def splitmix64(x: int) -> int:
    """splitmix64's output mix of a 64-bit value (Python ints; the reference for both paths)."""
    x &= _U64
    x = ((x ^ (x >> 30)) * _MIX1) & _U64
    x = ((x ^ (x >> 27)) * _MIX2) & _U64
    return x ^ (x >> 31)


def _i64(x: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits (what torch can hold)."""
    x &= _U64
    return x - (1 << 64) if x >> 63 else x


def seeded_normal(key: int, numel: int, device="cpu", scale: float = 1.0, base: float = 0.0,
                  chunk: int | None = None, dtype=torch.float32) -> torch.Tensor:
    """(numel,) tensor of `dtype` on `device` ~ base + scale * N(0, 1), approximately (the
    scheme in the module docstring), bit-identical on every device, for every chunk size and
    thread count. key: any Python int (wrapped to 64 bits). chunk (elements, rounded up to
    even): how much one step makes, which bounds the temporaries (8 bytes per element pair).
    """
    out = torch.empty(numel, dtype=dtype, device=device)
    mul = float(np.float32(scale / STD))      # exact in float32, so every device rounds alike
    add = float(np.float32(base))
    fill = _fill_cpu if out.device.type == "cpu" else _fill_torch
    default = CPU_CHUNK if out.device.type == "cpu" else DEVICE_CHUNK
    chunk = max(2, chunk or default)
    fill(out, splitmix64(key), mul, add, chunk + (chunk & 1))
    return out


# ------------------------------------------------------------------ CPU: numpy, on threads

def _fill_cpu(out: torch.Tensor, start: int, mul: float, add: float, chunk: int) -> None:
    """Fill out (numel,) on the CPU in blocks of CPU_BLOCK elements, on as many threads as torch
    may use (numpy releases the GIL inside each step)."""
    block = max(chunk, CPU_BLOCK // chunk * chunk)
    fill = functools.partial(_fill_block, out, start, mul, add, chunk, block)
    starts = range(0, out.numel(), block)
    threads = min(torch.get_num_threads(), len(starts))
    if threads <= 1:
        for lo in starts:
            fill(lo)
        return
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fill, starts))          # list(): re-raises a worker's exception


def _fill_block(out: torch.Tensor, start: int, mul: float, add: float, chunk: int, block: int,
                lo: int) -> None:
    """Elements [lo, lo + block) of out, chunk elements (chunk / 2 words) at a time."""
    u64 = np.uint64
    hi = min(lo + block, out.numel())
    words = np.arange(min(chunk, hi - lo) // 2 + 1, dtype=u64) * u64(_GAMMA)   # j * gamma
    z, t = np.empty_like(words), np.empty_like(words)
    table, target = _values(out.dtype, mul, add), _bits(out)
    for a in range(lo, hi, chunk):
        n = min(chunk, hi - a)
        w = (n + 1) // 2
        np.add(words[:w], u64((start + a // 2 * _GAMMA) & _U64), out=z[:w])
        np.take(table, _byte_sums_np(z[:w], t[:w])[:n], out=target[a:a + n],
                mode="clip")           # in range already; "raise" would buffer `out`


@functools.lru_cache(maxsize=64)
def _values(dtype: torch.dtype, mul: float, add: float) -> np.ndarray:
    """The value of each byte sum 0..1020 as `_bits` holds it: float32(s - MEAN) * mul (+ add)
    in float32, rounded once to dtype (to nearest even), the scheme's last steps made 1021 times
    instead of once per element (one gather per element then writes the dtype directly)."""
    v = np.arange(4 * 255 + 1, dtype=np.float32)
    v -= np.float32(MEAN)
    v *= np.float32(mul)
    if add:
        v += np.float32(add)
    return _bits(torch.from_numpy(v).to(dtype))


def _bits(out: torch.Tensor) -> np.ndarray:
    """out's memory as numpy sees it: float32, or the raw 16 bits of a half or bfloat16 (numpy
    has no bfloat16)."""
    if out.dtype == torch.float32:
        return out.numpy()
    if out.element_size() == 2:
        return out.view(torch.int16).numpy().view(np.uint16)
    raise ValueError(f"seeded_normal makes float32, float16 or bfloat16 (got {out.dtype})")


def _byte_sums_np(z: np.ndarray, t: np.ndarray) -> np.ndarray:
    """splitmix64's mix of each uint64 in z, then the sum of the four bytes of each 32-bit
    half: (2w,) uint32 (a view of t), low half first. z, t: (w,) uint64 scratch."""
    u64 = np.uint64
    for shift, mul in ((30, _MIX1), (27, _MIX2), (31, None)):
        np.right_shift(z, u64(shift), out=t)
        z ^= t
        if mul is not None:
            z *= u64(mul)                                       # wraps mod 2**64
    np.right_shift(z, u64(8), out=t)
    t &= u64(_BYTES)
    z &= u64(_BYTES)
    t += z                        # 16-bit lanes L0..L3 = b0+b1, b2+b3, b4+b5, b6+b7
    t *= u64(0x10001)             # t + (t << 16): lane 1 = L0+L1, lane 3 = L2+L3, no carries
    halves = t.view(np.uint32)
    halves >>= np.uint32(16)      # contiguous: a strided uint16 view converts 5x slower
    return halves


# ------------------------------------------------------------------ any device: torch

def _fill_torch(out: torch.Tensor, start: int, mul: float, add: float, chunk: int) -> None:
    """The same numbers with torch int64 ops on out's device, chunk elements at a time."""
    n_all = out.numel()
    words = torch.arange(min(chunk, n_all) // 2 + 1, dtype=torch.int64, device=out.device)
    words.mul_(_i64(_GAMMA))                   # int64 multiplication wraps on CPU and CUDA
    for a in range(0, n_all, chunk):
        n = min(chunk, n_all - a)
        z = words[:(n + 1) // 2] + _i64(start + a // 2 * _GAMMA)
        piece = _byte_sums_torch(z)[:n].to(torch.float32).sub_(MEAN).mul_(mul)
        if add:
            piece.add_(add)
        out[a:a + n].copy_(piece)


def _byte_sums_torch(z: torch.Tensor) -> torch.Tensor:
    """`_byte_sums_np` on an int64 tensor (z consumed) -> (2w,) int32, low half first. torch's
    `>>` on int64 is arithmetic, so the hash's shifts are masked to be logical; the byte sums
    need no mask (the top byte is masked off first, and every lane stays below 2**15)."""
    for shift, mul in ((30, _MIX1), (27, _MIX2), (31, None)):
        z.bitwise_xor_((z >> shift).bitwise_and_((1 << (64 - shift)) - 1))
        if mul is not None:
            z.mul_(_i64(mul))
    t = (z >> 8).bitwise_and_(_BYTES)
    t.add_(z.bitwise_and_(_BYTES)).mul_(0x10001)        # wraps past bit 63 like uint64
    return t.view(torch.int32) >> 16                    # little-endian on CPU and CUDA
