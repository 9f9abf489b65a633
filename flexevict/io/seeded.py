"""Seeded, approximately normal random numbers, the same bits on every device: dummy weights.

The numbers are a pure function of (key, index), so a tensor can be made in any number of
pieces, in parallel, on the CPU or on a GPU, and come out bit-identical. Scheme "tables2":

    A, B       two fixed tables of centred byte sums, TABLE_A = 1,048,573 and TABLE_B =
               1,048,571 entries (both prime): entry e of a table with seed s is the sum of
               the four bytes of the 32-bit half e % 2 of the word
               splitmix64(splitmix64(s) + (e // 2) * gamma), minus 510 (Irwin-Hall with
               n = 4 on 0..255: an integer in [-510, 510], standard deviation 147.8)
    start      h = splitmix64(key): a0 = h mod TABLE_A, b0 = (h >> 32) mod TABLE_B
    element i  = dtype(float32(a + b)) with a = float32(A[(a0 + i) mod TABLE_A]) * mul + base
               and b = float32(B[(b0 + i) mod TABLE_B]) * mul, mul = float32(scale / STD),
               each step one correctly rounded IEEE float32 operation (`+ base` only when
               base != 0), the last a rounding to the tensor's dtype (to nearest even)

So each element is the sum of two independent Irwin-Hall n = 4 draws: Irwin-Hall n = 8 over
bytes, mean `base`, standard deviation `scale` (STD = 147.8 * sqrt(2)), bounded by 4.88 sigma,
kurtosis 2.85. Every tensor is a window of one cycle of TABLE_A * TABLE_B = 1.1e12 elements,
starting at a place its key's hash picks; elements TABLE_A apart share their A term.

Why tables: making an element is then one float32 add of two streamed, cache-friendly reads
(the tables are scaled once per (scale, base)), where hashing each pair of elements cost about
a dozen passes of 64-bit integer arithmetic: 4-7x faster on a CPU (bench/dummy_weights.py).
The hash is spent only on the two tables, once per process. No step is a transcendental
function whose last bit could differ between CPU and CUDA, and every device runs the same torch
ops on the same table bits.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

# splitmix64's constants ("Fast splittable pseudorandom number generators", Steele, Lea and
# Flood, OOPSLA 2014, section 3)
_GAMMA, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_U64 = (1 << 64) - 1
_BYTES = 0x00FF00FF00FF00FF        # bytes 0, 2, 4, 6 of a word, each in its own 16-bit lane
TABLE_A, TABLE_B = 1_048_573, 1_048_571        # primes: the cycle is their product
SEED_A, SEED_B = 1, 2
STD = (8 * (256 ** 2 - 1) / 12) ** 0.5     # of A + B: eight uniform bytes' sum, 209.0

SCHEME = "tables2"        # names the scheme above; in the weight cache's key (io/weights.py)
CPU_CHUNK = 1 << 18       # elements per add on a CPU: amortizes the call, split over threads
DEVICE_CHUNK = 1 << 20    # elements per add on a GPU: tables of 8 MB, 16 MB a (scale, base)


def splitmix64(x: int) -> int:
    """splitmix64's output mix of a 64-bit value (Python ints)."""
    x &= _U64
    x = ((x ^ (x >> 30)) * _MIX1) & _U64
    x = ((x ^ (x >> 27)) * _MIX2) & _U64
    return x ^ (x >> 31)


def seeded_normal(key: int, numel: int, device="cpu", scale: float = 1.0, base: float = 0.0,
                  chunk: int | None = None, dtype=torch.float32) -> torch.Tensor:
    """(numel,) tensor of `dtype` on `device` ~ base + scale * N(0, 1), approximately (the
    scheme in the module docstring), bit-identical on every device, for every chunk size and
    thread count. key: any Python int (wrapped to 64 bits). chunk: elements per add, which
    bounds the table padding (4 bytes per element, per table).
    """
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"seeded_normal makes float32, float16 or bfloat16 (got {dtype})")
    out = torch.empty(numel, dtype=dtype, device=device)
    chunk = max(1, chunk or (CPU_CHUNK if out.device.type == "cpu" else DEVICE_CHUNK))
    mul = float(np.float32(scale / STD))      # exact in float32, so every device rounds alike
    a, b = _tables(mul, float(np.float32(base)), str(out.device), chunk)
    h = splitmix64(key)
    i, j = h % TABLE_A, (h >> 32) % TABLE_B          # where this key's window starts
    for x in range(0, numel, chunk):                  # on a CPU torch splits each add on threads
        n = min(chunk, numel - x)
        torch.add(a[i:i + n], b[j:j + n], out=out[x:x + n])   # float32 sum, rounded to dtype
        i, j = (i + n) % TABLE_A, (j + n) % TABLE_B
    return out


@functools.lru_cache(maxsize=8)
def _tables(mul: float, base: float, device: str, chunk: int) -> tuple[torch.Tensor, ...]:
    """The two tables scaled as the scheme says (float32, made on the CPU so every device gets
    the same bits), each padded with its own first `chunk` entries (cyclically) so that no
    chunk's window wraps: (TABLE_A + chunk,), (TABLE_B + chunk,) on device.
    A model uses a handful of (scale, base) pairs, so the cache holds them all."""
    a = torch.from_numpy(table(SEED_A, TABLE_A).astype(np.float32)) * mul
    if base:
        a += base
    b = torch.from_numpy(table(SEED_B, TABLE_B).astype(np.float32)) * mul
    return tuple(_pad_cyclic(t, chunk).to(device) for t in (a, b))


def _pad_cyclic(t: torch.Tensor, extra: int) -> torch.Tensor:
    """t (n,) followed by its first `extra` entries, cyclically: (n + extra,)."""
    return t.repeat(1 + -(-extra // t.numel()))[:t.numel() + extra]


@functools.lru_cache(maxsize=2)
def table(seed: int, n: int) -> np.ndarray:
    """(n,) int16: the scheme's table with this seed, centred byte sums in [-510, 510]."""
    u64 = np.uint64
    words = (n + 1) // 2
    z = np.arange(words, dtype=u64) * u64(_GAMMA) + u64(splitmix64(seed))    # wraps mod 2**64
    sums = _byte_sums(z, np.empty_like(z))[:n].astype(np.int16)
    return sums - np.int16(510)


def _byte_sums(z: np.ndarray, t: np.ndarray) -> np.ndarray:
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
    halves >>= np.uint32(16)
    return halves
