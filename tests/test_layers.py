"""A run's layers (runtime/layers.py): a sliding-window layer keeps a ring of its window and no
policy, a global layer the policy's budget; buffers, the memory plan and the result block count
each layer's own size."""
import dataclasses

import pytest
import torch

import flexevict.runtime.engine as engine
from flexevict.io.weights import DummyWeights
from flexevict.policies import get_policy
from flexevict.runtime.engine import Engine
from flexevict.runtime.generation import Sampling, as_engine, generate
from flexevict.core.model import Transformer
from flexevict.errors import UserError
from flexevict.runtime.layers import (describe_layers, describe_run, layer_budget_slots,
                                      layer_slots, layer_specs)
from flexevict.runtime.memory import MemoryPlan
from flexevict.runtime.placement import Placement
from tiny import FAMILY_CONFIGS, engine_logits, model_for, rand_prompts

GEMMA = FAMILY_CONFIGS["gemma3"]           # sliding, global, sliding; a window of 16


def test_sliding_layers_keep_their_window_global_ones_the_budget():
    specs = layer_specs(GEMMA, get_policy("h2o", budget=0.25), 40, 24)
    assert [s.kind for s in specs] == ["window", "global", "window"]
    assert [s.policy.name for s in specs] == ["local", "h2o", "local"]
    assert layer_slots(specs) == [16, 16, 16]          # floor(0.25 * 64) = 16 = the window
    specs = layer_specs(GEMMA, get_policy("h2o", budget=0.5), 40, 24)
    assert layer_slots(specs) == [16, 32, 16]
    assert all(s.layout.evicts for s in specs)
    assert describe_layers(specs) == {"window_layers": 2, "window_slots": 16, "total_slots": 64}


def test_a_window_that_holds_the_run_never_slides():
    """A sliding layer whose window covers prompt + generation is a global layer for that run
    (its window never binds): the policy runs on every layer, as on a model without windows."""
    specs = layer_specs(GEMMA, get_policy("h2o", budget=0.5), 10, 6)
    assert [s.kind for s in specs] == ["global"] * 3
    assert describe_layers(specs) == {}
    assert layer_specs(FAMILY_CONFIGS["qwen3"], get_policy("full"), 100, 50)[0].kind == "global"


def test_buffers_are_allocated_at_each_layers_size(monkeypatch):
    seen = []
    real = engine.allocate_layers
    monkeypatch.setattr(engine, "allocate_layers",
                        lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    m = model_for("gemma3")
    generate(m, rand_prompts([40, 33], seed=1), 24, get_policy("h2o", budget=0.5), Sampling(),
             (), 0)
    (bufs,) = seen
    assert [b.layout.slots for b in bufs] == [16, 32, 16]
    assert [b.k.shape[0] for b in bufs] == [16, 32, 16]
    assert all(b.k.shape[1] == 2 * GEMMA.num_kv_heads for b in bufs)


@pytest.mark.parametrize("name", ["h2o", "tova", "streaming"])
def test_a_whole_run_budget_on_global_layers_gives_fulls_bits(name):
    """The window layers are the same ring under every policy, so a budget that holds the
    whole run on the global layers gives `full`'s logits bit for bit."""
    m = model_for("gemma3")
    ps = rand_prompts([40, 40], seed=6)
    feed = [torch.tensor([5, 9]), torch.tensor([7, 3])] * 8
    ref_pre, ref = engine_logits(m, ps, feed, get_policy("full"))
    pre, steps = engine_logits(m, ps, feed, get_policy(name, budget=1.0))
    assert torch.equal(pre, ref_pre)
    assert all(torch.equal(a, b) for a, b in zip(steps, ref))


def test_result_block_counts_each_layer():
    result = as_engine(model_for("gemma3")).run(
        rand_prompts([40], seed=2), 24, get_policy("h2o", budget=0.5),
        lambda i, k, h, head: head(h[:, -1] if h.dim() == 3 else h).argmax(-1))
    assert result.layout.slots == 32                    # the policy's, on the global layer
    assert layer_slots(result.layers) == [16, 32, 16]


@pytest.mark.parametrize("policy", [("h2o", {"budget": 0.3}), ("full", {}),
                                    ("h2o", {"budget_tokens": 16})])   # the window's size
def test_offloaded_cache_with_mixed_layouts_matches_resident(policy, tmp_path):
    """A cache homed on the CPU and disk tiers (working copies from the pool, whose buffers
    alternate between the window's and the global layers' layouts, of equal shapes at 16
    slots) gives the resident run's tokens."""
    cfg = GEMMA
    ps = rand_prompts([40, 37, 40, 29], seed=3)
    make = lambda: get_policy(policy[0], **policy[1])  # noqa: E731
    want = generate(model_for("gemma3"), ps, 20, make(), Sampling(), (), 0)
    placement = Placement(gpu_batch_size=2, num_gpu_batches=2, cache_gpu=0, cache_cpu=50,
                          offload_dir=str(tmp_path), sep_layer=True)
    eng = Engine.load(cfg, DummyWeights(cfg, seed=0), placement, "cpu", torch.float32)
    try:
        assert generate(eng, ps, 20, make(), Sampling(), (), 0) == want
    finally:
        eng.close()


def test_memory_plan_counts_each_layers_slots():
    """The plan's cache bytes are the buffers' real bytes, each layer at its own slots."""
    specs = layer_specs(GEMMA, get_policy("h2o", budget=0.5), 40, 24)
    slots = layer_slots(specs)
    plan = MemoryPlan(GEMMA, Placement(gpu_batch_size=2), torch.float32, 2, 40, 24, slots)
    bufs = engine.allocate_layers(model_for("gemma3"), specs, 2)
    assert plan.cache_bytes() == sum(b.nbytes() for b in bufs)
    every = MemoryPlan(GEMMA, Placement(gpu_batch_size=2), torch.float32, 2, 40, 24, 32)
    assert plan.cache_bytes() == every.cache_bytes() * sum(slots) // (32 * 3)


def test_result_blocks_name_the_window_layers():
    specs = layer_specs(GEMMA, get_policy("h2o", budget=0.5), 40, 24)
    block = describe_run(GEMMA, get_policy("h2o", budget=0.5), specs[1].layout)
    assert block["slots"] == 32 and block["window_layers"] == 2 and block["window_slots"] == 16
    qwen = FAMILY_CONFIGS["qwen3"]
    layout = get_policy("h2o", budget=0.5).layout(40, 24)
    assert "window_layers" not in describe_run(qwen, get_policy("h2o", budget=0.5), layout)


# ------------------------------------------------------------------ per-layer budgets

EIGHT = dataclasses.replace(FAMILY_CONFIGS["qwen3"], num_layers=8, name="t-qwen3-8",
                             extra={})


@pytest.mark.parametrize("budget", [0.1, 0.25, 0.5, 0.9])
@pytest.mark.parametrize("n", [1, 2, 7, 8, 32])
def test_pyramid_keeps_the_uniform_total_and_decreases(budget, n):
    """PyramidKV's schedule: n times the uniform budget's slots in all, non-increasing from
    the bottom layer up, each layer within [the policy's minimum, the run]."""
    policy = get_policy("h2o", budget=budget, layer_budgets="pyramid")
    k = policy.slots_for(400, 100)
    slots = layer_budget_slots(policy, n, 400, 100)
    assert sum(slots) == n * k
    assert all(a >= b for a, b in zip(slots, slots[1:]))
    assert min(slots) >= policy.minimum_slots() and max(slots) <= 500
    if n > 1 and budget <= 0.25:           # unclipped: the paper's top and bottom layers
        assert abs(slots[-1] - k / 20) <= 1 and abs(slots[0] - (2 * k - k / 20)) <= 1


def test_explicit_weights_share_the_uniform_total():
    policy = get_policy("tova", budget_tokens=30, layer_budgets="3,1,1,1")
    assert layer_budget_slots(policy, 4, 100, 20) == [60, 20, 20, 20]
    with pytest.raises(UserError, match="4 weights for 3"):
        layer_budget_slots(policy, 3, 100, 20)
    for bad in ("pyramids", "1,0", "a,b", ""):
        with pytest.raises(UserError, match="layer_budgets"):
            get_policy("tova", budget=0.2, layer_budgets=bad)


def test_layer_budgets_apply_to_global_layers_only():
    """On Gemma-3 the one global layer holds all of the policy's slots; with a whole-run
    budget every layer's schedule is the run itself, and the tokens are `full`'s."""
    specs = layer_specs(GEMMA, get_policy("h2o", budget=0.5, layer_budgets="pyramid"), 40, 24)
    assert layer_slots(specs) == [16, 32, 16]
    m = model_for("qwen3")
    ps = rand_prompts([40, 40], seed=8)
    ref = generate(m, ps, 12, get_policy("full"), Sampling(), (), 0)
    policy = get_policy("h2o", budget=1.0, layer_budgets="pyramid")
    assert generate(m, ps, 12, policy, Sampling(), (), 0) == ref


def test_a_pyramid_run_allocates_each_layers_budget(monkeypatch):
    seen = []
    real = engine.allocate_layers
    monkeypatch.setattr(engine, "allocate_layers",
                        lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    m = Transformer.load(EIGHT, DummyWeights(EIGHT, seed=0))
    policy = get_policy("h2o", budget=0.25, layer_budgets="pyramid")
    ps = rand_prompts([60, 60], seed=9)
    out = generate(m, ps, 20, policy, Sampling(), (), 0)
    (bufs,) = seen
    want = layer_budget_slots(policy, 8, 60, 20)
    assert [b.layout.slots for b in bufs] == want and sum(want) == 8 * 20
    assert want[0] > want[-1]
    assert out == [generate(m, [p], 20, policy, Sampling(), (), 0)[0] for p in ps]
    block = describe_run(EIGHT, policy, policy.layout(60, 20))
    assert block["layer_slots"] == want and block["total_slots"] == 160


@pytest.mark.parametrize("s,window,pads", [(40, 8, None), (1100, 128, None), (300, 64, [0, 37]),
                                           (100, 64, [5, 0])])
def test_banded_window_attention_is_the_masked_square(s, window, pads):
    """A sliding layer's prefill in bands of `window` queries (`model.windowed_attention`)
    gives what one masked (S, S) square gives, for prompts shorter than two windows (one
    square) and far longer, grouped-query heads, and left-padded rows."""
    import torch.nn.functional as F
    from flexevict.core.model import causal_attention
    g = torch.Generator().manual_seed(s)
    q = torch.randn(2, 4, s, 16, generator=g)
    k, v = torch.randn(2, 2, s, 16, generator=g), torch.randn(2, 2, s, 16, generator=g)
    pad = None if pads is None else torch.tensor(pads)
    got = causal_attention(q, k, v, pad, 0.3, window=window)           # (B, S, H, d)
    gap = torch.arange(s)[:, None] - torch.arange(s)
    for b in range(2):
        p = 0 if pads is None else pads[b]              # the row's real tokens: p..s-1
        real = slice(p, s)
        mask = ((gap >= 0) & (gap < window))[:s - p, :s - p]
        ref = F.scaled_dot_product_attention(q[b:b + 1, :, real], k[b:b + 1, :, real],
                                             v[b:b + 1, :, real], attn_mask=mask, scale=0.3,
                                             enable_gqa=True)
        torch.testing.assert_close(got[b, real], ref[0].transpose(0, 1), rtol=1e-5, atol=1e-6)
