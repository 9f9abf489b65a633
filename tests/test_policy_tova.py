"""`tova` (policies/tova.py): hand-made worked examples of the rule, invariants on random traces
through the real model, bit-identity with `full` when nothing is evicted, and bad input."""
import pytest
import torch

import flexevict.runtime.engine as E
import flexevict.policies.tova  # noqa: F401  (registers "tova")
from flexevict.errors import UserError
from flexevict.runtime.generation import Sampling, generate
from flexevict.core.kv import KVBuffer, Layout
from flexevict.policies import get_policy
from flexevict.policies.base import kv_head_probs

from tiny import model_for, rand_prompts, decode_step as step, kept



def setup(prompt_len, rows=1, budget_tokens=4, gen=10, scores=None, valid=None, **args):
    policy = get_policy("tova", budget_tokens=budget_tokens, **args)
    layout = policy.layout(prompt_len, gen)
    buf = KVBuffer(layout, rows, 2, torch.float32, "cpu", fields=policy.fields(layout))
    s = prompt_len
    valid = torch.ones(s, rows, dtype=torch.bool) if valid is None else valid
    pos = (valid.long().cumsum(0) - 1).clamp(min=0).to(torch.int32)
    policy.prefill(buf, torch.randn(s, rows, 2), torch.randn(s, rows, 2), pos, valid, scores)
    return policy, buf


# ------------------------------------------------------------------ worked examples (the rule)

def test_evicts_lowest_current_score_new_token_included():
    policy, buf = setup(3, budget_tokens=4)             # 3 committed slots + scratch
    assert buf.capacity == 3 and kept(buf) == [0, 1, 2]
    # step 1: slot 1 (pos 1) and the new token tie at 0.1 -> the older one (pos 1) goes
    step(policy, buf, [3], torch.tensor([[[0.5, 0.1, 0.3, 0.1]]]))
    assert kept(buf) == [0, 2, 3]
    assert buf.pos[:3, 0].tolist() == [0, 3, 2]          # the new token reuses the freed slot
    torch.testing.assert_close(buf.score[:3, 0], torch.tensor([0.5, 0.1, 0.3]))
    # step 2: the new token itself has the lowest score -> omitted right away (no recent window)
    step(policy, buf, [4], torch.tensor([[[0.2, 0.3, 0.4, 0.1]]]))
    assert kept(buf) == [0, 2, 3] and not buf.valid[buf.scratch].any()
    # step 3: TOVA keeps no memory: pos 0 had the highest score before, now it is the lowest
    step(policy, buf, [5], torch.tensor([[[0.05, 0.3, 0.3, 0.35]]]))
    assert kept(buf) == [2, 3, 5]


def test_rows_evict_independently_and_gqa_sums_group():
    policy, buf = setup(3, rows=2, budget_tokens=4)
    # row 0: head A would drop slot 0, head B slot 2; the group sum drops slot 1 (0.3 + 0.2)
    # row 1: the group sum drops slot 0
    probs = torch.tensor([[[0.1, 0.2, 0.4, 0.3], [0.6, 0.1, 0.05, 0.25]],
                          [[0.1, 0.3, 0.3, 0.3], [0.0, 0.4, 0.3, 0.3]]])
    step(policy, buf, [3, 3], probs)
    assert kept(buf, 0) == [0, 2, 3] and kept(buf, 1) == [1, 2, 3]
    # group sums: row 0 [0.7, 0.3, 0.45 | new 0.55], row 1 [0.1, 0.7, 0.6 | new 0.6]
    torch.testing.assert_close(buf.score[:3].t(), torch.tensor([[0.7, 0.55, 0.45],
                                                                [0.6, 0.7, 0.6]]))


def test_prefill_keeps_top_scores_in_position_order():
    scores = torch.tensor([[0.9], [0.1], [0.5], [0.2], [0.7]])
    policy, buf = setup(5, budget_tokens=4, scores=scores)          # 3 committed slots
    assert buf.pos[:3, 0].tolist() == [0, 2, 4]
    torch.testing.assert_close(buf.score[:3, 0], torch.tensor([0.9, 0.5, 0.7]))
    # ties: the newest prompt tokens are kept
    policy, buf = setup(4, budget_tokens=3, scores=torch.tensor([[0.3], [0.3], [0.3], [0.1]]))
    assert kept(buf) == [1, 2]


def test_prefill_left_padding_pads_never_kept():
    valid = torch.tensor([[True, False], [True, False], [True, True], [True, True], [True, True]])
    scores = torch.tensor([[0.4, 0.0], [0.3, 0.0], [0.1, 0.2], [0.6, 0.9], [0.5, 0.1]])
    policy, buf = setup(5, rows=2, budget_tokens=4, scores=scores, valid=valid)
    assert kept(buf, 0) == [0, 3, 4]                     # real positions of prompt indices 0,3,4
    assert kept(buf, 1) == [0, 1, 2]                     # the short row keeps all 3 real tokens
    assert buf.valid[:3, 1].all()
    # a short row with fewer real tokens than slots: the rest stays empty and fills first
    valid = torch.tensor([[True, False], [True, False], [True, False], [True, True], [True, True]])
    policy, buf = setup(5, rows=2, budget_tokens=4, scores=scores, valid=valid)
    assert kept(buf, 1) == [0, 1] and buf.valid[:3, 1].sum() == 2
    step(policy, buf, [3, 2], torch.tensor([[[0.4, 0.1, 0.3, 0.2]], [[0.1, 0.1, 0.0, 0.8]]]))
    assert kept(buf, 0) == [0, 3, 4] and kept(buf, 1) == [0, 1, 2]   # hole filled, nothing lost


def test_layer_mode_evicts_same_token_for_all_heads():
    policy, buf = setup(3, rows=2, budget_tokens=4, heads="layer")
    buf.kv_heads = 2                                     # one sequence, two kv heads
    # per head: row 0 would drop slot 0, row 1 slot 1; summed over the layer slot 2 is lowest
    probs = torch.tensor([[[0.1, 0.4, 0.2, 0.3]], [[0.4, 0.1, 0.2, 0.3]]])   # sums .5 .5 .4 .6
    step(policy, buf, [3, 3], probs)
    assert kept(buf, 0) == kept(buf, 1) == [0, 1, 3]
    assert torch.equal(buf.score[:3, 0], buf.score[:3, 1])


def test_prompt_scores_hook_is_last_query_row():
    torch.manual_seed(0)
    b, hk, g, s = 2, 2, 2, 7
    logits = torch.randn(b, hk, g, s, s).masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(),
                                                   float("-inf"))
    p = logits.softmax(-1)
    valid = torch.ones(b, s, dtype=torch.bool)
    policy = get_policy("tova", budget=0.5)
    layout = policy.layout(s, 10)
    acc = None
    for first in range(0, s, 3):                         # blocks of 3 query rows
        acc = policy.prompt_scores(layout, acc, p[:, :, :, first:first + 3], first, valid)
    torch.testing.assert_close(acc, p[:, :, :, -1].sum(2))


# ------------------------------------------------------------------ invariants through the model

def _trace(monkeypatch, policy, check):
    """Wrap after_attention to run `check(buf, slot, probs, before)` after every call."""
    real = type(policy).after_attention

    def wrapped(self, buf, slot, probs, scored=False):
        before = (buf.pos.clone(), buf.valid.clone())
        real(self, buf, slot, probs, scored)
        check(buf, slot, probs, before)

    monkeypatch.setattr(type(policy), "after_attention", wrapped)   # policies are frozen


def _spy_allocate(monkeypatch, kv_heads=None):
    seen, real = [], E.allocate

    def spy(*a):
        bufs = real(*a)
        for buf in bufs:
            if kv_heads:
                buf.kv_heads = kv_heads
        seen.extend(bufs)
        return bufs

    monkeypatch.setattr(E, "allocate", spy)
    return seen


@pytest.mark.parametrize("heads", ["kv", "layer"])
def test_random_trace_invariants(monkeypatch, heads):
    model = model_for("llama-gqa")
    nk = model.config.num_kv_heads
    prompts = rand_prompts([40, 27], seed=1)             # left padding in the batch
    policy = get_policy("tova", budget=0.2, heads=heads)
    bufs = _spy_allocate(monkeypatch, kv_heads=nk if heads == "layer" else None)
    monkeypatch.setattr(E.Engine, "stack_layers", False)   # checks each layer's own commit
    s, gen = 40, 16
    stats = {"steps": 0, "dropped_new": 0}

    def check(buf, slot, probs, before):
        cap = buf.capacity
        assert cap == buf.layout.slots - 1 == (s + gen) // 5 - 1
        v, p = buf.valid[:cap], buf.pos[:cap]
        assert not buf.valid[cap].any()                  # scratch never holds a kept token
        assert (v.sum(0) <= cap).all()
        cur = buf.pos[slot]                              # the token just decoded
        for r in range(v.shape[1]):
            real = p[v[:, r], r].tolist()
            assert len(set(real)) == len(real)           # unique per row
            assert all(0 <= x <= cur[r] for x in real)   # real token positions, none in future
            assert len(real) == min(cap, int(cur[r]) + 1)  # full once enough tokens came
        if heads == "layer":                             # all kv heads of a sequence alike
            assert torch.equal(p.view(cap, -1, nk)[..., :1].expand(-1, -1, nk).reshape(cap, -1), p)
        if slot == buf.scratch:                          # the dropped token had the lowest score
            stats["steps"] += 1
            score = kv_head_probs(probs)
            if heads == "layer":
                score = score.view(score.shape[0], -1, nk).sum(-1).repeat_interleave(nk, 1)
            old_pos, old_valid = before
            for r in range(v.shape[1]):
                cands = {int(old_pos[i, r]): score[i, r].item()
                         for i in range(cap + 1) if old_valid[i, r]}
                gone = set(cands) - set(p[v[:, r], r].tolist())
                assert len(gone) == 1
                (g,) = gone
                assert cands[g] == min(cands.values())
                stats["dropped_new"] += g == int(old_pos[cap, r])

    _trace(monkeypatch, policy, check)
    generate(model, prompts, gen, policy, Sampling(), stop_ids=(), pad_id=0)
    assert len(bufs) == model.config.num_layers
    assert stats["steps"] > 0 and stats["dropped_new"] > 0   # the new token can be omitted


def test_rows_independent():
    model = model_for("llama-gqa")
    prompts = rand_prompts([30, 30], seed=5)
    both = generate(model, prompts, 12, get_policy("tova", budget=0.2), pad_id=0)
    alone = [generate(model, [p], 12, get_policy("tova", budget=0.2), pad_id=0)[0] for p in prompts]
    assert both == alone
    full = generate(model, prompts, 12, get_policy("full"), pad_id=0)
    assert both != full                                   # eviction changed something


# bit-identity with `full` when nothing is evicted: tests/test_policy_matrix.py


# ------------------------------------------------------------------ bad input

def test_bad_input():
    with pytest.raises(UserError, match="unknown policy_args"):
        get_policy("tova", budget=0.2, window=4)
    with pytest.raises(UserError, match="heads"):
        get_policy("tova", budget=0.2, heads="query")
    with pytest.raises(UserError, match="minimum of 2"):
        get_policy("tova", budget_tokens=1).layout(20, 10)
    with pytest.raises(UserError, match="minimum of 2"):
        get_policy("tova", budget=0.03).layout(20, 10)
    # heads=layer on an engine whose buffers do not know their kv heads
    if not hasattr(KVBuffer(Layout(2), 1, 1, torch.float32, "cpu"), "kv_heads"):
        with pytest.raises(UserError, match="kv_heads"):
            generate(model_for("llama-gqa"), rand_prompts([30], seed=0), 4,
                     get_policy("tova", budget=0.2, heads="layer"), pad_id=0)
