"""`cascade` (Willette et al. 2024, "Training-Free Exponential Extension of Sliding Window
Context with Cascading KV Cache"): hand-computed worked examples of Algorithm 1 on hand-made
tensors, a plain-Python Algorithm 1 reference on random traces, Eq. 4, and end-to-end invariants
through the tiny random models."""
import functools
import math
import random
import struct

import pytest
import torch

import flexevict.runtime.engine as E
import flexevict.policies.cascade  # noqa: F401  (registers the policy)
from flexevict.errors import UserError
from flexevict.runtime.generation import Sampling, generate
from flexevict.core.kv import KVBuffer
from flexevict.policies import get_policy

from tiny import model_for, rand_prompts as prompts_of

D = 2   # head dim of the hand-made buffers


# ------------------------------------------------------------------ driving the hooks by hand

def make(budget_tokens, prompt_len, gen_len, rows=1, kv_heads=None, **args):
    policy = get_policy("cascade", budget_tokens=budget_tokens, **args)
    layout = policy.layout(prompt_len, gen_len)
    buf = KVBuffer(layout, rows, D, torch.float32, "cpu", fields=policy.fields(layout))
    if kv_heads is not None:
        buf.kv_heads = kv_heads
    return policy, buf


def prefill(policy, buf, n, scores=None, valid=None):
    rows = buf.k.shape[1]
    if valid is None:
        valid = torch.ones(n, rows, dtype=torch.bool)
    pos = (valid.long().cumsum(0) - 1).clamp(min=0).to(torch.int32)
    k = torch.randn(n, rows, D)
    policy.prefill(buf, k, k.clone(), pos, valid,
                   torch.zeros(n, rows) if scores is None else scores)


def step(policy, buf, t, probs_fn=None):
    """Decode token t for every row; probs_fn(buf, slot, n) -> (rows, n) head-reduced probs."""
    rows = buf.k.shape[1]
    slot = buf.incoming_slot()
    buf.write(slot, torch.randn(rows, D), torch.randn(rows, D),
              torch.full((rows,), t, dtype=torch.int32))
    policy.before_attention(buf, slot, torch.randn(rows, 1, D))
    n = buf.attended(slot)
    probs = torch.zeros(rows, n) if probs_fn is None else probs_fn(buf, slot, n)
    policy.after_attention(buf, slot, probs.unsqueeze(1))
    return slot


def kept(buf, row=0):
    return sorted(buf.pos[buf.valid[:, row], row].tolist())


# Example A (hand-computed, Algorithm 1): S=2, |C|=8, N=4, W=2, all mu = 0, strict '>'
EXAMPLE_A = {
    4: [[3, 4], [2], [], []],
    5: [[4, 5], [2], [], []],
    8: [[7, 8], [4, 6], [2], []],
    14: [[13, 14], [10, 12], [4, 8], [2]],
    26: [[25, 26], [22, 24], [16, 20], [4, 12]],
    39: [[38, 39], [34, 36], [28, 32], [12, 20]],
}


def test_example_a_schedule_decode():
    policy, buf = make(11, 2, 38, sinks=2)
    assert buf.layout.sizes == (2, 2, 2, 2) and buf.capacity == 10
    prefill(policy, buf, 2)
    for t in range(2, 40):
        assert step(policy, buf, t) == buf.scratch
        if t in EXAMPLE_A:
            assert policy.contents(buf) == EXAMPLE_A[t], t
            assert kept(buf) == [0, 1] + sorted(sum(EXAMPLE_A[t], []))
    # attention positions at t=39 are the ranks 0..9 of these tokens
    assert kept(buf) == [0, 1, 12, 20, 28, 32, 34, 36, 38, 39]


@pytest.mark.parametrize("t", sorted(EXAMPLE_A))
def test_example_a_schedule_prefill(t):
    """Prefill inserts the prompt with the same rule: a prompt of t+1 tokens ends in the state
    Example A reaches at step t."""
    policy, buf = make(11, t + 1, 20, sinks=2)
    prefill(policy, buf, t + 1)
    assert policy.contents(buf) == EXAMPLE_A[t]
    assert buf.used == buf.capacity and kept(buf) == [0, 1] + sorted(sum(EXAMPLE_A[t], []))


def example_b_probs(scale=1.0):
    """Seed Example B: 0.6 for token 3, 0.2 for the current token, 0.1 for other cached tokens."""
    def fn(buf, slot, n):
        pos, valid = buf.pos[:n], buf.valid[:n]
        p = torch.where(valid, 0.1, 0.0)
        p[slot] = 0.2
        p = torch.where(valid & (pos == 3), 0.6, p)
        p[:2] = 0.0                                    # sinks are not scored anyway
        return (p * scale).t()
    return fn


def mu_of(buf, position, row=0):
    hit = (buf.pos[:, row] == position) & buf.valid[:, row]
    assert hit.sum() == 1
    return buf.state[hit.nonzero()[0, 0], row].item()


@pytest.mark.parametrize("tie_replace", [False, True])
def test_example_b_ema_competition(tie_replace):
    """Seed Example B: S=2, |C|=4, N=2, W=2, gamma=0.5 (scores, EMA, selection, ties)."""
    policy, buf = make(7, 2, 10, sinks=2, cascades=2, gamma=0.5, tie_replace=tie_replace)
    prefill(policy, buf, 2)
    fn = example_b_probs()
    expect = {
        2: ([[2], []], {2: .10}),
        3: ([[2, 3], []], {2: .10, 3: .30}),
        4: ([[3, 4], [2]], {3: .45, 4: .10, 2: .10}),
        5: ([[4, 5], [3]], {3: .525, 4: .10, 5: .10}),    # 3 (.45) beats newest 2 (.10)
        6: ([[5, 6], [3, 4]], {3: .5625, 4: .10}),
        # tie 5 (.10) vs 4 (.10): the seed keeps 4; the code's '>=' replaces it
        7: ([[6, 7], [3, 5] if tie_replace else [3, 4]], {3: .58125}),
        # C2 accepting and full: 6 pushed in, the oldest (3, mu .58) is discarded
        8: ([[7, 8], [5, 6] if tie_replace else [4, 6]], {}),
    }
    for t in range(2, 9):
        step(policy, buf, t, fn)
        content, mus = expect[t]
        assert policy.contents(buf) == content, t
        for p, m in mus.items():
            assert mu_of(buf, p) == pytest.approx(m, abs=1e-6), (t, p)
    assert kept(buf) == ([0, 1, 5, 6, 7, 8] if tie_replace else [0, 1, 4, 6, 7, 8])


def test_example_b_homogeneous_heads():
    """Two kv heads of one sequence see different probabilities whose mean is Example B's:
    both rows make the paper's moves and hold the same tokens and scores."""
    policy, buf = make(7, 2, 10, rows=2, kv_heads=2, sinks=2, cascades=2, gamma=0.5)
    prefill(policy, buf, 2)
    base = example_b_probs()

    def fn(buf, slot, n):
        p = base(buf, slot, n)
        return torch.stack([p[0] * 1.6, p[1] * 0.4])
    for t in range(2, 9):
        step(policy, buf, t, fn)
        assert policy.contents(buf, 0) == policy.contents(buf, 1)
        assert torch.equal(buf.state[:, 0], buf.state[:, 1])
    assert kept(buf, 0) == kept(buf, 1) == [0, 1, 4, 6, 7, 8]
    assert mu_of(buf, 4) == pytest.approx(.10 * .5 ** 2 + .10 * (1 - .5 ** 2), abs=1e-6)


def test_cascading_of_evicted_tokens():
    """Example A's cascade chain step by step: one token leaves per full step, and it is the
    one the schedule names (the loser at the first non-accepting boundary, or C4's oldest)."""
    policy, buf = make(11, 2, 60, sinks=2)
    prefill(policy, buf, 2)
    prev = set(kept(buf))
    for t in range(2, 60):
        step(policy, buf, t)
        now = set(kept(buf))
        assert t in now                                   # C1 always accepts
        assert now - prev == {t}
        left = prev - now
        assert len(left) <= 1
        c = policy.contents(buf)
        if sum(map(len, c)) == 8 and len(prev) == 10:
            assert len(left) == 1                         # full: exactly one leaves
        if (t - 2) % 8 == 0 and len(left) == 1 and len(c[3]) == 2:
            # every sub-cache accepting: the token leaving is C4's oldest before the step
            assert left.pop() < min(c[3])
        # C_{i+1} is older than C_i, each sub-cache in temporal order
        flat = [p for sub in reversed(c) for p in sub]
        assert flat == sorted(flat)
        prev = now


def test_prefill_uses_prompt_scores():
    """A prompt token's score (its EMA-weighted column sum) decides the competition at C2's
    boundary (t=5: token 3 vs newest 2) and becomes its initial mu."""
    n = 6
    for winner, loser in ((3, 2), (2, 3)):
        policy, buf = make(7, n, 4, sinks=2, cascades=2)
        scores = torch.zeros(n, 1)
        scores[winner] = 0.6
        scores[loser] = 0.1
        prefill(policy, buf, n, scores)
        assert policy.contents(buf) == [[4, 5], [winner]]
        assert kept(buf) == sorted([0, 1, winner, 4, 5])
        assert mu_of(buf, winner) == pytest.approx(0.6)


def test_prefill_rows_independent_and_left_padded():
    """Two sequences (one kv head each) with different prompt lengths: each row follows its
    own schedule, the same as alone."""
    scores = torch.rand(12, 2)
    valid = torch.ones(12, 2, dtype=torch.bool)
    valid[:5, 1] = False                                  # row 1: 7 tokens, left-padded
    policy, buf = make(11, 12, 6, rows=2, kv_heads=1, sinks=2)
    prefill(policy, buf, 12, scores, valid)
    for row, (sc, n) in enumerate(((scores[:, :1], 12), (scores[5:, 1:], 7))):
        p1, b1 = make(11, 12, 6, sinks=2)
        prefill(p1, b1, n, sc)
        assert policy.contents(buf, row) == p1.contents(b1)
    # pads are never kept: the short row holds its sinks and sub-cache tokens, nothing else
    p = kept(buf, 1)
    assert len(set(p)) == len(p) == 2 + sum(map(len, policy.contents(buf, 1)))
    assert policy.contents(buf, 0) != policy.contents(buf, 1)


# ------------------------------------------------------------------ reference: Algorithm 1

def f32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


class Reference:
    """Plain-Python Algorithm 1 for one sequence: lists of token ids, mu per token."""

    def __init__(self, sinks, sizes, gamma, tie_replace=False, eager_fill=False):
        self.S, self.sizes, self.gamma = sinks, sizes, gamma
        self.tie, self.eager = tie_replace, eager_fill
        self.sink, self.subs, self.mu = [], [[] for _ in sizes], {}

    def tokens(self):
        return self.sink + [x for s in self.subs for x in s]

    def step(self, t, s):
        """Token t attended with head-reduced probabilities s[token]; EMA, then insertion."""
        self.mu[t] = 0.0
        for x in [x for sub in self.subs for x in sub] + [t]:      # fp32, like the buffer
            self.mu[x] = f32(f32(self.gamma * self.mu[x]) + f32((1 - self.gamma) * s[x]))
        self.insert(t)

    def insert(self, t):
        if len(self.sink) < self.S:
            self.sink.append(t)
            return
        item = t
        not_full = sum(map(len, self.subs)) < sum(self.sizes)
        for i, sub in enumerate(self.subs):
            accepting = (t - self.S) % (2 ** i) == 0 or (self.eager and not_full)
            if accepting:
                sub.append(item)
                if len(sub) <= self.sizes[i]:
                    return
                item = sub.pop(0)
            else:
                if not sub:
                    sub.append(item)
                elif (self.mu[item] > self.mu[sub[-1]]
                      or (self.tie and self.mu[item] == self.mu[sub[-1]])):
                    sub[-1] = item
                return


@pytest.mark.parametrize("args", [dict(), dict(tie_replace=True), dict(eager_fill=True),
                                  dict(cascades=3, reduce="max"), dict(reduce="median")])
def test_matches_reference_on_random_traces(args):
    """Batched over 3 sequences x 2 kv heads with different prompt lengths (so different t),
    random attention, scores quantised so that ties happen: the buffer holds exactly the
    reference's tokens and scores at every step."""
    rng = random.Random(0)
    kv, lens, steps = 2, [3, 9, 5], 40
    rows = kv * len(lens)
    policy, buf = make(16, max(lens), steps, rows=rows, kv_heads=kv, sinks=3, gamma=0.5, **args)
    valid = torch.zeros(max(lens), rows, dtype=torch.bool)
    for b, n in enumerate(lens):
        valid[max(lens) - n:, b * kv:(b + 1) * kv] = True
    # the prompt is scored all-zero here; decode tokens get random quantised probabilities
    prefill(policy, buf, max(lens), torch.zeros(max(lens), rows), valid)
    red = {"mean": lambda v: sum(v) / len(v), "max": max,
           "median": lambda v: sorted(v)[(len(v) - 1) // 2]}[policy.reduce]
    refs = []
    for b, n in enumerate(lens):
        r = Reference(3, buf.layout.sizes, 0.5, policy.tie_replace, policy.eager_fill)
        for t in range(n):
            r.step(t, {x: 0.0 for x in range(t + 1)})
        refs.append(r)
    for k in range(steps):
        table = [[{x: rng.choice([0.0, 0.25, 0.5]) for x in range(n + k + 1)} for _ in range(kv)]
                 for n in lens]

        def fn(buf, slot, m):
            p = torch.zeros(rows, m)
            for row in range(rows):
                for s in range(m):
                    if buf.valid[s, row]:
                        p[row, s] = table[row // kv][row % kv][int(buf.pos[s, row])]
            return p
        rows_t = torch.tensor([n + k for n in lens]).repeat_interleave(kv)
        slot = buf.incoming_slot()
        buf.write(slot, torch.randn(rows, D), torch.randn(rows, D), rows_t.to(torch.int32))
        m = buf.attended(slot)
        policy.after_attention(buf, slot, fn(buf, slot, m).unsqueeze(1))
        for b, n in enumerate(lens):
            t = n + k
            refs[b].step(t, {x: red([table[b][h][x] for h in range(kv)]) for x in range(t + 1)})
            for h in range(kv):
                row = b * kv + h
                assert kept(buf, row) == sorted(refs[b].tokens()), (k, b, h)
                assert policy.contents(buf, row) == refs[b].subs
                for x in refs[b].tokens()[3:]:
                    assert mu_of(buf, x, row) == pytest.approx(refs[b].mu[x], abs=1e-5)


@pytest.mark.parametrize("args", [dict(), dict(tie_replace=True), dict(eager_fill=True),
                                  dict(reduce="max")])
def test_prefill_matches_reference(args):
    """Prefill of a left-padded batch (3 sequences x 2 kv heads) with random column sums: each
    row holds what Algorithm 1 keeps when the prompt tokens arrive in order with mu = their
    prompt statistic (reduced over the sequence's heads)."""
    g = torch.Generator().manual_seed(1)
    kv, lens = 2, [37, 12, 30]
    p, rows = max(lens), kv * len(lens)
    policy, buf = make(20, p, 30, rows=rows, kv_heads=kv, sinks=3, cascades=3, **args)
    valid = torch.zeros(p, rows, dtype=torch.bool)
    for b, n in enumerate(lens):
        valid[p - n:, b * kv:(b + 1) * kv] = True
    scores = (torch.randint(0, 4, (p, rows), generator=g) * 0.5).float()   # ties happen
    prefill(policy, buf, p, scores, valid)
    red = {"mean": lambda v: sum(v) / len(v), "max": max}[policy.reduce]
    for b, n in enumerate(lens):
        ref = Reference(3, buf.layout.sizes, 0.5, policy.tie_replace, policy.eager_fill)
        sc = scores[p - n:, b * kv:(b + 1) * kv]
        for t in range(n):
            ref.mu[t] = f32(red([sc[t, h].item() for h in range(kv)]))
            ref.insert(t)
        for h in range(kv):
            row = b * kv + h
            assert kept(buf, row) == sorted(ref.tokens()), (b, h)
            assert policy.contents(buf, row) == ref.subs
            for x in ref.tokens()[3:]:
                assert mu_of(buf, x, row) == pytest.approx(ref.mu[x], abs=1e-6)
    assert int(buf.valid[:, 1 * kv].sum()) < int(buf.valid[:, 0].sum())   # short row: holes


def test_prompt_scores_are_the_streamed_ema():
    """The prompt statistic folded from the prefill attention (over query blocks, left-padded
    rows) is the EMA mu <- gamma mu + (1 - gamma) s the decode path would give each prompt token
    had the prompt been streamed one query at a time with full attention (GQA: summed over the
    group)."""
    from flexevict.core import kernels
    g = torch.Generator().manual_seed(5)
    policy = get_policy("cascade", budget_tokens=45)
    layout = policy.layout(60, 30)
    gamma = layout.gamma
    assert 0.5 < gamma < 1
    b, h, hk, s, d = 2, 4, 2, 11, 8
    q, k, v = (torch.randn(b, n, s, d, generator=g) for n in (h, hk, hk))
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[1, :4] = False
    _, stat = kernels.prefill_attention_scores(
        q, k, v, valid, d ** -0.5, fold=functools.partial(policy.prompt_scores, layout), block=3)
    for bi in range(b):
        for kh in range(hk):
            mu = torch.zeros(s, dtype=torch.float64)
            for qi in range(s):                 # stream the real queries one at a time
                if not valid[bi, qi]:
                    continue
                seen = valid[bi, :qi + 1]
                a = torch.zeros(s, dtype=torch.float64)
                for qh in range(kh * h // hk, (kh + 1) * h // hk):
                    logits = (k[bi, kh, :qi + 1][seen] @ q[bi, qh, qi]).double() * d ** -0.5
                    a[:qi + 1][seen] += logits.softmax(-1)
                mu = gamma * mu + (1 - gamma) * a
            torch.testing.assert_close(stat[bi, kh].double(), mu, rtol=1e-5, atol=1e-7)
    assert stat[1, :, :4].abs().max() == 0                 # pad keys get nothing


def test_eq4_approximate_context():
    """Eq. 4: after many tokens the span of retained indices is |C|/N (2^N - 1), within 2^N."""
    for n_casc, w in ((1, 12), (2, 6), (4, 4), (3, 5)):
        s = 4
        slots = s + n_casc * w + 1
        policy, buf = make(slots, 1500, 10, sinks=s, cascades=n_casc)
        prefill(policy, buf, 1500)
        window = sorted(kept(buf))[s:]
        span = window[-1] - window[0] + 1
        assert policy.describe(buf.layout)["approx_context"] == w * (2 ** n_casc - 1)
        assert abs(span - w * (2 ** n_casc - 1)) <= 2 ** n_casc, (n_casc, span)


def test_budget_split_and_gamma():
    policy = get_policy("cascade", budget_tokens=4 + 4 * 25 + 3 + 1)
    layout = policy.layout(500, 100)
    assert layout.sizes == (28, 25, 25, 25)             # the remainder goes to C_1
    assert layout.gamma == pytest.approx(math.exp(-4 * math.log(100) / 103))
    # App. B / Table 6: |C|/N = 2048/4 -> 0.991, 4096/4 -> 0.995
    for window, g in ((2048, 0.991), (4096, 0.995)):
        p = get_policy("cascade", budget_tokens=4 + window + 1)
        lay = p.layout(10 ** 5, 1)
        assert math.floor(lay.gamma * 1000) / 1000 == g   # printed truncated
    assert get_policy("cascade").minimum_slots() == 9


# ------------------------------------------------------------------ end to end (tiny models)



def traced(monkeypatch, model, prompts, n_new, policy, check=None):
    """generate() with the buffers recorded (kv_heads set, as the engine should) and `check`
    called after every after_attention; -> (outputs, buffers, per-step logits)."""
    bufs, logits = [], []
    real_alloc = E.allocate

    def alloc(*a):
        out = real_alloc(*a)
        for b in out:
            b.kv_heads = model.config.num_kv_heads
        bufs.extend(out)
        return out
    monkeypatch.setattr(E, "allocate", alloc)
    real_after = type(policy).after_attention

    def after(self, buf, slot, probs, scored=False):
        real_after(self, buf, slot, probs, scored)
        if check:
            check(buf)
    monkeypatch.setattr(type(policy), "after_attention", after)   # policies are frozen
    monkeypatch.setattr(E.Engine, "stack_layers", False)          # each layer checked as it commits
    real_head = model.head
    monkeypatch.setattr(model, "head",
                        lambda h, o=None: logits.append(real_head(h, o)) or logits[-1])
    out = generate(model, prompts, n_new, policy, Sampling(), stop_ids=(), pad_id=0)
    return out, bufs, logits


@pytest.mark.parametrize("key", ["llama-gqa", "opt"])
def test_invariants_end_to_end(monkeypatch, key):
    model = model_for(key)
    kv = model.config.num_kv_heads
    lengths, n_new = [40, 23], 40
    prompts = prompts_of(lengths, seed=1)
    policy = get_policy("cascade", budget=0.2)
    seen_steps = []

    def check(buf):
        slots = buf.layout.slots
        w0 = buf.layout.sizes[0]
        for b, n in enumerate(lengths):
            rows_pos = [kept(buf, b * kv + h) for h in range(kv)]
            assert all(r == rows_pos[0] for r in rows_pos)     # one decision for all heads
            p = rows_pos[0]
            assert len(p) <= slots - 1 and len(set(p)) == len(p)
            t = max(p)
            assert all(0 <= x <= t for x in p)
            assert set(range(min(policy.sinks, t + 1))) <= set(p)           # sinks
            assert set(range(max(t - w0 + 1, 0), t + 1)) <= set(p)         # C_1 window
            flat = [x for sub in reversed(policy.contents(buf, b * kv)) for x in sub]
            assert flat == sorted(flat) and sorted(flat + list(range(policy.sinks))) == p
        seen_steps.append(1)

    out, bufs, _ = traced(monkeypatch, model, prompts, n_new, policy, check)
    lay = bufs[0].layout                                   # the run's resolved layout
    assert lay.evicts and lay.slots == int(0.2 * (40 + n_new))
    assert len(seen_steps) == (n_new - 1) * model.config.num_layers
    for buf in bufs:
        assert int(buf.valid.sum(0).max()) <= lay.slots - 1
        for b, n in enumerate(lengths):
            assert max(kept(buf, b * kv)) == n + n_new - 2           # the last fed token
    # the cache really cascades: older tokens than a plain window of the same size survive
    p = kept(bufs[0], 0)
    assert min(p[policy.sinks:]) < 40 + n_new - 2 - (lay.slots - 1 - policy.sinks)


@pytest.mark.parametrize("key", ["llama-gqa", "opt"])
def test_batch_rows_independent(key):
    model = model_for(key)
    prompts = prompts_of([30, 30], seed=2)
    def run(ps):
        return generate(model, ps, 30, get_policy("cascade", budget=0.2), Sampling(),
                        stop_ids=(), pad_id=0)
    both = run(prompts)
    assert both == [run([p])[0] for p in prompts]
    assert len({t for o in both for t in o}) > 5


@pytest.mark.parametrize("key", ["llama-gqa", "opt"])
@pytest.mark.parametrize("budget", [dict(budget=1.0), dict(budget_tokens=70),
                                    dict(budget_tokens=500)])
def test_full_budget_bit_identical(monkeypatch, key, budget):
    model = model_for(key)
    prompts = prompts_of([25, 13], seed=3)
    ref, _, ref_logits = traced(monkeypatch, model, prompts, 20, get_policy("full"))
    monkeypatch.undo()
    policy = get_policy("cascade", **budget)
    out, bufs, logits = traced(monkeypatch, model, prompts, 20, policy)
    assert not bufs[0].layout.evicts                      # the run's resolved layout
    assert out == ref and len(logits) == len(ref_logits) == 20
    assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits))


def test_one_cascade_is_streaming(monkeypatch):
    """N = 1 is the Sink Cache (Sec. 3.1): the same kept tokens as `streaming` at every step."""
    model = model_for("llama-gqa")
    prompts = prompts_of([30], seed=4)
    sets = {}
    for name, args in (("streaming", {}), ("cascade", {"cascades": 1})):
        policy = get_policy(name, budget_tokens=16, **args)
        trace = sets[name] = []
        _, _, logits = traced(monkeypatch, model, prompts, 20, policy,
                              lambda buf, trace=trace: trace.append(kept(buf)))
        trace.append(logits)
        monkeypatch.undo()
    assert sets["cascade"][:-1] == sets["streaming"][:-1]
    for a, b in zip(sets["cascade"][-1], sets["streaming"][-1]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


# ------------------------------------------------------------------ bad input

def test_bad_input():
    with pytest.raises(UserError, match="unknown policy_args"):
        get_policy("cascade", budget=0.5, window=3)
    with pytest.raises(UserError, match="minimum of 9"):
        get_policy("cascade", budget_tokens=8).layout(100, 10)
    with pytest.raises(UserError, match="minimum of 7"):
        get_policy("cascade", budget_tokens=6, sinks=2, cascades=4).layout(100, 10)
    get_policy("cascade", budget_tokens=7, sinks=2, cascades=4).layout(100, 10)
    with pytest.raises(UserError, match="minimum"):
        get_policy("cascade", budget=0.05).layout(100, 60)
    for bad in (dict(reduce="sum"), dict(cascades="0"), dict(sinks=-1), dict(gamma=1.5),
                dict(cascades="x")):
        with pytest.raises(UserError):
            get_policy("cascade", budget=0.5, **bad)


def stepwise_insertion(policy, lay, proxy, n_real):
    """The prompt insertion as it was before it was batched: Algorithm 1 token by token on
    index maps (the bit-identity reference of `Cascade._insert_prompt`)."""
    p, rows = proxy.shape
    cap = sc = lay.capacity
    plan, _ = policy._schedule(lay, p)
    held = torch.full((cap + 1, rows), -1, dtype=torch.int64)
    mu = torch.zeros(cap + 1, rows)
    ridx = torch.arange(rows)
    for i, (src, dst, cmp) in enumerate(plan):
        if cmp is not None:
            src, dst = src + [cmp[0]], dst + [cmp[1]]
        s_t, d_t = (torch.tensor(x, dtype=torch.int64).unsqueeze(1) for x in (src, dst))
        held[sc], mu[sc] = i, proxy[i]
        move = torch.ones(s_t.shape[0], rows, dtype=torch.bool)
        if cmp is not None:
            a, b = mu[cmp[0]], mu[cmp[1]]
            move[-1] = a >= b if policy.tie_replace else a > b
        move &= (i < n_real).expand(s_t.shape[0], rows)
        s_t, d_t = torch.where(move, s_t, sc), torch.where(move, d_t, sc)
        held[d_t, ridx] = held[s_t, ridx]
        mu[d_t, ridx] = mu[s_t, ridx]
    return held[:cap]


@pytest.mark.parametrize("args", [{}, {"tie_replace": True}, {"eager_fill": True},
                                  {"cascades": 2, "tie_replace": True, "eager_fill": True}])
def test_batched_insertion_is_bit_identical_to_token_by_token(args):
    """Ranges and one argmax keep exactly the tokens the token-by-token insertion kept, with
    many ties (scores from 4 values), rows of different lengths and a row shorter than the
    window."""
    gen = torch.Generator().manual_seed(len(args))
    policy = get_policy("cascade", budget_tokens=30, **args)
    p, rows = 120, 6
    lay = policy.layout(p, 40)
    proxy = torch.randint(0, 4, (p, rows), generator=gen).float()
    n_real = torch.tensor([120, 120, 97, 64, 33, 12])
    want = stepwise_insertion(policy, lay, proxy, n_real)
    got = policy._insert_prompt(lay, proxy, n_real)
    assert torch.equal(got, want)
    assert (want >= 0).sum() > 0 and len(set(want[:, 0].tolist())) > 20   # not degenerate
