"""`python -m flexevict.bench.kernels`: per-op latency of every CUDA kernel against its PyTorch
reference, at the papers' benchmark shapes.

    python -m flexevict.bench.kernels [--device cuda] [--json FILE] [--quick] [--launches N]
                                      [--loops N] [--only PHASES] [--attention-batch B]

Shapes: Cascade's (batch 8, 32 heads, head dim 128, a 2048-slot cache) and H2O's FlexGen
settings (OPT-6.7B: 32 heads, OPT-30B: 56 heads, head dim 128, 20% of 2048 + 2048 tokens =
819 slots, batch 24; prompts of 2048). `--quick` is a tiny shape for CI smoke tests.

Decode attention (phase "attention"): the split-slot kernel (`kernels.split_decode_attention`,
fused score accumulation, per-head probabilities) against what the model runs today, torch's
decode attention plus the separate score pass (`decode_attention` with the buffer's score), at
OPT-6.7B (32 heads x 128) and OPT-30B (56 x 128) kv heads over 2k, 8k and 32k slots, and a GQA
shape (LLaMA-3-8B, 32 query / 8 kv heads, also giving the group's mass alone), batch
--attention-batch (8). The summary reads each speedup against the target (>= 1.5x). On a CPU
they run at the quick shape only (the references; the 32k shapes are GPU-sized).

Timing. Every input is built before the clock starts. One timed loop launches an op N times
back to back; on a GPU a `torch.cuda._sleep` is queued first, so the host has queued all N
launches before the GPU reaches the start event, and CUDA events around the whole loop / N give
the op's device time without the Python dispatch between launches (outputs the wrappers
allocate come from the caching allocator: no device time). Ops that change their buffer so
that a repeat would do different work (BUZZ's pass compacts) get one prepared copy per launch.
The median over --loops loops is reported. Python dispatch is reported apart: the host's wall
time per call of the same loop run without any synchronisation (host_us). On a CPU only the
reference runs (the kernels need a GPU), timed on the host, and the result says so. Kernel and
reference run side by side in one run; every result records the device, torch/CUDA versions,
commit and backend.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from flexevict.core import kernels
from flexevict.bench.report import write_json
from flexevict.errors import UserError, cli_errors
from flexevict.core.kernels.quant import GROUP
from flexevict.core.kv import KVBuffer, Layout
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
PHASES = ("decode", "prefill", "quant", "attention")


@dataclass(frozen=True)
class AttentionShape:
    """A decode attention case: `kv_heads` rows per sequence, heads / kv_heads query heads
    each, `slots` attended slots (all valid), `batch` sequences (--attention-batch)."""
    model: str
    heads: int
    kv_heads: int
    head_dim: int
    slots: int

    def name(self, batch: int) -> str:
        slots = f"{self.slots // 1024}k" if self.slots % 1024 == 0 else str(self.slots)
        heads = f"{self.heads}" if self.heads == self.kv_heads else \
            f"{self.heads}/{self.kv_heads}"
        return f"{self.model} (b {batch}, {heads} x {self.head_dim}, {slots} slots)"


ATTENTION_SHAPES = [AttentionShape(model, heads, heads, 128, slots)
                    for model, heads in (("opt-6.7b", 32), ("opt-30b", 56))
                    for slots in (2048, 8192, 32768)] + \
    [AttentionShape("llama-3-8b", 32, 8, 128, 8192)]
ATTENTION_QUICK = [AttentionShape("quick", 4, 2, 16, 64)]
ATTENTION_BATCH = 8
ATTENTION_TARGET = 1.5              # the goal: kernel >= 1.5x torch's attention + scores
CASCADE_TARGET_MS = 0.05            # the target for the caching operation
GPU_CLOCK_HZ = 2.0e9                # H100/H200 boost clock: turns host seconds into sleep cycles


def _nothing():
    return None


@dataclass
class Op:
    """One benchmarked op: fn(i) is launch i of a timed loop; setup() runs untimed before each
    loop; copies, when set, is how many launches in a row find fresh state (at most that many
    launches per loop)."""
    name: str
    fn: Callable[[int], object]
    setup: Callable[[], None] = _nothing
    copies: int | None = None


# ------------------------------------------------------------------------------ timing

def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_loop(op: Op, n: int, device: torch.device, sleep_s: float = 0.0) -> float:
    """Seconds per launch of n back-to-back launches: CUDA events around the loop on a GPU
    (after a device sleep of sleep_s, so the launches queue up behind it), the host clock on
    a CPU."""
    op.setup()
    _sync(device)
    if device.type != "cuda":
        t0 = time.perf_counter()
        for i in range(n):
            op.fn(i)
        return (time.perf_counter() - t0) / n
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if sleep_s > 0 and hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(int(sleep_s * GPU_CLOCK_HZ))
    start.record()
    for i in range(n):
        op.fn(i)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / n


def host_loop(op: Op, n: int, device: torch.device) -> float:
    """Host wall seconds per call of n launches with no synchronisation: Python dispatch (the
    wrapper's argument checks, allocation and launch), plus any sync the wrapper does itself."""
    op.setup()
    _sync(device)
    t0 = time.perf_counter()
    for i in range(n):
        op.fn(i)
    seconds = (time.perf_counter() - t0) / n
    _sync(device)
    return seconds


def time_op(op: Op, device: torch.device, launches: int, loops: int) -> dict:
    """{ms: device time per launch (median of loops), host_us: host time per call, launches}.
    One untimed launch first: first-use module loading and allocation stay out of the loops."""
    n = min(launches, op.copies or launches)
    op.setup()
    op.fn(0)
    _sync(device)
    host = statistics.median([host_loop(op, n, device) for _ in range(max(1, loops // 2))])
    sleep_s = min(2 * host * n + 1e-4, 0.25)       # longer than queueing the n launches takes
    device_s = [time_loop(op, n, device, sleep_s) for _ in range(loops)]
    return {"ms": statistics.median(device_s) * 1e3, "host_us": host * 1e6, "launches": n}


def both_paths(op: Op, device, launches, loops, with_kernels: bool) -> dict:
    """The same op with kernels on and off -> {kernel_ms, kernel_host_us, reference_ms,
    reference_host_us, launches, speedup}."""
    out = {"kernel_ms": None, "kernel_host_us": None}
    if with_kernels:
        with kernels.ext.use_kernels(True):
            t = time_op(op, device, launches, loops)
        out.update(kernel_ms=t["ms"], kernel_host_us=t["host_us"])
    with kernels.ext.use_kernels(False):
        t = time_op(op, device, launches, loops)
    out.update(reference_ms=t["ms"], reference_host_us=t["host_us"], launches=t["launches"])
    out["speedup"] = out["reference_ms"] / out["kernel_ms"] if out["kernel_ms"] else None
    return out


# ------------------------------------------------------------------------------ inputs

def full_buffer(shape: Shape, device, dtype, gen, kv_heads: int) -> KVBuffer:
    """A buffer whose committed slots and scratch slot all hold random tokens."""
    cap, rows = shape.slots - 1, shape.batch * shape.heads
    buf = KVBuffer(Layout(shape.slots), rows, shape.head_dim, dtype, device, kv_heads=kv_heads)
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

BUZZ_COPIES = 8                     # prepared buffers per timed loop of the BUZZ pass


def decode_ops(shape: Shape, device, dtype, gen) -> list[Op]:
    """The decode-time ops at this shape. Each repeats the same work when launched again on
    its own output (a full buffer stays full), except BUZZ's pass (copies)."""
    rows, d, n = shape.batch * shape.heads, shape.head_dim, shape.slots
    buf = full_buffer(shape, device, dtype, gen, kv_heads=shape.heads)
    q = torch.randn(rows, 1, d, generator=gen, device=device).to(dtype)
    ops = [Op("decode_attention + score accumulation",
              lambda i: kernels.decode_attention_kernel(q, buf.k, buf.v, buf.valid, d ** -0.5,
                                                        buf.score)),
           Op("h2o victim + ring commit", lambda i: kernels.evict_commit(buf, buf.ring_start),
              snapshot(buf)),
           Op("tova victim + replace",
              lambda i: kernels.evict_commit(buf, n, cursor=False, commit="replace"),
              snapshot(buf))]
    proj = torch.randn(16, d, generator=gen, device=device)

    def hashevict_step(i):
        code = kernels.hash_codes(buf.k[buf.scratch], proj)
        buf.state[buf.scratch] = code[:, 0].float()
        victims = kernels.hash_victims(buf, kernels.hash_codes(q, proj), 4)
        kernels.ring_commit(buf, victims)
    ops.append(Op("hashevict hash + victim + ring commit", hashevict_step, snapshot(buf)))
    ops.append(cascade_op(shape, device, dtype, gen))
    ops.append(buzz_op(shape, device, dtype))
    return ops


def cascade_op(shape: Shape, device, dtype, gen) -> Op:
    """Cascade's caching operation (EMA + sub-cache insertion) on a buffer filled by its own
    prefill."""
    policy = get_policy("cascade", budget_tokens=shape.slots)
    layout = policy.layout(shape.slots + 16, 64)
    cap, rows = layout.capacity, shape.batch * shape.heads
    buf = KVBuffer(layout, rows, shape.head_dim, dtype, device, kv_heads=shape.heads,
                   fields=policy.fields(layout))
    k = torch.randn(shape.slots + 16, rows, shape.head_dim, generator=gen, device=device).to(dtype)
    valid = torch.ones(k.shape[:2], dtype=torch.bool, device=device)
    pos = torch.arange(k.shape[0], dtype=torch.int32, device=device).unsqueeze(1).expand_as(valid)
    policy.prefill(buf, k, k, pos.contiguous(), valid, torch.rand(valid.shape, device=device))
    buf.write(buf.scratch, k[0], k[0], pos[-1] + 1)
    probs = random_probs(rows, cap + 1, device, gen)
    restore = snapshot(buf)
    sub_state = {name: t.clone() for name, t in buf.policy_state.items()}   # start, count

    def setup():
        restore()
        for name, t in sub_state.items():
            buf.policy_state[name].copy_(t)
    return Op("cascade EMA + sub-cache update",
              lambda i: policy.after_attention(buf, buf.scratch, probs), setup)


def buzz_op(shape: Shape, device, dtype) -> Op:
    """One BUZZ pass over a full buffer whose middle exceeds the threshold. A pass compacts its
    buffer (a second one would find less to do), so each launch gets its own prepared copy."""
    policy = get_policy("buzz", budget_tokens=shape.slots)
    lay = policy.layout(shape.slots + 16, 64)
    bufs = []
    for _ in range(BUZZ_COPIES if device.type == "cuda" else 2):     # CPU: 2 launches a loop
        gen = torch.Generator(device=device).manual_seed(1)            # identical copies
        buf = full_buffer(shape, device, dtype, gen, kv_heads=shape.heads)
        buf.state[:shape.slots // 3] = 1.0                             # old tokens
        bufs.append(buf)
    restores = [snapshot(b) for b in bufs]
    return Op("buzz pass + compaction",
              lambda i: kernels.buzz_pass(bufs[i], shape.slots, lay.k, lay.w, lay.T, lay.s),
              lambda: [r() for r in restores], copies=len(bufs))


def attention_ops(shape: AttentionShape, batch: int, device, dtype, gen) -> list[Op]:
    """Decode attention over a full buffer with H2O's fused score accumulation: the kernel path
    is the split-slot kernel, the reference path torch's decode attention plus the score pass
    (what the model runs today). Each launch does the same work (the scores only grow)."""
    rows, g, d = batch * shape.kv_heads, shape.heads // shape.kv_heads, shape.head_dim
    n = shape.slots
    k = torch.randn(n, rows, d, generator=gen, device=device).to(dtype)
    v = torch.randn(n, rows, d, generator=gen, device=device).to(dtype)
    valid = torch.ones(n, rows, dtype=torch.bool, device=device)
    score = torch.zeros(n, rows, device=device)
    q = torch.randn(rows, g, d, generator=gen, device=device).to(dtype)
    scale = d ** -0.5
    ops = [Op("split decode attention + scores",
              lambda i: kernels.split_decode_attention(q, k, v, valid, scale, score))]
    if g > 1:
        ops.append(Op("split decode attention + scores, mass",
                      lambda i: kernels.split_decode_attention(q, k, v, valid, scale, score,
                                                               heads=False)))
    return ops


def run_attention(shape: AttentionShape, batch, device, dtype, launches, loops,
                  with_kernels) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for op in attention_ops(shape, batch, device, dtype, gen):
        timing = both_paths(op, device, launches, loops, with_kernels)
        rows.append({"shape": shape.name(batch), "phase": "attention", "op": op.name,
                     "loops": loops, "slots": shape.slots, "batch": batch,
                     "heads": shape.heads, "kv_heads": shape.kv_heads,
                     "head_dim": shape.head_dim, **timing})
        print(format_row(rows[-1]), file=sys.stderr)
    return rows


def prefill_ops(shape: Shape, device, dtype, gen) -> list[Op]:
    """The prefill-time ops (stateless, or writing the same slots again)."""
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
    buf = KVBuffer(Layout(shape.slots, prefix=cap // 2, ring=cap - cap // 2), rows, d, dtype,
                   device)
    return [Op("prefill attention + column sums",
               lambda i: kernels.prefill_attention(q, k, v, mask, valid, d ** -0.5)),
            Op("prompt top-k compaction",
               lambda i: kernels.compact_prompt(buf, kp, vp, pos, vrow, scores, scores))]


def quant_ops(shape: Shape, device, dtype, gen) -> list[Op]:
    hidden = shape.heads * shape.head_dim
    w = torch.randn(hidden, hidden, generator=gen, device=device).to(dtype)
    cache = torch.randn(shape.slots, shape.batch * shape.heads, shape.head_dim, generator=gen,
                        device=device).to(dtype)
    packed_w = kernels.quantize_4bit(w, dim=0)
    return [Op(f"quantize_4bit weight (group {GROUP} along dim 0)",
               lambda i: kernels.quantize_4bit(w, dim=0)),
            Op("dequantize_4bit weight", lambda i: kernels.dequantize_4bit(packed_w)),
            Op("quantize_4bit KV cache (along head dim)", lambda i: kernels.quantize_4bit(cache))]


# ------------------------------------------------------------------------------ main

def run_shape(shape: Shape, device, dtype, launches, loops, with_kernels,
              phases=PHASES) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for group, builder in (("decode", decode_ops), ("prefill", prefill_ops), ("quant", quant_ops)):
        if group not in phases:
            continue
        for op in builder(shape, device, dtype, gen):
            n = max(1, launches // 5) if group == "prefill" else launches    # ms-long ops
            timing = both_paths(op, device, n, loops, with_kernels)
            rows.append({"shape": shape.name, "phase": group, "op": op.name, "loops": loops,
                         **timing})
            print(format_row(rows[-1]), file=sys.stderr)
    return rows


def format_row(r: dict) -> str:
    """One line per op: device time per launch, then the host's dispatch time per call."""
    def path(ms, us):
        return "      n/a                 " if ms is None else f"{ms:9.4f} ms ({us:7.1f} us host)"
    speed = f"{r['speedup']:7.1f}x" if r["speedup"] else "        "
    return (f"{r['shape'][:28]:28s} {r['op'][:40]:40s} kernel "
            f"{path(r['kernel_ms'], r['kernel_host_us'])}  reference "
            f"{path(r['reference_ms'], r['reference_host_us'])} {speed}")


def summary(rows: list[dict]) -> dict:
    """The issue's targets, read off the rows: Cascade's caching op, and H2O's bookkeeping
    against its decode attention."""
    out = {}
    for r in rows:
        if r["op"].startswith("cascade") and r["kernel_ms"] is not None:
            out[f"{r['shape']}: cascade caching op ms (target <= {CASCADE_TARGET_MS})"] = \
                r["kernel_ms"]
    for r in rows:
        if r["phase"] == "attention" and r["speedup"]:
            out[f"{r['shape']}: {r['op']}: speedup vs torch (target >= {ATTENTION_TARGET})"] = \
                r["speedup"]
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
    ap.add_argument("--load", action="store_true",
                    help="only load the extension (building it just in time if needed), print "
                         "where from and how long it took; exit 1 if it is not available")
    ap.add_argument("--launches", type=int, default=None,
                    help="back-to-back launches per timed loop (default 20 on a GPU, 2 on a CPU)")
    ap.add_argument("--loops", type=int, default=None,
                    help="timed loops per op, the median reported (default 5 on a GPU, 3 on a CPU)")
    ap.add_argument("--only", default=",".join(PHASES),
                    help=f"comma list of phases to time (default all: {','.join(PHASES)})")
    ap.add_argument("--attention-batch", type=int, default=ATTENTION_BATCH,
                    help=f"sequences of the decode attention shapes (default {ATTENTION_BATCH})")
    args = ap.parse_args(argv)
    if args.load:
        return load_only()
    with cli_errors("flexevict.bench.kernels"):
        result, device = run(args)
        write_json(args.json, result, device)
    return 0


def load_only() -> int:
    """Load flexevict's CUDA extension now (the GPU plan does this before any benchmark)."""
    t0 = time.perf_counter()
    module = kernels.ext.load()
    where = getattr(module, "__file__", None) or "not available (PyTorch reference)"
    print(f"flexevict kernels: {where} ({time.perf_counter() - t0:.1f} s)")
    return 0 if module is not None else 1


def run(args) -> tuple[dict, torch.device]:
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        raise UserError(f"--device {args.device}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA GPU is visible to torch; use --device cpu")
    cuda = device.type == "cuda"
    launches = args.launches if args.launches is not None else (20 if cuda else 2)
    loops = args.loops if args.loops is not None else (5 if cuda else 3)
    if launches < 1 or loops < 1:
        raise UserError(f"--launches {launches} / --loops {loops}: both must be >= 1")
    phases = tuple(p for p in args.only.split(",") if p)
    if not phases or set(phases) - set(PHASES):
        raise UserError(f"--only {args.only}: a comma list of {', '.join(PHASES)}")
    if args.attention_batch < 1:
        raise UserError(f"--attention-batch {args.attention_batch} must be >= 1")
    backend = kernels.backend(device)
    with_kernels = backend == "cuda-kernels"
    note = "kernels vs reference side by side" if with_kernels else (
        "CUDA kernels are not available on this device (they need a GPU and the built "
        "extension): reference only")
    print(f"flexevict.bench.kernels: {device} ({backend}): {note}", file=sys.stderr)
    dtype = torch.float16 if cuda else torch.float32
    rows = []
    for shape in (QUICK if args.quick else SHAPES):
        if set(phases) - {"attention"}:
            rows += run_shape(shape, device, dtype, launches, loops, with_kernels, phases)
    if "attention" in phases:       # GPU-sized: a CPU times the references at the quick shape
        batch = 2 if args.quick or not cuda else args.attention_batch
        for shape in (ATTENTION_QUICK if args.quick or not cuda else ATTENTION_SHAPES):
            rows += run_attention(shape, batch, device, dtype, launches, loops, with_kernels)
    timing = (f"CUDA events around {launches} back-to-back launches queued behind a device "
              "sleep, per launch, median of loops" if cuda else
              f"perf_counter around {launches} launches, per launch, median of loops")
    return {"benchmark": "kernels", "backend": backend, "kernels_available": with_kernels,
            "note": note, "dtype": str(dtype).replace("torch.", ""), "timing": timing,
            "host_timing": "host wall time per call, no synchronisation (Python dispatch)",
            "launches": launches, "loops": loops, "phases": list(phases), "results": rows,
            "summary": summary(rows)}, device


if __name__ == "__main__":
    sys.exit(main())
