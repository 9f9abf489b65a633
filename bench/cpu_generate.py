"""Greedy generation on CPU: flexevict vs transformers' `generate`, same fp32 weights, same run.

    python bench/cpu_generate.py [--repeats N] [--batch 8] [--prompt-len 256] [--new-tokens 64]
                                 [--json FILE] [--threads N] [--no-prefill-runs] [--no-profile]
                                 [--no-what-if]

Workload: SmolLM2-135M (the packaged GGUF, dequantized to fp32 by both loaders), `--batch`
different Wikipedia windows of exactly `--prompt-len` tokens each (no padding), `--new-tokens`
greedy tokens, no stop tokens. Both systems run in this process with the same torch thread count
(torch's default unless --threads).

Measurements
  * full run: one `generate` call, wall time; tokens/s = batch * new_tokens / time.
  * prefill (time to first token), two ways:
      - a separate `generate(max_new_tokens=1)` run per system ("prefill run"), and
      - a timestamp inside every full run: flexevict's first `model.head` call returns, and
        transformers' first logits-processor call ("in-run TTFT").
    decode = full - prefill; per decode step = decode / (new_tokens - 1).
  * rounds alternate the order of the two systems (A B, B A, ...) so slow drifts of the machine
    hit both; the ratio is reported as a ratio of medians, as the median of per-round ratios and
    as a ratio of minimum times. A short matmul probe before and after each timed call records
    how fast the machine was then: shared/virtualized CPUs can change speed by 2-3x within
    seconds (on a 2-vCPU VM, sustained 2-thread work can be throttled below 1-thread speed; use
    --threads 1 there and compare the probes).
  * token agreement: fraction of identical greedy tokens, and the identical-prefix length per row.
  * where flexevict's time goes: exclusive wall time per region (a stack timer wrapped around the
    engine's functions for the duration of the measurement only) for one prefill and several
    decode steps, and torch.profiler's top ops by self CPU time (plus transformers' top ops for
    one prefill forward and one decode step, for comparison).
  * decode attention layout: does `bmm`/`baddbmm` copy the transposed views of the sequence-major
    (slots, rows, d) K/V buffer? (profiler children of the bmm ops, with shapes), and the time of
    the current `attend` vs the same math on contiguous head-major (rows, slots, d) K/V and vs
    SDPA, cache-hot (one layer repeated) and cold (all layers in turn, as in a real step).
  * what-ifs (candidate engine changes, patched in from here for one measurement, the engine
    files are not modified): decode attention over all layers with other K/V layouts, prefill
    SDPA with is_causal instead of the mask. (The oneDNN-prepacked linears first measured here
    are now the engine's CPU default: `flexevict.model.PackedWeight`.)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import flexevict  # noqa: E402
import flexevict.generation as gen  # noqa: E402
import flexevict.kv as fkv  # noqa: E402
import flexevict.model as fmodel  # noqa: E402
import flexevict.policies  # noqa: E402
from flexevict.generation import Sampling  # noqa: E402
from flexevict.packaged import smollm2_gguf, wikipedia_text  # noqa: E402

T0 = time.perf_counter()


def log(*a):
    print(f"[{time.perf_counter() - T0:7.1f}s]", *a, file=sys.stderr, flush=True)


def median(xs):
    return statistics.median(xs) if xs else float("nan")


# ------------------------------------------------------------------------------ machine probe
_PA = torch.randn(256, 576)
_PW = torch.randn(1536, 576)


def probe_gflops(reps: int = 10) -> float:
    """GFLOP/s of a small fixed fp32 GEMM right now (~30 ms): how fast the machine is now."""
    t = time.perf_counter()
    for _ in range(reps):
        F.linear(_PA, _PW)
    dt = time.perf_counter() - t
    return reps * 2 * _PA.shape[0] * _PW.shape[0] * _PA.shape[1] / dt / 1e9


# ------------------------------------------------------------------------------ prompts
def build_prompts(tokenizer, batch: int, length: int) -> list[list[int]]:
    """`batch` consecutive `length`-token windows of the packaged Wikipedia text."""
    need = batch * length
    articles = 64
    while True:
        ids = tokenizer.encode(wikipedia_text(articles), special=False)
        # drop a margin at the end: the last tokens of a truncated text may tokenize differently
        if len(ids) >= need + 64:
            break
        articles *= 2
    return [ids[i * length:(i + 1) * length] for i in range(batch)]


# ------------------------------------------------------------------------------ the two systems
class FlexRunner:
    name = "flexevict"

    def __init__(self, llm, prompts):
        self.llm, self.prompts = llm, prompts
        self.policy = flexevict.policies.get_policy("full")

    def run(self, new_tokens: int):
        """-> (wall seconds, in-run TTFT seconds, tokens (B, new_tokens) list)."""
        model = self.llm.model
        first = []
        real_head = model.head

        def head(h):                       # timestamp when the first logits exist
            out = real_head(h)
            if not first:
                first.append(time.perf_counter())
            return out

        model.head = head                  # instance attribute shadows the method
        try:
            t = time.perf_counter()
            out = gen.generate(model, self.prompts, new_tokens, self.policy, Sampling(),
                               stop_ids=(), pad_id=self.llm.pad_id)
            dt = time.perf_counter() - t
        finally:
            del model.head
        return dt, first[0] - t, out


class HFRunner:
    name = "transformers"

    def __init__(self, model, prompts):
        self.model = model
        self.ids = torch.tensor(prompts, dtype=torch.long)
        self.mask = torch.ones_like(self.ids)
        from transformers import LogitsProcessor, LogitsProcessorList

        class FirstCall(LogitsProcessor):
            def __init__(self):
                self.t = None

            def __call__(self, input_ids, scores):
                if self.t is None:
                    self.t = time.perf_counter()
                return scores

        self._first_call, self._list = FirstCall, LogitsProcessorList

    def run(self, new_tokens: int):
        fc = self._first_call()
        t = time.perf_counter()
        out = self.model.generate(self.ids, attention_mask=self.mask, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False,
                                  logits_processor=self._list([fc]))
        dt = time.perf_counter() - t
        return dt, fc.t - t, out[:, self.ids.shape[1]:].tolist()


# ------------------------------------------------------------------------------ region timer
class RegionTimer:
    """Exclusive wall time per named region; nested regions are charged to the innermost."""

    def __init__(self):
        self.excl: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.stack: list[list] = []

    @contextmanager
    def region(self, name):
        frame = [name, time.perf_counter(), 0.0]
        self.stack.append(frame)
        try:
            yield
        finally:
            dt = time.perf_counter() - frame[1]
            self.stack.pop()
            self.excl[name] = self.excl.get(name, 0.0) + dt - frame[2]
            self.calls[name] = self.calls.get(name, 0) + 1
            if self.stack:
                self.stack[-1][2] += dt

    def top(self):
        return self.stack[-1][0] if self.stack else None

    def wrap(self, fn, name):
        def wrapped(*a, **k):
            with self.region(name):
                return fn(*a, **k)
        return wrapped


class _FProxy:
    """Stands in for `torch.nn.functional` inside flexevict.model while regions are timed."""

    def __init__(self, timer):
        self._t = timer
        self.scaled_dot_product_attention = timer.wrap(F.scaled_dot_product_attention,
                                                       "attention: SDPA kernel")
        self.silu = timer.wrap(F.silu, "mlp: silu")

    def __getattr__(self, name):
        return getattr(F, name)


@contextmanager
def instrumented(timer: RegionTimer):
    """Temporarily wrap the engine's functions with timed regions (restored on exit)."""
    T, KV = fmodel.Transformer, fkv.KVBuffer
    saved_mod = {n: getattr(fmodel, n) for n in ("linear", "rms_norm", "apply_rope", "attend", "F")}
    saved_cls = {(T, n): getattr(T, n) for n in ("_prefill_attention", "_decode_attention",
                                                 "embed", "head", "step_input", "attention")}
    saved_cls.update({(KV, n): getattr(KV, n) for n in ("write", "store_prompt")})
    real_linear = saved_mod["linear"]

    def linear(x, w, b=None):
        name = "lm_head GEMM" if timer.top() == "head (final norm etc.)" else "linear GEMMs (qkv/o/mlp)"
        with timer.region(name):
            return real_linear(x, w, b)

    fmodel.linear = linear
    fmodel.rms_norm = timer.wrap(saved_mod["rms_norm"], "rms_norm")
    fmodel.apply_rope = timer.wrap(saved_mod["apply_rope"], "rope: apply_rope")
    fmodel.attend = timer.wrap(saved_mod["attend"], "attention: decode attend (bias+baddbmm+softmax+bmm)")
    fmodel.F = _FProxy(timer)
    T._prefill_attention = timer.wrap(saved_cls[(T, "_prefill_attention")],
                                      "attention glue (views/permutes/rope cos-sin repeat)")
    T._decode_attention = timer.wrap(saved_cls[(T, "_decode_attention")],
                                     "attention glue (views/permutes/rope cos-sin repeat)")
    T.attention = timer.wrap(saved_cls[(T, "attention")], "attention glue (qkv split)")
    T.embed = timer.wrap(saved_cls[(T, "embed")], "embed")
    T.head = timer.wrap(saved_cls[(T, "head")], "head (final norm etc.)")
    T.step_input = timer.wrap(saved_cls[(T, "step_input")], "step_input (rope cos/sin, prefill mask)")
    KV.write = timer.wrap(saved_cls[(KV, "write")], "kv: buffer write / prompt store")
    KV.store_prompt = timer.wrap(saved_cls[(KV, "store_prompt")], "kv: buffer write / prompt store")
    try:
        yield
    finally:
        for n, v in saved_mod.items():
            setattr(fmodel, n, v)
        for (cls, n), v in saved_cls.items():
            setattr(cls, n, v)


# ------------------------------------------------------------------------------ flexevict internals
class FlexState:
    """A prefilled batch held in the engine's own buffers, to step decode by hand."""

    def __init__(self, model, prompts, new_tokens, pad_id):
        self.model = model
        self.policy = flexevict.policies.get_policy("full")
        self.tokens, self.valid, self.pos = gen.left_pad(prompts, pad_id, model.device)
        b, s = self.tokens.shape
        self.bufs = gen.allocate(model, self.policy.capacity(s, new_tokens), b)

    def prefill(self):
        m = self.model
        h = gen.forward(m, self.tokens, m.step_input(self.pos, self.valid), self.bufs, self.policy)
        self.nxt = m.head(h[:, -1]).argmax(-1)
        self.next_pos = self.valid.sum(dim=1)

    def step(self):
        m = self.model
        h = gen.forward(m, self.nxt, m.step_input(self.next_pos, None), self.bufs, self.policy)
        self.nxt = m.head(h).argmax(-1)
        self.next_pos = self.next_pos + 1


def _timed_regions(fn, n, profiler=None):
    """Run fn n times with the engine instrumented -> exclusive wall time per region."""
    timer = RegionTimer()
    with instrumented(timer):
        t = time.perf_counter()
        for _ in range(n):
            with timer.region("other (residual adds, silu*up, chunk, argmax, python)"):
                fn()
        total = (time.perf_counter() - t) / n
    regions = {k: v / n for k, v in timer.excl.items()}
    return {"seconds_per_call": total, "calls_averaged": n,
            "regions_s": dict(sorted(regions.items(), key=lambda kv: -kv[1])),
            "region_calls_per_call": {k: v // n for k, v in timer.calls.items()}}


def flex_profile(llm, prompts, new_tokens, decode_steps=8, top=12):
    # stay inside the buffer: warm + timed + profiled steps <= new_tokens - 2, so the layout
    # study can still place one more token
    decode_steps = max(1, min(decode_steps, (new_tokens - 2) // 2))
    """One prefill and decode steps in the middle of the run, on a single engine state.

    prefill: region timer and torch.profiler on the same call (profiler overhead is ~1% there);
    decode: `decode_steps` steps region-timed, then one step under torch.profiler.
    Returns (breakdown, top ops, state) - the state is reused by the attention-layout study.
    """
    from torch.profiler import ProfilerActivity, profile
    breakdown, ops = {}, {}
    with torch.inference_mode():
        st = FlexState(llm.model, prompts, new_tokens, llm.pad_id)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            breakdown["prefill"] = _timed_regions(st.prefill, 1)
        ops["prefill"] = _op_table(prof, top)
        for _ in range(max(0, new_tokens // 2 - decode_steps)):
            st.step()
        breakdown["decode_step"] = _timed_regions(st.step, decode_steps)
        breakdown["decode_step"]["kv_slots_at_start"] = st.bufs[0].used - decode_steps
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            st.step()
        ops["decode_step"] = _op_table(prof, top)
        ops["decode_step"]["kv_slots_attended"] = st.bufs[0].used
    return breakdown, ops, st


def hf_profile(hf, prompts, top=12):
    """transformers: one prefill forward (cache on, last-token logits) and one decode step."""
    from torch.profiler import ProfilerActivity, profile
    ids = torch.tensor(prompts, dtype=torch.long)
    mask = torch.ones_like(ids)
    res = {}
    with torch.inference_mode():
        t = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = hf(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
        res["prefill"] = _op_table(prof, top)
        res["prefill"]["wall_s"] = time.perf_counter() - t
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        t = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            hf(input_ids=nxt, attention_mask=mask, past_key_values=out.past_key_values,
               use_cache=True, logits_to_keep=1)
        res["decode_step"] = _op_table(prof, top)
        res["decode_step"]["wall_s"] = time.perf_counter() - t
        res["decode_step"]["kv_slots_attended"] = ids.shape[1] + 1
    return res


OP_CATEGORIES = [
    ("matmul/linear (aten::mm/addmm)", ("aten::mm", "aten::addmm")),
    ("attention bmm (aten::bmm/baddbmm)", ("aten::bmm", "aten::baddbmm")),
    ("attention SDPA kernel", ("aten::_scaled_dot_product_flash_attention_for_cpu",
                               "aten::_scaled_dot_product_attention_math")),
    ("softmax", ("aten::_softmax", "aten::softmax")),
    ("copies (copy_/clone/contiguous/cat/index_put)", ("aten::copy_", "aten::clone", "aten::cat",
                                                        "aten::index_put_", "aten::_index_put_impl_",
                                                        "aten::fill_", "aten::zero_")),
]


def categorize(name: str) -> str:
    for cat, names in OP_CATEGORIES:
        if name in names:
            return cat
    if name in ("aten::mul", "aten::add", "aten::neg", "aten::silu", "aten::pow", "aten::mean",
                "aten::rsqrt", "aten::sum", "aten::where", "aten::masked_fill_", "aten::cos",
                "aten::sin", "aten::div_", "aten::argmax", "aten::add_", "aten::sub"):
        return "elementwise/reductions (rope, norms, silu*up, residual)"
    return "other (views, allocation, dispatch)"


def _op_table(prof, top):
    avgs = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in avgs)
    cats: dict[str, float] = {}
    for e in avgs:
        c = categorize(e.key)
        cats[c] = cats.get(c, 0.0) + e.self_cpu_time_total
    return {"self_cpu_total_ms": total / 1e3,
            "top_ops": [{"op": e.key, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                         "calls": e.count} for e in avgs[:top]],
            "categories_ms": {k: v / 1e3 for k, v in sorted(cats.items(), key=lambda kv: -kv[1])}}


# ------------------------------------------------------------------------------ attention layout
def _timeit(fn, reps):
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return median(ts)


def attention_layout_study(llm, st, new_tokens, reps):
    """Decode attention on a real buffer (layer 0 of a decoding state): copies inside bmm?
    current sequence-major layout vs contiguous head-major vs SDPA. Operands are cache-hot here
    (the same call repeated); in a real step K/V come from DRAM, so compare with the region
    timer's in-situ `attend` time."""
    from torch.profiler import ProfilerActivity, profile
    c = llm.config
    nh, nk, d = c.num_heads, c.num_kv_heads, c.dim_head
    g = nh // nk
    with torch.inference_mode():
        buf = st.bufs[0]
        n = buf.used + 1                           # what attend reads for the next token
        rows = buf.k.shape[1]
        torch.manual_seed(0)
        q = torch.randn(rows, g, d, dtype=buf.k.dtype)
        buf.valid[n - 1] = True                    # pretend the next token was written
        scale = d ** -0.5
        attend = fmodel.attend

        # 1) does bmm/baddbmm copy the strided operands? Every op under them, with shapes: a
        #    copy of a K/V-sized tensor ((R, n, d) or (R, d, n)) is an operand copy; baddbmm also
        #    copies its `bias` input (R, g, n) into the output, which is not.
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            attend(q, buf, n, scale)
        children = {}
        operand_copies = []
        kv_shapes = ([rows, n, d], [rows, d, n], [n, rows, d])
        for ev in prof.events():
            if ev.name in ("aten::bmm", "aten::baddbmm"):
                kids = []
                stack = list(ev.cpu_children)
                while stack:
                    k = stack.pop()
                    shapes = [list(x) for x in (k.input_shapes or []) if x]
                    kids.append(f"{k.name}{shapes}")
                    if k.name in ("aten::copy_", "aten::clone", "aten::contiguous") and \
                            any(sh in kv_shapes for sh in shapes):
                        operand_copies.append(f"{ev.name} > {k.name}{shapes}")
                    stack.extend(k.cpu_children)
                children[ev.name] = sorted(set(kids))
        copies_inside = bool(operand_copies)

        keys = buf.k[:n].transpose(0, 1)           # (R, n, d) strides (d, R*d, 1)
        vals = buf.v[:n].transpose(0, 1)
        bias = torch.zeros(rows, 1, n, dtype=q.dtype)
        bias.masked_fill_(~buf.valid[:n].t().unsqueeze(1), float("-inf"))
        kc, vc = keys.contiguous(), vals.contiguous()
        kT_c = keys.transpose(1, 2).contiguous()
        # head-major buffers of the same capacity, read as a prefix view (what a (rows, slots, d)
        # KVBuffer would hand to attention: contiguous matrices, batch stride = capacity * d)
        cap = buf.k.shape[0]
        kh = torch.zeros(rows, cap, d, dtype=q.dtype)
        vh = torch.zeros(rows, cap, d, dtype=q.dtype)
        kh[:, :n].copy_(keys)
        vh[:, :n].copy_(vals)
        kh_n, vh_n = kh[:, :n], vh[:, :n]
        p = torch.softmax(torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=scale), -1)

        def sdpa_head_major():
            return F.scaled_dot_product_attention(q.unsqueeze(0), kh_n.unsqueeze(0),
                                                  vh_n.unsqueeze(0), attn_mask=bias.unsqueeze(0))

        def manual_head_major():
            s = torch.baddbmm(bias, q, kh_n.transpose(1, 2), alpha=scale)
            return torch.bmm(torch.softmax(s, -1), vh_n)

        t = {
            "attend (current: strided seq-major views)": _timeit(lambda: attend(q, buf, n, scale), reps),
            "baddbmm QK^T, strided K view": _timeit(
                lambda: torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=scale), reps),
            "baddbmm QK^T, contiguous (R,n,d) K": _timeit(
                lambda: torch.baddbmm(bias, q, kc.transpose(1, 2), alpha=scale), reps),
            "baddbmm QK^T, contiguous (R,d,n) K^T": _timeit(
                lambda: torch.baddbmm(bias, q, kT_c, alpha=scale), reps),
            "bmm PV, strided V view": _timeit(lambda: torch.bmm(p, vals), reps),
            "bmm PV, contiguous (R,n,d) V": _timeit(lambda: torch.bmm(p, vc), reps),
            "K.contiguous()+V.contiguous() copy (cost if copied)": _timeit(
                lambda: (keys.contiguous(), vals.contiguous()), reps),
            "bias zeros+masked_fill": _timeit(lambda: torch.zeros(rows, 1, n).masked_fill_(
                ~buf.valid[:n].t().unsqueeze(1), float("-inf")), reps),
            "softmax (R,g,n)": _timeit(lambda: torch.softmax(p, -1), reps),
            "manual attend on head-major (R,cap,d) prefix views": _timeit(manual_head_major, reps),
            "SDPA on head-major prefix views (+mask)": _timeit(sdpa_head_major, reps),
        }
        ref = attend(q, buf, n, scale)[0]
        agree = {"head_major_manual_max_abs_diff": float((manual_head_major() - ref).abs().max()),
                 "sdpa_head_major_max_abs_diff": float((sdpa_head_major()[0] - ref).abs().max())}
        buf.valid[n - 1] = False
    per_run = c.num_layers * (new_tokens - 1)
    return {"slots_attended": n, "rows": rows, "group": g, "head_dim": d,
            "bmm_children_ops": children, "bmm_copies_operands": copies_inside,
            "bmm_operand_copies": operand_copies,
            "strides": {"K_view_for_QK": list(keys.transpose(1, 2).stride()),
                        "V_view": list(vals.stride())},
            "median_us_per_layer_call": {k: v * 1e6 for k, v in t.items()},
            "per_generate_run_ms_(x layers x decode steps)": {
                k: v * per_run * 1e3 for k, v in t.items()},
            "numerics": agree}


# ------------------------------------------------------------------------------ what-ifs
# Candidate engine changes, measured here by patching the engine from outside for the duration
# of one measurement (flexevict/ itself is not modified).

def cold_decode_attention(llm, st, new_tokens, reps=5):
    """Decode attention for all layers in turn, as in a real step: the 30 layers' K/V (~3.5 MB
    each at batch 8) do not fit the L3, so every layer reads its K/V from DRAM. Compares the
    current `attend` on the sequence-major buffer with the same math on head-major copies and
    with SDPA on either layout. Each variant builds its padding bias per call, like `attend`."""
    c = llm.config
    g, d = c.num_heads // c.num_kv_heads, c.dim_head
    scale = d ** -0.5
    bufs = st.bufs
    n = bufs[0].used + 1
    rows, cap = bufs[0].k.shape[1], bufs[0].k.shape[0]
    attend = fmodel.attend
    res = {}
    with torch.inference_mode():
        torch.manual_seed(0)
        qs = [torch.randn(rows, g, d, dtype=b.k.dtype) for b in bufs]
        for b in bufs:
            b.valid[n - 1] = True
        heads = []                                   # (rows, capacity+1, d) buffers, same data
        for b in bufs:
            kh = torch.zeros(rows, cap, d, dtype=b.k.dtype)
            vh = torch.zeros(rows, cap, d, dtype=b.k.dtype)
            kh[:, :n].copy_(b.k[:n].transpose(0, 1))
            vh[:, :n].copy_(b.v[:n].transpose(0, 1))
            heads.append((kh, vh, b.valid.t().contiguous()))

        def bias_of(valid_rows_by_slots):            # (rows, n) bool -> (rows, 1, n) float
            bias = torch.zeros(rows, 1, n, dtype=qs[0].dtype)
            return bias.masked_fill_(~valid_rows_by_slots.unsqueeze(1), float("-inf"))

        def current():
            for q, b in zip(qs, bufs):
                attend(q, b, n, scale)

        def head_major_manual():
            for q, (kh, vh, val) in zip(qs, heads):
                s = torch.baddbmm(bias_of(val[:, :n]), q, kh[:, :n].transpose(1, 2), alpha=scale)
                torch.bmm(torch.softmax(s, -1), vh[:, :n])

        def head_major_sdpa():
            for q, (kh, vh, val) in zip(qs, heads):
                F.scaled_dot_product_attention(q[None], kh[None, :, :n], vh[None, :, :n],
                                               attn_mask=bias_of(val[:, :n])[None])

        def seq_major_sdpa():
            for q, b in zip(qs, bufs):
                F.scaled_dot_product_attention(q[None], b.k[:n].transpose(0, 1)[None],
                                               b.v[:n].transpose(0, 1)[None],
                                               attn_mask=bias_of(b.valid[:n].t())[None])

        variants = {"current attend (seq-major strided views, baddbmm+softmax+bmm)": current,
                    "same math on head-major (rows, slots, d) buffers": head_major_manual,
                    "SDPA on head-major buffers": head_major_sdpa,
                    "SDPA on seq-major strided views": seq_major_sdpa}
        for k, fn in variants.items():
            res[k] = _timeit(fn, reps)
        for b in bufs:
            b.valid[n - 1] = False
    base = res["current attend (seq-major strided views, baddbmm+softmax+bmm)"]
    kv_mb = sum(2 * rows * n * d * b.k.element_size() for b in bufs) / 1e6
    return {"slots_attended": n, "layers": len(bufs), "kv_bytes_read_per_step_MB": kv_mb,
            "ms_per_decode_step": {k: v * 1e3 for k, v in res.items()},
            "effective_GB_per_s": {k: kv_mb / 1e3 / v for k, v in res.items()},
            "ms_per_generate_run": {k: v * 1e3 * (new_tokens - 1) for k, v in res.items()},
            "saving_vs_current_ms_per_step": {k: (base - v) * 1e3 for k, v in res.items()}}


def prefill_sdpa_mask_vs_causal(llm, batch, length, reps=3):
    """Prefill SDPA as the engine calls it (explicit (B,1,S,S) bool mask) vs is_causal=True,
    valid when a batch has no padding."""
    c = llm.config
    torch.manual_seed(0)
    q = torch.randn(batch, c.num_heads, length, c.dim_head)
    k = torch.randn(batch, c.num_kv_heads, length, c.dim_head)
    v = torch.randn(batch, c.num_kv_heads, length, c.dim_head)
    gqa = c.num_heads != c.num_kv_heads
    with torch.inference_mode():
        mask = fmodel.prefill_mask(torch.ones(batch, length, dtype=torch.bool))
        with_mask = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        causal = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        t_mask, t_causal = _timeit(with_mask, reps), _timeit(causal, reps)
        diff = float((with_mask() - causal()).abs().max())
    L = c.num_layers
    return {"per_layer_ms": {"bool mask": t_mask * 1e3, "is_causal": t_causal * 1e3},
            "per_prefill_ms": {"bool mask": t_mask * 1e3 * L, "is_causal": t_causal * 1e3 * L},
            "saving_per_prefill_ms": (t_mask - t_causal) * 1e3 * L, "max_abs_diff": diff}


# ------------------------------------------------------------------------------ main
def git_commit(repo):
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                    cwd=repo, capture_output=True, text=True).stdout.strip())
        return head, dirty
    except Exception:
        return None, None


def machine_info():
    import transformers
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commit, dirty = git_commit(repo)
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpu_model": cpu, "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(),
            "torch_interop_threads": torch.get_num_interop_threads(),
            "mkl": torch.backends.mkl.is_available(), "mkldnn": torch.backends.mkldnn.is_available(),
            "flexevict_linear": "onednn-prepacked" if fmodel.onednn_usable("cpu", torch.float32)
            else "F.linear",
            "git_commit": commit, "git_dirty_tracked": dirty}


def agreement(a, b):
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    total = sum(len(r) for r in a)
    prefix = []
    for ra, rb in zip(a, b):
        k = 0
        while k < min(len(ra), len(rb)) and ra[k] == rb[k]:
            k += 1
        prefix.append(k)
    return {"identical_tokens": same, "total_tokens": total, "fraction_identical": same / total,
            "identical_prefix_per_row": prefix, "all_identical": same == total and
            all(len(x) == len(y) for x, y in zip(a, b))}


def summarize(rr, B, N, L, stat):
    full = stat(rr["full_s"])
    ttft = stat(rr["ttft_inrun_s"])
    dec = stat([f - p for f, p in zip(rr["full_s"], rr["ttft_inrun_s"])])
    out = {"full_s": full, "tokens_per_s": B * N / full, "ttft_inrun_s": ttft,
           "prefill_tokens_per_s_inrun": B * L / ttft,
           "decode_s_from_inrun": dec, "decode_step_ms_from_inrun": dec / (N - 1) * 1e3,
           "decode_tokens_per_s_from_inrun": B * (N - 1) / dec, "prefill_run_s": None}
    if rr["prefill_run_s"]:
        pre = stat(rr["prefill_run_s"])
        out.update(prefill_run_s=pre, decode_s_from_prefill_run=full - pre,
                   decode_step_ms_from_prefill_run=(full - pre) / (N - 1) * 1e3)
    return out


def print_ops(title, tp, n_ops):
    extra = f", {tp['kv_slots_attended']} slots in cache" if "kv_slots_attended" in tp else ""
    print(f"\n{title} (profiler self CPU {tp['self_cpu_total_ms']:.1f} ms{extra})")
    for k, v in tp["categories_ms"].items():
        print(f"  {k:58s}{v:9.2f} ms {100 * v / tp['self_cpu_total_ms']:5.1f}%")
    print("  top ops by self CPU:")
    for o in tp["top_ops"][:n_ops]:
        print(f"    {o['op']:56s}{o['self_cpu_ms']:9.2f} ms  x{o['calls']}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json", default=None, help="write all numbers to this file")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads for both systems (default: torch's own choice)")
    ap.add_argument("--no-prefill-runs", action="store_true",
                    help="skip the separate max_new_tokens=1 runs (in-run TTFT is still measured)")
    ap.add_argument("--no-profile", action="store_true",
                    help="skip the breakdowns (region timer, profiler, attention layout)")
    ap.add_argument("--no-what-if", action="store_true",
                    help="skip the measured what-ifs (attention layouts, causal SDPA)")
    args = ap.parse_args(argv)
    if args.new_tokens < 2:
        ap.error("--new-tokens must be >= 2 (decode time is full - prefill)")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    info = machine_info()
    threads = torch.get_num_threads()
    print(f"torch threads: {threads} (intra-op, the same for both systems); cpu_count "
          f"{os.cpu_count()}; torch {info['torch']}, transformers {info['transformers']}")

    log("loading flexevict")
    t = time.perf_counter()
    llm = flexevict.LLM("smollm2-135m")
    load_flex = time.perf_counter() - t
    gguf = smollm2_gguf()
    log("loading transformers")
    t = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                              dtype=torch.float32, attn_implementation="sdpa")
    hf.eval()
    load_hf = time.perf_counter() - t
    assert hf.dtype == torch.float32 and llm.model.dtype == torch.float32
    # same weights on both sides (the linear weights may be prepacked; the embedding is not)
    wdiff = (llm.model.outer["embed"] - hf.model.embed_tokens.weight).abs().max().item()

    prompts = build_prompts(llm.tokenizer, args.batch, args.prompt_len)
    assert all(len(p) == args.prompt_len for p in prompts)
    assert len({tuple(p) for p in prompts}) == args.batch
    runners = [FlexRunner(llm, prompts), HFRunner(hf, prompts)]

    log("warm-up (2 new tokens each)")
    for r in runners:
        r.run(2)

    runs = {r.name: {"full_s": [], "ttft_inrun_s": [], "prefill_run_s": [],
                     "probe_gflops_before": [], "probe_gflops_after": []} for r in runners}
    tokens = {}
    pair_ratio = []
    for rnd in range(args.repeats):
        order = runners if rnd % 2 == 0 else runners[::-1]      # A B, B A, A B, ...
        full = {}
        for r in order:
            g0 = probe_gflops()
            dt, ttft, out = r.run(args.new_tokens)
            g1 = probe_gflops()
            rr = runs[r.name]
            rr["full_s"].append(dt)
            rr["ttft_inrun_s"].append(ttft)
            rr["probe_gflops_before"].append(g0)
            rr["probe_gflops_after"].append(g1)
            tokens[r.name] = out
            full[r.name] = dt
            log(f"round {rnd + 1}/{args.repeats} {r.name:12s} full {dt:6.2f}s  ttft {ttft:5.2f}s  "
                f"(probe {g0:4.0f}/{g1:4.0f} GFLOP/s before/after)")
        pair_ratio.append(full["transformers"] / full["flexevict"])
        if not args.no_prefill_runs:
            for r in order:
                dt, _, _ = r.run(1)
                runs[r.name]["prefill_run_s"].append(dt)
                log(f"round {rnd + 1}/{args.repeats} {r.name:12s} prefill-only {dt:6.2f}s")

    B, N, L = args.batch, args.new_tokens, args.prompt_len
    summary = {name: summarize(rr, B, N, L, median) for name, rr in runs.items()}
    summary_min = {name: summarize(rr, B, N, L, min) for name, rr in runs.items()}
    fx, tf = summary["flexevict"], summary["transformers"]
    # A round is "clean" when the machine ran at full speed around both of its runs: every probe
    # >= 75% of the fastest probe of this session and each run <= 1.25x that system's best time.
    probes = [g for rr in runs.values() for g in rr["probe_gflops_before"] + rr["probe_gflops_after"]]
    spread = max(probes) / min(probes)
    clean = []
    for i in range(args.repeats):
        ok = all(rr["probe_gflops_before"][i] >= 0.75 * max(probes)
                 and rr["probe_gflops_after"][i] >= 0.75 * max(probes)
                 and rr["full_s"][i] <= 1.25 * min(rr["full_s"]) for rr in runs.values())
        clean.append(ok)
    clean_ratios = [r for r, ok in zip(pair_ratio, clean) if ok]
    ratios = {
        "headline_throughput_ratio_flex_over_hf": median(clean_ratios or pair_ratio),
        "headline_basis": (f"median of per-round ratios over {len(clean_ratios)} clean round(s)"
                           if clean_ratios else "median of per-round ratios (no clean round)"),
        "clean_rounds": clean,
        "throughput_ratio_flex_over_hf": tf["full_s"] / fx["full_s"],
        "throughput_ratio_median_of_per_round": median(pair_ratio),
        "throughput_ratio_of_min_times": (summary_min["transformers"]["full_s"]
                                          / summary_min["flexevict"]["full_s"]),
        "per_round_ratios": pair_ratio,
        "prefill_speed_ratio_inrun": tf["ttft_inrun_s"] / fx["ttft_inrun_s"],
        "decode_speed_ratio_inrun": tf["decode_s_from_inrun"] / fx["decode_s_from_inrun"],
        "note": "all ratios are flexevict speed / transformers speed (>1: flexevict faster). "
                "throughput_ratio_flex_over_hf = median HF time / median flexevict time; a round "
                "is clean when all its probes are >= 0.75 x the session's best probe and both "
                "runs are <= 1.25 x their system's best time",
    }
    if fx["prefill_run_s"] is not None:
        ratios["prefill_speed_ratio_prefill_run"] = tf["prefill_run_s"] / fx["prefill_run_s"]
        ratios["decode_speed_ratio_prefill_run"] = (tf["decode_s_from_prefill_run"]
                                                    / fx["decode_s_from_prefill_run"])
    agree = agreement(tokens["flexevict"], tokens["transformers"])

    breakdown = fops = hops = layout = None
    whatif = {}
    if not args.no_profile:
        log("flexevict: region timer + torch.profiler (prefill, decode steps)")
        breakdown, fops, st = flex_profile(llm, prompts, N)
        log("flexevict: decode attention layout study")
        layout = attention_layout_study(llm, st, N, reps=50)
        if not args.no_what_if:
            log("what-if: decode attention over all layers (cold K/V)")
            whatif["decode_attention_cold"] = cold_decode_attention(llm, st, N)
        del st
        log("transformers: torch.profiler (prefill, one decode step)")
        hops = hf_profile(hf, prompts)
    if not args.no_what_if:
        log("what-if: prefill SDPA with is_causal instead of the bool mask")
        whatif["prefill_sdpa"] = prefill_sdpa_mask_vs_causal(llm, B, L)

    # ------------------------------------------------------------------ report
    print()
    print(f"SmolLM2-135M fp32 on CPU ({info['cpu_model']}), batch {B} x prompt {L} tokens "
          f"(no padding), {N} new tokens greedy, {args.repeats} rounds, {threads} threads")
    print(f"same weights (embedding max |diff|): {wdiff:g}; load: flexevict {load_flex:.1f}s, "
          f"transformers {load_hf:.1f}s")
    hdr = f"{'median over rounds':30s}{'flexevict':>12s}{'transformers':>14s}{'flex/HF speed':>15s}"
    print(hdr)
    print("-" * len(hdr))

    def row(label, a, b, fmt="{:.3f}", speed=True, inverse=False):
        sp = ""
        if speed:
            sp = f"{(a / b if inverse else b / a):.3f}x"
        print(f"{label:30s}{fmt.format(a):>12s}{fmt.format(b):>14s}{sp:>15s}")

    fm, tm = summary_min["flexevict"], summary_min["transformers"]
    row("full generate, s", fx["full_s"], tf["full_s"])
    row("  tokens/s (B*N/time)", fx["tokens_per_s"], tf["tokens_per_s"], "{:.1f}", inverse=True)
    row("  min over rounds, s", fm["full_s"], tm["full_s"])
    row("prefill: TTFT in-run, s", fx["ttft_inrun_s"], tf["ttft_inrun_s"])
    row("  prefill tokens/s", fx["prefill_tokens_per_s_inrun"], tf["prefill_tokens_per_s_inrun"],
        "{:.0f}", inverse=True)
    if fx["prefill_run_s"] is not None:
        row("prefill: run new_tokens=1, s", fx["prefill_run_s"], tf["prefill_run_s"])
    row("decode: full - TTFT, s", fx["decode_s_from_inrun"], tf["decode_s_from_inrun"])
    row("  per decode step, ms", fx["decode_step_ms_from_inrun"], tf["decode_step_ms_from_inrun"],
        "{:.1f}")
    row("  decode tokens/s", fx["decode_tokens_per_s_from_inrun"],
        tf["decode_tokens_per_s_from_inrun"], "{:.1f}", inverse=True)
    if fx["prefill_run_s"] is not None:
        row("decode: full - prefill run, s", fx["decode_s_from_prefill_run"],
            tf["decode_s_from_prefill_run"])
    print(f"\nTHROUGHPUT RATIO flexevict / transformers = "
          f"{ratios['headline_throughput_ratio_flex_over_hf']:.3f} ({ratios['headline_basis']})")
    print(f"  ratio of median times {ratios['throughput_ratio_flex_over_hf']:.3f}; per-round "
          f"[{', '.join(f'{x:.3f}' + ('' if ok else '*') for x, ok in zip(pair_ratio, clean))}] "
          f"(* = round disturbed); ratio of min times {ratios['throughput_ratio_of_min_times']:.3f}")
    print(f"greedy tokens identical: {agree['identical_tokens']}/{agree['total_tokens']} "
          f"({agree['fraction_identical']:.4f}); identical prefix per row: "
          f"{agree['identical_prefix_per_row']}")
    print(f"machine-speed probe around timed runs: {min(probes):.0f}..{max(probes):.0f} GFLOP/s "
          f"(max/min {spread:.2f})" + ("  <-- the machine's speed changed during the runs; trust "
                                       "per-round ratios and min times more" if spread > 1.3 else ""))

    if breakdown:
        for phase in ("prefill", "decode_step"):
            b = breakdown[phase]
            where = (f", cache {b['kv_slots_at_start']}+ slots" if phase == "decode_step" else "")
            print(f"\nflexevict {phase}: {b['seconds_per_call'] * 1e3:.1f} ms per call (exclusive "
                  f"wall time per region, mean of {b['calls_averaged']}{where})")
            for k, v in b["regions_s"].items():
                c = b["region_calls_per_call"].get(k, 1)
                print(f"  {k:58s}{v * 1e3:9.2f} ms {100 * v / b['seconds_per_call']:5.1f}%"
                      f"  ({c} calls, {v / c * 1e6:.0f} us each)")
        print_ops("flexevict prefill", fops["prefill"], 12)
        print_ops("flexevict decode step", fops["decode_step"], 12)
        print_ops("transformers prefill (model forward, for comparison)", hops["prefill"], 8)
        print_ops("transformers decode step (model forward, for comparison)", hops["decode_step"], 8)
        La = layout
        print(f"\ndecode attention, one layer, {La['slots_attended']} slots x {La['rows']} rows x "
              f"d={La['head_dim']} (group {La['group']}); strides K^T view "
              f"{La['strides']['K_view_for_QK']}, V view {La['strides']['V_view']}")
        print("  ops inside bmm/baddbmm [input shapes]:")
        for k, v in La["bmm_children_ops"].items():
            print(f"    {k}: {', '.join(v)}")
        print(f"  -> bmm/baddbmm copy the K/V operands: {La['bmm_copies_operands']} "
              f"{La['bmm_operand_copies'] or ''}  (baddbmm's copy_ of (R, g, n) is its bias input)")
        per = La["per_generate_run_ms_(x layers x decode steps)"]
        print(f"  {'cache-hot micro-benchmark (median of 50)':56s}{'us/call':>9s}  {'ms/run':>8s}")
        for k, v in La["median_us_per_layer_call"].items():
            print(f"  {k:56s}{v:9.1f}  {per[k]:8.1f}")
        print(f"  numerics vs current attend: {La['numerics']}")

    if whatif:
        print("\nWHAT-IFS (candidate engine changes, measured by patching the engine from the bench)")
        if "prefill_sdpa" in whatif:
            w = whatif["prefill_sdpa"]
            print(f"  prefill SDPA, bool mask -> is_causal (no padding): "
                  f"{w['per_prefill_ms']['bool mask']:.0f} -> {w['per_prefill_ms']['is_causal']:.0f} "
                  f"ms per prefill (saves {w['saving_per_prefill_ms']:.0f} ms; max |diff| "
                  f"{w['max_abs_diff']:.1e})")
        if "decode_attention_cold" in whatif:
            w = whatif["decode_attention_cold"]
            print(f"  decode attention, all {w['layers']} layers in turn (K/V from DRAM, "
                  f"{w['kv_bytes_read_per_step_MB']:.0f} MB per step, {w['slots_attended']} slots):")
            for k, v in w["ms_per_decode_step"].items():
                print(f"    {k:62s}{v:7.2f} ms/step {w['effective_GB_per_s'][k]:5.1f} GB/s "
                      f"{w['ms_per_generate_run'][k]:7.0f} ms/run")

    result = {"benchmark": "cpu_generate", "model": "smollm2-135m", "gguf": gguf, "dtype": "float32",
              "args": vars(args), "machine": info,
              "load_s": {"flexevict": load_flex, "transformers": load_hf},
              "weights_max_abs_diff_embedding": wdiff,
              "runs": runs, "summary_median": summary, "summary_min": summary_min,
              "ratios": ratios, "token_agreement": agree,
              "machine_probe_gflops": {"min": min(probes), "max": max(probes), "max_over_min": spread},
              "flexevict_region_breakdown": breakdown, "flexevict_profiler": fops,
              "transformers_profiler": hops, "decode_attention_layout": layout,
              "what_if": whatif,
              "benchmark_wall_s": time.perf_counter() - T0}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {args.json}")
    log("done")
    return result


if __name__ == "__main__":
    main()
