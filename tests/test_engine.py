"""The offloading engine on CPU: every tier, overlap and batch split give the tokens of the
resident model; only budget-sized buffers move; placement rules; compression."""
import os

import pytest
import torch
from tiny import CONFIGS, greedy, model_for, rand_prompts, roomy

from flexevict.runtime.engine import Engine
from flexevict.errors import UserError
from flexevict.runtime.generation import generate, token_nll
from flexevict.runtime.placement import Placement
from flexevict.policies import POLICIES, get_policy
from flexevict.io.weights import DummyWeights

ALL_GPU = (100, 0, 100, 0, 100, 0)
PLACEMENTS = {   # name: (percent, flags)
    "weights-cpu": ((0, 100, 100, 0, 100, 0), {}),
    "weights-disk": ((0, 0, 100, 0, 100, 0), {}),
    "weights-mixed": ((30, 50, 100, 0, 100, 0), {}),
    "cache-cpu": ((100, 0, 0, 100, 100, 0), {}),
    "cache-cpu-compute": ((100, 0, 0, 100, 100, 0), {"cpu_cache_compute": True}),
    "cache-disk": ((100, 0, 0, 0, 100, 0), {}),
    "cache-disk-cpu-compute": ((100, 0, 0, 0, 100, 0), {"cpu_cache_compute": True}),
    "cache-mixed-2-batches": ((100, 0, 50, 50, 100, 0), {"num_gpu_batches": 2}),
    "activations-cpu": ((100, 0, 100, 0, 0, 100), {}),
    "no-overlap": (ALL_GPU, {"overlap": False}),
    "no-sep-layer": (ALL_GPU, {"sep_layer": False}),
    "batches-2x2": (ALL_GPU, {"gpu_batch_size": 2, "num_gpu_batches": 2}),
    "batches-4x1-all-tiers": ((20, 30, 30, 40, 0, 100), {"num_gpu_batches": 4}),
    "everything-offloaded-no-overlap": ((0, 50, 0, 0, 0, 100),
                                        {"num_gpu_batches": 2, "overlap": False}),
}


def engine(arch, percent=ALL_GPU, tmp=None, **flags) -> Engine:
    cfg = CONFIGS[arch]
    p = Placement.from_percent(percent, offload_dir=str(tmp or "/tmp/flexevict-test"), **flags)
    return Engine.load(cfg, DummyWeights(cfg, seed=0), p, "cpu", torch.float32)


def policy(name):
    return get_policy(name, **roomy(name, budget=0.3)) if name != "full" else get_policy("full")


@pytest.mark.parametrize("arch", CONFIGS)
@pytest.mark.parametrize("name", ["full", "h2o"])
def test_greedy_tokens_do_not_depend_on_placement(arch, name, tmp_path):
    prompts = rand_prompts([30, 25, 40, 33], seed=3)
    ref = generate(model_for(arch), prompts, 14, policy(name))
    for label, (percent, flags) in PLACEMENTS.items():
        e = engine(arch, percent, tmp_path, **flags)
        try:
            assert generate(e, prompts, 14, policy(name)) == ref, label
        finally:
            e.close()


@pytest.mark.parametrize("name", sorted(n for n in POLICIES if n != "full"))
def test_every_policy_survives_an_offloaded_cache(name, tmp_path):
    """Every registered policy: its declared state travels with the cache through a CPU home
    and a pool of working buffers, so tokens equal the all-on-device run's. A policy that
    batches by length (`Policy.batch_key`) gets prompts that may share a batch: equal ones."""
    prompts = rand_prompts([40, 40] if policy(name).batch_by_length else [40, 33], seed=5)
    ref = generate(model_for("llama-gqa"), prompts, 24, policy(name))
    e = engine("llama-gqa", (0, 100, 0, 0, 100, 0), tmp_path, num_gpu_batches=2)
    try:
        assert generate(e, prompts, 24, policy(name)) == ref
    finally:
        e.close()


def test_scoring_through_an_offloaded_cache_is_exact(tmp_path):
    ids = rand_prompts([120], seed=8)[0]
    ref = token_nll(model_for("opt"), ids, get_policy("h2o", budget=0.25))
    e = engine("opt", (0, 100, 0, 100, 100, 0), tmp_path, cpu_cache_compute=True)
    try:
        assert torch.equal(token_nll(e, ids, get_policy("h2o", budget=0.25)), ref)
    finally:
        e.close()


def test_smaller_budget_moves_fewer_cache_bytes(tmp_path):
    """Cache on the CPU tier: each decode step loads the whole (budget-sized) buffer and stores
    back only the changed K/V rows plus per-slot metadata."""
    prompts, moved = rand_prompts([64] * 4, seed=1), {}
    for name, budget in (("full", None), ("h2o", 0.5), ("h2o", 0.2)):
        e = engine("opt", (100, 0, 0, 100, 100, 0), tmp_path)
        moved[budget] = e.run(prompts, 16, get_policy(name, budget=budget), greedy).stats.traffic
        e.close()
    loads = {b: t["cpu->gpu"] for b, t in moved.items()}
    assert loads[0.2] < loads[0.5] < loads[None]
    c = CONFIGS["opt"]
    for t in moved.values():
        # stores after prefill: metadata + only the written slots' K/V, far less than loads
        assert t["gpu->cpu"] < t["cpu->gpu"] / 2
    rows, slots = 4 * c.num_kv_heads, 64 + 16          # full: P + G slots, scratch included
    per_step_load = c.num_layers * slots * rows * (2 * c.dim_head * 4 + 13)
    assert loads[None] == 15 * per_step_load


def test_disk_tier_files_live_under_offload_dir_until_close(tmp_path):
    e = engine("llama-gqa", (0, 0, 0, 0, 100, 0), tmp_path)
    generate(e, rand_prompts([20], seed=2), 4, get_policy("full"))
    files = [f for _, _, fs in os.walk(tmp_path) for f in fs]
    assert files, "disk-resident weights and cache must be files under --offload-dir"
    e.close()
    # only the kept dummy weights stay (runtime/weight_cache.py), none of the run's files
    kept = os.path.join(tmp_path, "weights")
    assert not [f for d, _, fs in os.walk(tmp_path) for f in fs if not d.startswith(kept)]
    assert os.listdir(kept)


def test_weight_tiers_follow_flexgen_midpoint_rule():
    p = Placement(w_gpu=20, w_cpu=30)                       # disk 50 | cpu 30 | gpu 20
    assert p.weight_tiers([10] * 5) == ["disk", "disk", "cpu", "cpu", "gpu"]
    assert p.weight_tiers([1, 98, 1]) == ["disk", "cpu", "gpu"]     # midpoints 0.5, 50, 99.5
    assert Placement(cache_gpu=50, cache_cpu=25).cache_tiers(4) == ["disk", "cpu", "gpu", "gpu"]


def test_batch_split():
    assert Placement(num_gpu_batches=3).batch_split(7) == [3, 3, 1]
    assert Placement(gpu_batch_size=2, num_gpu_batches=2).batch_split(3) == [2, 1]
    assert Placement(num_gpu_batches=3).batch_rows(7) == [slice(0, 3), slice(3, 6), slice(6, 7)]
    with pytest.raises(UserError, match="exceed one block"):
        Placement(gpu_batch_size=2, num_gpu_batches=2).batch_split(5)


@pytest.mark.parametrize("percent, needle", [
    ((100, 10, 100, 0, 100, 0), "summing to at most 100"),
    ((100, 0, 100, 0, 50, 50), "100% on one tier"),
    ((100, 0, 100, 0, 0, 0), "on disk are not supported"),
    ((100, 0, 100), "six integers"),
])
def test_bad_placements_name_the_fix(percent, needle):
    with pytest.raises(UserError, match=needle):
        Placement.from_percent(percent)


def test_compressed_weights_are_stored_at_4_bits(tmp_path):
    from flexevict.core.kernels import Packed4bit
    plain, comp = engine("opt", (0, 100, 100, 0, 100, 0), tmp_path), \
        engine("opt", (0, 100, 100, 0, 100, 0), tmp_path, compress_weight=True)
    try:
        homes = [h for hs in comp.homes for h in hs.values() if h.data is not None]
        assert all(isinstance(h.data, Packed4bit) == (h.data.dim() == 2 if torch.is_tensor(h.data)
                                                   else True) for h in homes)
        packed = sum(h.data.nbytes for h in homes if isinstance(h.data, Packed4bit))
        assert packed and comp.weight_bytes() < 0.2 * plain.weight_bytes()   # fp32 -> 4 bits
        out = generate(comp, rand_prompts([30, 30], seed=4), 10, get_policy("h2o", budget=0.5))
        assert [len(o) for o in out] == [10, 10]
    finally:
        plain.close()
        comp.close()


@pytest.mark.slow
def test_compression_perplexity_on_smollm2(smollm2_path, tmp_path):
    """4-bit cache: within 5% of uncompressed (decode path, 64 steps read the compressed cache).
    4-bit weights: reported, bounded loosely. The packaged SmolLM2 weights are already Q4_1
    (4-bit, groups of 32), so regrouping them by 64 compounds two quantisations (README)."""
    from flexevict import LLM
    from flexevict.io.packaged import wikipedia_text
    text = wikipedia_text()
    ppl = {}
    for label, flags, prefill in (("base-decode", {}, 192),
                                  ("cache", {"compress_cache": True}, 192),
                                  ("base-prefill", {}, None),
                                  ("weights", {"compress_weight": True}, None)):
        llm = LLM("smollm2-135m", placement=Placement(offload_dir=str(tmp_path), **flags))
        ppl[label] = llm.score(text, max_tokens=256, prefill_tokens=prefill)["ppl"]
        llm.close()
    cache, weights = ppl["cache"] / ppl["base-decode"] - 1, ppl["weights"] / ppl["base-prefill"] - 1
    print(f"smollm2 ppl change: 4-bit cache {100 * cache:+.2f}%, "
          f"4-bit weights {100 * weights:+.2f}%")
    assert cache != 0 and abs(cache) < 0.05
    assert 0 < weights < 1.0


def test_positions_wrap_only_when_asked():
    e = Engine.resident(model_for("opt"))                         # tiny OPT: 512 positions
    prompts = rand_prompts([500], seed=6)
    with pytest.raises(UserError, match="maximum of 512 positions"):
        generate(e, prompts, 20, get_policy("full"))
    run = e.run(prompts, 20, get_policy("h2o", budget=0.2), greedy,   # bench's
                wrap_positions=True)                                  # --ignore-max-positions
    assert run.tokens.shape == (1, 20)
    with pytest.raises(UserError, match="maximum of 512 positions"):  # a flag of that run only
        e.run(prompts, 20, get_policy("full"), greedy)


@pytest.mark.slow
def test_generate_and_eval_clis_take_placement_flags(tmp_path):
    from test_cli import TINY, run
    from flexevict.io.weights import convert
    convert(DummyWeights(TINY, seed=3), TINY, str(tmp_path / "m"), "float32", tokenizer="bytes")
    text = tmp_path / "t.txt"
    text.write_text("placement must not change what the model computes " * 3)
    offload = ["--percent", "0", "0", "0", "100", "100", "0", "--num-gpu-batches", "2",
               "--offload-dir", str(tmp_path / "off")]
    for cmd in (["generate", "--prompt", "hello there", "--max-new-tokens", "8"],
                ["eval", "ppl", "--text", str(text), "--max-tokens", "48", "--policy", "h2o",
                 "--budget", "0.5",
                 "--json"]):
        args = [cmd[0], *cmd[1:], "--model", str(tmp_path / "m")]
        plain, placed = run(*args), run(*args, *offload)
        assert plain.returncode == placed.returncode == 0, placed.stderr
        assert plain.stdout == placed.stdout and plain.stdout.strip()


def test_budget_lets_a_larger_batch_fit():
    """H2O's setting: OPT-6.7B, 2048 + 2048 tokens, batch 64 on an 80 GB GPU; the estimate
    matches H2O's logs within 15% at batch 24 (FlexGen 74.8 GB, H2O 36.4 GB measured)."""
    from flexevict.core.config import registry_config
    from flexevict.runtime.memory import GIB, MemoryPlan
    c = registry_config("opt-6.7b")
    need = lambda bs, slots: MemoryPlan(c, Placement(gpu_batch_size=bs), torch.float16, bs,  # noqa: E731
                                        2048, 2048, slots).needs()["gpu"] / GIB
    assert need(64, 4096) > 80 > need(64, 819)
    assert need(24, 4096) == pytest.approx(74.8, rel=0.15)
    assert need(24, 819) == pytest.approx(36.4, rel=0.15)


def test_eviction_time_counts_prefill_and_decode_apart(monkeypatch):
    """The policy hooks' time is split at the prefill: a slow prompt selection shows in
    `prefill_eviction_seconds` only; a run whose buffers hold every token times nothing."""
    import time
    from flexevict.policies.h2o import H2O
    e = engine("llama-gqa")
    prompts = rand_prompts([20, 17], seed=1)
    real = H2O.prefill
    monkeypatch.setattr(H2O, "prefill", lambda *a, **kw: (time.sleep(0.05), real(*a, **kw))[1])
    stats = e.run(prompts, 6, get_policy("h2o", budget_tokens=8), greedy).stats
    layers = CONFIGS["llama-gqa"].num_layers
    assert stats.prefill_eviction_seconds >= 0.05 * layers
    assert 0 < stats.eviction_seconds < 0.05 * layers / 2
    for policy in (get_policy("full"), get_policy("h2o", budget_tokens=40)):   # keeps all
        stats = e.run(prompts, 6, policy, greedy).stats
        assert stats.prefill_eviction_seconds == 0 and stats.eviction_seconds == 0


STACKING = sorted(n for n, cls in POLICIES.items() if cls.stacks)


def _run_keeping_buffers(e: Engine, prompts, steps, name):
    runs, real = [], e._run
    e._run = lambda run, *a: runs.append(run) or real(run, *a)
    tokens = e.run(prompts, steps, policy(name), greedy).tokens
    return tokens, runs[0].cache


@pytest.mark.parametrize("name", STACKING)
def test_stacked_layers_commit_once_per_step_and_change_nothing(name, monkeypatch):
    """A policy that `stacks` keeps a resident cache as one buffer of every layer's rows and
    commits once per decode step on it: tokens and every layer's buffer (K, V, positions,
    validity, scores, state, declared state) equal those of one commit per layer."""
    assert {"h2o", "tova", "vatp", "hashevict"} <= set(STACKING)
    prompts, steps = rand_prompts([40, 27, 33], seed=7), 20
    e = engine("llama-gqa", num_gpu_batches=1)
    layers = e.config.num_layers
    commits = []
    cls = type(policy(name))
    real_commit = cls.commit
    monkeypatch.setattr(cls, "commit",
                        lambda self, buf, slot: commits.append(buf.stack is None and
                                                               buf.layer is None)
                        or real_commit(self, buf, slot))
    stacked, cache = _run_keeping_buffers(e, prompts, steps, name)
    assert all(b.stack is cache[0][0].stack is not None for b in cache[0])
    assert len(commits) == steps - 1 and all(commits)       # once per step, on the stack
    commits.clear()
    monkeypatch.setattr(Engine, "stack_layers", False)
    alone, per_layer = _run_keeping_buffers(e, prompts, steps, name)
    fused = name == "cascade"       # its per-layer commit is fused into after_attention
    assert len(commits) == (0 if fused else (steps - 1) * layers) and not any(commits)
    assert torch.equal(stacked, alone)
    for a, b in zip(cache[0], per_layer[0]):
        assert b.stack is None and (a.used, a.cursor) == (b.used, b.cursor)
        for x, y in zip(a.tensors(), b.tensors()):
            assert torch.equal(x, y)
        for f in a.fields:
            assert torch.equal(a.policy_state[f.name], b.policy_state[f.name])
