"""Predicted time and memory of a run under a placement: FlexGen's cost model for this engine.

FlexGen ("FlexGen: High-Throughput Generative Inference of Large Language Models with a Single
GPU", Sheng et al., ICML 2023, section 4, "Cost model") predicts a layer's time in prefill and in
each decode step as the maximum of five overlapped terms, ctog, gtoc, dtoc, ctod and comp, and
the total as T_pre * l + T_gen * (n - 1) * l. This module keeps that shape for the engine's block
schedule (engine.py) and adds what eviction changes: each layer's cache is a budget-sized buffer
of that layer's slots, so its bytes, its loads and stores and the attention over it shrink with
the budget, and the hooks of the policy it runs cost time per slot. Layers differ
(`layers.layer_specs`): a sliding layer whose window is shorter than the run keeps a ring of its
window and runs `local`, whatever the run's policy, and per-layer budgets give each global layer
its own slots. Layers with the same policy over the same layout price alike: they form a
`LayerGroup`, costed once per step and counted as often as it has layers (a model whose layers
are all alike is one group, priced as one layer times L).

Per token step and schedule layer s (embed, attention and MLP halves or whole blocks, head),
with k over the GPU batches of the block:

    T_s = max(comp_s, W_{s+1}, CL_s, CS_s, work_s / cores) + fixed_s    (--overlap)
    T_s = comp_s + W_s + CL_s + CS_s + fixed_s                           (no overlap)

- comp_s = sum_k: matmuls (weights streamed from memory + flops), attention (prefill: causal
  SDPA, or for a policy that ranks the prompt the pass that also sums its columns, or for a
  sliding layer whose window binds its masked bands; decode: per slot its layer attends),
  element-wise passes over the hidden states, the layer's policy's hooks (per slot x row), and
  activation moves to and from a CPU tier (the engine makes them on the compute stream, so they
  add to comp rather than overlap it, unlike FlexGen's model).
- W_{s+1}: the next layer's weights, loaded while s computes (the first layer's load is not
  hidden): bytes over their link (pinned or pageable host-to-device; disk through the page
  cache), dequantization when compressed, and on a CPU device the oneDNN reorder of each
  streamed linear weight (`model.PackedWeight`, its cost measured by size).
- CL_s, CS_s: loading each GPU batch's cache buffer of the layer from its tier (whole: it is
  budget-sized, at the layer's own slots) and storing back what changed (one slot of K/V and the
  per-slot state in decode, everything after prefill), with 4-bit (de)quantization when the
  cache is compressed.
- On a CUDA device the links are shared resources: weight and cache loads both use
  host-to-device, so they add up on it (as ctog does in FlexGen). On a CPU device every term is
  a thread of the same CPU: `work_s / cores` bounds them together, and `fixed_s` (the engine's
  Python work per cell and per lane job, serialised by the GIL) adds outside the maximum; on a
  GPU the fixed costs overlap the device's work (kernel launches are asynchronous).

Decode attention grows with the slots step i attends, min(P + i, slots) of each layer's layout
(BUZZ's saw between its passes: `Layout.held`), so decode time is summed over steps (sampled at
up to 8 evenly spaced steps, every group at the same steps). Memory per tier is MemoryPlan's
(memory.py, the same numbers the run's preflight checks).

Three things come from the calibration's probes rather than from first principles: a later GPU
batch of the same layer reads its weights from the last-level cache when they fit (measured
rate); the element-wise passes of a half layer (a one-layer probe's measured halves less their
matmuls and attention); and, on a CPU, factors on compute and on weight streaming that make the
model reproduce the real engine on a six-layer probe (`_efficiency`): what isolated
measurements miss when the compute thread and a lane thread share one CPU's memory bandwidth,
caches and GIL. They scale the matmuls and element-wise passes, not attention: the probe's
prompts are short, so its fit says nothing about attention, which the calibration times at the
shapes a run has (at 4k and 8k-token prompts a factor of 0.7 on attention priced runs 20-35% too
fast).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import torch

from flexevict.core.model import LINEAR_WEIGHTS
from flexevict.planner.calibration import attention_rate
from flexevict.policies import PolicySpec
from flexevict.runtime.layers import LayerSpec, layer_slots, layer_specs
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


@dataclass(frozen=True)
class LayerGroup:
    """Layers of a run that price alike (the same kind, policy and layout: `LayerSpec`), so one
    cost per stage stands for each of them."""
    layers: tuple[int, ...]     # their indices, bottom first
    spec: PolicySpec            # what their hooks are measured as (`Calibration.policy`)
    slots: int                  # per (sequence, kv head), the scratch slot included
    attended: tuple[int, ...]   # slots decode steps 1 .. gen_len - 1 attend, per row
    written: int                # K/V slots per row a decode step writes
    ranks_prompt: bool          # prefill is the scored pass (a policy that ranks the prompt)
    window: int | None          # tokens: a sliding window that binds in prefill, else None


def layer_groups(config, specs: list[LayerSpec], spec: PolicySpec, prompt_len: int,
                 gen_len: int) -> list[LayerGroup]:
    """The run's layers (`layer_specs`) grouped by (kind, policy, layout), in order of their
    first layer. spec: the run's; a global layer's hooks are its policy's even at a budget of
    its own, a window layer's are its ring's (`local` at the window)."""
    members: list[tuple[LayerSpec, list[int]]] = []
    for s in specs:
        same = [m for m in members if (m[0].kind, m[0].policy, m[0].layout) ==
                (s.kind, s.policy, s.layout)]
        if same:
            same[0][1].append(s.index)
        else:
            members.append((s, [s.index]))
    return [_group(config, s, tuple(idx), spec, prompt_len, gen_len) for s, idx in members]


def _group(config, s: LayerSpec, layers: tuple, spec: PolicySpec, P: int, G: int) -> LayerGroup:
    """The group of `layers`, all priced as s (their first) in a run of P + G tokens."""
    lay, pol = s.layout, s.policy
    if s.kind == "window":      # a plain ring; it never ranks the prompt (model.py refuses)
        window = config.layer_window(s.index)
        return LayerGroup(layers, PolicySpec(pol.name, budget_tokens=pol.budget_tokens),
                          lay.slots, tuple(lay.attended_per_step(G - 1)), lay.written_per_step,
                          False, window if window < P else None)   # else no prefill row slides
    ranks = pol.needs_prompt_scores and pol.slots_for(P, G) < P + G
    return LayerGroup(layers, spec, lay.slots, tuple(lay.attended_per_step(G - 1)),
                      lay.written_per_step, ranks, None)


class CostModel:
    """Predictions for one model, lengths, policy and compute device, from a calibration.

    slots: the run's policy's resolved slots per (sequence, layer, kv head), scratch included
    (`PolicySpec.make().slots_for(prompt_len, gen_len)`); layer_slots: each layer's own (the
    memory plan's); groups: the layers by how they price (`LayerGroup`: what the times use)."""

    def __init__(self, config, calibration, device, dtype, prompt_len: int, gen_len: int,
                 spec, efficiency: dict | None = None):
        """efficiency: the factors `_efficiency` fits (given: the probe's own model)."""
        self.config, self.cal, self.dtype = config, calibration, dtype
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.P, self.G, self.spec = prompt_len, gen_len, spec
        policy = spec.make()
        self.slots = policy.slots_for(prompt_len, gen_len)
        layout = policy.layout(prompt_len, gen_len)
        # each layer at its own size (a sliding layer's window, a per-layer budget): the memory
        # plan counts each layer's slots, the times price each group of layers alike
        specs = layer_specs(config, policy, prompt_len, gen_len, layout)
        self.layer_slots = layer_slots(specs)
        self.groups = layer_groups(config, specs, spec, prompt_len, gen_len)
        self.history = layout.home_tokens                 # recall's
        self.attended = layout.attended_per_step(gen_len - 1)   # the policy's, by decode step
        self.elem = torch.empty((), dtype=dtype).element_size()
        self.dev = calibration.device(self.device, dtype)
        # (a group's spec, whether on the CPU for --cpu-cache-compute) -> its hook costs
        self._hooks = {(g.spec, False): calibration.policy(g.spec, self.device, dtype)
                       for g in self.groups}
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
        prefill, pre_terms = self._step(placement, plan, sizes, 0,
                                        (self.P,) * len(self.groups))   # prefill prices by P
        decode, dec_terms = 0.0, {}
        for step, weight, attended in self._decode_samples():
            t, terms = self._step(placement, plan, sizes, step, attended)
            decode += weight * t
            for k, v in terms.items():
                dec_terms[k] = dec_terms.get(k, 0.0) + v * weight / max(self.G - 1, 1)
        return Estimate(placement, n, prefill, decode, plan.needs(self.device), pre_terms,
                        dec_terms, self.G)

    def _decode_samples(self) -> list[tuple[int, float, tuple[int, ...]]]:
        """(decode step i >= 1, how many steps it stands for, the slots they attend on average
        in each layer group), the counts summing to gen_len - 1: a sample's slots are its span's
        mean (BUZZ's saw is not aliased by where a sample falls)."""
        steps = self.G - 1          # step i attends attended[i - 1]
        if steps <= SAMPLED_STEPS:
            return [(i, 1.0, tuple(g.attended[i - 1] for g in self.groups))
                    for i in range(1, steps + 1)]
        width = steps / SAMPLED_STEPS
        samples = []
        for j in range(SAMPLED_STEPS):
            lo, hi = int(j * width), int((j + 1) * width)
            mean = tuple(round(sum(g.attended[lo:hi]) / (hi - lo)) for g in self.groups)
            samples.append((1 + int((j + 0.5) * width), width, mean))
        return samples

    # ------------------------------------------------------------------ one token step
    def _step(self, p, plan, sizes, i: int, attended: tuple[int, ...]) -> tuple[float, dict]:
        """Seconds of token step i (0: prefill), layer group j attending attended[j] slots per
        row -> (seconds, term -> the seconds of the stages it bounds). Every block's weights are
        alike and the layers of a group price alike, so each (layer kind, next layer kind,
        group) is costed once and counted as often as it occurs."""
        stages = {s[0]: s[1] for s in self._stage_kinds(p.sep_layer)}
        loads = {kind: self._weight_load(p, plan, stage) for kind, stage in stages.items()}
        caches = {}           # group index -> its cache loads and stores (`_cache_io`)
        works = [p.work_tier(t) if i > 0 else "gpu" for t in p.cache_tiers(len(sizes))]
        total, terms = 0.0, {}

        def add(term, t):
            terms[term] = terms.get(term, 0.0) + t
        if p.overlap and loads["embed"]["total"]:     # the step's first load is not hidden
            total += loads["embed"]["total"]
            add(loads["embed"]["term"], loads["embed"]["total"])
        for kind, nxt, count, j in self._sequence(p.sep_layer):
            g = None if j is None else self.groups[j]
            attn = None if j is None else (g, attended[j])
            comp = sum(self._compute(p, kind, stages[kind], b, i, work, attn, hot=k > 0)
                       for k, (b, work) in enumerate(zip(sizes, works)))
            w = loads[kind] if not p.overlap else loads[nxt] if nxt else NO_LOAD
            if g is not None and j not in caches:
                caches[j] = self._cache_io(p, plan, sizes, i, g)
            t, term = self._overlap(p, comp, w, NO_CACHE if g is None else caches[j])
            fixed = self._fixed(p, kind, sizes, i, loads[kind]["total"] > 0,
                                g is not None and caches[j]["offloaded"])
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

    def _sequence(self, sep_layer: bool) -> list[tuple[str, str | None, int, int | None]]:
        """The schedule as (layer kind, the next layer's kind, how many times in a step, the
        index of the layer group whose attention and cache the stage has, or None)."""
        L, groups = self.config.num_layers, range(len(self.groups))
        if sep_layer:
            return [("embed", "attn", 1, None),
                    *(("attn", "mlp", len(self.groups[j].layers), j) for j in groups),
                    ("mlp", "attn", L - 1, None), ("mlp", "head", 1, None), ("head", None, 1, None)]
        last = next(j for j in groups if L - 1 in self.groups[j].layers)   # before the head
        blocks = [("block", "block", len(self.groups[j].layers) - (j == last), j) for j in groups]
        return [("embed", "block", 1, None), *(b for b in blocks if b[2]),
                ("block", "head", 1, last), ("head", None, 1, None)]

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
    def _compute(self, p, kind: str, stage, b: int, i: int, work: str,
                 attn: tuple[LayerGroup, int] | None = None, hot: bool = False) -> float:
        """Seconds one GPU batch of b sequences computes stage `kind` at step i, its attention
        (attn: the layer group, and the slots per row it attends in decode) on the `work` tier
        (cpu with --cpu-cache-compute and a cpu or disk cache). hot: an earlier GPU batch just
        read this layer's weights (from the cache if they fit)."""
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
        if p.act_tier == "cpu" and kind != "embed":            # fetch the input, park the output
            moved = b * self.P if i == 0 else b
            t += 2 * moved * c.hidden_size * e / self._act_link(p)
        t *= self._efficiency()["prefill" if i == 0 else "decode"]
        # attention is measured at the shapes a run has (calibration.measure_attention), so the
        # engine probe's factor, fitted where attention is a sliver of the work, stays off it
        if attn is not None:
            t += self._attention(b, i, attn[1], work, attn[0])
        return t

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

    def _attention(self, b: int, i: int, n: int, work: str, g: LayerGroup) -> float:
        """Seconds of one GPU batch of b sequences' attention in a layer of group g at step i
        (decode: n attended slots per row), its policy's hooks included."""
        c = self.config
        h, hk, dh = c.num_heads, c.num_kv_heads, c.dim_head
        rows = b * hk
        if i == 0:
            flops, at = self._prefill_flops(b, g)
            t = flops / attention_rate(self.dev, g.ranks_prompt, at)
            hook = self._hooks[g.spec, False]["prefill"]
            return t + hook["fixed_s"] + hook["per_token_row_s"] * self.P * rows
        on_cpu = self.cuda and work == "cpu"
        d = self._cpu_cal() if on_cpu else self.dev
        if (g.spec, on_cpu) not in self._hooks:
            self._hooks[g.spec, on_cpu] = self.cal.policy(g.spec, torch.device("cpu"), self.dtype)
        hooks = self._hooks[g.spec, on_cpu]
        a = d["attn_decode"]
        t = a["fixed_s"] + a["per_unit_s"] * n * rows * (h // hk + 2) * dh
        t += hooks["decode"]["fixed_s"] + hooks["decode"]["per_slot_row_s"] * n * rows
        if on_cpu:      # q, k, v of the new token to the cache's CPU, the output back
            t += b * (2 * h + 2 * hk) * dh * self.elem / self.cal.link("h2d_pinned")
        return t

    def _prefill_flops(self, b: int, g: LayerGroup) -> tuple[float, int]:
        """(flops, the prompt length whose measured rate they run at) of one GPU batch's
        prefill attention in a layer of group g over the P-token prompt: causal, 2 b h P^2 dh
        (QK^T and PV over half the square), at the rate for P. A binding window W runs as
        masked squares, which the kernel computes whole (twice the causal pass):
        `model.windowed_attention`'s one square up to P = 2W, else P / W bands of W x 2W,
        4 W / P of the causal pass's flops, at the rate for 2W tokens."""
        c = self.config
        causal = 2 * b * c.num_heads * self.P * self.P * c.dim_head
        if g.window is None:
            return causal, self.P
        w = g.window
        return (2 * causal, self.P) if self.P <= 2 * w else (causal * 4 * w / self.P, 2 * w)

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
    def _cache_io(self, p, plan: MemoryPlan, sizes, i: int, g: LayerGroup) -> dict:
        """Per attention stage of a layer in group g (its buffers at its own slots): ((load on
        device, load on link), (store on device, store on link)) in seconds, summed over the GPU
        batches, and whether any buffer is offloaded."""
        tiers = p.cache_tiers(len(sizes))
        loads = [0.0, 0.0]
        stores = [0.0, 0.0]
        offloaded = False
        for tier, b in zip(tiers, sizes):
            if tier == "gpu" and not p.compress_cache or i > 0 and p.in_place(tier):
                continue
            offloaded = True
            whole = sum(plan._buffer_tensors(b, p.compress_cache, g.slots))
            full = sum(plan._buffer_tensors(b, False, g.slots))
            work = p.work_tier(tier) if i > 0 else "gpu"      # prefill computes on the device
            kv_full = plan.kv_bytes(b, g.slots)
            if i == 0:                        # a fresh buffer, everything stored after prefill
                loads[0] += full / self.dev["mem_bw"]
                stores[1] += whole / self._store_link(tier, "gpu")
                if p.compress_cache:
                    stores[0] += kv_full / self.dev["quant_bw"]
                continue
            loads[1] += whole / self._load_link(tier, work)
            if p.compress_cache:
                loads[0] += kv_full / self._work_cal(work)["dequant_bw"]
            kept = 1 if p.compress_cache else g.written   # a lossy home keeps no region
            written = plan.kv_bytes(b, kept)         # K/V of the slots a step writes
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
