"""HashEvict (policies/hashevict.py): hand-computed worked examples of Algorithm 1,
hashing and Hamming distances, the decode and prefill rules against a plain-Python reference of
the paper's Algorithm 1, and end-to-end invariants through a tiny random model."""
import math

import pytest
import torch

import flexevict.runtime.engine as E
import flexevict.core.model
import flexevict.policies.hashevict  # noqa: F401  (registers "hashevict")
from flexevict.errors import UserError
from flexevict.runtime.generation import Sampling, generate
from flexevict.core.kv import KVBuffer
from flexevict.core import kernels
from flexevict.policies import get_policy
from flexevict.core.kernels import hamming, hash_codes, popcount
from flexevict.policies.hashevict import projection

from tiny import CONFIGS as CFGS, model_for, rand_prompts as prompts

NAME = "hashevict"


# ------------------------------------------------------------------------------ helpers

def make(slots, prompt_len, gen_len, rows=1, d=4, **args):
    policy = get_policy(NAME, budget_tokens=slots, **args)
    layout = policy.layout(prompt_len, gen_len)
    return policy, KVBuffer(layout, rows, d, torch.float32, "cpu", fields=policy.fields(layout))


def prefill(policy, buf, k, pos=None, q=None, valid=None):
    """k (S, rows, d); pos (S,) or (S, rows)."""
    s, rows, _ = k.shape
    if pos is None:
        pos = torch.arange(s)
    pos = torch.as_tensor(pos, dtype=torch.int32)
    if pos.dim() == 1:
        pos = pos.unsqueeze(1).expand(s, rows)
    if valid is None:
        valid = torch.ones(s, rows, dtype=torch.bool)
    policy.prefill(buf, k, k.clone(), pos.contiguous(), valid, None, q=q)


def decode(policy, buf, k, pos, q, check=None):
    """One step: k (rows, d), pos int or (rows,), q (rows, g, d). `check(buf, slot)` runs
    between the hooks (after the victim is masked, before attention)."""
    rows = k.shape[0]
    slot = buf.incoming_slot()
    buf.write(slot, k, k.clone(), torch.as_tensor(pos, dtype=torch.int32).expand(rows))
    policy.before_attention(buf, slot, q)
    if check is not None:
        check(buf, slot)
    n = buf.attended(slot)
    _, probs = flexevict.core.model.attend(q, buf, n, q.shape[-1] ** -0.5)
    policy.after_attention(buf, slot, probs)


def kept(buf, row=0):
    c = buf.capacity
    return sorted(buf.pos[:c, row][buf.valid[:c, row]].tolist())


def signs(*patterns):
    """'+-+-' strings -> (n, d) float vectors of +-1."""
    return torch.tensor([[1.0 if ch == "+" else -1.0 for ch in p] for p in patterns])


def bits(x, proj):
    return (x.float() @ proj.t()) >= 0


def check_codes(policy, buf):
    """Every valid committed slot stores the code of the key it holds (codes move with keys)."""
    c = buf.capacity
    want = hash_codes(buf.k[:c], policy._proj(buf))
    got = policy._get(buf, slice(0, c))
    assert torch.equal(got[buf.valid[:c]], want[buf.valid[:c]])


def reference(kb, qb, n, cap, sinks, recent):
    """Algorithm 1 for one row in plain Python (the paper's Algorithm 1 and Sec. 3).

    kb (N, c) bool key bits, qb (N, g, c) bool query bits; the first `cap` tokens fill the
    cache, then each token t evicts, among cached positions p with sinks <= p < t - recent,
    the one with the largest summed Hamming distance to its query heads (ties: smallest p).
    -> list of the kept positions after each token (index t - cap)."""
    cache, trace = list(range(min(n, cap))), []
    for t in range(cap, n):
        cands = [p for p in cache if sinks <= p < t - recent]
        dist = {p: int((qb[t] != kb[p]).sum()) for p in cands}
        cache.remove(max(cands, key=lambda p: (dist[p], -p)))
        cache.append(t)
        trace.append(sorted(cache))
    return trace


# ------------------------------------------------------------------------------ hashing

R_A = torch.tensor([[1.0, 0, 0, 1], [0, 1, -1, 0], [1, -1, 0, 0]])   # example (a)
Q_A = torch.tensor([1.0, 1, 0, 1])
K_A = torch.tensor([[1.0, 2, 0, 0], [-1, 0, 1, 0], [0, 0, 0, -1]])


def test_worked_example_a_hash_bits_and_distances():
    # h(q) = 111 (0 >= 0 gives 1), h(k1) = 110, h(k2) = 000, h(k3) = 011; bit j -> 2**j
    assert hash_codes(Q_A, R_A).tolist() == [0b111]
    assert hash_codes(K_A, R_A)[:, 0].tolist() == [0b011, 0b000, 0b110]
    d = hamming(hash_codes(Q_A, R_A).view(1, 1, 1), hash_codes(K_A, R_A).unsqueeze(1))
    assert d[:, 0].tolist() == [1, 3, 1]
    assert (K_A @ Q_A).tolist() == [3, -1, -1]          # k3: dissimilar but a close code


def test_pack_and_popcount_against_python():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 2 ** 32, (1000,), generator=g, dtype=torch.int64)
    assert popcount(x).tolist() == [bin(v).count("1") for v in x.tolist()]
    assert popcount(torch.tensor([0, 2 ** 32 - 1])).tolist() == [0, 32]
    short = (x & 0xFFFF).to(torch.int32)             # codes of <= 16 bits: one table lookup
    assert popcount(short, 16).tolist() == [bin(v).count("1") for v in short.tolist()]
    assert popcount(torch.tensor([2 ** 16 - 1]), 16).tolist() == [16]
    # 70 bits -> 3 words of 32; the packed words reproduce the sign bits
    proj = projection(70, 16, seed=3)
    v = torch.randn(5, 16, generator=g)
    words = hash_codes(v, proj)
    assert words.shape == (5, 3) and words.dtype == torch.int64
    b = bits(v, proj)
    for i in range(5):
        ints = [sum(int(b[i, j]) << (j - 32 * w) for j in range(32 * w, min(70, 32 * w + 32)))
                for w in range(3)]
        assert words[i].tolist() == ints
    # distance = number of differing sign bits, summed over words
    assert hamming(words[:1].unsqueeze(1), words.unsqueeze(1))[:, 0].tolist() == \
        [int((b[0] != b[i]).sum()) for i in range(5)]


def test_lsh_estimator_matches_angle():
    """Eq. 3: E[d_H] / c = theta / pi (SimHash's angle property, c = 4096, d = 128)."""
    g = torch.Generator().manual_seed(1)
    proj = projection(4096, 128, seed=7)
    x, y = torch.randn(2, 20, 128, generator=g)
    y = 0.8 * x + 0.6 * y                                     # angles well inside (0, pi/2)
    theta = torch.arccos(torch.nn.functional.cosine_similarity(x, y)) / math.pi
    dh = hamming(hash_codes(x, proj).unsqueeze(1), hash_codes(y, proj).unsqueeze(1)).diagonal()
    est = dh.float() / 4096
    assert (est - theta).abs().max() < 0.04
    assert abs((est - theta).mean()) < 0.01
    # scale invariance: no normalisation needed
    assert torch.equal(hash_codes(3.5 * x, proj), hash_codes(x, proj))


def test_projection_is_seeded_per_layer():
    a = projection(16, 8, seed=0, layer=0)
    assert torch.equal(a, projection(16, 8, seed=0, layer=0))
    assert not torch.equal(a, projection(16, 8, seed=1, layer=0))
    assert not torch.equal(a, projection(16, 8, seed=0, layer=1))
    policy, buf = make(20, 20, 5, d=8, seed=5)
    buf.layer = 2
    prefill(policy, buf, torch.randn(20, 1, 8))
    assert torch.equal(policy._proj(buf), projection(16, 8, seed=5, layer=2))


# ------------------------------------------------------------------------------ worked examples

def test_worked_example_a_victim():
    """§1.8(a) through the hooks: no sinks, no recent window; k2 is evicted before attention."""
    policy, buf = make(4, 3, 2, sinks=0, recent=0, hash_bits=3)
    assert (buf.capacity, buf.layout.prefix, buf.layout.ring) == (3, 2, 1)
    buf.constants[("hash_proj", "cpu")] = R_A
    prefill(policy, buf, K_A.unsqueeze(1))
    assert kept(buf) == [0, 1, 2]
    assert policy._get(buf, slice(0, 3))[:, 0, 0].tolist() == [0b011, 0b000, 0b110]
    k_new = torch.tensor([[0.0, 1, 1, 1]])

    def masked(buf, slot):
        assert slot == buf.scratch
        assert buf.valid[:4, 0].tolist() == [True, False, True, True]   # k2 out, new token in

    decode(policy, buf, k_new, 3, Q_A.view(1, 1, 4), masked)
    assert buf.pos[:3, 0].tolist() == [0, 2, 3]       # k3 left the ring into k2's slot
    check_codes(policy, buf)


def _example_b_keys():
    # q = all +; key j has as many '-' signs as its distance [3, 2, 5, 5, 4, 1] (R = identity)
    return signs("---+++++", "--++++++", "-----+++", "-----+++", "----++++", "-+++++++")


def test_worked_example_b_budgeted_step():
    """§1.8(b): C=6 with 1 sink and 2 recent protected; positions [0,3,5,7,8,9], t=10,
    distances [3,2,5,5,4,1]: candidates 3, 5, 7 (2, 5, 5), tie -> oldest: position 5 goes."""
    policy, buf = make(7, 6, 8, d=8, sinks=1, recent=2, hash_bits=8)
    assert (buf.capacity, buf.layout.prefix, buf.layout.ring) == (6, 3, 3)
    buf.constants[("hash_proj", "cpu")] = torch.eye(8)
    prefill(policy, buf, _example_b_keys().unsqueeze(1), pos=[0, 3, 5, 7, 8, 9])
    assert buf.pos[:6, 0].tolist() == [0, 3, 5, 7, 8, 9]
    q = torch.ones(1, 1, 8)
    assert hamming(hash_codes(q[0], policy._proj(buf)),
                   policy._get(buf, slice(0, 6)))[:, 0].tolist() == [3, 2, 5, 5, 4, 1]
    seen = {}

    def masked(buf, slot):
        seen["valid"] = buf.valid[:7, 0].tolist()
        seen["victim"] = buf.policy_state["victims"].tolist()

    decode(policy, buf, torch.ones(1, 8), 10, q, masked)
    assert seen == {"victim": [2], "valid": [True, True, False, True, True, True, True]}
    assert kept(buf) == [0, 3, 7, 8, 9, 10]
    assert buf.pos[:6, 0].tolist() == [0, 3, 7, 10, 8, 9]
    check_codes(policy, buf)


def test_ties_go_to_oldest_not_lowest_slot_and_protected_tokens_stay():
    """After a commit the slot order is no longer the position order: a tie between slot 1
    (position 7) and slot 2 (position 5) evicts position 5. The sink and the recent tokens carry
    the largest distance (all signs flipped) and are never evicted."""
    policy, buf = make(7, 6, 8, d=8, sinks=1, recent=2, hash_bits=8)
    buf.constants[("hash_proj", "cpu")] = torch.eye(8)
    keys = signs("--------", "--------", "----++++", "----++++", "++++++++", "--------")
    prefill(policy, buf, keys.unsqueeze(1), pos=[0, 3, 5, 7, 8, 9])
    q = torch.ones(1, 1, 8)
    # t=10: candidates 3 (8), 5 (4), 7 (4) -> position 3; the sink (8) and 9 (8) are protected
    decode(policy, buf, -torch.ones(1, 8), 10, q)
    assert buf.pos[:6, 0].tolist() == [0, 7, 5, 10, 8, 9]
    # t=11: candidates 7 (slot 1, 4), 5 (slot 2, 4), 8 (cursor, 0); 0, 9 and 10 (8) protected
    decode(policy, buf, torch.ones(1, 8), 11, q)
    assert buf.pos[:6, 0].tolist() == [0, 7, 8, 10, 11, 9]
    assert kept(buf) == [0, 7, 8, 9, 10, 11]
    check_codes(policy, buf)


def test_gqa_sums_distances_over_query_heads():
    """Seed §5.3: per kv head, the sum over its query heads. Here head 0 alone would evict k1,
    head 1 alone k0, the max over heads k0, the mean query k1; the sums (3, 3, 5) evict k2."""
    policy, buf = make(4, 3, 2, d=4, sinks=0, recent=0, hash_bits=4)
    buf.constants[("hash_proj", "cpu")] = torch.eye(4)
    prefill(policy, buf, signs("+--+", "----", "++--").unsqueeze(1))
    q = signs("+--+", "--+-").unsqueeze(0)                    # (rows=1, group=2, d)
    assert hamming(hash_codes(q[0], policy._proj(buf)),
                   policy._get(buf, slice(0, 3)))[:, 0].tolist() == [3, 3, 5]
    decode(policy, buf, torch.ones(1, 4), 3, q)
    assert kept(buf) == [0, 1, 3]


# ------------------------------------------------------------------------------ rule vs reference

def _random_run(rows=3, g=2, d=8, n=40, cap_slots=19, **args):
    gen = torch.Generator().manual_seed(11)
    k = torch.randn(n, rows, d, generator=gen)
    q = torch.randn(n, rows, g, d, generator=gen)
    policy, buf = make(cap_slots, n, 4, rows=rows, d=d, **args)
    return policy, buf, k, q


@pytest.mark.parametrize("args", [{"hash_bits": 6}, {"hash_bits": 40},
                                  {"hash_bits": 6, "hash_source": "key"}])
def test_decode_steps_match_reference(args):
    """Prefill C tokens, then decode token by token through the hooks: the kept set after every
    step equals plain Algorithm 1, the victim is masked before attention (zero probability,
    output = attention over the kept set), and every stored code is its key's code. c = 6 makes
    ties frequent; c = 40 exercises the buf.hash storage."""
    policy, buf, k, q = _random_run(**args)
    cap, n, rows = buf.capacity, k.shape[0], k.shape[1]
    sinks, recent = policy.sinks, policy.recent
    prefill(policy, buf, k[:cap])
    proj = policy._proj(buf)
    kb = bits(k, proj)
    qb = bits(q, proj) if args.get("hash_source", "query") == "query" else kb.unsqueeze(2)
    refs = [reference(kb[:, r], qb[:, r], n, cap, sinks, recent) for r in range(rows)]

    def pre_attention(buf, slot):
        n_att = buf.attended(slot)
        out, p = flexevict.core.model.attend(q_t, buf, n_att, 0.5)
        victims = buf.policy_state["victims"]
        assert (p[buf.rows_index, :, victims] == 0).all()
        for r in range(rows):
            keep = buf.valid[:n_att, r]
            ref = torch.softmax(q_t[r] @ buf.k[:n_att, r][keep].t() * 0.5, dim=-1) \
                @ buf.v[:n_att, r][keep]
            torch.testing.assert_close(out[r], ref)

    for t in range(cap, n):
        q_t = q[t]
        decode(policy, buf, k[t], t, q_t, pre_attention)
        for r in range(rows):
            assert kept(buf, r) == refs[r][t - cap]
        check_codes(policy, buf)
    assert any(refs[0][i] != list(range(refs[0][i][-1] - cap + 1, refs[0][i][-1] + 1))
               for i in range(len(refs[0])))     # not a plain sliding window


def test_replay_prefill_equals_sequential_decisions():
    """Seed §5.9(b): replaying Algorithm 1 over the prompt with its query/key codes keeps the
    same tokens as feeding the prompt token by token through the decode hooks, and both equal
    the reference; the layout is sinks, candidates, then the ring oldest-first at the cursor."""
    policy, buf, k, q = _random_run(hash_bits=6)
    cap, n, rows = buf.capacity, k.shape[0], k.shape[1]
    prefill(policy, buf, k, q=q)
    policy2, buf2 = make(19, n, 4, rows=rows, d=8, hash_bits=6)
    prefill(policy2, buf2, k[:cap])
    for t in range(cap, n):
        decode(policy2, buf2, k[t], t, q[t])
    kb, qb = bits(k, policy._proj(buf)), bits(q, policy._proj(buf))
    for r in range(rows):
        want = reference(kb[:, r], qb[:, r], n, cap, 4, 10)[-1]
        assert kept(buf, r) == kept(buf2, r) == want
        stored = buf.pos[:cap, r].tolist()
        assert stored[:4] == [0, 1, 2, 3]
        assert stored[buf.layout.prefix:] == list(range(n - 11, n))  # ring, oldest at cursor
        assert stored[4:buf.layout.prefix] == sorted(stored[4:buf.layout.prefix])
        assert torch.equal(buf.k[:cap, r][buf.valid[:cap, r]],
                           k[buf.pos[:cap, r][buf.valid[:cap, r]].long(), r])
    assert buf.cursor == buf.ring_start == buf.layout.prefix and buf.used == cap
    check_codes(policy, buf)


def test_replay_with_padding_and_short_rows():
    """Left-padded rows of different lengths: each row is replayed over its own tokens; a row
    shorter than the cache keeps everything (holes invalid) with its ring right-aligned."""
    gen = torch.Generator().manual_seed(5)
    n, rows, g, d, slots = 40, 3, 2, 8, 19
    lens = [40, 31, 9]
    k = torch.randn(n, rows, d, generator=gen)
    q = torch.randn(n, rows, g, d, generator=gen)
    valid = torch.zeros(n, rows, dtype=torch.bool)
    pos = torch.zeros(n, rows, dtype=torch.int32)
    for r, m in enumerate(lens):
        valid[n - m:, r] = True
        pos[n - m:, r] = torch.arange(m, dtype=torch.int32)
    policy, buf = make(slots, n, 4, rows=rows, d=d, hash_bits=6)
    prefill(policy, buf, k, pos=pos, q=q, valid=valid)
    cap = buf.capacity
    for r, m in enumerate(lens):
        kb, qb = bits(k[n - m:, r], policy._proj(buf)), bits(q[n - m:, r], policy._proj(buf))
        want = reference(kb, qb, m, cap, 4, 10)[-1] if m > cap else list(range(m))
        assert kept(buf, r) == want
    short = buf.pos[:cap, 2].tolist()
    assert short[:4] == [0, 1, 2, 3] and short[-5:] == [4, 5, 6, 7, 8]
    assert not buf.valid[4:cap - 5, 2].any()
    check_codes(policy, buf)
    # decoding fills the short row's holes before evicting anything
    for t in range(9, 9 + cap - 9):
        decode(policy, buf, k[0], torch.tensor([40 + t - 9, 31 + t - 9, t]), q[0])
    assert kept(buf, 2) == list(range(cap))


def test_prefill_recent_global():
    policy, buf, k, q = _random_run(hash_bits=6, prompt_pool="recent_global")
    prefill(policy, buf, k, q=q)
    assert kept(buf, 1) == [0, 1, 2, 3] + list(range(40 - 14, 40))


# ------------------------------------------------------------------------------ end to end

_ALLOCATE = E.allocate



def traced_generate(monkeypatch, model, ps, gen_len, policy):
    """generate() that checks every step's buffers; -> (outputs, buffers, steps seen).
    Policies are frozen: the hooks are wrapped on the class, for this call only."""
    bufs, steps = [], []
    cls = type(policy)
    after, pre = cls.after_attention, cls.prefill
    sinks, recent = policy.sinks, policy.recent

    def on_prefill(self, buf, k, v, pos, valid, scores=None, **kw):
        assert scores is None                      # no attention column sums
        pre(self, buf, k, v, pos, valid, scores, **kw)
        check(buf, (valid.sum(0) - 1).tolist())   # each row's last prompt token

    def on_after(self, buf, slot, probs, scored=False):
        if slot == buf.scratch:                    # the victim got no attention
            assert (probs[buf.rows_index, :, buf.policy_state["victims"]] == 0).all()
        t = buf.pos[slot].tolist()                 # each row's new token
        after(self, buf, slot, probs, scored)
        check(buf, t)
        steps.append(t)

    def check(buf, ts):
        assert int(buf.valid.sum(0).max()) <= buf.layout.slots
        for r, t in enumerate(ts):
            p = buf.pos[buf.valid[:, r], r].tolist()
            assert len(p) == len(set(p)) and all(0 <= x <= t for x in p)
            assert set(range(min(sinks, t + 1))) <= set(p)                 # sinks
            assert set(range(max(t - recent, 0), t + 1)) <= set(p)         # recent + new

    with monkeypatch.context() as m:
        m.setattr(E, "allocate", lambda *a: bufs.extend(_ALLOCATE(*a)) or bufs)
        m.setattr(cls, "prefill", on_prefill)
        m.setattr(cls, "after_attention", on_after)
        out = generate(model, ps, gen_len, policy, Sampling(), stop_ids=(), pad_id=0)
    return out, bufs, steps


@pytest.mark.parametrize("key", list(CFGS))
def test_invariants_on_random_traces(monkeypatch, key):
    model = model_for(key)
    policy = get_policy(NAME, budget=0.2)
    ps = prompts([80], seed=1)
    out, bufs, steps = traced_generate(monkeypatch, model, ps, 40, policy)
    assert all(buf.layout.evicts and buf.layout.slots == 24 for buf in bufs)
    assert len(steps) == 39 * len(bufs) and len(out[0]) == 40
    # the kept set is not a sinks + sliding window set: older middle tokens survived
    c, last = bufs[0].capacity, 80 + 38
    for buf in bufs:
        for r in range(buf.valid.shape[1]):
            p = buf.pos[:c, r][buf.valid[:c, r]]
            assert len(p) == c and ((p >= 4) & (p <= last - (c - 4))).any()


@pytest.mark.parametrize("lengths", [[50, 50], [50, 37]])
def test_rows_independent(monkeypatch, lengths):
    """A batch gives each sequence the same tokens and the same kept positions as alone
    (fixed slot count, so the budget does not depend on the batch's padded length)."""
    model = model_for("llama-gqa")
    ps = prompts(lengths, seed=2)
    out, bufs, _ = traced_generate(monkeypatch, model, ps, 20, get_policy(NAME, budget_tokens=30))
    nk = model.config.num_kv_heads
    for b, p in enumerate(ps):
        with monkeypatch.context() as m:
            alone, abufs, _ = traced_generate(m, model, [p], 20, get_policy(NAME, budget_tokens=30))
        assert out[b] == alone[0]
        for buf, abuf in zip(bufs, abufs):
            for h in range(nk):
                assert kept(buf, b * nk + h) == kept(abuf, h)


@pytest.mark.parametrize("key", list(CFGS))
@pytest.mark.parametrize("budget,lengths,gen", [
    ({"budget": 1.0}, [30, 22], 12), ({"budget_tokens": 64}, [30, 22], 12),
    ({"budget_tokens": 64}, [6, 4], 5)])          # 11 tokens: fewer than the minimum slots
def test_full_budget_bit_identical(monkeypatch, key, budget, lengths, gen):
    model = model_for(key)
    ps = prompts(lengths, seed=3)

    def logits(policy, bufs=None):
        seen = []
        real = model.head
        with monkeypatch.context() as m:
            m.setattr(model, "head", lambda h, o=None: seen.append(real(h, o)) or seen[-1])
            if bufs is not None:
                m.setattr(E, "allocate", lambda *a: bufs.extend(_ALLOCATE(*a)) or bufs)
            generate(model, ps, gen, policy, Sampling(), stop_ids=(), pad_id=0)
        return seen

    pol, bufs = get_policy(NAME, **budget), []
    got, want = logits(pol, bufs), logits(get_policy("full"))
    assert bufs and not any(buf.layout.evicts for buf in bufs)       # the run's layout
    assert len(got) == len(want) == gen
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_prefill_is_attention_free():
    policy = get_policy(NAME, budget=0.2)
    layout = policy.layout(400, 100)
    assert layout.evicts and not policy.wants_prompt_scores(layout)
    assert get_policy("h2o", budget=0.2).needs_prompt_scores


# ------------------------------------------------------------------------------ bad input

def test_bad_input():
    with pytest.raises(UserError, match="unknown policy_args"):
        get_policy(NAME, budget=0.5, window=3)
    with pytest.raises(UserError, match="minimum of 17"):
        get_policy(NAME, budget_tokens=16).layout(100, 10)
    with pytest.raises(UserError, match="minimum of 9"):
        get_policy(NAME, budget_tokens=8, sinks=2, recent=4).layout(100, 10)
    get_policy(NAME, budget_tokens=17).layout(100, 10)
    with pytest.raises(UserError, match="hash_source"):
        get_policy(NAME, budget=0.5, hash_source="value")
    with pytest.raises(UserError, match="prompt_pool"):               # was `prefill`
        get_policy(NAME, budget=0.5, prompt_pool="sequential")
    with pytest.raises(UserError, match="hash_bits"):
        get_policy(NAME, budget=0.5, hash_bits="0")
    with pytest.raises(UserError, match="expected a int"):
        get_policy(NAME, budget=0.5, hash_bits="many")
    assert get_policy(NAME, budget=0.5, hash_bits="8").hash_bits == 8


def stepwise_replay(pool, kh, qh, n_real, s, capacity, ring):
    """The replay as it was before its keys came from one GEMM: each step's distances by
    popcount over the pool's codes (the bit-identity reference of `HashEvict._replay`)."""
    from flexevict.core.kernels import hamming, popcount
    rows = torch.arange(pool.shape[1])
    big = s + 1
    pool_h = kh.gather(0, pool.clamp(min=0).unsqueeze(-1).expand(-1, -1, kh.shape[-1]))
    ts = torch.arange(capacity, s)
    d_arr = popcount(qh[capacity:] ^ kh[capacity - ring:s - ring].unsqueeze(2)).sum((-1, -2))
    key_arr = d_arr * big + (s - (ts - ring)).unsqueeze(1)
    for i, t in enumerate(range(capacity, s)):
        a = t - ring
        key = hamming(qh[t], pool_h) * big + (s - pool)
        best, slot = key.max(dim=0)
        evict = (best > key_arr[i]) & (t < n_real)
        pool[slot, rows] = torch.where(evict, a, pool[slot, rows])
        pool_h[slot, rows] = torch.where(evict.unsqueeze(-1), kh[a], pool_h[slot, rows])
    return pool


@pytest.mark.parametrize("bits_, source, g", [(6, "query", 3), (16, "query", 1),
                                              (40, "query", 2), (16, "key", 1)])
def test_batched_replay_is_bit_identical_to_the_stepwise_one(bits_, source, g):
    """The replay's decisions from GEMM-made keys equal the per-step popcount replay's, with
    short rows (empty pool entries, rows that stop early) and multi-word codes."""
    gen = torch.Generator().manual_seed(bits_ + g)
    s, rows, d, capacity, ring, sinks = 90, 5, 8, 30, 11, 4
    policy = get_policy("hashevict", budget_tokens=capacity + 1, hash_bits=bits_,
                        hash_source=source)
    proj = torch.randn(bits_, d, generator=gen)
    kb = kernels.hash_bits(torch.randn(s, rows, d, generator=gen), proj)
    qb = kernels.hash_bits(torch.randn(s, rows, g, d, generator=gen), proj)
    if source == "key":
        qb = kb.unsqueeze(2)
    kh, qh = kernels.pack_codes(kb), kernels.pack_codes(qb)
    n_real = torch.tensor([90, 90, 61, 35, 25])
    npool = capacity - ring - sinks
    idx = sinks + torch.arange(npool).unsqueeze(1)
    pool = torch.where(idx < n_real - ring, idx, -1)
    assert (pool < 0).any()
    want = stepwise_replay(pool.clone(), kh, qh, n_real, s, capacity, ring)
    signs = flexevict.policies.hashevict._signs
    got = policy._replay(pool.clone(), signs(kb), signs(qb).sum(dim=2), n_real, capacity, ring)
    assert torch.equal(got, want)
    assert not torch.equal(want, pool)                      # the replay evicted something


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("words", [1, 2])
def test_victims_follow_lowest_rule_with_empty_slots(seed, words):
    """The reference's one-key rule picks what `lowest` (and the CUDA kernel, which orders
    candidates the same way) picks: empty slots first and the oldest of them, then the
    farthest key, then the oldest; valid sinks never; the ring's oldest token competes. The
    first GPU run of the kernel test found the reference taking the first empty slot instead."""
    from flexevict.core.kernels import reference as ref
    from flexevict.core.kv import Layout
    gen = torch.Generator().manual_seed(seed)
    cap, rows, g, prefix, sinks = 24, 5, 3, 14, 3
    buf = KVBuffer(Layout(cap + 1, prefix=prefix, ring=cap - prefix), rows, 4, torch.float32,
                   "cpu")
    buf.pos[:cap] = torch.rand(cap, rows, generator=gen).argsort(dim=0).to(torch.int32)
    buf.valid[:cap] = torch.rand(cap, rows, generator=gen) > 0.3
    buf.used, buf.ring_start, buf.cursor = cap, prefix, prefix + seed % (cap - prefix)
    bits = 6 if words == 1 else 32
    codes = torch.randint(0, 1 << bits, (cap + 1, rows, words), generator=gen)
    query = torch.randint(0, 1 << bits, (rows, g, words), generator=gen)
    if words == 1:
        buf.state.copy_(codes[..., 0].float())
    candidates = torch.tensor([*range(prefix), buf.cursor])
    distance = hamming(query, codes.index_select(0, candidates), bits).float()
    value = torch.where(candidates.unsqueeze(1) < sinks, float("inf"), -distance)
    want = ref.lowest(buf, value, candidates)
    valid_before = buf.valid.clone()
    got = ref.hash_victims(buf, query, sinks, None if words == 1 else codes, bits)
    assert torch.equal(got, want)
    assert not buf.valid[got, torch.arange(rows)].any()          # masked out of this step
    assert torch.equal(buf.valid | valid_before, valid_before)
