"""`python -m flexevict.bench.kernels`: per-op latency of every CUDA kernel against its PyTorch
reference, at the papers' benchmark shapes.

    python -m flexevict.bench.kernels [--device cuda] [--json FILE] [--quick] [--reps N]

Shapes: Cascade's (batch 8, 32 heads, head dim 128, a 2048-slot cache) and H2O's FlexGen
settings (OPT-6.7B: 32 heads, OPT-30B: 56 heads, head dim 128, 20% of 2048 + 2048 tokens =
819 slots, batch 24; prompts of 2048). `--quick` is a tiny shape for CI smoke tests. On a GPU
each op is timed with CUDA events (warmup, then the median of N runs), kernel and reference
side by side in one run; on a CPU only the reference runs (the kernels need a GPU) and the
result says so. Every result records the device, torch/CUDA versions, commit and backend.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from flexevict import kernels
from flexevict.bench.report import write_json
from flexevict.kv import KVBuffer
from flexevict.policies import get_policy


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    heads: int
    head_dim: int
    slots: int            # buffer slots, the scratch slot included
    prompt: int


SHAPES = [Shape("cascade (batch 8, 32 heads, 2048 slots)", 8, 32, 128, 2048, 2048),
          Shape("h2o opt-6.7b (batch 24, 32 heads, 20% of 4096)", 24, 32, 128, 819, 2048),
          Shape("h2o opt-30b (batch 24, 56 heads, 20% of 4096)", 24, 56, 128, 819, 2048)]
QUICK = [Shape("quick (batch 2, 4 heads, 64 slots)", 2, 4, 16, 64, 96)]
CASCADE_TARGET_MS = 0.05            # the target for the caching operation


# ------------------------------------------------------------------------------ timing

def median_ms(fn, setup, device: torch.device, warmup: int, reps: int) -> float:
    """Median wall time of fn() in ms; setup() runs untimed before every call."""
    cuda = device.type == "cuda"
    times = []
    for i in range(warmup + reps):
        setup()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
    return statistics.median(times)


def both_paths(fn, setup, device, warmup, reps, with_kernels: bool) -> dict:
    """{kernel_ms, reference_ms, speedup}: the same op with kernels on and off."""
    saved = os.environ.get("FLEXEVICT_KERNELS")
    try:
        kernel = None
        if with_kernels:
            os.environ.pop("FLEXEVICT_KERNELS", None)
            kernel = median_ms(fn, setup, device, warmup, reps)
        os.environ["FLEXEVICT_KERNELS"] = "0"
        reference = median_ms(fn, setup, device, warmup, reps)
    finally:
        if saved is None:
            os.environ.pop("FLEXEVICT_KERNELS", None)
        else:
            os.environ["FLEXEVICT_KERNELS"] = saved
    return {"kernel_ms": kernel, "reference_ms": reference,
            "speedup": reference / kernel if kernel else None}


# ------------------------------------------------------------------------------ inputs

def full_buffer(shape: Shape, device, dtype, gen, kv_heads: int) -> KVBuffer:
    """A buffer whose committed slots and scratch slot all hold random tokens."""
    cap, rows = shape.slots - 1, shape.batch * shape.heads
    buf = KVBuffer(cap, rows, shape.head_dim, dtype, device, kv_heads=kv_heads)
    buf.k.copy_(torch.randn(buf.k.shape, generator=gen, device=device))
    buf.v.copy_(torch.randn(buf.v.shape, generator=gen, device=device))
    buf.score.copy_(torch.rand(buf.score.shape, generator=gen, device=device))
    buf.pos.copy_(torch.arange(cap + 1, device=device, dtype=torch.int32).unsqueeze(1))
    buf.valid.fill_(True)
    buf.used = cap
    buf.ring_start = buf.cursor = cap // 2
    return buf


def snapshot(buf: KVBuffer):
    """-> restore(): puts the buffer's tensors and counters back (untimed setup)."""
    saved = [t.clone() for t in buf.tensors()]
    counters = (buf.used, buf.cursor)

    def restore():
        for t, s in zip(buf.tensors(), saved):
            t.copy_(s)
        buf.used, buf.cursor = counters
    return restore


def random_probs(rows, n, device, gen):
    return torch.softmax(torch.randn(rows, 1, n, generator=gen, device=device), dim=-1)


# ------------------------------------------------------------------------------ ops

def decode_ops(shape: Shape, device, dtype, gen):
    """(op name, fn, setup) of the decode-time ops at this shape."""
    rows, d, n = shape.batch * shape.heads, shape.head_dim, shape.slots
    buf = full_buffer(shape, device, dtype, gen, kv_heads=shape.heads)
    q = torch.randn(rows, 1, d, generator=gen, device=device).to(dtype)
    nothing = lambda: None                                                 # noqa: E731
    ops = [("decode_attention + score accumulation",
            lambda: kernels.decode_attention(q, buf.k, buf.v, buf.valid, d ** -0.5, buf.score),
            nothing),
           ("h2o victim + ring commit", lambda: kernels.evict_commit(buf, buf.ring_start),
            snapshot(buf)),
           ("tova victim + replace",
            lambda: kernels.evict_commit(buf, n, cursor=False, commit="replace"), snapshot(buf))]
    proj = torch.randn(16, d, generator=gen, device=device)

    def hashevict_step():
        code = kernels.hash_codes(buf.k[buf.scratch], proj)
        buf.state[buf.scratch] = code[:, 0].float()
        victims = kernels.hash_victims(buf, kernels.hash_codes(q, proj), 4)
        kernels.ring_commit(buf, victims)
    ops.append(("hashevict hash + victim + ring commit", hashevict_step, snapshot(buf)))
    ops.append(cascade_op(shape, device, dtype, gen))
    ops.append(buzz_op(shape, device, dtype, gen))
    return ops


def cascade_op(shape: Shape, device, dtype, gen):
    """Cascade's caching operation (EMA + sub-cache insertion) on a buffer filled by its own
    prefill."""
    policy = get_policy("cascade", budget_tokens=shape.slots)
    cap = policy.capacity(shape.slots + 16, 64)
    rows = shape.batch * shape.heads
    buf = KVBuffer(cap, rows, shape.head_dim, dtype, device, kv_heads=shape.heads)
    k = torch.randn(shape.slots + 16, rows, shape.head_dim, generator=gen, device=device).to(dtype)
    valid = torch.ones(k.shape[:2], dtype=torch.bool, device=device)
    pos = torch.arange(k.shape[0], dtype=torch.int32, device=device).unsqueeze(1).expand_as(valid)
    policy.prefill(buf, k, k, pos.contiguous(), valid, torch.rand(valid.shape, device=device))
    buf.write(buf.scratch, k[0], k[0], pos[-1] + 1)
    probs = random_probs(rows, cap + 1, device, gen)
    run = lambda: policy.after_attention(buf, buf.scratch, probs)          # noqa: E731
    restore = snapshot(buf)
    counters = (buf.cascade_start.clone(), buf.cascade_count.clone())

    def setup():
        restore()
        buf.cascade_start.copy_(counters[0])
        buf.cascade_count.copy_(counters[1])
    return "cascade EMA + sub-cache update", run, setup


def buzz_op(shape: Shape, device, dtype, gen):
    """One BUZZ pass over a full buffer whose middle exceeds the threshold."""
    policy = get_policy("buzz", budget_tokens=shape.slots)
    policy.capacity(shape.slots + 16, 64)
    buf = full_buffer(shape, device, dtype, gen, kv_heads=shape.heads)
    buf.state[:shape.slots // 3] = 1.0                                     # old tokens
    return ("buzz pass + compaction",
            lambda: kernels.buzz_pass(buf, shape.slots, policy.k, policy.w, policy.T, policy.s),
            snapshot(buf))


def prefill_ops(shape: Shape, device, dtype, gen):
    """(op name, fn, setup) of the prefill-time ops."""
    b, h, d, s = shape.batch, shape.heads, shape.head_dim, shape.prompt
    rows, cap = b * h, shape.slots - 1
    q, k, v = (torch.randn(b, s, h, d, generator=gen, device=device).to(dtype).transpose(1, 2)
               for _ in range(3))
    valid = torch.ones(b, s, dtype=torch.bool, device=device)
    mask = torch.ones(s, s, dtype=torch.bool, device=device).tril().expand(b, 1, s, s)
    kp = torch.randn(s, rows, d, generator=gen, device=device).to(dtype)
    vp, pos = kp.clone(), torch.arange(s, dtype=torch.int32, device=device).unsqueeze(1)
    pos = pos.expand(s, rows).contiguous()
    vrow = torch.ones(s, rows, dtype=torch.bool, device=device)
    scores = torch.rand(s, rows, generator=gen, device=device)
    buf = KVBuffer(cap, rows, d, dtype, device)
    nothing = lambda: None                                                 # noqa: E731
    return [("prefill attention + column sums",
             lambda: kernels.prefill_attention(q, k, v, mask, valid, d ** -0.5), nothing),
            ("prompt top-k compaction",
             lambda: kernels.compact_prompt(buf, kp, vp, pos, vrow, scores, scores, cap // 2,
                                            cap - cap // 2), nothing)]


def quant_ops(shape: Shape, device, dtype, gen):
    hidden = shape.heads * shape.head_dim
    w = torch.randn(hidden, hidden, generator=gen, device=device).to(dtype)
    cache = torch.randn(shape.slots, shape.batch * shape.heads, shape.head_dim, generator=gen,
                        device=device).to(dtype)
    packed_w = kernels.quantize_4bit(w, dim=0)
    nothing = lambda: None                                                 # noqa: E731
    return [("quantize_4bit weight (group 64 along dim 0)",
             lambda: kernels.quantize_4bit(w, dim=0), nothing),
            ("dequantize_4bit weight", lambda: kernels.dequantize_4bit(packed_w), nothing),
            ("quantize_4bit KV cache (along head dim)", lambda: kernels.quantize_4bit(cache),
             nothing)]


# ------------------------------------------------------------------------------ main

def run_shape(shape: Shape, device, dtype, warmup, reps, with_kernels) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for group, builder in (("decode", decode_ops), ("prefill", prefill_ops), ("quant", quant_ops)):
        for op, fn, setup in builder(shape, device, dtype, gen):
            n = max(1, reps // 5) if group == "prefill" else reps
            timing = both_paths(fn, setup, device, warmup, n, with_kernels)
            rows.append({"shape": shape.name, "phase": group, "op": op, "reps": n, **timing})
            print(format_row(rows[-1]), file=sys.stderr)
    return rows


def format_row(r: dict) -> str:
    kernel = f"{r['kernel_ms']:9.4f} ms" if r["kernel_ms"] is not None else "      n/a   "
    speed = f"{r['speedup']:7.1f}x" if r["speedup"] else "        "
    return f"{r['shape'][:28]:28s} {r['op'][:40]:40s} kernel {kernel}  reference " \
           f"{r['reference_ms']:9.4f} ms {speed}"


def summary(rows: list[dict]) -> dict:
    """The issue's targets, read off the rows: Cascade's caching op, and H2O's bookkeeping
    against its decode attention."""
    out = {}
    for r in rows:
        if r["op"].startswith("cascade") and r["kernel_ms"] is not None:
            out[f"{r['shape']}: cascade caching op ms (target <= {CASCADE_TARGET_MS})"] = \
                r["kernel_ms"]
    for shape in {r["shape"] for r in rows}:
        ops = {r["op"]: r for r in rows if r["shape"] == shape}
        att, evict = ops.get("decode_attention + score accumulation"), \
            ops.get("h2o victim + ring commit")
        if att and evict and att["kernel_ms"] and evict["kernel_ms"]:
            out[f"{shape}: h2o bookkeeping / (attention + bookkeeping)"] = \
                evict["kernel_ms"] / (att["kernel_ms"] + evict["kernel_ms"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flexevict.bench.kernels",
                                 description="CUDA kernels vs their PyTorch references")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", help="write the results to this JSON file")
    ap.add_argument("--quick", action="store_true", help="one tiny shape (CI smoke test)")
    ap.add_argument("--reps", type=int, default=None, help="timed runs per op (median)")
    args = ap.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        ap.error(str(e))
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU is visible to torch")
    cuda = device.type == "cuda"
    backend = kernels.backend(device)
    with_kernels = backend == "cuda-kernels"
    note = "kernels vs reference side by side" if with_kernels else (
        "CUDA kernels are not available on this device (they need a GPU and the built "
        "extension): reference only")
    print(f"flexevict.bench.kernels: {device} ({backend}): {note}", file=sys.stderr)
    reps = args.reps or (20 if cuda else 3)
    dtype = torch.float16 if cuda else torch.float32
    rows = []
    for shape in (QUICK if args.quick else SHAPES):
        rows += run_shape(shape, device, dtype, 2 if cuda else 1, reps, with_kernels)
    result = {"benchmark": "kernels", "backend": backend, "kernels_available": with_kernels,
              "note": note, "dtype": str(dtype).replace("torch.", ""),
              "timing": "CUDA events, median" if cuda else "perf_counter, median",
              "results": rows, "summary": summary(rows)}
    write_json(args.json, result, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
