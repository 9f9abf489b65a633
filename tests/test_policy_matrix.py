"""Every registered policy, automatically: bit-identity with `full` when the budget holds the
whole sequence, budget and position invariants on random traces, independent batch rows, and
buffers sized exactly by the resolved slots that never grow."""
import pytest
import torch

import flexevict.runtime.engine as engine
from flexevict.core import kv
import flexevict.runtime.generation as gen
from flexevict.errors import UserError
from flexevict.runtime.generation import Sampling, generate
from flexevict.core.model import Transformer
from flexevict.policies import POLICIES, Policy, get_policy
from tiny import CONFIGS, FAMILY_CONFIGS, model_for, rand_prompts, roomy

EVICTING = sorted(n for n in POLICIES if n != "full")


def record(monkeypatch):
    """Capture every step's logits and the buffers of a run."""
    logits, bufs = [], []
    real_head, real_alloc = Transformer.head, engine.allocate
    monkeypatch.setattr(Transformer, "head",
                        lambda self, h, o=None: logits.append(real_head(self, h, o)) or logits[-1])

    def allocate(*args):
        new = real_alloc(*args)
        bufs.extend(new)
        return new

    monkeypatch.setattr(engine, "allocate", allocate)
    return logits, bufs


@pytest.fixture(params=["exact", "spans"])
def fill_spans(request, monkeypatch):
    """Attention over the exact fill (a CPU), or over 16-slot spans of it as on a GPU
    (kv.FILL_SPAN: the slots past the new token masked)."""
    if request.param == "spans":
        monkeypatch.setattr(kv, "FILL_SPAN", 16)
        monkeypatch.setattr(kv, "SPAN_DEVICES", ("cuda", "cpu"))
    return request.param


@pytest.mark.parametrize("arch", CONFIGS)
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_whole_sequence_budget_is_bit_identical_to_full(name, arch, monkeypatch, fill_spans):
    if POLICIES[name].logit_scale is not Policy.logit_scale:
        pytest.skip(f"{name} rescales attention logits by design (checked in its own tests)")
    m, ps = model_for(arch), rand_prompts([40, 40], seed=2)
    logits, _ = record(monkeypatch)
    ref = generate(m, ps, 24, get_policy("full"), Sampling(), (), 0)
    ref_logits = list(logits)
    for budget in (dict(budget=1.0), dict(budget_tokens=40 + 24 + 50)):
        logits.clear()
        out = generate(m, ps, 24, get_policy(name, **budget), Sampling(), (), 0)
        assert out == ref
        assert len(logits) == len(ref_logits)
        assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits)), f"{name} {budget}"


@pytest.mark.parametrize("arch", CONFIGS)
def test_attention_over_spans_gives_the_exact_tokens(arch, monkeypatch):
    """A filling buffer attending over 16-slot spans (masked past the new token), as every
    GPU step does, decodes the tokens of one attending over the exact fill; its logits agree
    up to rounding (a longer masked reduction)."""
    m, ps = model_for(arch), rand_prompts([40, 33], seed=2)
    logits, _ = record(monkeypatch)
    ref = generate(m, ps, 24, get_policy("full"), Sampling(), (), 0)
    exact = list(logits)
    logits.clear()
    monkeypatch.setattr(kv, "FILL_SPAN", 16)
    monkeypatch.setattr(kv, "SPAN_DEVICES", ("cuda", "cpu"))
    spans, real = set(), kv.KVBuffer.attended
    monkeypatch.setattr(kv.KVBuffer, "attended",
                        lambda self, slot: spans.add(real(self, slot) - slot - 1) or
                        real(self, slot))
    assert generate(m, ps, 24, get_policy("full"), Sampling(), (), 0) == ref
    assert max(spans) > 0 and all(n < 16 for n in spans)    # masked slots past the token
    for a, b in zip(logits, exact):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", CONFIGS)
@pytest.mark.parametrize("name", EVICTING)
def test_a_buffer_that_fills_then_evicts_decodes_alike_over_spans(name, arch, monkeypatch):
    """Prompts shorter than the budget: the buffer fills for a while (a GPU then attends over
    16-slot spans, as a graphed step does), then evicts; every policy's hooks see the masked
    slots past the new token as empty, so the tokens are those of the exact fill."""
    m, ps = model_for(arch), rand_prompts([20, 14], seed=5)
    policy = get_policy(name, budget_tokens=48)
    exact = generate(m, ps, 40, policy, Sampling(), (), 0)
    monkeypatch.setattr(kv, "FILL_SPAN", 16)
    monkeypatch.setattr(kv, "SPAN_DEVICES", ("cuda", "cpu"))
    assert generate(m, ps, 40, policy, Sampling(), (), 0) == exact


@pytest.mark.parametrize("arch", CONFIGS)
@pytest.mark.parametrize("name", EVICTING)
def test_random_trace_invariants(name, arch, monkeypatch, per_layer_commits, fill_spans):
    m = model_for(arch)
    ps = rand_prompts([60, 45, 52], seed=3)                     # left padding included
    policy = get_policy(name, budget=0.3)
    _, bufs = record(monkeypatch)
    seen, layouts = [], set()
    real_after = type(policy).after_attention

    def checked(self, buf, slot, probs, scored=False):
        real_after(self, buf, slot, probs, scored)
        committed = buf.valid[:buf.capacity]
        assert int(buf.valid.sum(0).max()) <= buf.layout.slots    # never above the budget
        layouts.add(buf.layout)
        assert not buf.valid[buf.scratch].any() or slot != buf.scratch
        pos = torch.where(committed, buf.pos[:buf.capacity], -1)
        for r in range(pos.shape[1]):                                 # test-side loop only
            p = pos[:, r][pos[:, r] >= 0]
            assert p.unique().numel() == p.numel()                    # each token at most once
        seen.append(int(committed.sum(0).max()))

    monkeypatch.setattr(type(policy), "after_attention", checked)
    generate(m, ps, 40, policy, Sampling(), (), 0)
    (layout,) = layouts                                               # one for the whole run
    assert seen and max(seen) <= layout.slots and layout == policy.layout(60, 40)
    assert layout.evicts


@pytest.mark.parametrize("name", EVICTING)
def test_batch_rows_are_independent(name):
    m, ps = model_for("llama-gqa"), rand_prompts([50, 50], seed=4)
    together = generate(m, ps, 30, get_policy(name, budget=0.3), Sampling(), (), 0)
    alone = [generate(m, [p], 30, get_policy(name, budget=0.3), Sampling(), (), 0)[0] for p in ps]
    assert together == alone


@pytest.mark.parametrize("family", FAMILY_CONFIGS)
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_family_runs_every_policy(name, family):
    """Each further family (its own block around the shared attention and cache): a whole-
    sequence budget gives `full`'s tokens, an evicting one the same tokens in a batch as
    alone."""
    m, ps = model_for(family), rand_prompts([40, 40], seed=2)
    ref = generate(m, ps, 16, get_policy("full"), Sampling(), (), 0)
    if POLICIES[name].logit_scale is Policy.logit_scale:
        assert generate(m, ps, 16, get_policy(name, budget=1.0), Sampling(), (), 0) == ref
    if name != "full":
        policy = lambda: get_policy(name, **roomy(name, budget=0.4))  # noqa: E731
        together = generate(m, ps, 16, policy(), Sampling(), (), 0)
        assert together == [generate(m, [p], 16, policy(), Sampling(), (), 0)[0] for p in ps]


@pytest.mark.parametrize("name", EVICTING)
def test_buffer_is_sized_by_slots_and_never_grows(name, monkeypatch):
    m = model_for("llama-gqa")
    sizes = {}
    for new_tokens in (20, 60):
        _, bufs = record(monkeypatch)
        policy = get_policy(name, budget_tokens=30)
        pointers = {}
        real_after = type(policy).after_attention

        def watch(self, buf, slot, probs, scored=False):
            real_after(self, buf, slot, probs, scored)
            declared = [x for x in buf.policy_state.values() if isinstance(x, torch.Tensor)]
            now = [(t.data_ptr(), tuple(t.shape)) for t in (*buf.tensors(), *declared)]
            assert pointers.setdefault(id(buf), now) == now       # same storage every step

        monkeypatch.setattr(type(policy), "after_attention", watch)
        generate(m, rand_prompts([40], seed=5), new_tokens, policy, Sampling(), (), 0)
        c = m.config
        # K, V fp32 + score, state, pos, valid
        per_slot = 2 * c.dim_head * 4 + 4 + 4 + 4 + 1
        rows = c.num_kv_heads
        for buf in bufs:
            # recall's key summaries take slots' worth of the budget (policies/recall.py)
            summaries = getattr(buf.layout, "summaries", 0)
            assert buf.k.shape[0] == buf.layout.slots == 30 - summaries
            assert buf.nbytes() == buf.layout.slots * rows * per_slot
        sizes[new_tokens] = sum(b.layout.slots + summaries for b in bufs)   # budget units
        monkeypatch.undo()
    assert sizes[20] == sizes[60]                                    # independent of length


def test_full_refuses_a_budget():
    with pytest.raises(UserError, match="keeps every token"):
        generate(model_for("opt"), rand_prompts([20], seed=6), 8, get_policy("full", budget=0.5),
                 Sampling(), (), 0)


def _batched(m, ps, new, make, batch_size):
    """Greedy tokens per prompt when the batcher groups them (generation.plan_batches)."""
    out = [None] * len(ps)
    for batch in gen.plan_batches([len(p) for p in ps], new, make(), batch_size):
        for i, ids in zip(batch, generate(m, [ps[i] for i in batch], new, make(), Sampling(),
                                          (), 0)):
            out[i] = ids
    return out


@pytest.mark.parametrize("budget", [dict(budget=0.5), dict(budget_tokens=24)],
                         ids=["budget", "budget-tokens"])
@pytest.mark.parametrize("name", EVICTING)
def test_batched_output_never_depends_on_the_other_prompts(name, budget):
    """Prompts shorter and longer than the slot count, padded together where the batcher allows:
    each prompt's tokens equal its tokens alone (the new-user report: 31 of 60 agreed)."""
    m, new = model_for("llama-gqa"), 32
    ps = rand_prompts([8, 14, 20, 20, 23, 30, 37, 37, 44, 51], seed=7)
    make = lambda: get_policy(name, **roomy(name, **budget))  # noqa: E731
    alone = [generate(m, [p], new, make(), Sampling(), (), 0)[0] for p in ps]
    assert _batched(m, ps, new, make, batch_size=4) == alone
    assert _batched(m, ps, new, make, batch_size=len(ps)) == alone


def test_the_batcher_still_pads_prompts_that_compact_alike():
    """Prompts longer than the buffer share one padded batch; `full` batches any lengths."""
    lengths = [30, 37, 44, 51]
    keys = {get_policy("h2o", budget_tokens=24).batch_key(n, 16) for n in lengths}
    assert len(keys) == 1
    assert gen.plan_batches([8, 51, 14], 16, get_policy("full"), 8) == [[0, 2, 1]]
    assert gen.plan_batches([8, 51, 14], 16, get_policy("h2o", budget_tokens=24), 8) == \
        [[0], [2], [1]]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_run_leaves_the_policy_unchanged(name):
    """Per-run sizes live in the run's frozen layout, not on the policy: the policy equals
    what it was after a run, refuses attribute writes, and every buffer carries that layout."""
    import dataclasses
    policy = get_policy(name, **({} if name == "full" else {"budget": 0.5}))
    before = dataclasses.replace(policy)          # a copy of its budget and arguments
    generate(model_for("llama-gqa"), rand_prompts([40, 31], seed=6), 12, policy, Sampling(), (), 0)
    assert policy == before and vars(policy).keys() == vars(before).keys()
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.budget = 0.5
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.anything_new = 1
    layout = policy.layout(40, 12)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.slots = 3


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_arguments_are_typed_fields_converted_from_strings(name):
    """Every argument is a dataclass field with a default; a --policy-arg string becomes the
    field's type (what the CLI passes), and an unknown name is refused naming the known ones."""
    import typing
    cls = POLICIES[name]
    default = cls.from_args()
    hints = typing.get_type_hints(type(default))
    for key, value in default.arguments().items():
        assert isinstance(value, hints[key]), (key, value)
        as_string = str(value).lower() if isinstance(value, bool) else str(value)
        again = cls.from_args(**{key: as_string}).arguments()[key]
        assert again == value and type(again) is type(value), (key, again)
    with pytest.raises(UserError, match="unknown policy_args nope") as e:
        cls.from_args(nope="1")
    assert all(key in str(e.value) for key in default.arguments())


def test_policy_arg_strings_of_the_wrong_type_are_refused():
    with pytest.raises(UserError, match="hash_bits=many: expected a int"):
        get_policy("hashevict", hash_bits="many")
    with pytest.raises(UserError, match="tie_replace=maybe: expected true or false"):
        get_policy("cascade", tie_replace="maybe")
    assert get_policy("cascade", tie_replace="yes").tie_replace is True
    assert get_policy("cascade", gamma="0.5").gamma == 0.5
