"""Predicted time and memory of a run under a placement: FlexGen's cost model for this engine.

FlexGen ("FlexGen: High-Throughput Generative Inference of Large Language Models with a Single
GPU", Sheng et al., ICML 2023, section 4, "Cost model") predicts a layer's time in prefill and in
each decode step as the maximum of five overlapped terms, ctog, gtoc, dtoc, ctod and comp, and
the total as T_pre * l + T_gen * (n - 1) * l. This module keeps that shape for the engine's block
schedule (engine.py) and adds what eviction changes: the cache is a budget-sized buffer of the
policy's resolved slots (`Policy.slots_for`), so its bytes, its loads and stores and the
attention over it shrink with the budget, and the policy's own hooks cost time per slot.

Per token step and schedule layer s (embed, attention and MLP halves or whole blocks, head),
with k over the GPU batches of the block:

    T_s = max(comp_s, W_{s+1}, CL_s, CS_s, work_s / cores) + fixed_s    (--overlap)
    T_s = comp_s + W_s + CL_s + CS_s + fixed_s                           (no overlap)

- comp_s = sum_k: matmuls (weights streamed from memory + flops), attention (prefill: causal
  SDPA, or for a policy that ranks the prompt the pass that also sums its columns; decode: per
  attended slot),
  element-wise passes over the hidden states, the policy's hooks (per slot x row), and
  activation moves to and from a CPU tier (the engine makes them on the compute stream, so they
  add to comp rather than overlap it, unlike FlexGen's model).
- W_{s+1}: the next layer's weights, loaded while s computes (the first layer's load is not
  hidden): bytes over their link (pinned or pageable host-to-device; disk through the page
  cache), dequantization when compressed, and on a CPU device the oneDNN reorder of each
  streamed linear weight (`model.PackedWeight`, its cost measured by size).
- CL_s, CS_s: loading each GPU batch's cache buffer from its tier (whole: it is budget-sized)
  and storing back what changed (one slot of K/V and the per-slot state in decode, everything
  after prefill), with 4-bit (de)quantization when the cache is compressed.
- On a CUDA device the links are shared resources: weight and cache loads both use
  host-to-device, so they add up on it (as ctog does in FlexGen). On a CPU device every term is
  a thread of the same CPU: `work_s / cores` bounds them together, and `fixed_s` (the engine's
  Python work per cell and per lane job, serialised by the GIL) adds outside the maximum; on a
  GPU the fixed costs overlap the device's work (kernel launches are asynchronous).

Decode attention grows with the slots step i attends, min(P + i, slots) (BUZZ's saw between
its passes: `Layout.held`), so decode time is summed over steps (sampled at up to 8 evenly
spaced steps). Memory per tier is MemoryPlan's
(memory.py, the same numbers the run's preflight checks).

Three things come from the calibration's probes rather than from first principles: a later GPU
batch of the same layer reads its weights from the last-level cache when they fit (measured
rate); the element-wise passes of a half layer (a one-layer probe's measured halves less their
matmuls and attention); and, on a CPU, factors on compute and on weight streaming that make the
model reproduce the real engine on a six-layer probe (`_efficiency`): what isolated
measurements miss when the compute thread and a lane thread share one CPU's memory bandwidth,
caches and GIL.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import torch

from flexevict.core.model import LINEAR_WEIGHTS
from flexevict.planner.calibration import attention_rate
from flexevict.runtime.layers import layer_slots, layer_specs
from flexevict.runtime.memory import MemoryPlan, stage_weights

# Element-wise passes per half layer, without a calibration probe: over (tokens x hidden) in the
# attention half (norm, RoPE, reshapes, residual), over (tokens x (hidden + ffn)) in the MLP half
# (norm, activation, residual); counted from model.py's ops.
PASSES = {"opt": {"attn": 12.0, "mlp": 3.0}, "llama": {"attn": 16.0, "mlp": 4.0}}
SAMPLED_STEPS = 8
EFFICIENCY_RANGE = (0.5, 4.0)     # the engine probe's factors are kept within this
BIG_MATRIX = 32 << 20      # glibc's largest mmap threshold: bigger buffers are always fresh pages
NO_LOAD = {"total": 0.0, "link": 0.0, "device": 0.0, "term": ""}
NO_CACHE = {"load": (0.0, 0.0), "store": (0.0, 0.0), "offloaded": False,
            "term_load": "cache loading", "term_store": "cache storing"}


@dataclass
class Estimate:
    """The prediction for one placement and batch of n sequences."""
    placement: object
    n: int
    prefill_s: float
    decode_s: float                    # all gen_len - 1 decode steps
    memory: dict                       # bytes per tier (MemoryPlan.needs)
    prefill_terms: dict = field(default_factory=dict)   # term -> seconds it bounds
    decode_terms: dict = field(default_factory=dict)    # per decode step (mean)
    gen_len: int = 1

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def throughput(self) -> float:
        """Generated tokens per second, prefill included (FlexGen's total throughput)."""
        return self.n * self.gen_len / self.total_s

    @property
    def step_s(self) -> float:
        return self.decode_s / max(self.gen_len - 1, 1)

    def bound(self, phase: str = "decode") -> tuple[str, float]:
        """(the term that bounds most of the phase's time, its share)."""
        terms = self.decode_terms if phase == "decode" else self.prefill_terms
        total = sum(terms.values()) or 1.0
        name = max(terms, key=terms.get) if terms else "compute"
        return name, terms.get(name, 0.0) / total

    def describe(self) -> dict:
        return {"n": self.n, "prefill_s": self.prefill_s, "decode_s": self.decode_s,
                "decode_step_s": self.step_s, "total_s": self.total_s,
                "throughput": self.throughput, "memory_bytes": dict(self.memory),
                "prefill_terms": dict(self.prefill_terms), "decode_terms": dict(self.decode_terms)}


class CostModel:
    """Predictions for one model, lengths, policy and compute device, from a calibration.

    slots: the policy's resolved slots per (sequence, layer, kv head), scratch included
    (`PolicySpec.make().slots_for(prompt_len, gen_len)`)."""

    def __init__(self, config, calibration, device, dtype, prompt_len: int, gen_len: int,
                 spec, efficiency: dict | None = None):
        """efficiency: the factors `_efficiency` fits (given: the probe's own model)."""
        self.config, self.cal, self.dtype = config, calibration, dtype
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.P, self.G, self.spec = prompt_len, gen_len, spec
        policy = spec.make()
        self.slots = policy.slots_for(prompt_len, gen_len)
        self.evicts = self.slots < prompt_len + gen_len
        layout = policy.layout(prompt_len, gen_len)
        # each layer's own slots (a sliding layer's window): the memory plan counts them; the
        # times below price every layer at the policy's
        self.layer_slots = layer_slots(layer_specs(config, policy, prompt_len, gen_len, layout))
        self.history = layout.home_tokens                 # recall's
        self.attended = layout.attended_per_step(gen_len - 1)   # by decode step 1, 2, ...
        self.written = layout.written_per_step            # K/V slots a step stores back
        self.ranks_prompt = policy.needs_prompt_scores and self.evicts
        self.elem = torch.empty((), dtype=dtype).element_size()
        self.dev = calibration.device(self.device, dtype)
        self.hooks = calibration.policy(spec, self.device, dtype)
        self._cpu = None
        self._loads = {}          # weight loads per (weight placement, stage)
        self._kinds = {}          # sep_layer -> (kind, weights) of each kind of stage
        self._passes_fit = None
        self._eff = efficiency
        for sep in (True, False):      # now: building them imports what a plan's memory counts
            self._stage_kinds(sep)
        host = calibration.data["host"]
        self._parallel = host.get("parallel", host["cores"])

    # ------------------------------------------------------------------ public
    def memory_plan(self, placement, n: int) -> MemoryPlan:
        return MemoryPlan(self.config, placement, self.dtype, n, self.P, self.G,
                          self.layer_slots, self.history)

    def estimate(self, placement, n: int, plan: MemoryPlan | None = None) -> Estimate:
        """Predicted prefill and decode time of n sequences under `placement`."""
        plan = plan or self.memory_plan(placement, n)
        sizes = plan.sizes
        prefill, pre_terms = self._step(placement, plan, sizes, 0, self.P)
        decode, dec_terms = 0.0, {}
        for step, weight, attended in self._decode_samples():
            t, terms = self._step(placement, plan, sizes, step, attended)
            decode += weight * t
            for k, v in terms.items():
                dec_terms[k] = dec_terms.get(k, 0.0) + v * weight / max(self.G - 1, 1)
        return Estimate(placement, n, prefill, decode, plan.needs(self.device), pre_terms,
                        dec_terms, self.G)

    def _decode_samples(self) -> list[tuple[int, float, int]]:
        """(decode step i >= 1, how many steps it stands for, the slots they attend on average),
        the counts summing to gen_len - 1: a sample's slots are its span's mean (BUZZ's saw
        is not aliased by where a sample falls)."""
        steps, attended = self.G - 1, self.attended     # step i attends attended[i - 1]
        if steps <= SAMPLED_STEPS:
            return [(i, 1.0, attended[i - 1]) for i in range(1, steps + 1)]
        width = steps / SAMPLED_STEPS
        samples = []
        for j in range(SAMPLED_STEPS):
            span = attended[int(j * width):int((j + 1) * width)]
            samples.append((1 + int((j + 0.5) * width), width, round(sum(span) / len(span))))
        return samples

    # ------------------------------------------------------------------ one token step
    def _step(self, p, plan, sizes, i: int, n: int) -> tuple[float, dict]:
        """Seconds of token step i (0: prefill) attending n slots -> (seconds, term -> the
        seconds of the stages it bounds). Every block is alike, so each (layer kind, next
        layer kind) pair is costed once and counted as often as it occurs."""
        stages = {s[0]: s[1] for s in self._stage_kinds(p.sep_layer)}
        loads = {kind: self._weight_load(p, plan, stage) for kind, stage in stages.items()}
        cache = self._cache_io(p, plan, sizes, i)
        works = [p.work_tier(t) if i > 0 else "gpu" for t in p.cache_tiers(len(sizes))]
        total, terms = 0.0, {}

        def add(term, t):
            terms[term] = terms.get(term, 0.0) + t
        if p.overlap and loads["embed"]["total"]:     # the step's first load is not hidden
            total += loads["embed"]["total"]
            add(loads["embed"]["term"], loads["embed"]["total"])
        for kind, nxt, count in self._sequence(p.sep_layer):
            comp = sum(self._compute(p, kind, stages[kind], b, i, n, work, hot=k > 0)
                       for k, (b, work) in enumerate(zip(sizes, works)))
            w = loads[kind] if not p.overlap else loads[nxt] if nxt else NO_LOAD
            has_cache = kind in ("attn", "block")
            t, term = self._overlap(p, comp, w, cache if has_cache else NO_CACHE)
            fixed = self._fixed(p, kind, sizes, i, loads[kind]["total"] > 0,
                                has_cache and cache["offloaded"])
            total += count * (t + fixed)
            add(term, count * t)
            if fixed:
                add("fixed per-layer costs (Python, lane jobs)", count * fixed)
        return total, terms

    def _stage_kinds(self, sep_layer: bool) -> list[tuple[str, list]]:
        """(kind, its weights) for embed, the first block's stage(s) and head."""
        if sep_layer not in self._kinds:
            stages = stage_weights(self.config, sep_layer)
            kinds = ["embed", "attn", "mlp"] if sep_layer else ["embed", "block"]
            self._kinds[sep_layer] = [*zip(kinds, stages), ("head", stages[-1])]
        return self._kinds[sep_layer]

    def _sequence(self, sep_layer: bool) -> list[tuple[str, str | None, int]]:
        """The schedule as (layer kind, the next layer's kind, how many times in a step)."""
        L = self.config.num_layers
        if sep_layer:
            return [("embed", "attn", 1), ("attn", "mlp", L), ("mlp", "attn", L - 1),
                    ("mlp", "head", 1), ("head", None, 1)]
        return [("embed", "block", 1), ("block", "block", L - 1), ("block", "head", 1),
                ("head", None, 1)]

    def _overlap(self, p, comp: float, w: dict, cache: dict) -> tuple[float, str]:
        """One stage's time from its terms -> (seconds, the bounding term's name)."""
        load, store = cache["load"], cache["store"]
        if not p.overlap:
            return comp + w["total"] + sum(load) + sum(store), "compute (no overlap)"
        if self.cuda:        # the GPU computes and (de)quantizes; the links carry the bytes
            h2d = w["link"] + load[1]             # weights and cache share host-to-device
            terms = {"compute": comp + load[0] + store[0] + w["device"],
                     (w["term"] if w["link"] >= load[1] else cache["term_load"]): h2d,
                     cache["term_store"]: store[1]}
        else:                # every lane is a thread on the same CPU
            terms = {"compute": comp, w["term"] or "weight loading": w["total"],
                     cache["term_load"]: sum(load), cache["term_store"]: sum(store),
                     "CPU cores (all lanes together)":
                         (comp + w["total"] + sum(load) + sum(store)) / self._parallel}
        name = max(terms, key=terms.get)
        return terms[name], name

    # ------------------------------------------------------------------ compute
    def _compute(self, p, kind: str, stage, b: int, i: int, n: int, work: str,
                 hot: bool = False) -> float:
        """Seconds one GPU batch of b sequences computes stage `kind` at step i (n slots), its
        attention on the `work` tier (cpu with --cpu-cache-compute and a cpu or disk cache).
        hot: an earlier GPU batch just read this layer's weights (from the cache if they fit)."""
        c, d, e = self.config, self.dev, self.elem
        tokens = b * self.P if i == 0 and kind != "head" else b    # the head: last tokens only
        matrices = [(name, s) for name, s in stage if name in LINEAR_WEIGHTS and len(s) == 2]
        bw = self._weight_read_bw(sum(math.prod(s) for _, s in matrices) * e, hot)
        t = 0.0
        for name, shape in matrices:
            t += shape[0] * shape[1] * e / bw + 2 * tokens * shape[0] * shape[1] / d["gemm_flops"]
        t += self._passes(kind, tokens) * tokens * e / d["mem_bw"]
        if kind == "head":
            t += b * c.vocab_size * 4 * 2 / d["mem_bw"]          # fp32 logits and the argmax
        if kind in ("attn", "block"):
            t += self._attention(p, b, i, n, work)
        if p.act_tier == "cpu" and kind != "embed":            # fetch the input, park the output
            moved = b * self.P if i == 0 else b
            t += 2 * moved * c.hidden_size * e / self._act_link(p)
        return t * self._efficiency()["prefill" if i == 0 else "decode"]

    def _passes(self, kind: str, tokens: int) -> float:
        """Elements per token an element-wise pass moves in layer `kind`, times the passes, in
        a step of `tokens` tokens."""
        c, passes = self.config, self._fitted_passes(tokens)
        width = {"embed": 3.0 * c.hidden_size, "head": 3.0 * c.hidden_size,
                 "attn": passes["attn"] * c.hidden_size,
                 "mlp": passes["mlp"] * (c.hidden_size + c.ffn_size)}
        width["block"] = width["attn"] + width["mlp"]
        return width[kind]

    def _fitted_passes(self, tokens: int | None = None) -> dict:
        """The passes that make the calibration's probe layer (calibration.measure_probe) come
        out as measured: its halves' time less their matmuls, attention and the full policy's
        prefill hook, over one pass's time (PASSES without a probe). Where the calibration has
        the probe at a long prefill too ("probe_long", on a CPU), the passes at `tokens` are
        interpolated between the two probes' in log tokens, and constant beyond them."""
        if self._passes_fit is None:
            self._passes_fit = sorted((self._probe_passes(key) for key in ("probe", "probe_long")
                                       if self.dev.get(key, {}).get(
                                           self.config.family.calibrated_as)),
                                      key=lambda fit: fit[0])
        fits = self._passes_fit
        if not fits:
            return dict(PASSES[self.config.family.calibrated_as])
        if tokens is None or len(fits) == 1 or tokens <= fits[0][0]:
            return fits[0][1]
        if tokens >= fits[-1][0]:
            return fits[-1][1]
        (t0, p0), (t1, p1) = fits[0], fits[-1]
        f = math.log(tokens / t0) / math.log(t1 / t0)
        return {k: p0[k] + f * (p1[k] - p0[k]) for k in p0}

    def _probe_passes(self, key: str) -> tuple[int, dict]:
        """(tokens, passes) of the calibration's probe `key` ("probe" or "probe_long")."""
        arch, d, e = self.config.family.calibrated_as, self.dev, self.elem
        probe = d[key][arch]
        from flexevict.planner.calibration import probe_config
        from flexevict.policies import PolicySpec
        c = probe_config(arch)
        b, s = probe["batch"], probe["prompt"]
        m = b * s
        stages = stage_weights(c, True)
        mm = lambda stage: sum(  # noqa: E731
            n * k * e / d["gemv_bw"] + 2 * m * n * k / d["gemm_flops"]
            for name, (n, k) in ((nm, sh) for nm, sh in stage if len(sh) == 2)
            if name in LINEAR_WEIGHTS)
        hook = self.cal.policy(PolicySpec("full"), self.device, self.dtype)["prefill"]
        attn = 2 * b * c.num_heads * s * s * c.dim_head / attention_rate(d, False, s) + \
            hook["fixed_s"] + hook["per_token_row_s"] * s * b * c.num_kv_heads
        one = m * e / d["mem_bw"]
        return m, {
            "attn": max(probe["attn_s"] - mm(stages[1]) - attn, 0.0) / (one * c.hidden_size),
            "mlp": max(probe["mlp_s"] - mm(stages[2]), 0.0) / (one * (c.hidden_size + c.ffn_size))}

    def _efficiency(self) -> dict:
        """Factors on the CPU's compute (prefill, decode) and weight-streaming work that make
        the model reproduce the real engine on the calibration's engine probe (a six-layer
        model, calibration.measure_engine_probe): what isolated measurements miss of a run, such
        as the compute thread and a lane thread sharing the memory bandwidth and the GIL, and
        the allocator's state. 1.0 without a probe (and on a GPU)."""
        if self._eff is not None:
            return self._eff
        self._eff = {"prefill": 1.0, "decode": 1.0, "weights": 1.0}
        probe = self.dev.get("engine_probe", {}).get(self.config.family.calibrated_as)
        if not probe or self.cuda:
            return self._eff
        from flexevict.planner.calibration import engine_probe_config
        from flexevict.runtime.placement import Placement
        from flexevict.policies import PolicySpec
        eff = {"prefill": 1.0, "decode": 1.0, "weights": 1.0}
        # fitted where the probe ran (the calibration's thread count), used at any count
        m = CostModel(engine_probe_config(self.config.family.calibrated_as), self.cal.as_measured(),
                      self.device,
                      self.dtype, probe["prompt"], probe["gen"], PolicySpec("full"),
                      efficiency=eff)
        shape = {"gpu_batch_size": probe["gpu_batch_size"],
                 "num_gpu_batches": probe["num_gpu_batches"]}
        n = probe["gpu_batch_size"] * probe["num_gpu_batches"]
        e = m.estimate(Placement(**shape), n)
        eff["prefill"] = _clamp(probe["memory"][0] / e.prefill_s)
        eff["decode"] = _clamp(probe["memory"][1] / e.step_s)
        stream = Placement(0, 100, 100, 0, 100, 0, **shape)
        lo, hi = EFFICIENCY_RANGE                  # the streamed step grows with the factor
        for _ in range(24):
            eff["weights"] = (lo + hi) / 2
            m._loads.clear()
            if m.estimate(stream, n).step_s < probe["stream"][1]:
                lo = eff["weights"]
            else:
                hi = eff["weights"]
        self._eff = dict(eff)
        return self._eff

    def _weight_read_bw(self, nbytes: int, hot: bool) -> float:
        """Bytes/s a matmul reads a layer's weights at: from memory, or for a later GPU batch of
        the same layer from the last-level cache, fully when the layer fits in half of it, not
        at all once it fills it (linear in between; measured, see calibration.measure_matmul)."""
        d = self.dev
        cold, warm, llc = d["gemv_bw"], d.get("gemv_hot_bw", d["gemv_bw"]), d.get("llc_bytes", 0)
        if not hot or nbytes >= llc:
            return cold
        f = min(max((llc - nbytes) / (llc / 2), 0.0), 1.0)        # 1 at llc / 2, 0 at llc
        return 1.0 / (f / warm + (1 - f) / cold)

    def _attention(self, p, b: int, i: int, n: int, work: str) -> float:
        c = self.config
        h, hk, dh = c.num_heads, c.num_kv_heads, c.dim_head
        rows = b * hk
        if i == 0:
            d = self.dev
            flops = 2 * b * h * self.P * self.P * dh
            t = flops / attention_rate(d, self.ranks_prompt, self.P)     # the rate at P
            hook = self.hooks["prefill"]
            return t + hook["fixed_s"] + hook["per_token_row_s"] * self.P * rows
        on_cpu = self.cuda and work == "cpu"
        d = self._cpu_cal() if on_cpu else self.dev
        hooks = self.cal.policy(self.spec, torch.device("cpu"), self.dtype) if on_cpu \
            else self.hooks
        a = d["attn_decode"]
        t = a["fixed_s"] + a["per_unit_s"] * n * rows * (h // hk + 2) * dh
        t += hooks["decode"]["fixed_s"] + hooks["decode"]["per_slot_row_s"] * n * rows
        if on_cpu:      # q, k, v of the new token to the cache's CPU, the output back
            t += b * (2 * h + 2 * hk) * dh * self.elem / self.cal.link("h2d_pinned")
        return t

    def _cpu_cal(self) -> dict:
        if self._cpu is None:
            self._cpu = self.cal.device(torch.device("cpu"), self.dtype)
        return self._cpu

    def _act_link(self, p) -> float:
        return self.cal.link("h2d_pinned" if p.pin_weight and self.cuda else "h2d_pageable")

    # ------------------------------------------------------------------ weights
    def _weight_load(self, p, plan: MemoryPlan, stage) -> dict:
        """One stage's weight load (once per step, whatever the GPU batches) -> {total,
        link, device, term}: seconds in all, on the link, on the GPU (dequantize)."""
        key = (p.w_gpu, p.w_cpu, p.compress_weight, p.pin_weight, id(stage))
        if key in self._loads:
            return self._loads[key]
        link = dev = prep = 0.0
        tiers = p.weight_tiers([math.prod(s) for _, s in stage])
        worst = None
        rate = self._prepare_rate(stage)
        for (name, shape), tier in zip(stage, tiers):
            packed = p.compress_weight and len(shape) == 2
            if tier == "gpu" and not packed:
                continue
            full = math.prod(shape) * self.elem
            stored = sum(plan._stored(shape))
            t = self._link_time(tier, stored, p)
            link += t
            if packed:
                dev += full / self.dev["dequant_bw"]
            if self.dev["pack"] and name in LINEAR_WEIGHTS and len(shape) == 2:
                prep += full / (self._big_rate(full) if full > BIG_MATRIX else rate)
            if tier != "gpu" and (worst is None or tier == "disk"):
                worst = tier
        if self.cuda:
            term = f"weight loading ({worst}->gpu)" if worst else "weight dequantizing"
        else:
            term = "weight preparing (oneDNN reorder" + (f" of {worst}-tier weights)" if worst
                                                         else " of compressed weights)")
        if not self.cuda:                     # a lane thread's work on the CPU (see _efficiency)
            dev, prep = dev * self._efficiency()["weights"], prep * self._efficiency()["weights"]
        out = {"total": link + dev + prep, "link": link, "device": dev, "term": term}
        self._loads[key] = out
        return out

    def _link_time(self, tier: str, nbytes: int, p) -> float:
        """Seconds to bring nbytes from a tier to the compute device for use."""
        if tier == "gpu" or not self.cuda:
            # a CPU device computes on host memory in place (the cpu and disk tiers are
            # mapped into the process: a tensor.to(cpu) is no copy); what it costs is the
            # reorder (prepare) or the dequantization, counted by the caller
            return 0.0
        if tier == "cpu":
            return nbytes / self.cal.link("h2d_pinned" if p.pin_weight else "h2d_pageable")
        return nbytes / self.cal.link("disk_read") + nbytes / self.cal.link("h2d_pageable")

    def _prepare_rate(self, stage) -> float:
        """Bytes/s of the oneDNN reorder of a stage's streamed matrices: the calibration's
        rate for a layer of as many bytes (one block's matrices), interpolated in log size."""
        block = stage_weights(self.config, False)[1]
        nbytes = sum(math.prod(s) for n, s in block if n in LINEAR_WEIGHTS) * self.elem
        return _interpolate((self.dev.get("prepare") or {}).get("layers", []), nbytes)

    def _big_rate(self, nbytes: int) -> float:
        """A matrix above BIG_MATRIX (an embedding-sized LM head) reorders into fresh pages."""
        prepare = self.dev.get("prepare") or {}
        return _interpolate(prepare.get("big") or prepare.get("layers", []), nbytes)

    # ------------------------------------------------------------------ cache
    def _cache_io(self, p, plan: MemoryPlan, sizes, i: int) -> dict:
        """Per attention stage: ((load on device, load on link), (store on device, store on
        link)) summed over the GPU batches, and whether any buffer is offloaded."""
        tiers = p.cache_tiers(len(sizes))
        loads = [0.0, 0.0]
        stores = [0.0, 0.0]
        offloaded = False
        for tier, b in zip(tiers, sizes):
            if tier == "gpu" and not p.compress_cache or i > 0 and p.in_place(tier):
                continue
            offloaded = True
            whole = sum(plan._buffer_tensors(b, p.compress_cache))
            full = sum(plan._buffer_tensors(b, False))
            work = p.work_tier(tier) if i > 0 else "gpu"      # prefill computes on the device
            kv_full = 2 * self.slots * b * self.config.num_kv_heads * self.config.dim_head * \
                self.elem
            if i == 0:                        # a fresh buffer, everything stored after prefill
                loads[0] += full / self.dev["mem_bw"]
                stores[1] += whole / self._store_link(tier, "gpu")
                if p.compress_cache:
                    stores[0] += kv_full / self.dev["quant_bw"]
                continue
            loads[1] += whole / self._load_link(tier, work)
            if p.compress_cache:
                loads[0] += kv_full / self._work_cal(work)["dequant_bw"]
            kept = 1 if p.compress_cache else self.written   # a lossy home keeps no region
            written = 2 * kept * b * self.config.num_kv_heads * \
                self.config.dim_head * self.elem      # K/V of the slots a step writes
            stores[1] += (full - kv_full + written) / self._store_link(tier, work)  # state whole
            if p.compress_cache:
                stores[0] += written / self._work_cal(work)["quant_bw"]
        where = "/".join(sorted({t for t in tiers if t != "gpu"})) or "gpu"
        return {"load": tuple(loads), "store": tuple(stores), "offloaded": offloaded,
                "term_load": f"cache loading ({where})", "term_store": f"cache storing ({where})"}

    def _work_cal(self, work: str) -> dict:
        return self._cpu_cal() if work == "cpu" and self.cuda else self.dev

    def _load_link(self, tier: str, work: str) -> float:
        """Bytes/s of a cache load from `tier` into a working buffer on `work`."""
        if not self.cuda or work == "cpu":
            return self.cal.link("h2d_pageable")           # host memcpy
        return self.cal.link("h2d_pinned" if tier == "cpu" else "h2d_pageable")

    def _store_link(self, tier: str, work: str) -> float:
        if not self.cuda or work == "cpu":
            return self.cal.link("d2h_pageable")
        return self.cal.link("d2h_pinned" if tier == "cpu" else "d2h_pageable")

    # ------------------------------------------------------------------ fixed costs
    def _fixed(self, p, kind: str, sizes, i: int, streams: bool, offloaded: bool) -> float:
        """The engine's per-cell Python work (CPU device only: on a GPU it overlaps the
        kernels it launches): the cell and its layer's ops, and its lane jobs."""
        if self.cuda:
            return 0.0
        phase = "prefill" if i == 0 else "decode"
        o = self.dev["overhead"][self.config.family.calibrated_as][phase]
        share = {"embed": o["ends_s"] / 2, "head": o["ends_s"] / 2, "block": o["block_s"],
                 "attn": 0.75 * o["block_s"], "mlp": 0.25 * o["block_s"]}[kind]
        t = len(sizes) * share
        if streams:
            t += o["weight_job_s"]
        if offloaded:
            t += len(sizes) * o["cache_job_s"]
        return t * self._efficiency()[phase]


def _interpolate(table: list, x: float) -> float:
    """y at x from [[x, y], ...] sorted by x, linear in log x, constant beyond the ends."""
    if not table:
        return math.inf
    xs = [row[0] for row in table]
    j = bisect.bisect_left(xs, x)
    if j == 0:
        return table[0][1]
    if j == len(table):
        return table[-1][1]
    (x0, y0), (x1, y1) = table[j - 1], table[j]
    f = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return y0 + f * (y1 - y0)


def _clamp(x: float) -> float:
    return min(max(x, EFFICIENCY_RANGE[0]), EFFICIENCY_RANGE[1])
