"""BUZZ (`buzz`, `buzz-logn`): hand-computed worked examples of Algorithms 1-2, the
steady-state counts of App. D.1, the budget -> (k, w, T, s) derivation (Theorem 3.1), a list-based
reference of the paper's rules on random multi-row traces, and end-to-end invariants through the
real model (rows independent, bit-identical to `full` when nothing is evicted)."""
import math

import pytest
import torch

import flexevict.runtime.engine as E
import flexevict.policies.buzz  # noqa: F401  (registers buzz, buzz-logn)
from flexevict.errors import UserError
from flexevict.runtime.generation import Sampling, generate
from flexevict.core.kv import KVBuffer
from flexevict.policies import get_policy
from flexevict.policies.full import Full
from flexevict.policies import PolicySpec
from flexevict.policies.buzz import BuzzLayout

from tiny import CONFIGS as CFGS, model_for

D = 4  # head dim of the hand-made buffers


# ------------------------------------------------------------------ hook drivers

def make(k, w, T, s, prompt_len, gen_len=8, rows=1, name="buzz"):
    policy = get_policy(name, budget_tokens=k + w + T + 1, k=k, w=w, T=T, s=s)
    layout = policy.layout(prompt_len, gen_len)
    assert layout.evicts and (layout.k, layout.w, layout.T, layout.s) == (k, w, T, s)
    return policy, KVBuffer(layout, rows, D, torch.float32, "cpu", fields=policy.fields(layout))


def kv_for(pos, rows):
    """k/v whose first entries encode (row, position), so we can check they move together."""
    pos = torch.as_tensor(pos)
    k = torch.zeros(*pos.shape, D)
    k[..., 0] = pos.float()
    k[..., 1] = torch.arange(rows).float() * 1000
    return k, -k


def prefill(policy, buf, scores):
    """One row, no padding; scores (S,) hand-made column sums."""
    s = len(scores)
    pos = torch.arange(s, dtype=torch.int32).unsqueeze(1)
    k, v = kv_for(pos, 1)
    policy.prefill(buf, k, v, pos, torch.ones(s, 1, dtype=torch.bool),
                   torch.tensor(scores, dtype=torch.float32).unsqueeze(1))


def decode(policy, buf, position, added):
    """One decode step of one row; `added` maps cached positions to the attention they get."""
    slot = buf.incoming_slot()
    k, v = kv_for(torch.tensor([position]), 1)
    buf.write(slot, k, v, torch.tensor([position], dtype=torch.int32))
    n = buf.attended(slot)
    probs = torch.zeros(1, 1, n)
    for j in range(n):
        if buf.valid[j, 0]:
            probs[0, 0, j] = added.get(int(buf.pos[j, 0]), 0.0)
    policy.after_attention(buf, slot, probs)
    return slot


def kept(buf, row=0):
    return buf.pos[:, row][buf.valid[:, row]].tolist()


def scores_of(buf, row=0):
    return dict(zip(kept(buf, row), buf.score[:, row][buf.valid[:, row]].tolist()))


def old_of(buf, row=0):
    return [p for p, o in zip(kept(buf, row), buf.state[:, row][buf.valid[:, row]].tolist()) if o]


def check_kv(buf):
    for r in range(buf.k.shape[1]):
        ok = buf.valid[:, r]
        assert torch.equal(buf.k[ok, r, 0], buf.pos[ok, r].float())
        assert torch.equal(buf.k[ok, r, 1], torch.full((int(ok.sum()),), 1000.0 * r))
        assert torch.equal(buf.v[ok, r], -buf.k[ok, r])


EX1_SCORES = [5.0, .5, .9, .1, .2, .3, .8, .7, .1, .05, .4, .6]


# ------------------------------------------------------------------ worked examples (§2.12)

def test_example1_prefill_and_two_decode_steps():
    policy, buf = make(k=1, w=2, T=4, s=3, prompt_len=12)
    assert buf.layout.s_hat == 2
    prefill(policy, buf, EX1_SCORES)
    # chunks [1,2,3]->2, [4,5,6]->6, [7,8,9]->7; sink [0], window [10, 11]
    assert kept(buf) == [0, 2, 6, 7, 10, 11] and buf.used == 6
    assert old_of(buf) == [2, 6, 7]                          # a = 3
    assert scores_of(buf) == pytest.approx({0: 5.0, 2: .9, 6: .8, 7: .7, 10: .4, 11: .6})
    check_kv(buf)
    # step 1: middle [2,6,7,10] = 4, not > T: nothing evicted
    slot = decode(policy, buf, 12, {10: .1, 11: 0.0, 12: .2})
    assert slot == 6
    assert kept(buf) == [0, 2, 6, 7, 10, 11, 12]
    assert scores_of(buf)[10] == pytest.approx(.5) and scores_of(buf)[12] == pytest.approx(.2)
    # step 2: the buffer is full, token 13 goes to scratch; middle [2,6,7,10,11] = 5 > 4:
    # old [2,6,7][::2] -> [2,7]; new [10,11] scores .55 vs .9 -> 11
    slot = decode(policy, buf, 13, {10: .05, 11: .3})
    assert slot == buf.scratch
    assert kept(buf) == [0, 2, 7, 11, 12, 13] and buf.used == 6
    assert old_of(buf) == [2, 7, 11]                         # a = 3
    assert scores_of(buf) == pytest.approx({0: 5.0, 2: .9, 7: .7, 11: .9, 12: .2, 13: 0.0})
    assert not buf.valid[6:].any() and (buf.pos[6:] == -1).all()
    check_kv(buf)


def test_example2_prefill_samples_until_it_fits():
    policy, buf = make(k=1, w=2, T=2, s=3, prompt_len=12)
    prefill(policy, buf, EX1_SCORES)
    # pass 1 gives [0,2,6,7,10,11] (a = 3 > T); pass 2 (all old): [2,6,7][::2] -> [2,7]
    assert kept(buf) == [0, 2, 7, 10, 11] and buf.used == 5
    assert old_of(buf) == [2, 7]
    check_kv(buf)


def test_example3_even_stride():
    policy, buf = make(k=2, w=2, T=6, s=4, prompt_len=14)
    assert buf.layout.s_hat == 2
    prefill(policy, buf, [9, 8, 1, 5, 2, 2, 7, 3, 0, 4, 6, 1, 0, 0])
    # middle 2..11: chunks [2..5]->3, [6..9]->6, [10,11]->10
    assert kept(buf) == [0, 1, 3, 6, 10, 12, 13]
    assert old_of(buf) == [3, 6, 10]
    check_kv(buf)


def test_ties_pick_the_first_token_of_a_chunk():
    policy, buf = make(k=1, w=1, T=2, s=3, prompt_len=8)
    prefill(policy, buf, [1, 2, 2, 2, 0, 1, 1, 1])
    # middle 1..6: [1,2,3] all tie -> 1; [4,5,6]: 5 and 6 tie -> 5
    assert kept(buf) == [0, 1, 5, 7]


# ------------------------------------------------------------------ sizing (§2.11, Thm 3.1)

@pytest.mark.parametrize("slots, expect", [(201, (4, 36, 160)), (165, (4, 30, 130))])
def test_budget_derivation_matches_the_papers_settings(slots, expect):
    p = get_policy("buzz", budget_tokens=slots)
    lay = p.layout(10_000, 100)
    assert (lay.k, lay.w, lay.T, lay.s) == (*expect, 5)
    d = p.describe(lay)
    assert d["peak_tokens"] == slots - 1 and d["w"] == expect[1] and d["T"] == expect[2]


@pytest.mark.parametrize("s", [3, 4, 5, 6, 7])
def test_budget_derivation_follows_theorem_3_1(s):
    ratio = (s * s + 1) / (s + 1) if s % 2 else s - 1
    for slots in range(60, 400, 7):
        p = get_policy("buzz", budget_tokens=slots, s=s)
        lay = p.layout(10_000, 100)
        assert lay.k + lay.w + lay.T + 1 == slots             # every slot used, none over
        assert ratio <= lay.T / lay.w < ratio + 2 * s / lay.w  # eq. (13)/(14)


def test_overrides_and_minimum():
    lay = get_policy("buzz", budget_tokens=100, w=10).layout(1000, 10)
    assert (lay.w, lay.T) == (10, 85)
    lay = get_policy("buzz", budget_tokens=100, T=50, k=2).layout(1000, 10)
    assert (lay.k, lay.w, lay.T) == (2, 47, 50)
    p = get_policy("buzz", budget_tokens=100, w=10, T=20, s="3")   # CLI strings are coerced
    lay = p.layout(1000, 10)
    assert (lay.w, lay.T, lay.s, lay.s_hat) == (10, 20, 3, 2)
    assert get_policy("buzz", budget_tokens=8).minimum_slots() == 8          # 4 + 1 + 2 + 1
    assert get_policy("buzz", budget_tokens=8, w=3, T=9).minimum_slots() == 17


def test_steady_state_matches_the_seed_table():
    """§2.11: min / max / mean resident tokens over 3000 decode steps (prompt 1000), a*."""
    for (k, w, s, T), (lo, hi, mean, a) in {(4, 30, 5, 130): (65, 164, 114.6, (31,)),
                                            (4, 160, 5, 400): (258, 564, 413.7, (93, 94)),
                                            (4, 36, 5, 160): (78, 200, 138.9, (38,))}.items():
        p = get_policy("buzz", budget_tokens=k + w + T + 1, k=k, w=w, T=T, s=s)
        lay = p.layout(1000, 3001)
        sizes = lay.held(3000)[1:]
        assert (min(sizes), max(sizes)) == (lo, hi)
        assert sum(sizes) / len(sizes) == pytest.approx(mean, abs=0.05)
        steady = min(sizes[-500:]) - k - w                    # old count right after a pass
        assert steady in a and abs(steady - lay.a_star()) <= 2


def test_one_pass_always_fits_for_every_stride_and_threshold():
    """Why s >= 3 and T >= 2: a decode pass over a middle of T + 1 (any old count a <= T) keeps
    ceil(a/ŝ) + ceil((T+1-a)/s) <= T tokens; T = 1 or ŝ = 1 (s <= 2) can keep T + 1."""
    def kept_after(a, T, s):
        return -(-a // ((s + 1) // 2)) + -(-(T + 1 - a) // s)
    for s in range(3, 12):
        for T in range(2, 150):
            assert max(kept_after(a, T, s) for a in range(T + 1)) <= T
        assert kept_after(1, 1, s) == 2
    assert kept_after(30, 30, 2) == 31


# ------------------------------------------------------------------ reference on random traces

def ref_pass(cache, k, w, T, s):
    """The paper's pass on one row, as lists: cache = [[pos, score, old], ...] in order."""
    n = len(cache)
    if n - k - w <= T:
        return cache
    sink, middle, window = cache[:k], cache[k:n - w], cache[n - w:]
    a = sum(1 for c in middle if c[2])
    old, new = middle[:a], middle[a:]
    keep = old[::(s + 1) // 2] + [max(new[i:i + s], key=lambda c: c[1])
                                  for i in range(0, len(new), s)]
    return ([[p, sc, False] for p, sc, _ in sink] + [[p, sc, True] for p, sc, _ in keep]
            + [[p, sc, False] for p, sc, _ in window])


@pytest.mark.parametrize("k, w, T, s", [(1, 2, 4, 3), (4, 3, 13, 5), (2, 2, 6, 4),
                                        (0, 1, 2, 3), (3, 5, 9, 7)])
def test_random_multirow_traces_match_the_reference(k, w, T, s):
    """Rows of different real lengths (left padding) and several query heads per kv head;
    scores are multiples of 1/8 (exact in fp32, so ties occur and must go to the first)."""
    gen = torch.Generator().manual_seed(k * 100 + T)
    lengths = [30, 30, 21, 9, 2]
    rows, group, S, steps = len(lengths), 2, max(lengths), 45
    policy = get_policy("buzz", budget_tokens=k + w + T + 1, k=k, w=w, T=T, s=s)
    layout = policy.layout(S, steps + 1)
    buf = KVBuffer(layout, rows, D, torch.float32, "cpu", fields=policy.fields(layout))
    valid = torch.zeros(S, rows, dtype=torch.bool)
    pos = torch.zeros(S, rows, dtype=torch.int32)
    for r, n in enumerate(lengths):
        valid[S - n:, r] = True
        pos[S - n:, r] = torch.arange(n, dtype=torch.int32)
    scores = torch.randint(0, 6, (S, rows), generator=gen).float() / 8 * valid
    k_, v_ = kv_for(pos, rows)
    policy.prefill(buf, k_, v_, pos, valid, scores)
    ref = []
    for r, n in enumerate(lengths):
        cache = [[p, float(scores[S - n + p, r]), False] for p in range(n)]
        while len(cache) - k - w > T:
            cache = ref_pass(cache, k, w, T, s)
        ref.append(cache)

    def compare():
        for r in range(rows):
            assert kept(buf, r) == [c[0] for c in ref[r]]
            assert list(scores_of(buf, r).values()) == [c[1] for c in ref[r]]
            assert old_of(buf, r) == [c[0] for c in ref[r] if c[2]]
        assert buf.used == max(len(c) for c in ref) <= buf.capacity
        assert not buf.valid[buf.used:].any()
        check_kv(buf)

    compare()
    for step in range(steps):
        new_pos = torch.tensor([n + step for n in lengths], dtype=torch.int32)
        slot = buf.incoming_slot()
        k_, v_ = kv_for(new_pos, rows)
        buf.write(slot, k_, v_, new_pos)
        n = buf.attended(slot)
        probs = torch.randint(0, 4, (rows, group, n), generator=gen).float() / 8
        probs *= buf.valid[:n].t().unsqueeze(1)
        for r in range(rows):
            ref[r].append([int(new_pos[r]), 0.0, False])
            ok = buf.valid[:n, r]
            got = dict(zip(buf.pos[:n, r][ok].tolist(), probs[r].sum(0)[ok].tolist()))
            for c in ref[r]:
                c[1] += got[c[0]]
        policy.after_attention(buf, slot, probs)
        ref = [ref_pass(c, k, w, T, s) for c in ref]
        compare()


# ------------------------------------------------------------------ end to end



def prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 128, (n,), generator=g).tolist() for n in lengths]


class Traced:
    """Run generate with buffers kept and a check after every after_attention call."""

    def __init__(self, monkeypatch):
        self.bufs = []
        self.monkeypatch = monkeypatch
        orig = E.allocate

        def allocate(*a, **kw):
            out = orig(*a, **kw)
            self.bufs.append(out)
            return out
        monkeypatch.setattr(E, "allocate", allocate)

    def run(self, model, ps, n_new, policy, check=None):
        if check is not None:
            inner = type(policy).after_attention

            def after(self, buf, slot, probs, scored=False):
                inner(self, buf, slot, probs, scored)
                check(buf)
            # policies are frozen: wrap the hook on the class (undone with the monkeypatch)
            self.monkeypatch.setattr(type(policy), "after_attention", after)
        return generate(model, ps, n_new, policy, Sampling(), stop_ids=(), pad_id=0)


@pytest.mark.parametrize("key", list(CFGS))
@pytest.mark.parametrize("name", ["buzz", "buzz-logn"])
def test_invariants_through_the_model(monkeypatch, key, name):
    model, lengths, n_new = model_for(key), [60, 47], 40
    policy = get_policy(name, budget=0.2)
    tr = Traced(monkeypatch)
    step = {"n": 0}
    used0 = []

    def check(buf):
        nk, lay = model.config.num_kv_heads, buf.layout
        if buf is tr.bufs[-1][0]:
            step["n"] += 1
            used0.append(int(buf.valid[:, 0].sum()))           # row 0: the longest prompt
        assert buf.valid.sum(0).max() <= lay.slots - 1
        assert buf.used == buf.valid.sum(0).max()              # compaction leaves no holes
        assert buf.used <= buf.capacity and not buf.valid[buf.used:].any()
        for r in range(buf.valid.shape[1]):
            plen = lengths[r // nk]
            p = buf.pos[:, r][buf.valid[:, r]]
            assert torch.equal(p, p.sort().values) and p.unique().numel() == p.numel()
            hi = plen + step["n"]                                # positions 0 .. hi - 1 exist
            assert int(p.min()) >= 0 and int(p.max()) == hi - 1
            # sinks and window always present (the window includes the current token)
            must = set(range(lay.k)) | set(range(hi - lay.w, hi))
            assert must <= set(p.tolist())
            # the middle never exceeds T
            assert p.numel() <= lay.k + lay.w + lay.T

    tr.run(model, prompts(lengths), n_new, policy, check)
    lay = tr.bufs[-1][0].layout                              # the run's resolved layout
    assert lay.evicts and lay.slots == 20 and (lay.k, lay.w, lay.T) == (4, 2, 13)
    assert step["n"] == n_new - 1
    # the unpadded row's count follows the rules exactly, as simulated for describe()
    assert lay.prompt_len == max(lengths) and used0 == lay.held(n_new - 1)[1:]
    assert policy.describe(lay)["avg_tokens"] == pytest.approx(sum(used0) / len(used0), abs=0.01)
    assert policy.describe(lay)["peak_tokens"] == 19 >= max(used0)


@pytest.mark.parametrize("key", list(CFGS))
def test_rows_are_independent(monkeypatch, key):
    model = model_for(key)
    ps = prompts([50, 50], seed=2)
    def run(batch, **budget):
        policy = get_policy("buzz", **(budget or {"budget": .25}))
        return generate(model, batch, 30, policy, Sampling(), stop_ids=(), pad_id=0)
    together = run(ps)
    assert together == [run([p])[0] for p in ps]
    assert together != generate(model, ps, 30, get_policy("full"), Sampling(), pad_id=0)
    assert len({t for o in together for t in o}) > 5
    # unequal lengths (left padding): rows reach the threshold at different steps (a fixed
    # slot count: --budget would give a lone short prompt fewer slots than the batch)
    ps = prompts([50, 23], seed=3)
    assert run(ps, budget_tokens=20) == [run([p], budget_tokens=20)[0] for p in ps]


def logits_of(model, ps, n_new, policy):
    out = []
    orig = model.head

    def head(h, o=None):
        out.append(orig(h, o))
        return out[-1]
    model.head = head
    try:
        generate(model, ps, n_new, policy, Sampling(), stop_ids=(), pad_id=0)
    finally:
        del model.head
    return out


@pytest.mark.parametrize("key", list(CFGS))
def test_no_eviction_is_bit_identical_to_full(key):
    model, ps, n_new = model_for(key), prompts([20, 13], seed=4), 12
    ref = logits_of(model, ps, n_new, get_policy("full"))
    for policy in (get_policy("buzz", budget=1.0), get_policy("buzz", budget_tokens=500)):
        got = logits_of(model, ps, n_new, policy)
        lay = policy.layout(max(map(len, ps)), n_new)         # what generate resolves
        assert not lay.evicts and len(got) == len(ref) == n_new
        assert all(torch.equal(a, b) for a, b in zip(got, ref))


class FullLogN(Full):
    """`full` with buzz-logn's logit factor (not registered)."""
    name = "full-logn-test"

    def logit_scale(self, n_keys):
        return math.log(n_keys) / math.log(512)


@pytest.mark.parametrize("key", list(CFGS))
def test_logn_without_eviction_only_rescales_logits(key):
    model, ps, n_new = model_for(key), prompts([20, 13], seed=4), 12
    ref = logits_of(model, ps, n_new, FullLogN())
    got = logits_of(model, ps, n_new, get_policy("buzz-logn", budget=1.0))
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    plain = logits_of(model, ps, n_new, get_policy("full"))
    assert not torch.equal(ref[-1], plain[-1])


def test_logit_scale():
    assert get_policy("buzz").logit_scale(200) == 1.0
    p = get_policy("buzz-logn")
    assert p.logit_scale(512) == 1.0
    assert p.logit_scale(200) == pytest.approx(0.849, abs=1e-3)
    assert p.logit_scale(1000) == pytest.approx(1.107, abs=1e-3)
    assert get_policy("buzz-logn", base=1000).logit_scale(1000) == 1.0


# ------------------------------------------------------------------ bad input

@pytest.mark.parametrize("name", ["buzz", "buzz-logn"])
def test_bad_input(name):
    with pytest.raises(UserError, match="unknown policy_args"):
        get_policy(name, budget=0.5, window=3)
    with pytest.raises(UserError, match="minimum of 8"):
        get_policy(name, budget_tokens=7).layout(100, 10)
    with pytest.raises(UserError, match="minimum of 8"):
        get_policy(name, budget=0.05).layout(100, 10)
    with pytest.raises(UserError, match="minimum of 20"):
        get_policy(name, budget_tokens=19, w=5, T=10).layout(100, 10)
    with pytest.raises(UserError, match="stride"):
        get_policy(name, s=2)
    with pytest.raises(UserError, match="threshold"):
        get_policy(name, T=1)
    with pytest.raises(UserError, match="expected a int"):
        get_policy(name, w="many")


def test_pos_shift_switches_rope_positions():
    """pos_shift (default on) rotates LLaMA keys by in-cache rank once tokens were evicted;
    OPT has learned absolute positions, so the switch cannot change its logits."""
    ps = prompts([40], seed=5)
    for key in CFGS:
        model = model_for(key)
        on = get_policy("buzz", budget_tokens=16)
        off = get_policy("buzz", budget_tokens=16, pos_shift="false")
        a, b = logits_of(model, ps, 20, on), logits_of(model, ps, 20, off)
        lay_on, lay_off = on.layout(40, 20), off.layout(40, 20)   # what generate resolves
        assert lay_on.rope_in_cache and not lay_off.rope_in_cache
        assert on.describe(lay_on)["pos_shift"] and not off.describe(lay_off)["pos_shift"]
        same = all(torch.equal(x, y) for x, y in zip(a, b))
        assert same == (key == "opt")


def _maxima_reference(scores, k, w, T, s):
    """Remark 2 read as local maxima on every pass: positions kept after prefill."""
    keep = list(range(len(scores)))
    while len(keep) - k - w > T:
        middle = keep[k:len(keep) - w]
        chosen = []
        for i in range(0, len(middle), s):
            hive = middle[i:i + s]
            chosen.append(max(hive, key=lambda p: (scores[p], -p)))    # first on ties
        keep = keep[:k] + chosen + keep[len(keep) - w:]
    return keep


@pytest.mark.parametrize("seed", range(4))
def test_prompt_sampling_maxima_takes_local_maxima_on_every_pass(seed):
    """`prompt_sampling=maxima`: each repeated prefill pass keeps the local maximum of every
    hive of the whole middle; the default treats a pass's survivors as old (interval-sampled),
    so the two differ on long prompts; the host counts and describe() follow the mode."""
    k, w, T, s, n = 2, 3, 6, 3, 60
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(n, generator=gen).tolist()
    kept = {}
    for mode in ("maxima", "interval"):
        policy = get_policy("buzz", budget_tokens=k + w + T + 1, k=k, w=w, T=T, s=s,
                            prompt_sampling=mode)
        layout = policy.layout(n, 8)
        buf = KVBuffer(layout, 1, D, torch.float32, "cpu", fields=policy.fields(layout))
        prefill(policy, buf, scores)
        kept[mode] = sorted(int(p) for p in buf.pos[buf.valid[:, 0], 0])
        assert buf.policy_state["counts"] == ((len(kept[mode]), len(kept[mode]) - k - w),)
        assert layout.held(0)[0] == len(kept[mode])
    assert kept["maxima"] == _maxima_reference(scores, k, w, T, s)
    assert kept["maxima"] != kept["interval"]


def test_prompt_sampling_is_checked():
    with pytest.raises(UserError, match="prompt_sampling=every"):
        get_policy("buzz", budget=0.5, prompt_sampling="every")


@pytest.mark.parametrize("budget", [0.05, 0.1, 0.2, 0.4])
def test_average_budget_basis_matches_the_constant_policys_tokens(budget):
    """budget_basis=average (Sec. 4.2.1): the largest peak whose steady-state average cache,
    k + w + (a* + T) / 2, stays within the tokens H2O keeps at the same budget."""
    from flexevict.policies.buzz import theorem_window
    h2o = PolicySpec("h2o", budget).make().layout(2047, 1)
    avg = PolicySpec("buzz", budget, args=(("budget_basis", "average"),)).make()
    lay = avg.layout(2047, 1)
    assert lay.slots > h2o.slots and lay.steady_tokens() <= h2o.capacity
    room = lay.slots - lay.k                       # one slot more breaks the average
    w = theorem_window(room, lay.s)
    over = BuzzLayout(lay.slots + 1, k=lay.k, w=w, T=room - w, s=lay.s)
    assert over.steady_tokens() > h2o.capacity
    assert PolicySpec("buzz", budget).make().layout(2047, 1).slots == h2o.slots   # peak basis


def test_average_budget_basis_is_checked():
    with pytest.raises(UserError, match="budget_basis=mean: expected 'peak'"):
        PolicySpec("buzz", 0.2, args=(("budget_basis", "mean"),)).make()
    with pytest.raises(UserError, match="leave w and T unset"):
        PolicySpec("buzz", 0.2, args=(("budget_basis", "average"), ("w", "8"))).make()
