"""Dummy weights are the same numbers on every device, for every chunk size and thread count,
so they can be made on the compute device (or on several CPU threads) and copied to a CPU or
disk tier without changing any token. The scheme is in flexevict/io/seeded.py."""
import zlib

import numpy as np
import pytest
import torch
from tiny import CONFIGS, rand_prompts

from flexevict.io import seeded, weights
from flexevict.io.seeded import seeded_normal
from flexevict.io.weights import DummyWeights
from flexevict.policies import get_policy
from flexevict.runtime.engine import Engine
from flexevict.runtime.generation import generate
from flexevict.runtime.placement import Placement

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs CUDA: compares weights made on the GPU with the CPU's")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, so equality is bitwise (-0.0 != 0.0)."""
    return t.cpu().view({4: torch.int32, 2: torch.int16}[t.element_size()])


# ------------------------------------------------------------------ an independent reference

def splitmix(x):
    """splitmix64's mix on uint64 arrays (wrapping)."""
    u64 = np.uint64
    x = (x ^ (x >> u64(30))) * u64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> u64(27))) * u64(0x94D049BB133111EB)
    return x ^ (x >> u64(31))


def reference_table(seed: int, n: int) -> np.ndarray:
    """Entry e: the four bytes of the 32-bit half e % 2 of word e // 2's hash, read as uint8s
    (little-endian) and summed, minus 510."""
    u64 = np.uint64
    with np.errstate(over="ignore"):
        start = splitmix(np.array([seed], dtype=u64))[0]
        h = splitmix(np.arange((n + 1) // 2, dtype=u64) * u64(0x9E3779B97F4A7C15) + start)
    return h.view(np.uint8).reshape(-1, 4).astype(np.int64).sum(axis=1)[:n] - 510


def reference_normal(key: int, n: int, scale: float, base: float) -> np.ndarray:
    """The scheme written plainly in numpy: each element the float32 sum of two table entries,
    at indices that start where the key's hash says and wrap around each table."""
    ta, tb = seeded.TABLE_A, seeded.TABLE_B
    with np.errstate(over="ignore"):
        h = int(splitmix(np.array([key % 2 ** 64], dtype=np.uint64))[0])
    mul = np.float32(scale / (8 * (256 ** 2 - 1) / 12) ** 0.5)
    a = reference_table(1, ta).astype(np.float32) * mul
    if base:
        a = a + np.float32(base)                                   # float32 ops, IEEE-rounded
    b = reference_table(2, tb).astype(np.float32) * mul
    i = np.arange(n)
    return a[(h % ta + i) % ta] + b[((h >> 32) % tb + i) % tb]


@pytest.mark.parametrize("key,scale,base", [(0, 1.0, 0.0), (12345, 0.02, 0.0),
                                            (2 ** 40 + 7, 0.1, 1.0),
                                            (3 * 1_000_003, 64 ** -0.5, 0.0)])
def test_matches_an_independent_implementation(key, scale, base):
    """Pins the exact scheme: a sign-extending shift, a lost wrap, a swapped half or a window
    that does not wrap around its table would change these (n > TABLE_A)."""
    n = seeded.TABLE_A + 300_001
    want = reference_normal(key, n, scale, base)
    got = seeded_normal(key, n, scale=scale, base=base)
    assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32))
    # made in half precision directly: the float32 value rounded to nearest even, once
    half = seeded_normal(key, n, scale=scale, base=base, dtype=torch.float16)
    assert np.array_equal(half.numpy().view(np.int16), want.astype(np.float16).view(np.int16))
    bf16 = seeded_normal(key, n, scale=scale, base=base, dtype=torch.bfloat16)
    assert torch.equal(bits(bf16), bits(torch.from_numpy(want).to(torch.bfloat16)))


def test_large_keys_and_negative_seeds_wrap_like_uint64():
    for key in (2 ** 64 + 5, -3 * 1_000_003 + 17):
        want = reference_normal(key, 101, 1.0, 0.0)
        assert np.array_equal(seeded_normal(key, 101).numpy().view(np.int32), want.view(np.int32))


def test_threads_do_not_change_a_bit():
    n = 300_007
    ref = reference_normal(5, n, 0.5, 0.0)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for dtype in (torch.float32, torch.float16):
                got = seeded_normal(5, n, scale=0.5, dtype=dtype, chunk=1 << 12)
                want = torch.from_numpy(ref).to(dtype)
                assert torch.equal(bits(got), bits(want)), (threads, dtype)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("device", DEVICES)
def test_chunk_size_does_not_change_a_bit(device):
    n = 100_003
    ref = seeded_normal(99, n, device, scale=0.3, base=1.0)
    for chunk in (7, 4096, 1 << 15, n - 1, n, 10 * n):
        assert torch.equal(bits(seeded_normal(99, n, device, 0.3, 1.0, chunk=chunk)), bits(ref))
    assert torch.equal(bits(seeded_normal(99, 50, device, 0.3, 1.0, chunk=1)), bits(ref[:50]))
    assert seeded_normal(99, 0, device).numel() == 0


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_and_cpu_make_the_same_bits(dtype):
    cfg = CONFIGS["opt"]
    names = ["model.decoder.embed_tokens.weight", "model.decoder.embed_positions.weight",
             "model.decoder.layers.0.fc1.weight", "model.decoder.layers.1.fc2.bias",
             "model.decoder.layers.0.final_layer_norm.weight"]
    src = DummyWeights(cfg, seed=4)
    for n in names:
        on_cpu = src.load(n, "cpu", dtype)
        on_gpu = src.load(n, "cuda", dtype)
        staged = src.generating_on("cuda").load(n, "cpu", dtype)
        assert on_gpu.device.type == "cuda" and staged.device.type == "cpu"
        assert torch.equal(bits(on_gpu), bits(on_cpu)), n
        assert torch.equal(bits(staged), bits(on_cpu)), n
    big = seeded_normal(7, (1 << 23) + 11, "cuda", 0.05)     # several default CUDA chunks
    assert torch.equal(bits(big), bits(seeded_normal(7, (1 << 23) + 11, "cpu", 0.05)))


# ------------------------------------------------------------------ statistics and seeds

def test_each_kind_of_tensor_has_its_intended_scale():
    cfg = CONFIGS["opt"]
    src = DummyWeights(cfg, seed=0)
    # (name, mean, std) - linear weights N(0, 1/fan_in), embeddings N(0, 1), learned positions
    # N(0, 0.02), norm weights 1 + N(0, 0.1), biases N(0, 0.02)
    kinds = [("model.decoder.layers.0.fc2.weight", 0, cfg.ffn_size ** -0.5),
             ("model.decoder.layers.0.fc1.weight", 0, cfg.hidden_size ** -0.5),
             ("model.decoder.embed_tokens.weight", 0, 1.0),
             ("model.decoder.embed_positions.weight", 0, 0.02),
             ("model.decoder.layers.0.final_layer_norm.weight", 1.0, 0.1),
             ("model.decoder.layers.0.fc1.bias", 0, 0.02)]
    for name, mean, std in kinds:
        w = src.load(name).double()
        n = w.numel()
        assert abs(w.mean().item() - mean) < 4 * std / n ** 0.5, name
        assert abs(w.std().item() / std - 1) < 4 / (2 * n) ** 0.5 + 0.02, name


def test_a_big_tensor_is_close_to_normal():
    fan_in = 4096
    w = seeded_normal(7, 4096 * fan_in, scale=fan_in ** -0.5).double() * fan_in ** 0.5
    # 16x longer than the tables, so the mean is theirs: each about N(0, 147.8 / 1024) / 209
    assert abs(w.mean().item()) < 1e-3
    assert abs(w.std().item() - 1) < 1e-3
    assert w.abs().max().item() <= 1020 / seeded.STD + 1e-6     # bounded at 4.88 sigma
    assert abs((w ** 4).mean().item() - 2.85) < 0.02           # its kurtosis, 3 - 1.2 / 8
    # mass within one sigma: the exact law of a sum of eight uniform bytes (a normal: 0.6827)
    law = np.ones(1)
    for _ in range(8):
        law = np.convolve(law, np.full(256, 1 / 256))
    within = law[np.abs(np.arange(2041) - 1020) < seeded.STD].sum()
    assert abs(within - 0.6775) < 1e-4
    assert abs((w.abs() < 1).double().mean().item() - within) < 0.002


def test_elements_a_table_apart_share_half_their_value():
    """The one correlation the scheme has (module docstring): TABLE_A apart, 1/2; else none."""
    w = seeded_normal(3, 3 * seeded.TABLE_A).double()
    n = seeded.TABLE_A
    apart = torch.corrcoef(torch.stack([w[:2 * n], w[n:]]))[0, 1].item()
    near = torch.corrcoef(torch.stack([w[:-1], w[1:]]))[0, 1].item()
    assert abs(apart - 0.5) < 0.01 and abs(near) < 0.01


def test_same_name_and_seed_same_tensor_else_different():
    cfg = CONFIGS["llama-gqa"]
    q0, q1 = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"
    a, b, c = DummyWeights(cfg, 0), DummyWeights(cfg, 0), DummyWeights(cfg, 1)
    assert torch.equal(a.load(q0), b.load(q0))
    for x, y in [(a.load(q0), a.load(q1)), (a.load(q0), c.load(q0))]:
        assert not torch.equal(x, y)
        assert abs(torch.corrcoef(torch.stack([x.flatten(), y.flatten()]))[0, 1]) < 0.05
    # the per-tensor key is seed * 1_000_003 + crc32(name), as before the change
    key = 1 * 1_000_003 + zlib.crc32(q0.encode())
    assert torch.equal(c.load(q0), seeded_normal(key, 64 * 64, scale=64 ** -0.5).view(64, 64))


def test_the_cache_key_names_the_seed_and_the_scheme(monkeypatch):
    """A kept weight file (runtime/weight_cache.py) made under another scheme or seed is never
    mapped into a run: the folder name changes with both."""
    cfg = CONFIGS["opt"]
    key = DummyWeights(cfg, 0).cache_key
    assert DummyWeights(cfg, 1).cache_key != key
    monkeypatch.setattr(weights, "SCHEME", "another")
    assert DummyWeights(cfg, 0).cache_key != key


def test_nearby_keys_are_not_shifted_copies():
    """Without mixing the key first, key + 1 could replay key's stream one element later."""
    a, b = seeded_normal(10, 5000), seeded_normal(11, 5000)
    for shift in range(4):
        assert not torch.equal(a[shift:shift + 100], b[:100])


# ------------------------------------------------------------------ end to end

def test_engine_generates_on_the_compute_device_for_offloaded_tiers(monkeypatch, tmp_path):
    cfg = CONFIGS["opt"]
    seen = []
    real = DummyWeights.load
    monkeypatch.setattr(DummyWeights, "load",
                        lambda self, n, device="cpu", dtype=torch.float32:
                        seen.append((self.generate_on, device)) or real(self, n, device, dtype))
    p = Placement.from_percent((0, 50, 100, 0, 100, 0), offload_dir=str(tmp_path))
    Engine.load(cfg, DummyWeights(cfg, 0), p, torch.device("cpu"), torch.float32).close()
    assert len(seen) == len(cfg.param_shapes())
    assert all(made == torch.device("cpu") and to == "cpu" for made, to in seen)


@pytest.mark.parametrize("device", DEVICES)
def test_tokens_do_not_depend_on_the_weight_tier(device, tmp_path):
    """On CUDA, generating per tier (Philox on the GPU, mt19937 on the CPU) gave each tier
    different weights and so different tokens."""
    cfg = CONFIGS["opt"]
    prompts = rand_prompts([30, 25, 41], seed=11)
    outs = {}
    for label, percent in [("gpu", (100, 0, 100, 0, 100, 0)), ("cpu", (0, 100, 100, 0, 100, 0)),
                           ("disk", (0, 0, 100, 0, 100, 0)), ("mixed", (30, 40, 100, 0, 100, 0))]:
        p = Placement.from_percent(percent, offload_dir=str(tmp_path / label))
        e = Engine.load(cfg, DummyWeights(cfg, seed=2), p, device, torch.float32)
        try:
            outs[label] = generate(e, prompts, 12, get_policy("h2o", budget=0.3))
        finally:
            e.close()
    assert len({str(o) for o in outs.values()}) == 1, outs
    assert len({t for o in outs["gpu"] for t in o}) > 3          # not a degenerate model


def test_the_package_asks_torch_for_huge_pages_before_torch_loads_and_a_user_setting_wins():
    """`import flexevict` first sets THP_MEM_ALLOC_ENABLE=1 (torch reads it once, at its first
    allocation) unless the environment already says otherwise."""
    import os
    import subprocess
    import sys
    code = "import flexevict, os; print(os.environ['THP_MEM_ALLOC_ENABLE'])"
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    for given, want in ((None, "1"), ("0", "0")):
        run_env = env if given is None else dict(env, THP_MEM_ALLOC_ENABLE=given)
        out = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True,
                             text=True, check=True).stdout.strip()
        assert out == want
