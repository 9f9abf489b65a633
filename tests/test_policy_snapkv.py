"""`snapkv` (policies/snapkv.py): the prompt's selection against a direct computation of the
pooled observation-window attention, hand-made decode steps (the window's sliding sum, pooling
along position order over the candidates only), a brute-force check of every eviction through
the model, and bad input. Bit-identity with `full` at a whole-sequence budget and batch
independence: tests/test_policy_matrix.py."""
import pytest
import torch
import torch.nn.functional as F

import flexevict.runtime.engine as E
from flexevict.core.kv import KVBuffer
from flexevict.errors import UserError
from flexevict.policies import get_policy
from flexevict.runtime.generation import Sampling, generate

from tiny import decode_step as step, kept, model_for, rand_prompts


def setup(prompt_len, budget_tokens, rows=1, scores=None, valid=None, **args):
    policy = get_policy("snapkv", budget_tokens=budget_tokens, **args)
    layout = policy.layout(prompt_len, 10)
    buf = KVBuffer(layout, rows, 2, torch.float32, "cpu", fields=policy.fields(layout))
    s = prompt_len
    valid = torch.ones(s, rows, dtype=torch.bool) if valid is None else valid
    pos = (valid.long().cumsum(0) - 1).clamp(min=0).to(torch.int32)
    policy.prefill(buf, torch.randn(s, rows, 2), torch.randn(s, rows, 2), pos, valid, scores)
    return policy, buf


def causal_probs(b, hk, g, s, valid=None, seed=0):
    """Random prefill attention (b, hk, g, s, s) of left-padded rows, pad queries zeroed."""
    torch.manual_seed(seed)
    valid = torch.ones(b, s, dtype=torch.bool) if valid is None else valid
    sees = torch.ones(s, s, dtype=torch.bool).tril() & valid[:, None, None, None, :]
    sees |= torch.eye(s, dtype=torch.bool)
    p = (3 * torch.randn(b, hk, g, s, s)).masked_fill(~sees, float("-inf")).softmax(-1)
    return p * valid[:, None, None, :, None]


def fold_all(policy, layout, p, valid, block=4):
    acc = None
    for first in range(0, p.shape[3], block):        # blocks of query rows, as the model
        acc = policy.prompt_scores(layout, acc, p[:, :, :, first:first + block, :first + block],
                                   first, valid)
    return acc


# ------------------------------------------------------------------ the prompt

def test_fold_keeps_each_window_query_row_by_position():
    s, w = 13, 5
    valid = torch.ones(2, s, dtype=torch.bool)
    valid[1, :4] = False                              # row 1: 4 pads, positions 0..8
    p = causal_probs(2, 2, 3, s, valid)
    policy = get_policy("snapkv", budget_tokens=8, window=w)
    lay = policy.layout(s, 4)
    acc = fold_all(policy, lay, p, valid)
    assert acc.shape == (2, 2, s, w)
    for b, pads in ((0, 0), (1, 4)):
        for i in range(s - w, s):                     # the window's queries, by padded index
            torch.testing.assert_close(acc[b, :, :, (i - pads) % w], p[b, :, :, i].sum(1))


@pytest.mark.parametrize("pool,kernel", [("avg", 7), ("avg", 5), ("max", 3), ("avg", 1)])
def test_prompt_selection_equals_the_pooled_window_attention_top_k(pool, kernel):
    """Listing 1: the window's attention summed over its queries (and, per kv head, over the
    query heads), pooled along the prefix, top (kept - window), plus the window."""
    s, w, slots = 40, 6, 17                            # 16 kept: 6 window + 10 selected
    p = causal_probs(1, 2, 3, s, seed=kernel)
    valid = torch.ones(1, s, dtype=torch.bool)
    policy = get_policy("snapkv", budget_tokens=slots, window=w, kernel=kernel, pool=pool)
    lay = policy.layout(s, 4)
    scores = fold_all(policy, lay, p, valid)[0].permute(1, 0, 2)       # (S, rows, w)
    _, buf = setup(s, slots, rows=2, scores=scores, window=w, kernel=kernel, pool=pool)
    for h in range(2):
        votes = p[0, h, :, s - w:, :s - w].sum(dim=(0, 1))              # (S - w,)
        op = F.avg_pool1d if pool == "avg" else F.max_pool1d
        pooled = op(votes[None, None], kernel, stride=1, padding=kernel // 2)[0, 0]
        top = pooled.topk(slots - 1 - w).indices.tolist()
        got = kept(buf, h)
        assert got[-w:] == list(range(s - w, s)) and len(got) == slots - 1
        chosen, dropped = got[:-w], sorted(set(range(s - w)) - set(got))
        assert pooled[chosen].min() >= pooled[dropped].max()
        edge = pooled[chosen].min()              # ties at the edge (max pooling): newest stay
        assert min(i for i in chosen if pooled[i] == edge) > \
            max([i for i in dropped if pooled[i] == edge], default=-1)
        if pool == "avg":
            assert got == sorted(top + list(range(s - w, s)))
        if pool == "avg":               # kvpress's order: pool each query head, then the mean
            per_head = F.avg_pool1d(p[0, h, :, s - w:, :s - w].mean(1)[:, None], kernel,
                                    stride=1, padding=kernel // 2)[:, 0].mean(0)
            assert sorted(per_head.topk(slots - 1 - w).indices.tolist()) == sorted(top)


def test_window_is_resolved_to_the_slots():
    policy = get_policy("snapkv", budget_tokens=10)                    # window 32 asked
    assert policy.layout(100, 10).window == 8                         # 9 kept: 8 + 1 selected
    assert get_policy("snapkv", budget=0.5).layout(200, 56).window == 32
    assert policy.describe(policy.layout(100, 10))["window"] == 8


def test_left_padding_selects_what_the_row_selects_alone():
    s, w = 24, 4
    valid = torch.ones(2, s, dtype=torch.bool)
    valid[1, :7] = False
    p = causal_probs(2, 1, 2, s, valid, seed=4)
    policy = get_policy("snapkv", budget_tokens=11, window=w, kernel=3)
    scores = fold_all(policy, policy.layout(s, 4), p, valid).permute(2, 0, 1, 3)[:, :, 0]
    _, both = setup(s, 11, rows=2, scores=scores, valid=valid.t(), window=w, kernel=3)
    q = p[1:, :, :, 7:, 7:]
    alone_scores = fold_all(policy, policy.layout(s - 7, 4), q,
                            valid[1:, 7:]).permute(2, 0, 1, 3)[:, :, 0]
    _, alone = setup(s - 7, 11, scores=alone_scores, window=w, kernel=3)
    assert kept(both, 1) == kept(alone, 0)
    hist_both, hist_alone = both.policy_state["hist"], alone.policy_state["hist"]
    torch.testing.assert_close(hist_both[:, :10, 1], hist_alone[:, :10, 0])


# ------------------------------------------------------------------ decode (hand-made)

def test_decode_scores_by_the_last_window_queries_only():
    # 4 prompt tokens fill the 4 committed slots; window 2, no pooling; no prompt history
    policy, buf = setup(4, budget_tokens=5, window=2, kernel=1)
    p = lambda *x: torch.tensor([[list(x)]])           # noqa: E731  (rows=1, group=1, n)
    # step 1 (pos 4, query row 0): window {3, 4}; candidates 0, 1, 2 score .05, .6, .15
    step(policy, buf, [4], p(0.05, 0.6, 0.15, 0.1, 0.1))
    assert kept(buf) == [1, 2, 3, 4] and buf.pos[:4, 0].tolist() == [4, 1, 2, 3]
    # step 2 (pos 5, row 1): slots hold 4, 1, 2, 3 | 5; window {4, 5}; candidates 1: .6 + .05,
    # 2: .15 + .3, 3: .1 + .3 -> 3 goes
    step(policy, buf, [5], p(0.3, 0.05, 0.3, 0.3, 0.05))
    assert kept(buf) == [1, 2, 4, 5]
    # step 3 (pos 6, row 0: step 1's query leaves the window): slots 4, 1, 2, 5 | 6; candidates
    # 4: .3 + .2, 1: .05 + .1, 2: .3 + .1 -> 1 goes (with step 1's .6 still counted, 2 would)
    step(policy, buf, [6], p(0.2, 0.1, 0.1, 0.3, 0.3))
    assert kept(buf) == [2, 4, 5, 6]
    torch.testing.assert_close(buf.policy_state["hist"].sum(0)[:4, 0],
                               torch.tensor([0.5, 0.3, 0.4, 0.35]))   # slots: 4, 6, 2, 5


@pytest.mark.parametrize("kernel,gone", [(1, 2), (3, 3)])
def test_decode_pools_the_candidates_alone_in_position_order(kernel, gone):
    # 5 prompt tokens fill 5 slots; window 2: the step's candidates are positions 0..3 with
    # scores .6, .6, 0, .05 (position 4 is in the window)
    policy, buf = setup(5, budget_tokens=6, window=2, kernel=kernel)
    step(policy, buf, [5], torch.tensor([[[0.6, 0.6, 0.0, 0.05, 0.9, 0.1]]]))
    # unpooled: position 2 (0) goes; pooled (kernel 3, zeros past the candidates): .4, .4,
    # .217, .017 -> position 3; had the window's .9 been pooled in, position 3 would be .317
    # and position 2 would go
    assert kept(buf) == sorted({0, 1, 2, 3, 4, 5} - {gone})


# ------------------------------------------------------------------ through the model

@pytest.mark.parametrize("kernel,pool", [(3, "avg"), (3, "max"), (1, "avg")])
def test_every_eviction_is_the_rule_recomputed_from_the_attention(monkeypatch, kernel, pool):
    """Brute force at every full step of every layer, from the attention each decode query
    used (recorded here by token position): the window's `window` newest tokens all stay, and
    the token that left has the lowest pooled window-attention sum among the older tokens."""
    w = 3
    model = model_for("llama-gqa")
    policy = get_policy("snapkv", budget=0.3, window=w, kernel=kernel, pool=pool)
    monkeypatch.setattr(E.Engine, "stack_layers", False)    # each layer commits on its own
    real_observe, real_commit = type(policy).observe, type(policy).commit
    rows_of = {}                         # (layer, row) -> {query pos: {token pos: attention}}
    seen = {"checked": 0}

    def observe(self, buf, slot, probs, scored=False):
        real_observe(self, buf, slot, probs, scored)
        n = probs.shape[-1]
        score = probs.sum(dim=1)                                      # (rows, n)
        for r in range(score.shape[0]):
            q = int(buf.pos[slot, r])
            rows_of.setdefault((buf.layer, r), {})[q] = {
                int(buf.pos[i, r]): float(score[r, i]) for i in range(n) if buf.valid[i, r]}

    def commit(self, buf, slot):
        full = slot == buf.scratch
        n = buf.scratch + 1
        present = [{int(buf.pos[i, r]) for i in range(n) if buf.valid[i, r]}
                   for r in range(buf.k.shape[1])]
        real_commit(self, buf, slot)
        if not full:
            return
        for r, before in enumerate(present):
            now = set(buf.pos[:buf.capacity, r][buf.valid[:buf.capacity, r]].tolist())
            (gone,) = before - now
            t = max(before)
            assert set(range(t - w + 1, t + 1)) <= now          # the window stays
            queries = rows_of[(buf.layer, r)]
            if not all(q in queries for q in range(t - w + 1, t + 1)):
                continue                 # a prompt query is still in the window: not recorded
            cands = sorted(x for x in before if x <= t - w)
            votes = torch.tensor([sum(queries[q].get(x, 0.0) for q in range(t - w + 1, t + 1))
                                  for x in cands], dtype=torch.float64)
            op = F.avg_pool1d if pool == "avg" else F.max_pool1d
            pooled = op(votes[None, None], kernel, stride=1, padding=kernel // 2)[0, 0]
            assert pooled[cands.index(gone)] <= pooled.min() + 1e-6
            seen["checked"] += 1

    monkeypatch.setattr(type(policy), "observe", observe)
    monkeypatch.setattr(type(policy), "commit", commit)
    generate(model, rand_prompts([60, 47], seed=2), 30, policy, Sampling(), (), 0)
    assert seen["checked"] > 100


def test_flags_and_declared_history():
    policy = get_policy("snapkv", budget=0.5)
    lay = policy.layout(100, 20)
    assert policy.graph_safe and policy.stacks and policy.needs_prompt_scores
    (hist,) = policy.fields(lay)
    assert hist.name == "hist" and hist.shape == (32, "slots", "rows")
    assert policy.fields(get_policy("snapkv", budget=1.0).layout(100, 20)) == ()


def test_bad_input():
    with pytest.raises(UserError, match="window=0"):
        get_policy("snapkv", budget=0.2, window=0)
    with pytest.raises(UserError, match="kernel=4"):
        get_policy("snapkv", budget=0.2, kernel=4)
    with pytest.raises(UserError, match="pool=min"):
        get_policy("snapkv", budget=0.2, pool="min")
    with pytest.raises(UserError, match="minimum of 3"):
        get_policy("snapkv", budget_tokens=2).layout(20, 10)
