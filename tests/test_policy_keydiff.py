"""`keydiff` (policies/keydiff.py): hand-made worked examples of the anchor rule, the prompt's
one-shot and block-wise selections against direct computations, a brute-force check of every
eviction through the model, and bad input. Bit-identity with `full` at a whole-sequence budget
and batch independence: tests/test_policy_matrix.py."""
import pytest
import torch
import torch.nn.functional as F

import flexevict.runtime.engine as E
from flexevict.core.kv import KVBuffer
from flexevict.errors import UserError
from flexevict.policies import get_policy
from flexevict.policies.keydiff import anchor_affinity, anchor_similarity
from flexevict.runtime.generation import Sampling, generate

from tiny import kept, model_for, rand_prompts


def setup(keys, budget_tokens, rows=1, valid=None, **args):
    """A bare buffer holding a prompt whose keys are `keys` (S, rows, d)."""
    keys = torch.as_tensor(keys, dtype=torch.float32)
    s, d = keys.shape[0], keys.shape[-1]
    policy = get_policy("keydiff", budget_tokens=budget_tokens, **args)
    layout = policy.layout(s, 10)
    buf = KVBuffer(layout, rows, d, torch.float32, "cpu", fields=policy.fields(layout))
    valid = torch.ones(s, rows, dtype=torch.bool) if valid is None else valid
    pos = (valid.long().cumsum(0) - 1).clamp(min=0).to(torch.int32)
    policy.prefill(buf, keys, torch.randn(s, rows, d), pos, valid)
    return policy, buf


def step(policy, buf, key, pos):
    """One decode step whose new token has key `key` (rows, d); the attention is irrelevant."""
    key = torch.as_tensor(key, dtype=torch.float32)
    rows = key.shape[0]
    slot = buf.incoming_slot()
    buf.write(slot, key, torch.randn(rows, key.shape[1]), torch.tensor(pos, dtype=torch.int32))
    policy.before_attention(buf, slot, torch.randn(rows, 1, key.shape[1]))
    n = buf.attended(slot)
    policy.after_attention(buf, slot, torch.full((rows, 1, n), 1.0 / n))


# ------------------------------------------------------------------ worked examples (the rule)

def test_evicts_the_key_most_similar_to_the_anchor():
    policy, buf = setup([[[1, 0]], [[0, 1]], [[1, 1]]], budget_tokens=4)     # 3 slots + scratch
    assert kept(buf) == [0, 1, 2]
    # unit keys (1,0), (0,1), (.707,.707), new (.981,.196): anchor (.672, .476) / its norm;
    # cosines .816, .578, .986, .914 -> (1, 1) goes, though (1, 0) and the new key are closer
    # to each other: KeyDiff drops the least distinctive key, not a duplicate
    step(policy, buf, [[1, 0.2]], [3])
    assert kept(buf) == [0, 1, 3] and buf.pos[:3, 0].tolist() == [0, 1, 3]
    # keys (1,0), (0,1), (1,.2), new (-1,.5): cosines .551, .834, .704, -.120 -> (0, 1) goes
    step(policy, buf, [[-1, 0.5]], [4])
    assert kept(buf) == [0, 3, 4]
    # a new key on the anchor's direction is the most similar: it is dropped once attended
    unit = F.normalize(torch.tensor([[1.0, 0.0], [-1, 0.5], [1, 0.2]]), dim=-1).sum(0)
    step(policy, buf, [unit.tolist()], [5])
    assert kept(buf) == [0, 3, 4] and not buf.valid[buf.scratch].any()


def test_a_window_protects_the_newest_tokens():
    """The same steps with window=1: the new key on the anchor's direction now stays, and the
    most similar of the others goes (cosines .861, -.542, .945 | new 1.0 -> position 3)."""
    policy, buf = setup([[[1, 0]], [[0, 1]], [[1, 1]]], budget_tokens=4, window=1)
    step(policy, buf, [[1, 0.2]], [3])
    step(policy, buf, [[-1, 0.5]], [4])
    assert kept(buf) == [0, 3, 4]                        # as without a window
    unit = F.normalize(torch.tensor([[1.0, 0.0], [-1, 0.5], [1, 0.2]]), dim=-1).sum(0)
    step(policy, buf, [unit.tolist()], [5])
    assert kept(buf) == [0, 4, 5]


def test_ties_evict_the_oldest_and_rows_are_independent():
    # row 0: unit keys (1,0), (0,1), (0,1), new (-1,0): anchor (0, .5): cosines 0, 1, 1, 0 ->
    # the tie between positions 1 and 2 drops the older; row 1: its own anchor and victim
    keys = [[[2, 0], [0, 1]], [[0, 1], [1, 0]], [[0, 3], [1, 0.6]]]
    policy, buf = setup(keys, budget_tokens=4, rows=2)
    step(policy, buf, [[-1, 0], [-0.2, 1]], [3, 3])
    assert kept(buf, 0) == [0, 2, 3]
    # row 1: keys (0,1), (1,0), (1,.6), new (-.2,1): cosines .832, .554, .904, .708 -> position 2
    assert kept(buf, 1) == [0, 1, 3]


def test_similarity_is_the_papers_score():
    """s_i = -cos(k_i, mean_j k_j / |k_j|) over the valid keys only (kvpress's KeyDiffPress)."""
    torch.manual_seed(0)
    k = torch.randn(9, 3, 5)
    valid = torch.ones(9, 3, dtype=torch.bool)
    valid[:4, 1] = False                                  # pads take no part in the anchor
    got = anchor_similarity(k, valid)
    for r in range(3):
        kr = k[valid[:, r], r]
        anchor = F.normalize(kr, dim=-1).mean(0, keepdim=True)
        torch.testing.assert_close(got[valid[:, r], r], F.cosine_similarity(kr, anchor, dim=-1))
    # the decode step's form: the cosine times the norm of the summed unit keys (same order)
    scale = torch.stack([F.normalize(k[valid[:, r], r], dim=-1).sum(0).norm() for r in range(3)])
    torch.testing.assert_close(anchor_affinity(k, valid), got * scale * valid)


# ------------------------------------------------------------------ the prompt

def _direct_oneshot(k, n, w=0):
    """The last w of a row's prompt tokens, and the top n - w of the others by -cos to the
    anchor of all of them, in order."""
    s = k.shape[0]
    score = -F.cosine_similarity(k, F.normalize(k, dim=-1).mean(0, keepdim=True), dim=-1)
    return sorted(score[:s - w].topk(n - w).indices.tolist() + list(range(s - w, s)))


def _direct_blocks(k, n, block, w=0):
    """The paper's block-wise processing, one row, in plain Python: the first n stay, then
    each block joins and the n best (by -cos to the anchor of the n + block; the prompt's last
    w always) stay."""
    keep, s = list(range(n)), k.shape[0]
    for i in range(n, s, block):
        cand = keep + list(range(i, min(i + block, s)))
        kc = k[cand]
        score = -F.cosine_similarity(kc, F.normalize(kc, dim=-1).mean(0, keepdim=True), dim=-1)
        score[[j for j, x in enumerate(cand) if x >= s - w]] = float("inf")
        keep = sorted(cand[j] for j in score.topk(n).indices.tolist())
    return keep


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("block", [0, 1, 3, 5, 100])
def test_prompt_selection_equals_the_direct_computation(block, window):
    torch.manual_seed(block)
    k = torch.randn(23, 2, 6)
    policy, buf = setup(k, budget_tokens=9, rows=2, block=block, window=window)   # 8 kept
    for r in range(2):
        want = (_direct_oneshot(k[:, r], 8, window) if block in (0, 100) else
                _direct_blocks(k[:, r], 8, block, window))
        assert kept(buf, r) == want
    if block == 3 and window == 0:                                    # blocks change the set
        assert any(kept(buf, r) != _direct_oneshot(k[:, r], 8) for r in range(2))


def test_left_padding_selects_what_the_row_selects_alone():
    torch.manual_seed(3)
    k = torch.randn(20, 2, 4)
    valid = torch.ones(20, 2, dtype=torch.bool)
    valid[:6, 1] = False                                  # row 1: 6 pads, then 14 real tokens
    for block in (0, 4):
        _, both = setup(k, budget_tokens=8, rows=2, valid=valid, block=block)
        _, alone = setup(k[6:, 1:], budget_tokens=8, block=block)
        assert kept(both, 1) == kept(alone, 0)
        assert torch.equal(both.k[:7, 1], alone.k[:7, 0])


# ------------------------------------------------------------------ through the model

@pytest.mark.parametrize("block,window", [(0, 0), (8, 0), (8, 4)])
def test_every_eviction_drops_the_key_most_similar_to_the_anchor(monkeypatch, block, window):
    """Brute force at every full step of every layer: the token that left is the one whose key
    has the highest cosine to the mean unit key of the keys present (the new one included),
    among those older than the `window` newest."""
    model = model_for("llama-gqa")
    policy = get_policy("keydiff", budget=0.3, block=block, window=window)
    monkeypatch.setattr(E.Engine, "stack_layers", False)    # each layer commits on its own
    real = type(policy).commit
    seen = {"steps": 0, "new_dropped": 0}

    def commit(self, buf, slot):
        full = slot == buf.scratch
        n = buf.scratch + 1
        before = [{int(buf.pos[i, r]): buf.k[i, r].clone() for i in range(n)
                   if buf.valid[i, r]} for r in range(buf.k.shape[1])]
        real(self, buf, slot)
        if not full:
            return
        seen["steps"] += 1
        for r, keys in enumerate(before):
            now = set(buf.pos[:buf.capacity, r][buf.valid[:buf.capacity, r]].tolist())
            (gone,) = set(keys) - now
            order = sorted(keys)
            kr = torch.stack([keys[p] for p in order])
            cos = F.cosine_similarity(kr, F.normalize(kr, dim=-1).mean(0, keepdim=True), dim=-1)
            cands = cos[:len(order) - window]
            assert gone in order[:len(order) - window]
            assert cos[order.index(gone)] >= cands.max() - 1e-6
            seen["new_dropped"] += gone == order[-1]

    monkeypatch.setattr(type(policy), "commit", commit)
    generate(model, rand_prompts([60, 47], seed=2), 30, policy, Sampling(), (), 0)
    assert seen["steps"] > 0 and (seen["new_dropped"] > 0) == (window == 0)


def test_flags():
    policy = get_policy("keydiff", budget=0.5)
    assert policy.graph_safe and policy.stacks and not policy.needs_prompt_scores
    assert policy.fields(policy.layout(40, 10)) == ()                 # no declared state
    assert policy.describe(policy.layout(40, 10)) == {"policy": "keydiff", "slots": 25,
                                                      "block": 128, "window": 0}
    assert get_policy("keydiff", window=3).protected(3) == 2         # two tokens still compete


def test_bad_input():
    with pytest.raises(UserError, match="block=-1"):
        get_policy("keydiff", budget=0.2, block=-1)
    with pytest.raises(UserError, match="window=-1"):
        get_policy("keydiff", budget=0.2, window=-1)
    with pytest.raises(UserError, match="unknown policy_args"):
        get_policy("keydiff", budget=0.2, sinks=4)
    with pytest.raises(UserError, match="minimum of 2"):
        get_policy("keydiff", budget_tokens=1).layout(20, 10)
