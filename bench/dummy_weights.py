"""How fast dummy weights are made: the generator before and after the two-elements-per-hash
scheme (flexevict/io/seeded.py), and torch.randn for scale, side by side in one run, in GB/s of
the tensor made (its numel times its dtype's bytes; best of --repeats).

    python bench/dummy_weights.py                      # 4096x4096 and 7168x28672, fp32 and fp16
    python bench/dummy_weights.py --device cuda        # the same on a GPU (the torch path)

`before` is the previous generator, kept here only to compare with: one splitmix64 hash per
element, its four 16-bit lanes summed, in torch int64 ops on 32K-element chunks, then cast to
the dtype. `torch.randn` (float32, then cast) is not device-independent and is not what the
engine uses: it is here as the yardstick a user would compare with.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from flexevict.io.seeded import seeded_normal, splitmix64
from flexevict.runtime.machine import run_metadata

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_GAMMA, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_LANES = 0x0000FFFF0000FFFF


def _i64(x: int) -> int:
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >> 63 else x


def before(key: int, numel: int, device, dtype, scale: float) -> torch.Tensor:
    """The previous seeded_normal (one hash per element), cast to dtype as its caller did."""
    chunk = 1 << 15 if torch.device(device).type == "cpu" else 1 << 22
    steps = torch.arange(min(chunk, numel), dtype=torch.int64, device=device).mul_(_i64(_GAMMA))
    out = torch.empty(numel, dtype=torch.float32, device=device)
    mul = float(np.float32(scale / ((2 ** 32 - 1) / 3) ** 0.5))
    for lo in range(0, numel, chunk):
        piece = out[lo:lo + chunk]
        z = steps[:piece.numel()] + _i64(splitmix64(key) + lo * _GAMMA)
        for shift, m in ((30, _MIX1), (27, _MIX2), (31, None)):
            z.bitwise_xor_((z >> shift).bitwise_and_((1 << (64 - shift)) - 1))
            if m is not None:
                z.mul_(_i64(m))
        pairs = (z >> 16).bitwise_and_(_LANES)
        pairs.add_(z.bitwise_and_(_LANES))
        total = (pairs >> 32).add_(pairs.bitwise_and_(0xFFFFFFFF))
        piece.copy_(total).sub_(131070).mul_(mul)
    return out.to(dtype)


def after(key: int, numel: int, device, dtype, scale: float) -> torch.Tensor:
    return seeded_normal(key, numel, device, scale, dtype=dtype)


def randn(key: int, numel: int, device, dtype, scale: float) -> torch.Tensor:
    g = torch.Generator(device).manual_seed(key)
    return torch.randn(numel, generator=g, device=device).mul_(scale).to(dtype)


GENERATORS = {"before": before, "torch.randn": randn, "after": after}


def gb_per_s(make, numel: int, device, dtype, repeats: int) -> float:
    """The best of `repeats` runs of make(...), in GB/s of the tensor it returns."""
    best = float("inf")
    for r in range(repeats):
        t0 = time.perf_counter()
        t = make(r + 1, numel, device, dtype, 0.02)
        if t.device.type == "cuda":
            torch.cuda.synchronize(t.device)
        best = min(best, time.perf_counter() - t0)
        del t
    return numel * torch.empty((), dtype=dtype).element_size() / best / 1e9


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="4096x4096,7168x28672",
                   help="comma-separated ROWSxCOLS (default 4096x4096,7168x28672)")
    p.add_argument("--dtypes", default="float32,float16",
                   help=f"comma-separated, of {', '.join(DTYPES)} (default float32,float16)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads, which the new generator uses (default: torch's)")
    p.add_argument("--repeats", type=int, default=3, help="runs per cell, best kept (default 3)")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the rows to OUT")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    print(f"GB/s of the tensor made, best of {args.repeats}, on {args.device}, "
          f"{torch.get_num_threads()} torch thread(s)")
    print(f"{'shape':>12} {'dtype':>9} " + " ".join(f"{g:>11}" for g in GENERATORS)
          + "  after/before")
    for shape in args.shapes.split(","):
        numel = int(np.prod([int(x) for x in shape.split("x")]))
        for name in args.dtypes.split(","):
            rates = {g: gb_per_s(make, numel, args.device, DTYPES[name], args.repeats)
                     for g, make in GENERATORS.items()}
            rows.append({"shape": shape, "dtype": name, "gb_per_s": rates})
            print(f"{shape:>12} {name:>9} " + " ".join(f"{v:11.2f}" for v in rates.values())
                  + f"  {rates['after'] / rates['before']:11.1f}x", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "threads": torch.get_num_threads(),
                       "run": run_metadata(args.device)}, f, indent=1)


if __name__ == "__main__":
    main()
