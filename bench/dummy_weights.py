"""How fast dummy weights are made: the generator before and after the two-tables scheme
(flexevict/io/seeded.py), and torch.randn for scale, side by side in one run, in GB/s of the
tensor made (its numel times its dtype's bytes; best of --repeats).

    python bench/dummy_weights.py                      # 4096x4096 and 7168x28672, fp32 and fp16
    python bench/dummy_weights.py --device cuda        # the same on a GPU
    python bench/dummy_weights.py --model opt-1.3b     # also every tensor of a model, in turn

`before` is the previous scheme ("bytes4"), kept here only to compare with: one splitmix64
hash per two elements, each element the sum of four of its bytes, made with numpy in 32K-element
chunks on the CPU, each chunk's byte sums turned into the dtype by one gather from a table of
the 1021 values they can take (measured on a CPU only; a GPU ran the same steps in torch int64).
`torch.randn` (float32, then cast) is not device-independent and is not what the engine uses:
it is here as the yardstick a user would compare with.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from flexevict.core.config import registry_config
from flexevict.io.seeded import _byte_sums, seeded_normal, splitmix64
from flexevict.runtime.machine import run_metadata

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_GAMMA = 0x9E3779B97F4A7C15
_STD4 = (4 * (256 ** 2 - 1) / 12) ** 0.5


def before(key: int, numel: int, device, dtype, scale: float) -> torch.Tensor:
    """The previous seeded_normal ("bytes4") on the CPU, on one thread (its small numpy steps
    held the GIL long enough that a second thread gained nothing)."""
    u64, chunk = np.uint64, 1 << 15
    out = torch.empty(numel, dtype=dtype)
    target = out.numpy() if dtype == torch.float32 else out.view(torch.int16).numpy()
    values = (np.arange(1021, dtype=np.float32) - np.float32(510)) * np.float32(scale / _STD4)
    table = torch.from_numpy(values).to(dtype)
    table = table.numpy() if dtype == torch.float32 else table.view(torch.int16).numpy()
    words = np.arange(chunk // 2, dtype=u64) * u64(_GAMMA)
    z, t = np.empty_like(words), np.empty_like(words)
    start = splitmix64(key)
    for a in range(0, numel, chunk):
        n = min(chunk, numel - a)
        w = (n + 1) // 2
        np.add(words[:w], u64((start + a // 2 * _GAMMA) % 2 ** 64), out=z[:w])
        np.take(table, _byte_sums(z[:w], t[:w])[:n], out=target[a:a + n], mode="clip")
    return out


def after(key: int, numel: int, device, dtype, scale: float) -> torch.Tensor:
    return seeded_normal(key, numel, device, scale, dtype=dtype)


def randn(key: int, numel: int, device, dtype, scale: float) -> torch.Tensor:
    g = torch.Generator(device).manual_seed(key)
    return torch.randn(numel, generator=g, device=device).mul_(scale).to(dtype)


GENERATORS = {"before": before, "torch.randn": randn, "after": after}


def gb_per_s(make, numels: list[int], device, dtype, repeats: int) -> float:
    """The best of `repeats` runs of make(...) for each of numels in turn, in GB/s of the
    tensors it returns. One small tensor first, untimed: the new scheme's tables are made
    once per process and scale, which a model's first tensor pays (tens of milliseconds)."""
    make(0, 1024, device, dtype, 0.02)
    best = float("inf")
    for r in range(repeats):
        t0 = time.perf_counter()
        for i, numel in enumerate(numels):
            t = make(r * len(numels) + i + 1, numel, device, dtype, 0.02)
            del t
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return sum(numels) * torch.empty((), dtype=dtype).element_size() / best / 1e9


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="4096x4096,7168x28672",
                   help="comma-separated ROWSxCOLS (default 4096x4096,7168x28672)")
    p.add_argument("--dtypes", default="float32,float16",
                   help=f"comma-separated, of {', '.join(DTYPES)} (default float32,float16)")
    p.add_argument("--model", default=None,
                   help="also a registry model's every tensor, one after another (its "
                        "DummyWeights scales aside: the same 0.02 for all)")
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
    generators = {g: make for g, make in GENERATORS.items()
                  if g != "before" or torch.device(args.device).type == "cpu"}
    print(f"{'shape':>12} {'dtype':>9} " + " ".join(f"{g:>11}" for g in generators)
          + "  after/before")
    cases = {shape: [int(np.prod([int(x) for x in shape.split("x")]))]
             for shape in args.shapes.split(",")}
    if args.model:
        shapes = registry_config(args.model).param_shapes().values()
        cases[args.model] = [int(np.prod(s)) for s in shapes]
    for shape, numels in cases.items():
        for name in args.dtypes.split(","):
            rates = {g: gb_per_s(make, numels, args.device, DTYPES[name], args.repeats)
                     for g, make in generators.items()}
            rows.append({"shape": shape, "dtype": name, "gb_per_s": rates})
            print(f"{shape:>12} {name:>9} " + " ".join(f"{v:11.2f}" for v in rates.values())
                  + (f"  {rates['after'] / rates['before']:11.1f}x" if "before" in rates else ""),
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "threads": torch.get_num_threads(),
                       "run": run_metadata(args.device)}, f, indent=1)


if __name__ == "__main__":
    main()
