"""`scissorhands` (policies/scissorhands.py): a hand-made worked example of the counting rule
(window, threshold, recent protection, ties), the prompt statistic, invariants on random traces
through the real model, bit-identity with `full` when nothing is evicted, and bad input."""
import pytest
import torch

import flexevict.runtime.engine as E
import flexevict.policies.scissorhands  # noqa: F401  (registers "scissorhands")
from flexevict.errors import UserError
from flexevict.runtime.generation import Sampling, generate
from flexevict.core.kv import KVBuffer
from flexevict.policies import get_policy

from tiny import model_for, rand_prompts, decode_step as step, kept



def score_by_pos(buf, row=0):
    v = buf.valid[:buf.capacity, row]
    return dict(zip(buf.pos[:buf.capacity, row][v].tolist(),
                    buf.score[:buf.capacity, row][v].tolist()))


def setup(prompt_len, budget_tokens, scores=None, gen=20, rows=1, **args):
    policy = get_policy("scissorhands", budget_tokens=budget_tokens, **args)
    layout = policy.layout(prompt_len, gen)
    buf = KVBuffer(layout, rows, 2, torch.float32, "cpu", fields=policy.fields(layout))
    s = prompt_len
    pos = torch.arange(s, dtype=torch.int32).unsqueeze(1).expand(s, rows)
    policy.prefill(buf, torch.randn(s, rows, 2), torch.randn(s, rows, 2), pos,
                   torch.ones(s, rows, dtype=torch.bool), scores)
    return policy, buf


# ------------------------------------------------------------------ worked example (the rule)

def test_worked_example_counts_window_recent_ties():
    """recent r = 2, history window w = 3, 4 committed slots (2 by score + 2 recent) + scratch.
    A token is unimportant for a query when its probability is below 1/n (n = 5 attended).
    Importance = w - (times unimportant in the last w queries)."""
    policy, buf = setup(4, budget_tokens=5, recent=2, window=3)
    assert (buf.layout.prefix, buf.layout.ring) == (2, 2) and kept(buf) == [0, 1, 2, 3]
    assert score_by_pos(buf) == {0: 3, 1: 3, 2: 3, 3: 3}      # nothing counted yet
    # t=4, slots hold pos [0, 1, 2, 3 | new 4]; threshold 0.2 -> unimportant: pos 1, 3, 4.
    # Candidates: pos 0, 1 (kept by score) and pos 2 (leaving the recent window) -> drop pos 1.
    step(policy, buf, [4], torch.tensor([[[0.40, 0.05, 0.30, 0.10, 0.15]]]))
    assert kept(buf) == [0, 2, 3, 4]
    assert score_by_pos(buf) == {0: 3, 2: 3, 3: 2, 4: 2}
    # t=5, slots [pos 0, 2, 4, 3 | new 5]: unimportant pos 0, 4, 5. Pos 4 is the lowest (count 2)
    # but recent (with pos 5); candidates pos 0 (2), pos 2 (3), pos 3 (2): tie -> the oldest.
    step(policy, buf, [5], torch.tensor([[[0.05, 0.50, 0.05, 0.30, 0.10]]]))
    assert kept(buf) == [2, 3, 4, 5]
    assert score_by_pos(buf) == {2: 3, 3: 2, 4: 1, 5: 2}
    # t=6, slots [pos 3, 2, 4, 5 | new 6]: unimportant pos 5, 6 (0.25 is not below 0.2).
    # Candidates pos 3 (2), pos 2 (3), pos 4 (1, leaving the recent window) -> drop pos 4.
    step(policy, buf, [6], torch.tensor([[[0.30, 0.30, 0.25, 0.10, 0.05]]]))
    assert kept(buf) == [2, 3, 5, 6]
    assert score_by_pos(buf) == {2: 3, 3: 2, 5: 1, 6: 2}
    # t=7: the t=4 query leaves the window (pos 3 loses that count and gains this one); slots
    # [pos 3, 2, 6, 5 | new 7], unimportant pos 3, 2, 7. Candidates pos 3 (2), pos 2 (2),
    # pos 5 (1) -> drop pos 5.
    step(policy, buf, [7], torch.tensor([[[0.10, 0.10, 0.30, 0.45, 0.05]]]))
    assert kept(buf) == [2, 3, 6, 7]
    assert score_by_pos(buf) == {2: 2, 3: 2, 6: 2, 7: 2}


def test_gqa_threshold_is_group_mean():
    """A kv head's score is its 2 query heads' sum; unimportant when the sum < 2/n."""
    policy, buf = setup(3, budget_tokens=4, recent=1, window=8)
    # n = 4: threshold 2/4 on the group sums [0.6, 0.45, 0.6 | new 0.35]: pos 1 and the new
    # token are unimportant (the sums, not single heads, decide: head B gives pos 1 0.25 = 1/4)
    probs = torch.tensor([[[0.30, 0.20, 0.40, 0.10], [0.30, 0.25, 0.20, 0.25]]])
    step(policy, buf, [3], probs)
    # counts: pos 0: 0, pos 1: 1, pos 2: 0 (0.6), new pos 3: 1 (0.35); candidates pos 0, 1, 2
    assert kept(buf) == [0, 2, 3]
    assert score_by_pos(buf) == {0: 8, 2: 8, 3: 7}


def test_attention_mode_windowed_sum():
    """score=attention (VATP's Eq. 3 reading): importance = attention summed over the last w
    queries."""
    policy, buf = setup(3, budget_tokens=4, recent=1, window=2, score="attention")
    step(policy, buf, [3], torch.tensor([[[0.5, 0.1, 0.3, 0.1]]]))      # drop pos 1 (0.1)
    assert kept(buf) == [0, 2, 3]
    torch.testing.assert_close(buf.score[:3, 0], torch.tensor([0.5, 0.3, 0.1]))
    # slots pos 0, 2, 3 | new 4: pos 0 = 0.6, pos 2 = 0.6, pos 3 = 0.65 -> tie, the oldest goes
    step(policy, buf, [4], torch.tensor([[[0.1, 0.3, 0.55, 0.05]]]))
    assert kept(buf) == [2, 3, 4]
    torch.testing.assert_close(buf.score[:3, 0], torch.tensor([0.65, 0.6, 0.05]))
    # slots pos 3, 2, 4 | new 5: the t=3 query leaves the window of 2:
    # pos 3 = 0.55 + 0.1, pos 2 = 0.3 + 0.1, pos 4 = 0.05 + 0.7 -> drop pos 2
    step(policy, buf, [5], torch.tensor([[[0.1, 0.1, 0.7, 0.1]]]))
    assert kept(buf) == [3, 4, 5]
    torch.testing.assert_close(buf.score[:3, 0], torch.tensor([0.65, 0.75, 0.1]))
    # window=0: no window, plain accumulation: pos 3 = 0.75, pos 2 = 0.7, pos 4 = 0.75
    policy, buf = setup(3, budget_tokens=4, recent=1, window=0, score="attention")
    for t, row in [(3, [0.5, 0.1, 0.3, 0.1]), (4, [0.1, 0.3, 0.55, 0.05]),
                   (5, [0.1, 0.1, 0.7, 0.1])]:
        step(policy, buf, [t], torch.tensor([[row]]))
    assert kept(buf) == [3, 4, 5]
    torch.testing.assert_close(buf.score[:3, 0], torch.tensor([0.75, 0.75, 0.1]))


# ------------------------------------------------------------------ prompt statistic

def _causal_probs(b, hk, g, s, seed, valid=None):
    torch.manual_seed(seed)
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    if valid is not None:
        mask = mask & valid[:, None, None, None, :] | torch.eye(s, dtype=torch.bool)
    p = torch.randn(b, hk, g, s, s).masked_fill(~mask, float("-inf")).softmax(-1)
    if valid is not None:
        p = p * valid[:, None, None, :, None]                # pad queries do not vote
    return p


def test_prompt_scores_hand_made():
    """Queries 1..3 over keys; unimportant below 1/(keys seen): q1 sees 2 keys, q2 3, q3 4."""
    rows = [[1.0, 0, 0, 0], [0.3, 0.7, 0, 0], [0.5, 0.1, 0.4, 0], [0.1, 0.2, 0.3, 0.4]]
    p = torch.tensor(rows).view(1, 1, 1, 4, 4)
    valid = torch.ones(1, 4, dtype=torch.bool)
    # window 2: only q2 (bit 2 % 2 = 0) and q3 (bit 1): key 0 <- q3, key 1 <- q2, q3
    pol = get_policy("scissorhands", budget=0.5, window=2)
    lay = pol.layout(4, 40)
    assert pol.prompt_scores(lay, None, p, 0, valid)[0, 0, :, 0].tolist() == [2, 3, 0, 0]
    # window 400: q1 (bit 1), q2 (bit 2), q3 (bit 3): key 0 <- q1, q3; key 1 <- q2, q3
    pol = get_policy("scissorhands", budget=0.5)
    lay = pol.layout(4, 40)
    assert pol.prompt_scores(lay, None, p, 0, valid)[0, 0, :, 0].tolist() == [10, 12, 0, 0]
    # blocks of query rows give the same statistic
    acc = pol.prompt_scores(lay, None, p[:, :, :, :3], 0, valid)
    assert torch.equal(pol.prompt_scores(lay, acc, p[:, :, :, 3:], 3, valid),
                       pol.prompt_scores(lay, None, p, 0, valid))


@pytest.mark.parametrize("window", [3, 9, 400])
def test_prompt_scores_match_brute_force(window):
    b, hk, g, s = 2, 2, 2, 11
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[1, :4] = False                                    # a left-padded row
    p = _causal_probs(b, hk, g, s, seed=window, valid=valid)
    pol = get_policy("scissorhands", budget=0.5, window=window)
    lay = pol.layout(s, 40)
    acc = None
    for first in range(0, s, 4):
        acc = pol.prompt_scores(lay, acc, p[:, :, :, first:first + 4], first, valid)
    count = torch.zeros(b, hk, s)
    for bi in range(b):
        for i in range(max(0, s - window), s):
            if not valid[bi, i]:
                continue
            seen = int(valid[bi, :i + 1].sum())
            for j in range(i + 1):
                if valid[bi, j]:
                    count[bi, :, j] += (p[bi, :, :, i, j].sum(1) < g / seen).float()
    pop = torch.tensor([bin(x).count("1") for x in range(256)])
    assert torch.equal(pop[acc.long()].sum(-1).float(), count)
    att = get_policy("scissorhands", budget=0.5, window=window, score="attention")
    total = att.prompt_scores(att.layout(s, 40), None, p, 0, valid)
    torch.testing.assert_close(total, p[:, :, :, max(0, s - window):].sum(dim=(2, 3)))


def test_prefill_with_prompt_bits_then_decode():
    """Algorithm 2 on a 5-token prompt (window 4, recent 1, 3 slots) from its window bits (bit
    i % 4 set: prompt query i found the key unimportant), then a decode step that slides the
    window past the prompt query 1."""
    bits = torch.tensor([0b0010, 0b1110, 0b1100, 0, 0], dtype=torch.uint8).view(5, 1, 1)
    policy, buf = setup(5, budget_tokens=4, scores=bits, recent=1, window=4)
    # importance 4 - count: pos 0: 3, pos 1: 1, pos 2: 2, pos 3: 4; pos 4 is recent
    assert kept(buf) == [0, 3, 4] and score_by_pos(buf) == {0: 3, 3: 4, 4: 4}
    # t=5 (bit 1, query 1 leaves): threshold 1/4, unimportant: pos 3 only. pos 0 -> 4, pos 3 -> 3
    step(policy, buf, [5], torch.tensor([[[0.3, 0.1, 0.3, 0.3]]]))
    assert kept(buf) == [0, 4, 5] and score_by_pos(buf) == {0: 4, 4: 4, 5: 4}


# ------------------------------------------------------------------ invariants through the model

def _spy_allocate(monkeypatch):
    seen, real = [], E.allocate

    def spy(*a):
        bufs = real(*a)
        seen.extend(bufs)
        return bufs

    monkeypatch.setattr(E, "allocate", spy)
    return seen


@pytest.mark.parametrize("args", [{}, {"recent": 3, "window": 5},
                                  {"score": "attention", "window": 6}])
def test_random_trace_invariants(monkeypatch, args):
    model = model_for("llama-gqa")
    prompts = rand_prompts([52, 35], seed=1)             # left padding in the batch
    s, gen = 52, 14
    policy = get_policy("scissorhands", budget=0.2, **args)
    recent, window = policy.recent, policy.window
    bufs = _spy_allocate(monkeypatch)
    real = type(policy).after_attention
    steps = []

    def check(self, buf, slot, probs, scored=False):
        real(self, buf, slot, probs, scored)
        cap = buf.capacity
        assert cap == buf.layout.slots - 1 == (s + gen) // 5 - 1 and buf.layout.ring == recent
        v, p = buf.valid[:cap], buf.pos[:cap]
        assert not buf.valid[cap].any() and (v.sum(0) <= cap).all()
        cur = buf.pos[slot]                              # the token just decoded
        for r in range(v.shape[1]):
            pos = p[v[:, r], r].tolist()
            assert len(set(pos)) == len(pos) == min(cap, int(cur[r]) + 1)
            assert all(0 <= x <= cur[r] for x in pos)
            # the `recent` newest tokens (the current one included) are always kept
            assert set(range(int(cur[r]) - recent + 1, int(cur[r]) + 1)) <= set(pos)
        if policy.counting:                              # importance = window - count
            sc = buf.score[:cap][v]
            assert ((sc >= 0) & (sc <= window) & (sc == sc.round())).all()
        assert buf.policy_state["hist"].shape[1:] == buf.score.shape  # allocated once, never grown
        steps.append(slot == buf.scratch)

    monkeypatch.setattr(type(policy), "after_attention", check)    # policies are frozen
    out = generate(model, prompts, gen, policy, Sampling(), stop_ids=(), pad_id=0)
    assert len(bufs) == model.config.num_layers and sum(steps) > 0
    assert out != generate(model, prompts, gen, get_policy("full"), pad_id=0)


def test_rows_independent():
    model = model_for("llama-gqa")
    prompts = rand_prompts([50, 50], seed=5)
    both = generate(model, prompts, 12, get_policy("scissorhands", budget=0.2), pad_id=0)
    alone = [generate(model, [p], 12, get_policy("scissorhands", budget=0.2), pad_id=0)[0]
             for p in prompts]
    assert both == alone


# bit-identity with `full` when nothing is evicted: tests/test_policy_matrix.py


# ------------------------------------------------------------------ bad input

def test_bad_input():
    with pytest.raises(UserError, match="unknown policy_args"):
        get_policy("scissorhands", budget=0.2, sinks=4)
    with pytest.raises(UserError, match="score"):
        get_policy("scissorhands", budget=0.2, score="value")
    with pytest.raises(UserError, match="recent"):
        get_policy("scissorhands", budget=0.2, recent=0)
    with pytest.raises(UserError, match="window"):
        get_policy("scissorhands", budget=0.2, window=0)
    with pytest.raises(UserError, match="expected a int"):
        get_policy("scissorhands", budget=0.2, window="many")
    # minimum: the recent tokens + one kept by score + scratch = 12 by default
    with pytest.raises(UserError, match="minimum of 12"):
        get_policy("scissorhands", budget=0.2).layout(40, 10)            # 10 slots
    with pytest.raises(UserError, match="minimum of 5"):
        get_policy("scissorhands", budget_tokens=4, recent=3).layout(40, 10)
    assert get_policy("scissorhands", budget=0.24).layout(40, 10).capacity == 11
