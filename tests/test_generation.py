"""Generation on random-weight models: padding invariance, sampling, stop ids, dummy weights,
position limits and KV buffer allocation."""
import math

import pytest
import torch

import flexevict.runtime.engine as E
import flexevict.core.kv
from flexevict.core.config import ModelConfig
from flexevict.errors import UserError
from flexevict.runtime.generation import Sampling, generate, left_pad, token_nll
from flexevict.runtime.engine import Engine
from flexevict.core.model import Transformer
from flexevict.policies import get_policy
from flexevict.policies.full import Full
from flexevict.io.weights import DummyWeights
from tiny import engine_logits

# untied heads: with a tied N(0, 1) embedding the dummy model just repeats the last prompt token,
# which would make most checks below trivially true
CFGS = {
    "opt": ModelConfig(arch="opt", name="t-opt", vocab_size=128, hidden_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=4, ffn_size=128, max_positions=256,
                       tie_embeddings=False),
    "llama-gqa": ModelConfig(arch="llama", name="t-llama", vocab_size=128, hidden_size=64,
                             num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=128,
                             max_positions=256, tie_embeddings=False),
}

_MODELS = {}


def model_for(key, seed=0):
    if (key, seed) not in _MODELS:
        cfg = CFGS[key]
        _MODELS[key, seed] = Transformer.load(cfg, DummyWeights(cfg, seed))
    return _MODELS[key, seed]


def rand_prompts(lengths, seed, vocab=128):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def run(model, prompts, n=16, sampling=Sampling(), stop_ids=(), policy="full"):
    return generate(model, prompts, n, get_policy(policy), sampling, stop_ids=stop_ids, pad_id=0)


# ------------------------------------------------------------------ (a) padding invariance

@pytest.mark.parametrize("key", list(CFGS))
def test_batch_equals_alone(key):
    torch.manual_seed(0)
    model = model_for(key)
    prompts = rand_prompts([5, 17, 1, 11], seed=3)
    batched = run(model, prompts)
    alone = [run(model, [p])[0] for p in prompts]
    assert batched == alone
    assert all(len(o) == 16 for o in batched)
    # the outputs are not degenerate (else equality would prove little)
    assert len({t for o in batched for t in o}) > 8


@pytest.mark.parametrize("key", list(CFGS))
def test_batch_logits_equal_alone(key):
    """Padded-batch prefill + decode logits match the unpadded run closely, per sequence."""
    model = model_for(key)
    prompts = rand_prompts([3, 9], seed=4)
    policy = get_policy("full")

    def logits(ps, feed):
        prefill, steps = engine_logits(model, ps, feed, policy)
        return torch.stack([prefill[:, -1], *steps], 1)  # (B, steps, V)

    feed = [[7, 8], [9, 10], [11, 12]]
    both = logits(prompts, feed)
    for i, p in enumerate(prompts):
        one = logits([p], [[f[i]] for f in feed])
        torch.testing.assert_close(both[i], one[0], rtol=0, atol=1e-4)


def test_left_pad_layout():
    tokens, valid, pos = left_pad([[5, 6, 7], [9]], pad_id=1, device="cpu")
    assert tokens.tolist() == [[5, 6, 7], [1, 1, 9]]
    assert valid.tolist() == [[True, True, True], [False, False, True]]
    assert pos[0].tolist() == [0, 1, 2] and pos[1, 2].item() == 0
    with pytest.raises(UserError):
        left_pad([[1], []], 0, "cpu")


# ------------------------------------------------------------------ (b) sampling

@pytest.mark.parametrize("key", list(CFGS))
def test_sampling_seeded(key):
    model = model_for(key)
    prompts = rand_prompts([4, 8], seed=5)
    s = dict(greedy=False, temperature=1.5)
    a = run(model, prompts, sampling=Sampling(seed=7, **s))
    b = run(model, prompts, sampling=Sampling(seed=7, **s))
    c = run(model, prompts, sampling=Sampling(seed=8, **s))
    assert a == b
    assert a != c
    greedy = run(model, prompts)
    assert a != greedy
    assert run(model, prompts, sampling=Sampling(greedy=False, top_k=1, seed=3)) == greedy
    # top_p so small that only the most likely token survives
    assert run(model, prompts, sampling=Sampling(greedy=False, top_p=1e-6, seed=4)) == greedy


def test_top_k_restricts_first_token():
    model = model_for("opt")
    prompt = rand_prompts([6], seed=6)[0]
    logits = engine_logits(model, [prompt], [], get_policy("full"))[0][0, -1]
    top3 = set(torch.topk(logits, 3).indices.tolist())
    firsts = {run(model, [prompt], n=1, sampling=Sampling(greedy=False, top_k=3,
                                                          temperature=5.0, seed=s))[0][0]
              for s in range(40)}
    assert firsts <= top3
    assert len(firsts) > 1        # a high temperature really samples


def test_sampling_checks():
    model = model_for("opt")
    for bad in (Sampling(greedy=False, temperature=-1.0), Sampling(greedy=False, top_p=0.0),
                Sampling(greedy=False, top_p=1.5), Sampling(greedy=False, top_k=-1)):
        with pytest.raises(UserError):
            run(model, [[1, 2]], sampling=bad)
    with pytest.raises(UserError):
        generate(model, [[1, 2]], 0, get_policy("full"))


# ------------------------------------------------------------------ (c) stop ids

@pytest.mark.parametrize("key", list(CFGS))
def test_stop_id_stops_one_sequence(key):
    model = model_for(key)
    for seed in range(20):
        prompts = rand_prompts([6, 10, 3], seed=100 + seed)
        free = run(model, prompts)
        stop = free[0][2]                          # the token greedy emits at step 3
        if stop not in free[0][:2] and all(stop not in o for o in free[1:]):
            break
    else:
        pytest.fail("no prompt set gives a usable stop id")
    out = run(model, prompts, stop_ids=(stop,))
    assert out[0] == free[0][:3]                   # stops right after emitting it, keeps it
    assert out[1:] == free[1:]                     # the others run to max_new_tokens


def test_all_stopped_ends_early(monkeypatch):
    model = model_for("llama-gqa")
    prompts = rand_prompts([4, 7], seed=9)
    free = run(model, prompts)
    stops = (free[0][0], free[1][0])
    calls = []
    real = Engine._step
    monkeypatch.setattr(Engine, "_step", lambda *a: calls.append(1) or real(*a))
    out = run(model, prompts, stop_ids=stops)
    assert out == [[free[0][0]], [free[1][0]]]
    assert len(calls) == 1                         # the prefill only: no wasted decode steps


# ------------------------------------------------------------------ (d) dummy weights

def test_dummy_weights_seeded():
    cfg = CFGS["llama-gqa"]
    names = list(cfg.param_shapes())
    a, b, c = DummyWeights(cfg, 0), DummyWeights(cfg, 0), DummyWeights(cfg, 1)
    for n in names:
        ta, tb, tc = a.load(n), b.load(n), c.load(n)
        assert tuple(ta.shape) == cfg.param_shapes()[n]
        assert torch.equal(ta, tb)
        assert not torch.equal(ta, tc)
        assert ta.std() > 0
    # distinct tensors of the same shape are not copies of each other
    assert not torch.equal(a.load("model.layers.0.self_attn.q_proj.weight"),
                           a.load("model.layers.1.self_attn.q_proj.weight"))


def test_dummy_weights_order_independent():
    cfg = CFGS["opt"]
    names = list(cfg.param_shapes())
    fwd = {n: DummyWeights(cfg, 3).load(n) for n in names}
    src = DummyWeights(cfg, 3)
    for n in reversed(names):
        src.load(names[0])                       # interleave other loads
        assert torch.equal(src.load(n), fwd[n])


def test_dummy_weights_scale():
    cfg = CFGS["llama-gqa"]
    src = DummyWeights(cfg, 0)
    w = src.load("model.layers.0.mlp.down_proj.weight")          # fan_in = ffn
    assert abs(w.std().item() * math.sqrt(cfg.ffn_size) - 1) < 0.1
    norm = src.load("model.layers.0.input_layernorm.weight")
    assert abs(norm.mean().item() - 1) < 0.1 and norm.std() > 0.01
    assert src.load("model.layers.0.mlp.up_proj.weight").dtype == torch.float32
    assert src.load("model.norm.weight", dtype=torch.float16).dtype == torch.float16


@pytest.mark.parametrize("key", list(CFGS))
def test_dummy_attention_not_uniform(key):
    """Decode attention over a 40-token context is far from uniform."""
    model = model_for(key)
    probs = []

    class Capture(Full):
        def after_attention(self, buf, slot, p, scored=False):
            probs.append(p.clone())
            super().after_attention(buf, slot, p, scored)

    generate(model, rand_prompts([40], seed=11), 4, Capture(), Sampling(), (), 0)
    assert len(probs) == 3 * model.config.num_layers
    p = torch.cat([x.flatten(0, 1) for x in probs[-model.config.num_layers:]])   # (rows, n)
    n = p.shape[-1]
    torch.testing.assert_close(p.sum(-1), torch.ones(p.shape[0]))
    entropy = -(p.clamp_min(1e-30).log() * p).sum(-1)
    assert (entropy / math.log(n)).mean() < 0.95
    assert p.max(-1).values.mean() > 3.0 / n


# ------------------------------------------------------------------ (e) position limit

@pytest.mark.parametrize("arch", ["opt", "llama"])
def test_max_positions(arch):
    from dataclasses import replace
    base = CFGS["opt" if arch == "opt" else "llama-gqa"]
    cfg = replace(base, max_positions=32, name="short")
    model = Transformer.load(cfg, DummyWeights(cfg, 0))
    prompt = rand_prompts([30], seed=1)[0]
    # exactly at the limit: positions 0..31 are used
    assert len(run(model, [prompt], n=3)[0]) == 3
    assert len(run(model, [prompt[:5], prompt], n=3)[1]) == 3
    with pytest.raises(UserError, match="maximum"):
        run(model, [prompt], n=4)
    with pytest.raises(UserError, match="maximum"):
        run(model, [prompt[:2], prompt + [1, 2, 3]], n=1)
    # scoring feeds every token but the last (it is only a target): 33 tokens use 0..31
    assert token_nll(model, prompt + [1, 2, 3], get_policy("full")).shape == (32,)
    with pytest.raises(UserError, match="maximum"):
        token_nll(model, prompt + [1, 2, 3, 4], get_policy("full"))


# ------------------------------------------------------------------ (f) one KV allocation

def test_kv_buffer_allocated_once(monkeypatch):
    model = model_for("llama-gqa")
    count = []
    real = flexevict.core.kv.KVBuffer.__init__

    def counting(self, *a, **kw):
        count.append(1)
        real(self, *a, **kw)

    monkeypatch.setattr(flexevict.core.kv.KVBuffer, "__init__", counting)
    prompts = rand_prompts([3, 8], seed=2)
    run(model, prompts, n=12)
    assert len(count) == model.config.num_layers
    run(model, prompts, n=5)
    assert len(count) == 2 * model.config.num_layers
    token_nll(model, prompts[1], get_policy("full"))
    assert len(count) == 3 * model.config.num_layers


def test_kv_buffer_never_grows(monkeypatch):
    """The buffers hold capacity+1 slots from the start and fill exactly to capacity."""
    model = model_for("opt")
    policy = get_policy("full")
    prompts = rand_prompts([4, 6], seed=8)
    seen = []
    real = E.allocate

    def spy(*a):
        bufs = real(*a)
        seen.extend(bufs)
        return bufs

    monkeypatch.setattr(E, "allocate", spy)
    run(model, prompts, n=5)
    assert len(seen) == model.config.num_layers
    cap = policy.layout(6, 5).capacity
    for buf in seen:
        assert buf.capacity == cap and buf.k.shape[0] == cap + 1
        assert buf.used == cap                    # prompt (padded to 6) + 4 fed tokens
        assert buf.valid[:cap].sum().item() == (4 + 6 + 2 * 4) * model.config.num_kv_heads


def test_onednn_prepacked_linears_match_plain():
    """The CPU fast path (oneDNN-prepacked weights) gives the plain path's greedy tokens and
    logits to fp32 rounding."""
    from flexevict.core.model import onednn_usable
    if not onednn_usable("cpu", torch.float32):
        pytest.skip("this torch build has no oneDNN linear ops")
    cfg = CFGS["llama-gqa"]
    plain = Transformer.load(cfg, DummyWeights(cfg, 0), onednn=False)
    packed = Transformer.load(cfg, DummyWeights(cfg, 0), onednn=True)
    prompts = rand_prompts([9, 14], seed=8)
    assert run(plain, prompts, n=12) == run(packed, prompts, n=12)
    x = torch.randn(3, cfg.hidden_size)
    assert torch.allclose(plain.head(x), packed.head(x), atol=1e-5, rtol=1e-5)
