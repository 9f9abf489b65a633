"""The cost model prices each layer at its own size (`costmodel.LayerGroup`): a sliding layer
whose window is shorter than the run at its ring, a per-layer budget at its slots, and a model
whose layers are all alike exactly as before. GPU plans use the synthetic H100 calibration
(datasheet numbers), CPU plans the tests' fixture calibration: no measuring."""
import dataclasses
import os

import pytest
import torch

from flexevict.core.config import REGISTRY
from flexevict.planner import calibration
from flexevict.planner.costmodel import CostModel
from flexevict.policies import PolicySpec
from flexevict.runtime.placement import Placement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100 = os.path.join(ROOT, "bench", "results", "placement", "calibration_h100_synthetic.json")
CPU_CAL = os.path.join(ROOT, "tests", "calibration_cpu.json")
GEMMA = REGISTRY["gemma3-270m"]          # 15 sliding layers (window 512), 3 global


def model(config, prompt, gen, policy="full", budget=None, args=(), device="cuda", cal=H100,
          dtype=torch.float16):
    return CostModel(config, calibration.read_file(cal), device, dtype, prompt, gen,
                     PolicySpec.parse(policy, budget, policy_args=args))


def decode_attention_s(m, b, slots_only=False):
    """Predicted decode attention seconds (hooks included) of one GPU batch of b sequences,
    over every layer and decode step; slots_only: the part that grows with the attended slots
    (each call less the same call at no slots)."""
    total = 0.0
    for i, weight, attended in m._decode_samples():
        for g, n in zip(m.groups, attended):
            t = m._attention(b, i, n, "gpu", g)
            if slots_only:
                t -= m._attention(b, i, 0, "gpu", g)
            total += weight * len(g.layers) * t
    return total


def attended_total(m):
    """Slots per row all layers attend over the decode steps, from the layers' own slots:
    decode step i attends min(P + i, slots) (`Layout.held`)."""
    return sum(min(m.P + i, s) for s in m.layer_slots for i in range(1, m.G))


def test_gemma3s_window_layers_are_priced_at_their_ring():
    """Gemma-3 at a 4096-token prompt: 15 of its 18 layers attend a 512-token ring, so decode
    attention is predicted well below the same model with every layer global; the part that
    grows with the slots falls by what the layers' slots say, the fixed costs per layer stay.
    A window layer's cache moves its own buffer, runs `local`, and never ranks the prompt."""
    windowed = model(GEMMA, 4096, 64)
    every = model(dataclasses.replace(GEMMA, sliding_window=None), 4096, 64)
    assert len(windowed.groups) == 2 and len(every.groups) == 1
    ring, glob = windowed.groups
    assert (len(ring.layers), ring.slots, ring.window, ring.spec.name) == (15, 512, 512, "local")
    assert (len(glob.layers), glob.slots, glob.spec.name) == (3, every.slots, "full")
    want = attended_total(windowed) / attended_total(every)
    assert want < 0.3
    b = 64
    assert decode_attention_s(windowed, b, True) / decode_attention_s(every, b, True) == \
        pytest.approx(want, rel=1e-3)
    ratio = decode_attention_s(windowed, b) / decode_attention_s(every, b)
    assert want < ratio < 0.5
    # the cache: each group loads its own buffer from the CPU
    p = Placement(100, 0, 0, 100, 100, 0, gpu_batch_size=b)
    plan = windowed.memory_plan(p, b)
    load = [windowed._cache_io(p, plan, plan.sizes, 1, g)["load"][1] for g in (ring, glob)]
    size = [sum(plan._buffer_tensors(b, False, g.slots)) for g in (ring, glob)]
    assert load[0] / load[1] == pytest.approx(size[0] / size[1], rel=1e-12)
    assert windowed.estimate(p, b).decode_s < 0.5 * every.estimate(p, b).decode_s
    # prefill: the global layers rank the prompt for h2o, the ring never does; a binding window
    # runs in masked bands of W x 2W (model.windowed_attention): 4W / P of the causal pass's
    # flops, at the rate for 2W tokens; one masked square (twice the causal pass) up to 2W
    h2o = model(GEMMA, 4096, 64, "h2o", 0.2)
    ring, glob = h2o.groups
    assert glob.ranks_prompt and not ring.ranks_prompt and ring.spec.name == "local"
    (band, at), (causal, p) = h2o._prefill_flops(1, ring), h2o._prefill_flops(1, glob)
    assert (band / causal, at, p) == (pytest.approx(4 * 512 / 4096), 1024, 4096)
    short = model(GEMMA, 1000, 16)
    (square, at), (causal, _) = (short._prefill_flops(1, g) for g in short.groups)
    assert (square / causal, at) == (2, 1000)


def test_a_window_that_holds_the_run_prices_as_a_global_layer():
    """Gemma-3 at 256 + 16 tokens: its 512-token window never slides, so every layer is
    global and the estimate is the one of the model without windows, number for number."""
    p = Placement(100, 0, 0, 100, 100, 0, gpu_batch_size=8)
    a = model(GEMMA, 256, 16, "h2o", 0.5).estimate(p, 8)
    b = model(dataclasses.replace(GEMMA, sliding_window=None), 256, 16, "h2o", 0.5).estimate(p, 8)
    assert (a.prefill_s, a.decode_s, a.decode_terms) == (b.prefill_s, b.decode_s, b.decode_terms)


def test_pyramid_budgets_price_each_layer_at_its_slots():
    """h2o with layer_budgets=pyramid on LLaMA-3-8B: each global layer is a group at its own
    slots, attending them every step (the prompt is longer than any budget); their total is the
    uniform budget's, and attention is linear in the slots with the same fixed costs per layer,
    so the total predicted decode attention (and an all-GPU run's whole decode, where compute
    bounds every stage) equals the uniform budget's."""
    config = REGISTRY["llama-3-8b"]
    uni = model(config, 4096, 64, "h2o", 0.2)
    pyr = model(config, 4096, 64, "h2o", 0.2, ("layer_budgets=pyramid",))
    assert len(pyr.groups) == config.num_layers
    for g in pyr.groups:
        (j,) = g.layers
        assert g.slots == pyr.layer_slots[j] < pyr.P
        assert set(g.attended) == {g.slots} and g.spec == pyr.spec and g.ranks_prompt
    assert pyr.groups[0].slots > 1.8 * uni.slots > 18 * pyr.groups[-1].slots
    assert sum(pyr.layer_slots) == sum(uni.layer_slots)
    assert decode_attention_s(pyr, 8) == pytest.approx(decode_attention_s(uni, 8), rel=1e-9)
    bottom, top = (pyr._attention(8, 1, g.slots, "gpu", g) for g in (pyr.groups[0],
                                                                      pyr.groups[-1]))
    assert bottom > top
    p = Placement(gpu_batch_size=8)
    assert pyr.estimate(p, 8).decode_s == pytest.approx(uni.estimate(p, 8).decode_s, rel=1e-9)


A = Placement(100, 0, 0, 100, 100, 0, gpu_batch_size=4, num_gpu_batches=2)
B = Placement(100, 0, 100, 0, 100, 0, gpu_batch_size=4, compress_cache=True, sep_layer=False)
C = Placement(0, 100, 0, 100, 100, 0, gpu_batch_size=4, overlap=False)
D = Placement(gpu_batch_size=4)
# (model, policy, budget, placement) -> (prefill_s, decode_s) computed before the cost model
# priced each layer at its own size (commit e4bf096): a model whose layers are all alike is
# one group and must come out the same (a new fixture calibration changes the CPU rows)
BEFORE = [
    ("llama-3-8b", "full", None, D, 0.5038706058152228, 0.6321200794828798),
    ("llama-3-8b", "full", None, A, 1.0093386516304457, 6.201787474575361),
    ("llama-3-8b", "full", None, B, 0.5077850945009371, 2.13088206864384),
    ("llama-3-8b", "full", None, C, 0.8706080957352228, 23.756699366522884),
    ("llama-3-8b", "h2o", 0.2, D, 0.5625112259632762, 0.51547648524288),
    ("llama-3-8b", "h2o", 0.2, A, 1.1253419399265523, 1.6931728185753596),
    ("llama-3-8b", "h2o", 0.2, B, 0.563294123700419, 0.55478235660288),
    ("llama-3-8b", "h2o", 0.2, C, 0.8928270838832763, 21.32992750092288),
    ("smollm2-135m", "full", None, A, 6.686442184134753, 1.5065885251752424),
    ("smollm2-135m", "full", None, C, 3.510620163202667, 3.200999456260715),
    ("smollm2-135m", "h2o", 0.2, A, 8.349263005700884, 1.4803307515628499),
    ("smollm2-135m", "h2o", 0.2, C, 4.33644059846335, 3.1276535429753487),
]


@pytest.mark.parametrize("name,policy,budget,placement,prefill,decode", BEFORE)
def test_a_model_whose_layers_are_alike_is_priced_as_before(name, policy, budget, placement,
                                                            prefill, decode):
    """LLaMA-3-8B at 4096 + 64 tokens on the synthetic H100, SmolLM2-135M at 512 + 16 on the
    fixture CPU calibration: one layer group, the same estimate as before."""
    gpu = name == "llama-3-8b"
    m = model(REGISTRY[name], *((4096, 64) if gpu else (512, 16)), policy, budget,
              device="cuda" if gpu else "cpu", cal=H100 if gpu else CPU_CAL,
              dtype=torch.float16 if gpu else torch.float32)
    assert len(m.groups) == 1 and m.groups[0].layers == tuple(range(m.config.num_layers))
    e = m.estimate(placement, 4 * placement.num_gpu_batches)
    assert (e.prefill_s, e.decode_s) == pytest.approx((prefill, decode), rel=1e-12)
