"""The offloading engine: FlexGen's block schedule over weights, KV buffers and activations
placed on GPU, CPU and disk.

The grid is (token step i, schedule layer s, GPU batch k). For each step and layer the layer's
weights are loaded once and reused by every GPU batch; while batch k computes, the next layer's
weights and the next batch's cache are loaded and the previous batch's cache is stored on their
own lanes (CUDA streams or copy threads, see offload.py), each wait tied to the buffer it needs.
A load of a home waits for every earlier store to that home (stores are ordered per home on
their lane, and the load waits on the latest), and a token step ends once all its stores have.

A schedule layer is the embedding, a transformer block (or, with `sep_layer`, its attention and
its MLP half as two layers), or the head. KV buffers are the policies' fixed-budget buffers:
their home is the cache tier; eviction runs where attention runs; an offloaded buffer is
copied in whole (it is budget-sized) and written back only where K/V changed.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from flexevict.io.weights import MetaWeights
from flexevict.core.kernels import ext
from flexevict.core.kernels.quant import Packed4bit, dequantize_4bit, quantize_4bit
from flexevict.errors import UserError, setting
from flexevict.core.kv import KVBuffer, Layout, Memory
from flexevict.core.model import (LINEAR_WEIGHTS, PackedWeight, Transformer, load_layer_weights,
                    load_outer_weights, onednn_usable)
from flexevict.policies import Policy
from flexevict.runtime.graphs import CaptureFailed, DecodeGraphs
from flexevict.runtime.layers import layer_specs, uniform
from flexevict.runtime.allocator import steady_host_allocator
from flexevict.runtime.offload import DONE, Lane, Tiers, Ticket, Traffic, load_into, store_into
from flexevict.runtime.placement import DEFAULT_OFFLOAD_DIR, Placement
from flexevict.runtime.weight_cache import WeightCache

POOL = 3          # working buffers in flight: computing, being loaded, being stored
EMBED_KEYS = ("embed", "pos_embed", "proj_in")


@dataclass(frozen=True)
class Stage:
    """One schedule layer: kind is embed, block, attn, mlp or head; layer is the block index."""
    kind: str
    layer: int = -1

    @property
    def has_cache(self) -> bool:
        return self.kind in ("block", "attn")


@dataclass
class Home:
    """Where one weight tensor lives. `data` is ready to compute with when tier is gpu."""
    tier: str
    data: object


@dataclass
class Run:
    """One run's working state, dropped when it ends: the KV buffers and where they live, the
    pool of working buffers, and the store tickets that later loads and the step's end wait on."""
    cache: list                     # cache[k][j]: GPU batch k's buffer of block j, in its home
    cache_tiers: list               # cache[k]'s home tier
    policy: Policy
    clock: "EvictionClock"      # defined below, with the helpers
    pool: list = field(default_factory=lambda: [None] * POOL)   # working buffers in flight
    stored: list = field(default_factory=lambda: [DONE] * POOL)  # pool slot -> its last store
    home_stored: dict = field(default_factory=dict)   # (k, j) -> the home's latest store
    step_stores: list = field(default_factory=list)   # this token step's stores
    graphs: DecodeGraphs | None = None                # its decode-step graphs, if it may use them
    layers: list = field(default_factory=list)        # each block's LayerSpec (runtime/layers.py)

    def policy_of(self, j: int) -> Policy:
        """The policy block j's cache runs (a sliding layer's window ring, or the run's)."""
        return self.layers[j].policy if self.layers else self.policy

    def policies(self) -> list[Policy]:
        """Every policy of the run, once each."""
        return list({id(s.policy): s.policy for s in self.layers}.values()) or [self.policy]


class Consumer(Protocol):
    """What a run hands each step's final hidden states to, for every GPU batch, and gets the
    next input tokens back (sampling, teacher forcing, scoring: generation.py, the bench).

    step: 0 for the prefill; batch: the GPU batch k; hidden (b, S, D) at the prefill, (b, D)
    after; head(x): the model's head with this step's weights, (..., D) -> fp32 logits
    (..., V). -> (b,) int64 tokens, fed to the next step (and returned in `RunResult.tokens`).
    """

    def __call__(self, step: int, batch: int, hidden: torch.Tensor,
                 head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor: ...


@dataclass
class RunStats:
    step_seconds: list = field(default_factory=list)     # per token step, prefill first
    prefill_eviction_seconds: float = 0.0     # policy hooks in the prefill (prompt selection)
    eviction_seconds: float = 0.0             # policy hooks in the eager decode steps
    graphed: list = field(default_factory=list)   # per token step: run through a CUDA graph
    graph_captures: int = 0                       # (its eviction work is not timed apart)
    traffic: dict = field(default_factory=dict)


@dataclass
class RunResult:
    """What `Engine.run` returns."""
    tokens: torch.Tensor            # (B, steps run) int64: the consumer's tokens, step by step
    layout: Layout                  # the run's resolved budget (`resolved_layout`)
    stats: RunStats
    layers: list = field(default_factory=list)   # each block's LayerSpec: its policy and layout


def resolved_layout(policy: Policy, prompts: list[list[int]], steps: int) -> Layout:
    """The budget a run resolves: one for the batch, sized for its longest prompt (left
    padding makes every row that long) and `steps` tokens."""
    return policy.layout(max(len(p) for p in prompts), steps)


def stages_for(num_layers: int, sep_layer: bool) -> list[Stage]:
    blocks = [Stage(kind, j) for j in range(num_layers)
              for kind in (("attn", "mlp") if sep_layer else ("block",))]
    return [Stage("embed"), *blocks, Stage("head")]


def split_weights(stage: Stage, layer: dict, outer: dict, family) -> dict:
    """The weights a schedule layer reads, in declaration order (None: an absent bias); a
    block's halves split by the family's `attention_keys`."""
    if stage.kind == "embed":
        w = {k: outer.get(k) for k in EMBED_KEYS}
    elif stage.kind == "head":
        w = {k: v for k, v in outer.items() if k not in EMBED_KEYS}
    elif stage.kind == "attn":
        w = {k: v for k, v in layer.items() if k in family.attention_keys}
    elif stage.kind == "mlp":
        w = {k: v for k, v in layer.items() if k not in family.attention_keys}
    else:
        w = dict(layer)
    return w


class Engine:
    """A model under a placement. Build with `Engine.load` (weights placed by the percents) or
    `Engine.resident` (an already loaded Transformer, everything on its device)."""

    Graphs = DecodeGraphs       # the steady decode steps' CUDA graphs (tests put a CPU double)
    # Decode steps a run needs before it captures its graph: a capture costs an eager step
    # plus a replay, and a replay saved about a quarter of an eager step on an H200 (OPT-6.7B,
    # batch 24: 31-34 ms to capture, 13.0 ms to replay, 17.0 ms eager), so a graph pays back
    # after about four replays
    GRAPH_REPLAYS = 5
    # A cache that stays where attention runs holds every layer's rows in one buffer when the
    # policy `stacks`, and commits once per step (kv.LayerRows); tests turn it off to compare
    stack_layers = True

    def __init__(self, model: Transformer, placement: Placement, homes: list[dict], tiers: Tiers):
        steady_host_allocator()        # a CPU step's temporaries reused, not mapped afresh
        self.model, self.placement, self.homes, self.tiers = model, placement, homes, tiers
        self.config = model.config
        self.stages = stages_for(self.config.num_layers, placement.sep_layer)
        compute = tiers.compute
        disk = any(h.tier == "disk" for hs in homes for h in hs.values()) or \
            placement.cache_gpu + placement.cache_cpu < 100
        # one load of each kind is in flight at a time (its lane is a queue); stores to
        # different homes overlap on the store lane's threads (keyed by home: see Lane)
        self.lanes = {"weights": Lane("load-weights", compute, threaded=disk),
                      "load_cache": Lane("load-cache", compute, threaded=disk),
                      "store_cache": Lane("store-cache", compute, 4 if disk else 2,
                                          threaded=True)}
        self.traffic = Traffic()
        self.pack = onednn_usable(compute, model.dtype)

    # ------------------------------------------------------------------ construction
    @classmethod
    def resident(cls, model: Transformer) -> "Engine":
        stages = stages_for(model.config.num_layers, sep_layer=False)
        homes = [{k: Home("gpu", v) for k, v in
                  split_weights(s, model.layers[s.layer] if s.has_cache else {},
                                model.outer, model.family).items()}
                 for s in stages]
        return cls(model, Placement(sep_layer=False, overlap=False),
                   homes, Tiers(model.device, DEFAULT_OFFLOAD_DIR, pin=False))

    @classmethod
    def load(cls, config, source, placement: Placement, device, dtype, progress=None) -> "Engine":
        """Read every weight once from `source` and put it in its tier (FlexGen's
        init_weight_list); gpu-tier weights are prepared for compute (oneDNN-packed on CPU).
        Disk-tier dummy weights are kept between runs (`weight_cache`): a kept one is mapped,
        never made. progress(nbytes): called once per layer read, with its weights' bytes."""
        tiers = Tiers(torch.device(device), placement.offload_dir, placement.pin_weight)
        model = Transformer(config, [], {}, device=torch.device(device), dtype=dtype)
        pack = onednn_usable(device, dtype)
        staging = device if placement.w_gpu == 100 else "cpu"
        kept = WeightCache.for_run(source, placement, dtype)
        if hasattr(source, "generating_on"):     # dummy weights: made on the compute device
            source = source.generating_on(device)   # (same numbers, much faster), then staged
            if torch.device(device).type == "cuda" and placement.w_gpu + placement.w_cpu == 100:
                # staged there too: one DMA copy per tensor into pinned memory, where a CPU
                # staging took a pageable copy, a concatenation and a copy again (OPT-30B's
                # 50 GiB of CPU weights: 66 s on an H200 machine)
                staging = device
        outer = load_outer_weights(config, source, staging, dtype)
        stages = stages_for(config.num_layers, placement.sep_layer)
        homes = []
        for s in stages:
            if s.kind in ("block", "attn"):
                layer, cached = _read_layer(config, source, s.layer, staging, dtype, placement,
                                            kept, [t for t in stages if t.layer == s.layer])
                if progress:
                    progress(sum(t.numel() * t.element_size() for t in layer.values()
                                 if t is not None))
            weights = split_weights(s, layer if s.layer >= 0 else {}, outer, config.family)
            tiers_of = placement.tensor_tiers(weights)
            place = functools.partial(_place, tiers, pack=pack, placement=placement)
            if kept is not None and s.layer >= 0:
                place = functools.partial(_place_kept, kept, s.layer, cached,
                                          placement.compress_weight, place)
            homes.append({name: place(tier, name, t)
                          for (name, t), tier in zip(weights.items(), tiers_of)})
        return cls(model, placement, homes, tiers)

    def close(self):
        for lane in self.lanes.values():
            lane.close()
        self.tiers.close()

    # ------------------------------------------------------------------ weights
    def weight_bytes(self, tier: str | None = None) -> int:
        return sum(_nbytes(h.data) for hs in self.homes for h in hs.values()
                   if tier is None or h.tier == tier)

    def _load_weights(self, s: int) -> Ticket:
        homes = self.homes[s]
        # offloaded weights are copied in; compressed ones (any tier) are decompressed on use
        streamed = {n: h for n, h in homes.items()
                    if h.tier != "gpu" or isinstance(h.data, Packed4bit)}
        if not streamed:
            return Ticket({n: h.data for n, h in homes.items()})
        for h in streamed.values():
            self.traffic.add(h.tier, "gpu", _nbytes(h.data))

        def fetch():
            w = {n: h.data for n, h in homes.items() if n not in streamed}
            for n, h in streamed.items():
                w[n] = self._to_compute(n, h.data)
            return w
        return self.lanes["weights"].submit(fetch)

    def _to_compute(self, name: str, data):
        if isinstance(data, Packed4bit):
            t = dequantize_4bit(data.to(self.tiers.compute, non_blocking=True))
        else:
            t = data.to(self.tiers.compute, non_blocking=True)
        return PackedWeight(t) if self.pack and name in LINEAR_WEIGHTS else t

    # ------------------------------------------------------------------ one run
    @torch.inference_mode()
    def run(self, prompts: list[list[int]], steps: int, policy, consume: Consumer,
            pad_id: int = 0, until=None, plan_steps: int | None = None,
            wrap_positions: bool = False) -> RunResult:
        """Prefill the prompts and decode steps - 1 more tokens (the budget is resolved for
        plan_steps, default steps: a benchmark that cuts the run short keeps the real budget;
        `resolved_layout`). consume: see `Consumer`. until() -> True stops after a step.
        wrap_positions (bench --ignore-max-positions, timing only): positions past the model's
        maximum wrap around instead of being refused; the output is then meaningless.
        """
        policy = policy.for_model(self.config)     # per-model data (TriAttention's statistics)
        tokens, valid, pos = left_pad(prompts, pad_id, self.tiers.compute)
        if not wrap_positions:
            check_length(self.config, max(len(x) for x in prompts), plan_steps or steps)
        sizes = self.placement.batch_split(len(prompts))
        layout = resolved_layout(policy, prompts, plan_steps or steps)
        layers = layer_specs(self.config, policy, tokens.shape[1], plan_steps or steps, layout)
        evicts = any(s.layout.evicts for s in layers)
        limit = self.config.max_positions if wrap_positions else None
        with self.tiers.run_scope():          # the next run reuses this run's pinned KV homes
            cache_tiers = self.placement.cache_tiers(len(sizes))
            run = Run(self._allocate_cache(layers, sizes, cache_tiers),
                      cache_tiers, policy, EvictionClock(self.tiers.compute, evicts),
                      layers=layers)
            if self._graphable(run, steps):
                run.graphs = self.Graphs(self.tiers.compute)
            stats, emitted = self._run(run, (tokens, valid, pos), steps, consume, until, limit)
        return RunResult(torch.stack(emitted, dim=1), layout, stats, layers)

    def _run(self, run: Run, padded, steps, consume, until, limit):
        """run's body: padded = tokens, valid, pos (B, S) from left_pad; limit: positions wrap
        modulo it (None: they never need to). -> the stats and each step's consumed tokens
        (B,)."""
        tokens, valid, pos = padded
        batches = self.placement.batch_rows(tokens.shape[0])
        width = tokens.shape[1]                 # step i's positions are below width + i
        inputs = [self._step_input(pos[b], valid[b], limit, width) for b in batches]
        feed = [tokens[b] for b in batches]
        next_pos = valid.sum(dim=1)
        stats, emitted = RunStats(), []
        self.traffic.bytes.clear()
        try:
            for i in range(steps):
                t0 = time.perf_counter()
                graphed = i > 0 and run.graphs is not None and (
                    all(p.graph_safe_filling for p in run.policies()) or _all_full(run.cache))
                if i > 0:        # a graph replays its capture at later steps: no host bound
                    end = None if graphed else width + i
                    inputs = [self._step_input(next_pos[b] + (i - 1), None, limit, end)
                              for b in batches]
                step = self._graph_step if graphed else self._step
                feed = step(run, i, feed, inputs, consume)
                emitted.append(torch.cat(feed))
                _sync(self.tiers.compute)
                stats.step_seconds.append(time.perf_counter() - t0)
                stats.graphed.append(graphed and run.graphs is not None)
                run.clock.drain()              # after the synchronize: every event completed
                if i == 0:
                    stats.prefill_eviction_seconds = run.clock.seconds()
                if until is not None and until():
                    break
        finally:
            for lane in self.lanes.values():       # no copy may outlive the run's buffers
                lane.drain()
        stats.eviction_seconds = run.clock.seconds() - stats.prefill_eviction_seconds
        stats.graph_captures = run.graphs.captures if run.graphs is not None else 0
        stats.traffic = self.traffic.as_dict()
        return stats, emitted

    def _step_input(self, pos, valid, limit: int | None, pos_end: int | None):
        """The model's step input; pos_end bounds the positions (None: not given)."""
        if limit is not None:
            pos = pos % limit
            pos_end = None if pos_end is None else min(pos_end, limit)
        return self.model.step_input(pos, valid, pos_end)

    def _allocate_cache(self, layers: list, sizes: list[int], tiers: list[str]
                        ) -> list[list[KVBuffer]]:
        """cache[k][j]: GPU batch k's buffer of block j (its `LayerSpec` layers[j]), in its
        home tier tiers[k], with its policy's declared state; the layers of a batch whose cache
        stays where attention runs share one stacked buffer when they are alike and their
        policy `stacks` (`_commit_stacks`)."""
        cache = []
        for tier, size in zip(tiers, sizes):
            alloc = self.tiers.alloc(tier)
            # compressed: K and V start in ordinary memory, only their 4-bit parts go to the
            # tier (allocated there, they would hold tier memory until the run ends)
            kv_alloc = _in_ram if self.placement.compress_cache else alloc
            memory = Memory(self.model.device, alloc, kv_alloc)
            stacked = self._stacks(layers, tier)
            bufs = allocate_layers(self.model, layers, size, memory, stacked)
            if self.placement.compress_cache:
                put = lambda x, tier=tier: self.tiers.put(tier, x)   # noqa: E731
                for b in bufs:
                    b.k, b.v = compressed(b.k, put), compressed(b.v, put)
            cache.append(bufs)
        return cache

    def _stacks(self, layers: list, tier: str) -> bool:
        """A batch's layers share one stacked buffer (kv.LayerRows) when they run one policy
        over one layout (`layers.uniform`), the policy `stacks` and evicts, and decode computes
        on its cache home in `tier` itself (`Placement.in_place`), on a device whose hot path is
        the PyTorch reference: the extension's kernels index contiguous buffers, and a layer's
        rows of a stack are a strided view."""
        policy, layout = layers[0].policy, layers[0].layout
        return (self.stack_layers and uniform(layers) and policy.stacks and layout.evicts
                and self.placement.in_place(tier)
                and ext.backend(self.tiers.device(tier)) == ext.REFERENCE)

    def _step(self, run: Run, i, feed, inputs, consume: Consumer):
        """One token step over the (layer, GPU batch) grid -> next feed per batch."""
        overlap, nb = self.placement.overlap, len(feed)
        order = [(s, k) for s in range(len(self.stages)) for k in range(nb)]
        hidden, out = list(feed), [None] * nb
        weights = self._load_weights(0) if overlap else None
        staged = self._load_cache(run, i, 0, order) if overlap else None
        for n, (s, k) in enumerate(order):
            stage = self.stages[s]
            if k == 0:
                w = (weights if overlap else self._load_weights(s)).wait()
                if overlap and s + 1 < len(self.stages):
                    weights = self._load_weights(s + 1)      # prefetch the next layer's weights
            buf = (staged if overlap else self._load_cache(run, i, n, order)).wait()
            if overlap and n + 1 < len(order):
                staged = self._load_cache(run, i, n + 1, order)   # and the next batch's cache
            h = self._fetch_hidden(hidden[k])
            if stage.kind == "head":
                out[k] = consume(i, k, h, lambda x, w=w: self.model.head(x, w))
                continue
            h = self._compute(stage, w, h, inputs[k], buf, run)
            if buf is not None:
                stored = self._store_cache(run, i, n, stage, k, buf)
                if not overlap:
                    stored.wait()
            hidden[k] = self._park_hidden(h)
        if i > 0:
            self._commit_stacks(run)
        stores, run.step_stores = run.step_stores, []
        for t in stores:                  # all of them: a ticket replaced in a pool slot too
            t.wait()
        return out

    def _commit_stacks(self, run: Run) -> None:
        """The decode step's commit of every stacked cache, once for all of its layers (their
        `after_attention` only observed): the same row-wise ops as a per-layer commit, on
        num_layers times the rows, so a step pays their per-op overhead once, not per layer."""
        for batch in run.cache:
            stack = batch[0].stack
            if stack is not None:
                with run.clock:
                    run.policy_of(0).commit(stack, stack.incoming_slot())

    # ------------------------------------------------------------------ CUDA graphs
    def _graphable(self, run: Run, steps: int) -> bool:
        """Decode steps may run as CUDA graphs (graphs.py): a CUDA device, --cuda-graphs, a
        graph_safe policy whose buffers fill up (else no host state repeats) or whose hooks are
        graph-safe while they fill (`full`), every weight, buffer and activation resident on
        the GPU (no copy lanes, no offloaded state), and a run long enough for its graphs to
        pay back (`GRAPH_REPLAYS`)."""
        p = self.placement
        resident = all(h.tier == "gpu" and not isinstance(h.data, Packed4bit)
                       for hs in self.homes for h in hs.values())
        alike = all(s.policy.graph_safe and (s.layout.evicts or s.policy.graph_safe_filling)
                    for s in run.layers)
        return (self.Graphs.supports(self.tiers.compute) and p.cuda_graphs and alike
                and resident
                and set(run.cache_tiers) == {"gpu"} and not p.compress_cache
                and p.act_tier == "gpu"
                and steps - 1 >= self.GRAPH_REPLAYS)

    def _graph_step(self, run: Run, i, feed, inputs, consume):
        """`_step` through the run's graphs: every layer up to the head replays, the head and
        consume (sampling, the caller's bookkeeping) run eagerly after. Hooks are not timed."""
        quiet = dataclasses.replace(run, clock=EvictionClock(self.tiers.compute, enabled=False))

        def body(x):
            hidden = []
            self._step(quiet, i, x[0], x[1], lambda i, k, h, head: hidden.append(h))
            return hidden
        bufs = _with_stacks(run.cache)
        try:
            hidden = run.graphs.step(bufs, (feed, inputs), body)
        except CaptureFailed as e:
            print(f"flexevict: CUDA graphs are off for this run, its decode steps run eagerly "
                  f"(a step could not be captured: {e})", file=sys.stderr)
            run.graphs = None
            return self._step(run, i, feed, inputs, consume)
        w = self._load_weights(len(self.stages) - 1).wait()
        return [consume(i, k, h, lambda x: self.model.head(x, w)) for k, h in enumerate(hidden)]

    def _compute(self, stage: Stage, w, h, inp, buf, run: Run):
        m = self.model
        if stage.kind == "embed":
            return m.embed(h, inp, w)
        if stage.kind == "mlp":
            return m.mlp_half(w, h)
        if buf is not None and buf.device != h.device and inp.valid is None:
            self._count_shipping(h.shape[0])
        h = m.attention_half(w, h, inp, buf, run.policy_of(stage.layer), run.clock)
        return m.mlp_half(w, h) if stage.kind == "block" else h

    # ------------------------------------------------------------------ cache
    def _load_cache(self, run: Run, i: int, n: int, order) -> Ticket:
        """Ticket for the buffer that grid cell n = (stage, k) computes with: the home itself,
        or a working buffer (fresh for a prefill, else a copy of the home) from a pool of
        POOL, reused once the store of its previous user is done."""
        s, k = order[n]
        stage = self.stages[s]
        if not stage.has_cache:
            return DONE
        home, tier = run.cache[k][stage.layer], run.cache_tiers[k]
        stored = run.home_stored.get((k, stage.layer), DONE)   # its latest store
        # the home itself, except a CPU home's prefill, which computes on the device
        if self.placement.in_place(tier) and (tier == "gpu" or i > 0):
            stored.wait()                              # e.g. the prefill's store into it
            return Ticket(home)
        if i == 0:                                     # prefill computes on the compute device
            return Ticket(_like(home, self.tiers.compute))
        slot = n % POOL
        work = run.pool[slot]
        dst = self.placement.work_tier(tier)
        dev = self.tiers.device(dst)
        if (work is None or work.device != dev or work.valid.shape != home.valid.shape
                or work.layout != home.layout or work.fields != home.fields):
            work = run.pool[slot] = _like(home, dev)
        previous = run.stored[slot]

        def load():
            previous.wait()                            # its last user's store has finished
            stored.wait()      # and so has every store into the home (ordered per home)
            self.traffic.add(tier, dst, load_into(work, home))
            return work
        return self.lanes["load_cache"].submit(load)

    def _store_cache(self, run: Run, i: int, n: int, stage: Stage, k: int, work: KVBuffer
                     ) -> Ticket:
        """Store a working buffer into its home -> the store's ticket, also kept for the
        home's next load, the pool slot's next user and the end of the step."""
        home, tier = run.cache[k][stage.layer], run.cache_tiers[k]
        if work is home:
            return DONE
        src = "gpu" if i == 0 else self.placement.work_tier(tier)   # prefill: on the device

        def store():
            self.traffic.add(src, tier, store_into(home, work))
        ticket = self.lanes["store_cache"].submit(store, key=(k, stage.layer))
        run.home_stored[(k, stage.layer)] = ticket
        if work is run.pool[n % POOL]:                 # a prefill buffer is not pooled
            run.stored[n % POOL] = ticket
        run.step_stores.append(ticket)
        return ticket

    def _count_shipping(self, b: int):
        """cpu_cache_compute ships q, k, v of the new token to the cache and the output back."""
        c, e = self.config, self.model.dtype.itemsize
        self.traffic.add("gpu", "cpu", b * (c.num_heads + 2 * c.num_kv_heads) * c.dim_head * e)
        self.traffic.add("cpu", "gpu", b * c.num_heads * c.dim_head * e)

    # ------------------------------------------------------------------ activations
    def _park_hidden(self, h):
        if self.placement.act_tier == "gpu":
            return h
        self.traffic.add("gpu", "cpu", _nbytes(h))
        return self.tiers.park(h)

    def _fetch_hidden(self, h):
        if self.placement.act_tier == "cpu" and h.is_floating_point():
            self.traffic.add("cpu", "gpu", _nbytes(h))
            return h.to(self.tiers.compute, copy=True)
        return h


class EvictionClock:
    """Times eviction bookkeeping, the policy's own work (not the attention it is handed): the
    model enters it around every policy hook (`Transformer.attention_half(..., clock)`). On
    CUDA the time comes from a pair of events per hook call, read and dropped by `drain()` once
    they have completed (the engine drains after each token step's synchronize, so the pairs
    never outnumber one step's hook calls). A run whose buffers hold every token evicts
    nothing: its clock (`enabled` False) times nothing and reads 0."""

    def __init__(self, device: torch.device, enabled: bool = True):
        self._cuda = device.type == "cuda"
        self._enabled = enabled
        self._spent, self._events, self._start = 0.0, [], None

    def __enter__(self):
        if not self._enabled:
            return
        if self._cuda:
            self._start = self._event()
            self._start.record()
        else:
            self._start = time.perf_counter()

    def __exit__(self, *exc):
        if not self._enabled:
            return
        if self._cuda:
            end = self._event()
            end.record()
            self._events.append((self._start, end))
        else:
            self._spent += time.perf_counter() - self._start

    @staticmethod
    def _event():
        return torch.cuda.Event(enable_timing=True)

    def drain(self) -> None:
        """Add up the event pairs that have completed and drop them; the others stay."""
        pending = []
        for a, b in self._events:
            if b.query():
                self._spent += a.elapsed_time(b) / 1e3
            else:
                pending.append((a, b))
        self._events = pending

    def seconds(self) -> float:
        if self._events:
            torch.cuda.synchronize()
            self.drain()
        return self._spent


# ---------------------------------------------------------------------------- helpers

def left_pad(prompts: list[list[int]], pad_id: int, device):
    """-> tokens (B, S), valid (B, S) bool, positions (B, S) counted over real tokens."""
    if any(len(p) == 0 for p in prompts):
        raise UserError("empty prompt: every prompt needs at least one token")
    s = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), s), pad_id, dtype=torch.long)
    valid = torch.zeros(len(prompts), s, dtype=torch.bool)
    for i, p in enumerate(prompts):
        tokens[i, s - len(p):] = torch.tensor(p, dtype=torch.long)
        valid[i, s - len(p):] = True
    pos = (valid.long().cumsum(1) - 1).clamp(min=0)
    return tokens.to(device), valid.to(device), pos.to(device)


def check_length(config, prompt_len: int, new_tokens: int):
    limit = config.max_positions
    if prompt_len + new_tokens - 1 > limit:
        raise UserError(f"prompt of {prompt_len} tokens + {new_tokens} new tokens exceeds the "
                        f"model's maximum of {limit} positions; shorten the prompt or "
                        f"{setting('max_new_tokens')}")


def allocate(model: Transformer, layout: Layout, batch: int, memory: Memory | None = None,
             fields=(), stacked: bool = False) -> list[KVBuffer]:
    """One KV buffer per layer, every one of `layout`, for `batch` sequences with the policy's
    declared state `fields`, in `memory` (default: zeros on the model's device; kv.Memory);
    stacked: every layer's rows in one buffer, each layer's a view (`KVBuffer.layers`)."""
    c = model.config
    rows, where = batch * c.num_kv_heads, memory or model.device
    if stacked:
        stack = KVBuffer(layout, c.num_layers * rows, c.dim_head, model.dtype, where,
                         kv_heads=c.num_kv_heads, layer=None, fields=fields)
        return stack.layers(c.num_layers)
    return [KVBuffer(layout, rows, c.dim_head, model.dtype, where, kv_heads=c.num_kv_heads,
                     layer=j, fields=fields) for j in range(c.num_layers)]


def allocate_layers(model: Transformer, layers: list, batch: int, memory: Memory | None = None,
                    stacked: bool = False) -> list[KVBuffer]:
    """`allocate` with each layer's own layout and policy state (its `LayerSpec`); stacked
    only for layers alike (`layers.uniform`)."""
    first = layers[0]
    if stacked or uniform(layers):
        return allocate(model, first.layout, batch, memory, first.policy.fields(first.layout),
                        stacked)
    c = model.config
    rows, where = batch * c.num_kv_heads, memory or model.device
    return [KVBuffer(s.layout, rows, c.dim_head, model.dtype, where, kv_heads=c.num_kv_heads,
                     layer=j, fields=s.policy.fields(s.layout)) for j, s in enumerate(layers)]


def _place(tiers: Tiers, tier: str, name: str, t: torch.Tensor, pack: bool, placement) -> Home:
    """Put one weight in its tier: compressed (2-D weights only) when asked, prepacked for
    oneDNN when it lives on the CPU compute device."""
    if t is None:
        return Home("gpu", None)
    if placement.compress_weight and t.dim() == 2:
        return Home(tier, compressed(t, lambda x: tiers.put(tier, x)))
    if tier == "gpu":
        t = t.to(tiers.compute)
        return Home(tier, PackedWeight(t) if pack and name in LINEAR_WEIGHTS else t)
    return Home(tier, tiers.put(tier, t))


def _read_layer(config, source, j: int, device, dtype, placement, kept, stages):
    """Layer j's weights, except those kept on disk (`kept`), which are not made: those are
    their meta-device shapes. -> (weights, the keys found kept)."""
    if kept is None:
        return load_layer_weights(config, source, j, device, dtype), set()
    meta = load_layer_weights(config, MetaWeights(config), j, "meta", dtype)
    on_disk = set()
    for s in stages:
        weights = split_weights(s, meta, {}, config.family)
        on_disk |= {k for k, tier in zip(weights, placement.tensor_tiers(weights))
                    if tier == "disk"}
    compress = placement.compress_weight
    cached = {k for k in on_disk if meta[k] is not None
              and kept.has(j, k, compress and meta[k].dim() == 2)}
    made = load_layer_weights(config, source, j, device, dtype,
                              only={k for k in meta if k not in cached})
    return {k: meta[k] if k in cached else t for k, t in made.items()}, cached


def _place_kept(kept: WeightCache, j: int, cached: set, compress_weight: bool, place,
                tier: str, name: str, t) -> Home:
    """`place` for layer j's weights, with the disk-tier ones kept between runs: mapped when
    `cached`, else written to the cache (or placed as usual when the cap is full)."""
    if tier != "disk" or t is None:
        return place(tier, name, t)
    compress = compress_weight and t.dim() == 2
    if name in cached:
        return Home("disk", kept.open(j, name, t, compress))
    value = compressed(t, lambda x: x) if compress else t
    return Home("disk", kept.store(j, name, value, lambda _: place(tier, name, t).data))


def compressed(t: torch.Tensor, put) -> Packed4bit:
    """t quantised to 4 bits in groups of quant.GROUP along its last dim (FlexGen's scheme:
    along the head dim for the cache, the input features for weights), each part placed by
    put(tensor)."""
    p = quantize_4bit(t, dim=-1)
    return dataclasses.replace(p, data=put(p.data), min=put(p.min), scale=put(p.scale))


def _in_ram(shape, dtype, device=None) -> torch.Tensor:
    """Zeros in ordinary memory, whatever device is asked for."""
    return torch.zeros(shape, dtype=dtype)


def _like(buf: KVBuffer, device) -> KVBuffer:
    """An empty working buffer with buf's shape and declared state on `device`, sharing its
    constants and the state that stays home (`Field.home`: referred to, never allocated)."""
    travels = tuple(f for f in buf.fields if not f.home)
    work = KVBuffer(buf.layout, buf.valid.shape[1], buf.head_dim, buf.dtype, device,
                    kv_heads=buf.kv_heads, layer=buf.layer, fields=travels)
    work.constants, work.fields = buf.constants, buf.fields
    work.policy_state.update({f.name: buf.policy_state[f.name] for f in buf.fields if f.home})
    return work


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, PackedWeight):
        return 0
    return getattr(x, "nbytes", 0)


def _with_stacks(cache) -> list[KVBuffer]:
    """Every buffer of a run and, once each, the stacks that hold stacked layers' counters:
    the buffers whose host state a decode-step graph is keyed by."""
    bufs = [b for batch in cache for b in batch]
    return bufs + list({id(b.stack): b.stack for b in bufs if b.stack is not None}.values())


def _all_full(cache) -> bool:
    """Every buffer has filled its committed slots (a decode step's host state then repeats)."""
    return all(b.used == b.capacity for batch in cache for b in batch)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
