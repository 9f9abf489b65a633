"""The decode hot path never waits on the host, and prefill attention runs on SDPA.

Decode (every registered policy, both tiny architectures, a budget that evicts): the model's
decode attention and the policy hooks it calls must not synchronise host and device. On a GPU
`torch.cuda.set_sync_debug_mode("error")` catches every sync; on a CPU nothing syncs, so
`NoHostSync` raises on the calls that would (reading a value on the host, shapes that depend on
data, tensors built from Python data, device moves, scalars assigned through an index).

Prefill: without prompt scores the attention output comes from SDPA with a causal flag and no
S x S mask (left padding handled by rolling rows, `model.causal_attention`); a policy that ranks
the prompt gets output and column sums from one blockwise pass
(`kernels.prefill_attention_scores`); both are checked against eager softmax attention.
"""
import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import flexevict.core.model as fmodel
from flexevict.core import kernels
from flexevict.runtime.engine import Engine, left_pad
from flexevict.runtime.generation import Sampling, generate
from flexevict.core.kernels import ext
from flexevict.core.kernels import reference as ref
from flexevict.core.model import Transformer, causal_attention
from flexevict.policies import POLICIES, get_policy
from flexevict.io.weights import DummyWeights
from tiny import CONFIGS, engine_logits, model_for, prefill_mask, rand_prompts

T = torch.Tensor
CUDA = torch.cuda.is_available()

# ==================================================================== the CPU sync detector

# always a sync on a GPU: a value read on the host, a data-dependent output shape, or a tensor
# built from Python data (a blocking host-to-device copy)
SYNCING = {getattr(owner, name): f"{'Tensor' if owner is T else 'torch'}.{name}"
           for owner, names in (
               (T, ("item", "tolist", "__bool__", "__int__", "__float__", "__index__",
                    "__complex__", "__contains__", "numpy", "__array__", "cpu", "cuda",
                    "nonzero", "argwhere", "unique", "unique_consecutive", "masked_select",
                    "bincount", "equal", "allclose", "is_nonzero")),
               (torch, ("nonzero", "argwhere", "unique", "unique_consecutive", "masked_select",
                        "bincount", "equal", "allclose", "is_nonzero", "tensor", "as_tensor",
                        "asarray")))
           for name in names}


class HostSync(AssertionError):
    pass


def _index_problem(tensor, index, value=None, assigning=False):
    """Why t[index] (or t[index] = value) would sync on a GPU, or None."""
    parts = index if isinstance(index, tuple) else (index,)
    through_tensor = False
    for part in parts:
        if isinstance(part, torch.Tensor):
            if part.dtype in (torch.bool, torch.uint8):
                return "boolean-mask indexing (a data-dependent shape: nonzero on a GPU)"
            if part.dim() == 0:
                return "indexing with a 0-dim tensor (its value is read on the host)"
            through_tensor = True
        elif isinstance(part, list):
            return "indexing with a Python list (copied to the device first)"
    if assigning and isinstance(value, (bool, int, float)):
        if through_tensor:
            return "a Python scalar assigned through a tensor index (index_put_ copies it)"
        if tensor[index].dim() == 0:
            return "a Python scalar assigned to a single element (a host-to-device copy)"
    return None


def sync_problem(func, args, kwargs) -> str | None:
    """Why this call would make a GPU wait for the host (or the host for a GPU), or None."""
    if func in SYNCING:
        return SYNCING[func]
    if func is T.to:
        moves = [a for a in args[1:] if isinstance(a, (torch.device, str, int, T))
                 and not isinstance(a, bool)]
        if moves or kwargs.get("device") is not None:
            return "Tensor.to with a device (a copy between host and device)"
    if func is torch.where and len(args) + len(kwargs) == 1:
        return "torch.where(condition) (nonzero)"
    if func in (T.repeat_interleave, torch.repeat_interleave):
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0])
        if isinstance(repeats, T) and repeats.numel() > 1 and kwargs.get("output_size") is None:
            return "repeat_interleave with tensor repeats (the output size is read on the host)"
    if func is T.__getitem__:
        return _index_problem(args[0], args[1])
    if func is T.__setitem__:
        return _index_problem(args[0], args[1], args[2], assigning=True)
    return None


class NoHostSync(TorchFunctionMode):
    """Raise HostSync on any torch call that would sync host and device on a GPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        problem = sync_problem(func, args, kwargs)
        if problem:
            raise HostSync(f"host sync in a decode step: {problem}")
        return func(*args, **kwargs)


def _t():
    return torch.arange(6.0).view(2, 3)


CAUGHT = {
    "item": lambda: _t()[0, 0].item(),
    "bool": lambda: bool(_t().any()),
    "int": lambda: int(_t().max()),
    "tolist": lambda: _t().tolist(),
    "nonzero": lambda: _t().nonzero(),
    "mask index": lambda: _t()[_t() > 2],
    "mask assign": lambda: _t().__setitem__(_t() > 2, 0.0),
    "list index": lambda: _t()[[0, 1]],
    "0-dim index": lambda: _t()[torch.tensor(1)],
    "scalar through index": lambda: _t().__setitem__((torch.arange(2), torch.arange(2)), 0.0),
    "scalar into one element": lambda: _t().__setitem__((0, 1), 5.0),
    "tensor from a list": lambda: torch.tensor([3], device="cpu"),
    "device move": lambda: _t().to("cpu"),
    "unique": lambda: torch.unique(_t()),
    "where(cond)": lambda: torch.where(_t() > 1),
    "repeat by tensor": lambda: torch.arange(3).repeat_interleave(torch.tensor([1, 2, 0])),
}


@pytest.mark.parametrize("case", CAUGHT)
def test_detector_catches_each_known_sync(case):
    with pytest.raises(HostSync), NoHostSync():
        CAUGHT[case]()


def test_detector_allows_the_sync_free_idioms():
    t, rows = _t(), torch.arange(3)
    with NoHostSync():
        slots = torch.arange(4)
        slots[3:].fill_(7)                              # a host int written by a fill kernel
        t[1] = 0.0                                      # a whole row: a fill
        t.scatter_(0, torch.zeros(1, 3, dtype=torch.long), 1.0)
        t[torch.zeros(3, dtype=torch.long), rows] = t[1, rows]
        t.masked_fill_(t > 3, 0.0)
        torch.where(t > 1, t, float("-inf"))
        t.to(torch.int32)
        torch.arange(3).repeat_interleave(2)


def test_popcount_table_is_made_on_its_device():
    """HashEvict's first decode step may build the popcount table: it is made where it is
    used, not copied from host memory (that copy made the GPU wait: the first H200 run)."""
    from flexevict.core.kernels import reference
    reference._bit_counts.cache_clear()
    x = torch.tensor([0, 5, 2 ** 32 - 1])
    with NoHostSync():
        counts = reference.popcount(x)
    assert counts.tolist() == [0, 2, 32]


# ==================================================================== decode: no host sync

BUDGET = dict(budget_tokens=24)          # every policy's minimum fits; 30-token prompts evict
PROMPTS = (30, 23)                       # left padding included
NEW_TOKENS = 20


def guard_decode(monkeypatch, guard):
    """Run every decode attention (which calls the policy hooks) and every decode step input
    inside `guard()`; -> a dict counting decode steps and the steps that evicted."""
    seen = {"steps": 0, "evicting": 0}
    real_attn, real_input = Transformer._decode_attention, Transformer.step_input

    def attention(self, q, k, v, inp, buf, policy, clock):
        slot, used = buf.incoming_slot(), buf.used
        with guard():
            out = real_attn(self, q, k, v, inp, buf, policy, clock)
        seen["steps"] += 1
        seen["evicting"] += slot == buf.scratch or buf.used <= used   # a commit or a BUZZ pass
        return out

    def step_input(self, pos, valid, pos_end=None):
        if valid is not None:                               # prefill may sync (documented)
            return real_input(self, pos, valid, pos_end)
        with guard():
            return real_input(self, pos, valid, pos_end)

    monkeypatch.setattr(Transformer, "_decode_attention", attention)
    monkeypatch.setattr(Transformer, "step_input", step_input)
    # a CPU's own shortcuts (host reads that cost nothing there) off: the path a GPU takes
    monkeypatch.setattr(ref, "host_reads_free", lambda t: False)
    return seen


def run_policy(model, name):
    policy = get_policy(name, **({} if name == "full" else BUDGET))
    out = generate(model, rand_prompts(PROMPTS, seed=11), NEW_TOKENS, policy, Sampling(), (), 0)
    assert all(len(row) == NEW_TOKENS for row in out)
    return policy


@pytest.mark.parametrize("arch", CONFIGS)
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_decode_step_has_no_host_sync(name, arch, monkeypatch):
    seen = guard_decode(monkeypatch, NoHostSync)
    policy = run_policy(model_for(arch), name)
    assert seen["steps"] == (NEW_TOKENS - 1) * CONFIGS[arch].num_layers
    if name != "full":
        assert policy.layout(max(PROMPTS), NEW_TOKENS).evicts and seen["evicting"] > 0, \
            "the run must exercise eviction"


@pytest.mark.parametrize("arch", CONFIGS)
@pytest.mark.parametrize("name", sorted(n for n, cls in POLICIES.items() if cls.graph_safe))
def test_decode_step_with_counters_on_the_device_has_no_host_sync(name, arch, monkeypatch):
    """A graphed run's buffers keep their counters on the device from its first graphed step
    (`KVBuffer.keep_counters_on_device`), and graph-safe hooks then take their device paths
    (Scissorhands' step counter, the ring commits' cursor): those never sync either."""
    seen = guard_decode(monkeypatch, NoHostSync)
    guarded = Transformer._decode_attention

    def attention(self, q, k, v, inp, buf, policy, clock):
        buf.keep_counters_on_device()                       # as the graphs' warm-up does
        return guarded(self, q, k, v, inp, buf, policy, clock)
    monkeypatch.setattr(Transformer, "_decode_attention", attention)
    run_policy(model_for(arch), name)
    assert seen["steps"] == (NEW_TOKENS - 1) * CONFIGS[arch].num_layers
    assert name == "full" or seen["evicting"]


class CudaSyncsAreErrors:
    """torch.cuda.set_sync_debug_mode("error") for a block, restored afterwards."""

    def __enter__(self):
        self.before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(self.before)


@pytest.mark.skipif(not CUDA, reason="needs CUDA: torch.cuda.set_sync_debug_mode only sees host "
                                     "syncs on a GPU (the CPU test above covers what a CPU can)")
@pytest.mark.parametrize("backend", ["cuda-kernels", "torch-reference"])
@pytest.mark.parametrize("arch", CONFIGS)
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_decode_step_never_syncs_on_gpu(name, arch, backend, monkeypatch):
    if backend == "torch-reference":
        monkeypatch.setenv("FLEXEVICT_KERNELS", "0")
    elif ext.load() is None:                    # build (or fail) before any guarded step
        pytest.fail("the CUDA kernels did not build (see the warning above)")
    model = Transformer.load(CONFIGS[arch], DummyWeights(CONFIGS[arch], seed=0), device="cuda")
    engine = Engine.resident(model)      # eager: a graph replay would not call (or guard) hooks
    engine.placement = dataclasses.replace(engine.placement, cuda_graphs=False)
    seen = guard_decode(monkeypatch, CudaSyncsAreErrors)
    policy = run_policy(engine, name)
    assert seen["steps"] == (NEW_TOKENS - 1) * CONFIGS[arch].num_layers
    if name != "full":
        assert policy.layout(max(PROMPTS), NEW_TOKENS).evicts and seen["evicting"] > 0


@pytest.mark.parametrize("name", ["buzz", "buzz-logn"])
@pytest.mark.parametrize("lengths", [(40,), (61, 23, 47), (30, 30, 9)])
def test_buzz_host_counts_match_the_buffer(name, lengths, monkeypatch):
    """BUZZ predicts each row's count on the host (no sync); it must equal the buffer's."""
    policy = get_policy(name, budget_tokens=20)
    real_after = type(policy).after_attention
    checked = []

    def after(self, buf, slot, probs, scored=False):
        real_after(self, buf, slot, probs, scored)
        live = buf.valid
        truth = set(zip(live.sum(0).tolist(), ((buf.state > 0.5) & live).sum(0).tolist()))
        assert set(buf.policy_state["counts"]) == truth
        assert buf.used == int(live.sum(0).max())
        checked.append(buf.used)

    monkeypatch.setattr(type(policy), "after_attention", after)
    generate(model_for("llama-gqa"), rand_prompts(lengths, seed=len(lengths)), 60, policy,
             Sampling(), (), 0)
    assert any(b < a for a, b in zip(checked, checked[1:]))          # passes happened


# ==================================================================== prefill attention

def eager_attention(q, k, v, valid, scale):
    """The previous implementation's result, densely: softmax over the causal mask without pad
    keys (pad queries see themselves) -> out (B, H, S, d), column sums (B, Hk, S) over the valid
    queries and the query heads of each kv head."""
    b, h, s, d = q.shape
    g = h // k.shape[1]
    kk, vv = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    logits = (q.double() @ kk.double().transpose(-1, -2)) * scale
    p = logits.masked_fill(~prefill_mask(valid), float("-inf")).softmax(-1)
    votes = (p * valid[:, None, :, None]).sum(2)
    return (p @ vv.double()).to(q.dtype), votes.view(b, -1, g, s).sum(2).float()


def qkv(b, h, hk, s, d, seed, pads=()):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=gen).transpose(1, 2)      # strided, as in the model
    k, v = (torch.randn(b, s, hk, d, generator=gen).transpose(1, 2) for _ in range(2))
    valid = torch.ones(b, s, dtype=torch.bool)
    for row, n in enumerate(pads):
        valid[row, :n] = False
    return q, k, v, valid


SHAPES = {"mha-unpadded": (2, 4, 4, 19, 8, ()), "mha-padded": (3, 4, 4, 19, 8, (0, 5, 18)),
          "gqa-padded": (3, 6, 2, 33, 16, (7, 0, 1)), "one-token": (2, 2, 1, 1, 8, ())}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scale", [None, 0.3])
def test_causal_attention_equals_eager_softmax(shape, scale):
    b, h, hk, s, d, pads = SHAPES[shape]
    q, k, v, valid = qkv(b, h, hk, s, d, seed=s, pads=pads)
    n_pads = (~valid).sum(1) if pads else None
    out = causal_attention(q, k, v, n_pads, scale).transpose(1, 2)          # (B, H, S, d)
    want, _ = eager_attention(q, k, v, valid, d ** -0.5 if scale is None else scale)
    real = valid[:, None, :, None].expand_as(out)
    torch.testing.assert_close(out[real], want[real], atol=1e-5, rtol=1e-5)
    assert out.isfinite().all()                                 # pad rows too: no NaN anywhere


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block", [None, 256, 5, 1])
def test_scored_attention_equals_eager_softmax(shape, block):
    """One pass gives the attention output and the column sums of eager softmax attention."""
    b, h, hk, s, d, pads = SHAPES[shape]
    q, k, v, valid = qkv(b, h, hk, s, d, seed=s + 1, pads=pads)
    out, got = kernels.prefill_attention_scores(q, k, v, valid, 0.4, block=block)
    want_out, want = eager_attention(q, k, v, valid, 0.4)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    _, before = ref.prefill_attention(q, k, v, prefill_mask(valid), valid, 0.4, block=block or 8)
    torch.testing.assert_close(got, before, atol=1e-6, rtol=1e-5)   # the previous pass
    assert not got[~valid[:, None].expand_as(got)].any()         # pad keys receive nothing
    out = out.transpose(1, 2)                                    # (B, H, S, d)
    real = valid[:, None, :, None].expand_as(out)
    torch.testing.assert_close(out[real], want_out[real], atol=1e-5, rtol=1e-5)
    assert out.isfinite().all()                                  # pad rows too: no NaN


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_scored_attention_in_half_precision(dtype):
    """fp16/bf16 inputs (a GPU's): logits in the input dtype, softmax and sums in fp32."""
    q, k, v, valid = qkv(3, 6, 2, 33, 16, seed=3, pads=(7, 0, 1))
    out, got = kernels.prefill_attention_scores(q.to(dtype), k.to(dtype), v.to(dtype), valid,
                                                0.25, block=8)
    _, want = eager_attention(q, k, v, valid, 0.25)
    assert got.dtype == torch.float32 and out.dtype == dtype
    torch.testing.assert_close(got, want, atol=0.03, rtol=0.03)


def test_scored_attention_chunks_bound_memory_not_results(monkeypatch):
    """Sequences are chunked to keep one block's probabilities within the device's budget;
    the block (query rows) stays, so output and sums are bit-identical chunked or not."""
    q, k, v, valid = qkv(3, 6, 2, 33, 16, seed=2, pads=(7, 0, 1))
    want = kernels.prefill_attention_scores(q, k, v, valid, 0.4, block=4)
    chunks = []
    real_bmm = torch.baddbmm
    monkeypatch.setitem(ref.PREFILL_BLOCKING, "cpu", (4, 6 * 33 * 4 * 4))   # one sequence
    monkeypatch.setattr(torch, "baddbmm", lambda *a, **kw: chunks.append(a[1].shape[0]) or
                        real_bmm(*a, **kw))
    got = kernels.prefill_attention_scores(q, k, v, valid, 0.4, block=4)
    assert set(chunks) == {2} and len(chunks) == 3 * 9                  # 2 kv rows, 9 blocks
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_scored_attention_of_a_sequence_alone_and_in_a_padded_batch():
    """A prompt's output and sums alone equal those it gets in a padded batch (to rounding:
    its query blocks start at other offsets there)."""
    q, k, v, valid = qkv(3, 6, 2, 70, 16, seed=6, pads=(0, 30, 11))
    out, got = kernels.prefill_attention_scores(q, k, v, valid, 0.4)
    for row, pads in enumerate((0, 30, 11)):
        alone = [t[row:row + 1, :, pads:] for t in (q, k, v)]
        out1, got1 = kernels.prefill_attention_scores(*alone, valid[row:row + 1, pads:], 0.4)
        torch.testing.assert_close(got1[0], got[row, :, pads:], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(out1[0], out[row, pads:], atol=1e-6, rtol=1e-6)


FOLDS = {"cascade": {}, "tova": {}, "scissorhands": {"window": 6},
         "scissorhands-attention": {"score": "attention", "window": 6},
         "snapkv": {"window": 5}}


@pytest.mark.parametrize("case", FOLDS)
def test_prompt_statistics_equal_the_previous_pass(case):
    """A policy's own prompt statistic (fold) is what the previous attention pass gave, at
    every real key (pad keys are never kept)."""
    name = case.split("-")[0]
    policy = get_policy(name, budget_tokens=20, **FOLDS[case])
    fold = functools.partial(policy.prompt_scores, policy.layout(40, 20))
    q, k, v, valid = qkv(3, 4, 2, 21, 8, seed=9, pads=(0, 6, 13))
    _, got = kernels.prefill_attention_scores(q, k, v, valid, 8 ** -0.5, fold=fold, block=4)
    _, want = ref.prefill_attention(q, k, v, prefill_mask(valid), valid, 8 ** -0.5, block=4,
                                    fold=fold)
    real = valid[:, None].expand(got.shape[:3])
    if got.dtype == torch.uint8:
        assert torch.equal(got[real], want[real])
    else:
        torch.testing.assert_close(got[real], want[real], atol=1e-6, rtol=1e-5)


def test_prefill_gives_sdpa_a_causal_flag_and_no_mask(monkeypatch):
    """full and an evicting h2o: SDPA is called with is_causal and no S x S mask, padded batch
    or not, and the evicting policy never reaches the scalar prefill kernel."""
    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    monkeypatch.setattr(kernels, "prefill_attention", lambda *a, **kw: pytest.fail("scalar"))
    for lengths in ((12, 12), (12, 5)):
        for policy in (get_policy("full"), get_policy("h2o", budget_tokens=8)):
            generate(model_for("llama-gqa"), rand_prompts(lengths, seed=1), 3, policy,
                     Sampling(), (), 0)
    assert calls and all(kw["is_causal"] and kw.get("attn_mask") is None for kw in calls)


def eager_causal_attention(q, k, v, pads, scale=None):
    """`causal_attention` by dense masked softmax (the previous implementation)."""
    b, h, s, d = q.shape
    valid = torch.arange(s)[None] >= (pads if pads is not None else torch.zeros(b))[:, None]
    out, _ = eager_attention(q, k, v, valid, d ** -0.5 if scale is None else scale)
    return out.transpose(1, 2)


def eager_scored_attention(q, k, v, valid, scale, fold=None, block=None):
    """`kernels.prefill_attention_scores` by dense softmax: a fold gets every query at once."""
    out, colsum = eager_attention(q, k, v, valid, scale)
    if fold is not None:
        b, h, s, d = q.shape
        hk = k.shape[1]
        logits = (q.double() @ k.repeat_interleave(h // hk, dim=1).double().transpose(-1, -2))
        p = (logits * scale).masked_fill(~prefill_mask(valid), float("-inf")).softmax(-1)
        p = (p * valid[:, None, :, None]).float().view(b, hk, h // hk, s, s)
        colsum = fold(None, p, 0, valid)
    return out.transpose(1, 2), colsum


SCORED = ["h2o", "buzz", "buzz-logn", "tova", "scissorhands", "cascade", "vatp", "snapkv"]


@pytest.mark.parametrize("arch", CONFIGS)
@pytest.mark.parametrize("name", ["full"] + SCORED)
def test_model_prefill_equals_eager_attention(arch, name, monkeypatch):
    """A padded prefill through the model: logits at real tokens, the prompt scores a policy
    receives (column sums or its own fold) and the tokens it keeps equal those of eager
    softmax attention; no NaN anywhere (pad rows included)."""
    model, prompts = model_for(arch), rand_prompts((17, 9, 14), seed=4)
    seen, kept = {}, {}

    def prefill(model):
        policy = get_policy(name, budget_tokens=None if name == "full" else 13)
        real = type(policy).prefill
        assert policy.wants_prompt_scores(policy.layout(17, 1)) == (name != "full")

        def spy(self, buf, k, v, pos, valid, scores=None, **kw):
            seen.setdefault(buf.layer, []).append(scores)
            real(self, buf, k, v, pos, valid, scores, **kw)
            kept.setdefault(buf.layer, []).append(torch.where(buf.valid, buf.pos, -1).clone())
        with monkeypatch.context() as patch:                        # policies are frozen
            patch.setattr(type(policy), "prefill", spy)
            logits, _ = engine_logits(model, prompts, [], policy)   # (B, S, V)
        assert logits.isfinite().all()
        valid = left_pad(prompts, 0, "cpu")[1]
        return logits[valid], valid

    with torch.inference_mode():
        got, valid = prefill(model)
        monkeypatch.setattr(fmodel, "causal_attention", eager_causal_attention)
        monkeypatch.setattr(kernels, "prefill_attention_scores", eager_scored_attention)
        want, _ = prefill(model)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for layer, (a, b) in seen.items():
        if name == "full":
            assert a is None and b is None
            continue
        keys = valid.repeat_interleave(CONFIGS[arch].num_kv_heads, 0).t()   # (S, rows)
        if a.dtype == torch.uint8:                                  # scissorhands' bits
            assert torch.equal(a[keys], b[keys])
        else:
            torch.testing.assert_close(a[keys], b[keys], atol=1e-5, rtol=1e-5)
        assert torch.equal(kept[layer][0], kept[layer][1])          # the same tokens kept


# ------------------------------------------------------------------ in-cache RoPE ranks

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_apply_rope_is_the_rotate_half_formula_bit_for_bit(dtype):
    """apply_rope works half by half; it must equal x * cos + rotate_half(x) * sin exactly,
    signed zeros, infinities and NaNs (where they arise) included."""
    g = torch.Generator().manual_seed(1)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    cos, sin = fmodel.rope_cos_sin(inv_freq, torch.randint(0, 5000, (50, 3), generator=g), dtype)
    x = torch.randn(50, 3, 64, generator=g).to(dtype)
    x[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    x[1, 2, 32:36] = torch.tensor([-0.0, float("nan"), 0.0, float("inf")])
    rotate_half = torch.cat([-x[..., 32:], x[..., :32]], dim=-1)
    want, got = x * cos + rotate_half * sin, fmodel.apply_rope(x, cos, sin)
    assert torch.equal(want.isnan(), got.isnan())
    assert torch.equal(torch.nan_to_num(want), torch.nan_to_num(got))
    number = ~want.isnan()                          # a NaN's sign means nothing
    assert torch.equal(torch.signbit(want)[number], torch.signbit(got)[number])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rank_rope_table_equals_rotating_each_rank(dtype):
    """StreamingLLM and Cascade rotate cached keys to their in-cache rank from a table grown by
    doubling; its rows are bit for bit `rope_cos_sin` of the ranks themselves, before and after
    it grows."""
    from tiny import CONFIGS
    cfg = next(c for c in CONFIGS.values() if c.arch == "llama")
    model = fmodel.Transformer(cfg, [], {}, device="cpu", dtype=dtype)
    inv_freq = model.rope_freq("cpu")
    g = torch.Generator().manual_seed(0)
    d = cfg.dim_head
    for n in (5, 37, 300):
        table = model.rank_rope(n, "cpu", dtype)
        h = d // 2
        assert table.shape[0] >= n and table.shape[1:] == (h, 2)      # (cos, sin) per pair
        rank = torch.randint(0, n, (n, 6), generator=g)
        want_cos, want_sin = fmodel.rope_cos_sin(inv_freq, rank, dtype)
        assert torch.equal(want_cos[..., :h], want_cos[..., h:])
        assert torch.equal(table[rank][..., 0], want_cos[..., :h])
        assert torch.equal(table[rank][..., 1], want_sin[..., :h])
    assert model.rank_rope(300, "cpu", dtype).shape[0] == 512         # kept, not rebuilt


@pytest.mark.parametrize("n,rows", [(0, 3), (1, 2), (40, 5), (460, 24)])
def test_counted_ranks_equal_the_sorted_ranks(n, rows):
    """In-cache ranks: the CPU's counting sort gives every valid slot the rank the GPU's stable
    sort gives it (empty slots at -1, stale positions of invalid slots, rows with none valid),
    and every slot a rank in [0, n) for the table lookup."""
    g = torch.Generator().manual_seed(n)
    pos = torch.stack([torch.randperm(3 * n + 1, generator=g)[:n] for _ in range(rows)], 1)
    pos = pos.to(torch.int32)
    valid = torch.rand(n, rows, generator=g) > 0.3
    valid[:, 0] = False
    pos[~valid & (torch.rand(n, rows, generator=g) > 0.5)] = -1
    counted = fmodel._counted_ranks(pos, valid, 3 * n + 1)
    by_sort = fmodel._sorted_ranks(pos, valid)
    assert torch.equal(counted[valid], by_sort[valid])
    assert counted.shape == (n, rows) and bool(((counted >= 0) & (counted < max(n, 1))).all())
    for r in range(rows):                                # the definition, row by row
        real = sorted(int(p) for p in pos[valid[:, r], r])
        assert [real.index(int(p)) for p in pos[valid[:, r], r]] == counted[valid[:, r], r].tolist()


def test_keys_rotated_to_their_rank_among_the_valid_slots():
    """In-cache RoPE: each valid key (cached with its pairs side by side) is rotated by its
    rank by position among its row's valid slots, the query by the row's count - 1, bit for bit
    as apply_rope with rope_cos_sin of those ranks, in the same order of dims."""
    from tiny import CONFIGS
    from flexevict.core.kv import KVBuffer, Layout
    cfg = next(c for c in CONFIGS.values() if c.arch == "llama")
    model = fmodel.Transformer(cfg, [], {}, device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    n, rows, d = 40, 5, cfg.dim_head
    buf = KVBuffer(Layout(n + 1), rows, d, torch.float32, "cpu")
    buf.k.copy_(torch.randn(n + 1, rows, d, generator=g))
    buf.pos[:n] = torch.stack([torch.randperm(500, generator=g)[:n] for _ in range(rows)], 1)
    buf.valid[:n] = torch.rand(n, rows, generator=g) > 0.3
    q = torch.randn(rows, cfg.num_heads // cfg.num_kv_heads, d, generator=g)
    q_rot, keys = model._rotate_in_cache(q, n, buf)
    inv_freq = model.rope_freq("cpu")
    for r in range(rows):
        real = buf.valid[:n, r].nonzero().flatten().tolist()
        for rank, slot in enumerate(sorted(real, key=lambda s: int(buf.pos[s, r]))):
            cos, sin = fmodel.rope_cos_sin(inv_freq, torch.tensor([rank]), torch.float32)
            key = buf.k[slot, r].unflatten(-1, (d // 2, 2)).t().flatten()   # rotate-half order
            want = fmodel.apply_rope(key, cos[0], sin[0])
            assert torch.equal(keys[slot, r], fmodel.pairs_adjacent(want))
        cos, sin = fmodel.rope_cos_sin(inv_freq, torch.tensor([len(real) - 1]), torch.float32)
        assert torch.equal(q_rot[r], fmodel.pairs_adjacent(fmodel.apply_rope(q[r], cos, sin)))
