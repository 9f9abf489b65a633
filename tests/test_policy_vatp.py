"""`vatp` (Guo et al. 2024, "Attention Score is not All You Need for Token Importance
Indicator in KV Cache Reduction: Value Also Matters") and its control `vatp-pin`.

Hand-made buffers: a hand-computed example of Eq. 4, the closed form
I = S * ||v|| against a per-row reference simulation, equal norms => vatp == vatp-pin.
Real tiny models: budget, uniqueness, pinned sinks and recent window at every step, row
independence, bit-identical logits without eviction (OPT and LLaMA-GQA), and vatp vs vatp-pin
differing only by the value norm. Bad input raises UserError.
"""
import pytest
import torch

import flexevict.runtime.engine as E
import flexevict.policies.vatp  # noqa: F401  (registers vatp, vatp-pin)
from flexevict.errors import UserError
from flexevict.runtime.generation import Sampling, generate
from flexevict.core.kv import KVBuffer
from flexevict.policies import get_policy
from flexevict.policies.vatp import ValueAware, value_norm

from tiny import CONFIGS as CFGS, model_for, rand_prompts



def kept(buf, row=0):
    """Sorted positions of the valid committed slots of one row."""
    return sorted(buf.pos[:buf.capacity, row][buf.valid[:buf.capacity, row]].tolist())


# ------------------------------------------------------------------ worked example (§2.8)

S_EX = [2.0, 0.6, 0.9, 0.3, 0.5, 0.7]
NORM_EX = [0.1, 3.0, 0.5, 2.0, 1.5, 1.0]


def example_prompt():
    """6 prompt tokens, one row, d = 2; v has the example's l1 norms (mixed signs, unequal
    parts, so the l1 norm differs from the l2 and linf norms)."""
    v = torch.tensor([[0.7 * n, -0.3 * n] for n in NORM_EX]).unsqueeze(1)   # (6, 1, 2)
    k = torch.randn(6, 1, 2, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(6, dtype=torch.int32).unsqueeze(1)
    valid = torch.ones(6, 1, dtype=torch.bool)
    return k, v, pos, valid, torch.tensor(S_EX).unsqueeze(1)


# Scissorhands w/ VATP with the example's split: 2 recent, 2 selected by score (App. A uses 10)
SCISSORS = {"base": "scissorhands", "recent": 2}


def example_buffer(name, **args):
    # budget 4 committed slots (+ the scratch slot): heavy 2, recent 2 (H2O split)
    policy = get_policy(name, budget_tokens=5, **args)
    layout = policy.layout(6, 2)
    assert (layout.capacity, layout.prefix, layout.ring) == (4, 2, 2)
    buf = KVBuffer(layout, 1, 2, torch.float32, "cpu", fields=policy.fields(layout))
    policy.prefill(buf, *example_prompt())
    return policy, buf


@pytest.mark.parametrize("name,args,expect", [
    ("h2o", {}, [0, 2, 4, 5]),                         # S only
    ("vatp", {"sinks": 0}, [1, 3, 4, 5]),              # S * ||v||, sink lost
    ("vatp", {"sinks": 1}, [0, 1, 4, 5]),              # the paper's VATP, F = 1
    ("vatp-pin", {"sinks": 1}, [0, 2, 4, 5]),          # control: pinning without the norm
    ("vatp", SCISSORS | {"sinks": 1}, [0, 1, 4, 5]),   # Scissorhands w/ VATP, same split
    ("vatp-pin", SCISSORS | {"sinks": 1}, [0, 2, 4, 5]),
])
def test_worked_example_prefill(name, args, expect):
    policy, buf = example_buffer(name, **args)
    assert kept(buf) == expect
    # buf.score keeps the accumulated attention S (not the importance)
    got = {int(p): float(s) for p, s, ok in zip(buf.pos[:4, 0], buf.score[:4, 0], buf.valid[:4, 0])
           if ok}
    assert got == pytest.approx({p: S_EX[p] for p in expect})
    assert buf.used == 4 and not buf.valid[buf.scratch].any()


@pytest.mark.parametrize("base", [{}, SCISSORS])
def test_worked_example_decode(base):
    """The same step for Scissorhands w/ VATP: with a 400-query window nothing has left the
    window yet, so S is the same accumulated attention."""
    policy, buf = example_buffer("vatp", sinks=1, **base)
    slot = buf.incoming_slot()
    assert slot == buf.scratch                          # full: token 6 goes to scratch
    # new token 6 with ||v_6||_1 = 1.2
    buf.write(slot, torch.tensor([[0.3, 0.1]]), torch.tensor([[0.9, -0.3]]),
              torch.tensor([6], dtype=torch.int32))
    policy.before_attention(buf, slot, torch.zeros(1, 1, 2))
    n = buf.attended(slot)
    assert n == 5 and buf.pos[:n, 0].tolist() == [0, 1, 4, 5, 6]
    probs = torch.tensor([[[0.5, 0.1, 0.1, 0.1, 0.2]]])
    # importance after this step's attention, before the decision (the seed's numbers)
    s_after = buf.score[:n, 0] + probs[0, 0]
    imp = policy.value_aware(buf.layout, s_after, buf.v[:n, 0], buf.pos[:n, 0],
                             buf.valid[:n, 0])
    assert imp[0] == float("inf")                       # pinned sink
    assert imp[1:].tolist() == pytest.approx([2.1, 0.9, 0.8, 0.24])
    policy.after_attention(buf, slot, probs)
    assert kept(buf) == [0, 1, 5, 6]                    # evicts 4
    got = {int(p): float(s) for p, s in zip(buf.pos[:4, 0], buf.score[:4, 0])}
    assert got == pytest.approx({0: 2.5, 1: 0.7, 5: 0.8, 6: 0.2})
    assert not buf.valid[buf.scratch].any()


def test_value_norm_kinds():
    v = torch.tensor([[3.0, -4.0], [0.5, 0.0]])
    assert value_norm(v, "l1").tolist() == [7.0, 0.5]
    assert value_norm(v, "l2").tolist() == [5.0, 0.5]
    assert value_norm(v, "linf").tolist() == [4.0, 0.5]
    assert value_norm(v, "none") is None
    assert value_norm(v.half(), "l1").dtype == torch.float32


# ------------------------------------------------------------------ reference simulation

def reference(prompt_S, norms, steps, cap, F):
    """Per-row reference of H2O w/ VATP with the first F positions pinned.

    prompt_S (L,), norms (L + T,), steps: list of dicts pos -> attention prob of that step.
    Yields the kept set after prefill and after each step (sets of positions)."""
    p = cap // 2
    r = cap - p
    F = min(F, p)
    L = len(prompt_S)
    S = {i: float(prompt_S[i]) for i in range(L)}
    imp = lambda i: float("inf") if i < F else S[i] * norms[i]  # noqa: E731
    if L <= cap:
        keep = set(range(L))
    else:
        recent = set(range(L - r, L))
        rest = sorted(set(range(L)) - recent, key=imp, reverse=True)
        keep = recent | set(rest[:p])
    yield keep
    for t, row in enumerate(steps):
        new = L + t
        S[new] = 0.0
        for i, a in row.items():
            S[i] += a
        keep = keep | {new}
        if len(keep) > cap:
            recent = set(sorted(keep)[-r:])
            keep = keep - {min(keep - recent, key=imp)}
        yield keep


@pytest.mark.parametrize("norm,F", [("l1", 2), ("l2", 3), ("linf", 0), ("none", 2)])
@pytest.mark.parametrize("L", [13, 5])
def test_matches_reference(norm, F, L):
    """Random hand-made traces, 3 independent rows: kept sets equal the reference every step,
    buf.score equals the accumulated attention, and the budget is exact."""
    g = torch.Generator().manual_seed(L * 7 + F)
    rows, d, T = 3, 4, 12
    policy = get_policy("vatp", budget_tokens=9, sinks=F, norm=norm)
    layout = policy.layout(L, T)
    cap = layout.capacity
    assert cap == 8
    buf = KVBuffer(layout, rows, d, torch.float32, "cpu", fields=policy.fields(layout))
    v = torch.randn(L + T, rows, d, generator=g)
    k = torch.randn(L + T, rows, d, generator=g)
    prompt_S = torch.rand(L, rows, generator=g) * 3
    pos = torch.arange(L + T, dtype=torch.int32).unsqueeze(1).expand(-1, rows)
    policy.prefill(buf, k[:L], v[:L], pos[:L].contiguous(), torch.ones(L, rows, dtype=torch.bool),
                   prompt_S)
    weights = value_norm(v, norm) if norm != "none" else torch.ones(L + T, rows)
    steps = [[{} for _ in range(T)] for _ in range(rows)]
    sums = [{i: float(prompt_S[i, r]) for i in range(L)} for r in range(rows)]
    refs = [reference(prompt_S[:, r].tolist(), weights[:, r].tolist(), steps[r], cap, F)
            for r in range(rows)]
    for r in range(rows):
        assert kept(buf, r) == sorted(next(refs[r]))
    for t in range(T):
        slot = buf.incoming_slot()
        buf.write(slot, k[L + t], v[L + t], pos[L + t])
        n = buf.attended(slot)
        probs = torch.softmax(torch.randn(rows, 1, n, generator=g) * 2, dim=-1)
        probs = probs * buf.valid[:n].t().unsqueeze(1)
        for r in range(rows):
            sums[r][L + t] = 0.0
            for j in range(n):
                if buf.valid[j, r]:
                    steps[r][t][int(buf.pos[j, r])] = float(probs[r, 0, j])
                    sums[r][int(buf.pos[j, r])] += float(probs[r, 0, j])
        policy.after_attention(buf, slot, probs)
        for r in range(rows):
            got = kept(buf, r)
            assert got == sorted(next(refs[r])), (t, r)
            assert len(got) == min(cap, L + t + 1)
            assert set(range(min(F, layout.prefix, L + t + 1))) <= set(got)
            for j in range(cap):
                if buf.valid[j, r]:
                    assert float(buf.score[j, r]) == pytest.approx(sums[r][int(buf.pos[j, r])],
                                                                   rel=1e-5, abs=1e-6)


def test_equal_norms_equal_pin_control():
    """With every value norm equal, vatp keeps exactly what vatp-pin keeps (the example's case
    (b))."""
    g = torch.Generator().manual_seed(5)
    L, T, rows, d = 14, 10, 2, 3
    v = torch.randn(L + T, rows, d, generator=g)
    v = v / v.abs().sum(-1, keepdim=True) * 2.5          # all l1 norms 2.5
    k = torch.randn(L + T, rows, d, generator=g)
    S = torch.rand(L, rows, generator=g)
    pos = torch.arange(L + T, dtype=torch.int32).unsqueeze(1).expand(-1, rows).contiguous()
    ones = torch.ones(L, rows, dtype=torch.bool)
    out = []
    for name in ("vatp", "vatp-pin"):
        policy = get_policy(name, budget_tokens=9, sinks=2)
        layout = policy.layout(L, T)
        buf = KVBuffer(layout, rows, d, torch.float32, "cpu", fields=policy.fields(layout))
        policy.prefill(buf, k[:L], v[:L], pos[:L], ones, S)
        trace = [[kept(buf, r) for r in range(rows)]]
        gg = torch.Generator().manual_seed(9)
        for t in range(T):
            slot = buf.incoming_slot()
            buf.write(slot, k[L + t], v[L + t], pos[L + t])
            n = buf.attended(slot)
            policy.after_attention(buf, slot, torch.softmax(torch.randn(rows, 1, n, generator=gg),
                                                            -1))
            trace.append([kept(buf, r) for r in range(rows)])
        out.append(trace)
    assert out[0] == out[1]


# ------------------------------------------------------------------ real tiny models

def run_policy(model, prompts, n, policy, monkeypatch=None, check=None, layouts=None):
    """generate() with per-step logits recorded; `check(buf, policy, slot)` after every
    after_attention call (every layer, every decode step); `layouts` (a list) gets the layout
    of every buffer the run allocates."""
    logits = []
    real_head = model.head
    if monkeypatch is not None:
        monkeypatch.setattr(model, "head",
                            lambda h, o=None: logits.append(real_head(h, o)) or logits[-1])
    with pytest.MonkeyPatch.context() as m:             # policies are frozen: wrap the class
        if check is not None:
            real_after = type(policy).after_attention

            def after(self, buf, slot, probs, scored=False):
                real_after(self, buf, slot, probs, scored)
                check(buf, self, slot)
            m.setattr(type(policy), "after_attention", after)
            m.setattr(E.Engine, "stack_layers", False)     # each layer checked as it commits
        if layouts is not None:
            real_alloc = E.allocate
            m.setattr(E, "allocate", lambda model, layout, *a:
                      layouts.append(layout) or real_alloc(model, layout, *a))
        out = generate(model, prompts, n, policy, Sampling(), stop_ids=(), pad_id=0)
    if monkeypatch is not None:
        monkeypatch.setattr(model, "head", real_head)
    return out, logits


def invariant_checker(prompt_lens, model, sinks):
    """Checks for a left-padded batch after every decode step of every layer: budget, unique
    real positions, first F real tokens (F = min(sinks, heavy slots); sinks None: the policy's
    derived F), H2O's recent window, pads never kept. steps["layout"]: the run's layout (the
    same in every buffer)."""
    kv_heads, layers = model.config.num_kv_heads, model.config.num_layers
    steps = {"n": 0}

    def check(buf, policy, slot):
        step = steps["n"] // layers                     # decode step (0 = 2nd generated token)
        steps["n"] += 1
        lay = buf.layout
        assert steps.setdefault("layout", lay) == lay
        assert lay.evicts
        assert not buf.valid[buf.scratch].any()
        F = policy.pinned_count(lay) if sinks is None else min(sinks, lay.prefix)
        steps["F"] = F
        for r in range(buf.valid.shape[1]):
            n_real = prompt_lens[r // kv_heads]
            assert n_real >= lay.slots                   # every row evicts from the prefill on
            pos = buf.pos[:, r][buf.valid[:, r]].tolist()
            assert len(pos) == lay.slots - 1             # exact budget, scratch committed
            assert len(set(pos)) == len(pos)             # unique
            newest = n_real + step                       # this step's token: always kept
            assert max(pos) == newest and min(pos) >= 0  # real positions only (no pads)
            assert set(range(F)) <= set(pos)             # the first F real tokens
            assert set(range(newest + 1 - lay.ring, newest + 1)) <= set(pos)      # window
    return check, steps


@pytest.mark.parametrize("key", list(CFGS))
def test_invariants_end_to_end(key):
    model = model_for(key)
    lens = [60, 37]
    prompts = rand_prompts(lens, seed=1)
    policy = get_policy("vatp", budget=0.2, sinks=4)
    check, steps = invariant_checker(lens, model, 4)
    out, _ = run_policy(model, prompts, 12, policy, check=check)
    lay = steps["layout"]
    assert lay.slots == int(0.2 * (60 + 12)) and lay.prefix > 4         # some heavy slots
    assert steps["n"] == 11 * model.config.num_layers
    assert all(len(o) == 12 for o in out)


def test_paper_sinks_end_to_end():
    """The paper's F = 20 with a budget where it fits in the heavy slots (heavy > 0)."""
    model = model_for("llama-gqa")
    lens = [120]
    policy = get_policy("vatp", budget_tokens=60, sinks=20)
    check, steps = invariant_checker(lens, model, 20)
    run_policy(model, rand_prompts(lens, seed=2), 6, policy, check=check)
    d = policy.describe(steps["layout"])
    assert d["pinned"] == 20 and d["heavy"] == 9
    assert steps["n"] == 5 * model.config.num_layers


def test_given_sinks_capped_end_to_end():
    """F = 20 with fewer heavy slots than F: the whole prefix holds the first tokens."""
    model = model_for("opt")
    lens = [50, 44]
    policy = get_policy("vatp", budget=0.2, sinks=20)
    check, steps = invariant_checker(lens, model, 20)
    run_policy(model, rand_prompts(lens, seed=7), 8, policy, check=check)
    assert policy.describe(steps["layout"])["pinned"] == steps["layout"].prefix == 5
    assert steps["n"] == 7 * model.config.num_layers


def test_rows_independent():
    model = model_for("llama-gqa")
    prompts = rand_prompts([40, 40], seed=3)
    both, _ = run_policy(model, prompts, 10, get_policy("vatp", budget=0.2, sinks=2))
    alone = [run_policy(model, [p], 10, get_policy("vatp", budget=0.2, sinks=2))[0][0]
             for p in prompts]
    assert both == alone
    assert both[0] != both[1] and len(set(both[0] + both[1])) > 4      # not degenerate


@pytest.mark.parametrize("key", list(CFGS))
@pytest.mark.parametrize("budget", [{"budget": 1.0}, {"budget_tokens": 47},
                                    {"budget_tokens": 500}])
@pytest.mark.parametrize("name,base", [("vatp", "h2o"), ("vatp-pin", "h2o"),
                                       ("vatp", "scissorhands")])
def test_no_eviction_bit_identical_to_full(key, budget, name, base, monkeypatch):
    model = model_for(key)
    prompts = rand_prompts([30, 21], seed=4)
    policy = get_policy(name, base=base, **budget)
    layouts = []
    out, logits = run_policy(model, prompts, 17, policy, monkeypatch, layouts=layouts)
    assert layouts and all(not lay.evicts and lay.slots == 47 for lay in layouts)
    ref, ref_logits = run_policy(model, prompts, 17, get_policy("full"), monkeypatch)
    assert out == ref and len(logits) == len(ref_logits) == 17
    assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits))


@pytest.mark.parametrize("key,base", [("llama-gqa", {}), ("opt", {}),
                                      ("llama-gqa", {"base": "scissorhands", "recent": 4})])
def test_ablation_differs_only_by_value_norm(key, base, monkeypatch):
    """vatp with its value weight replaced by ones is vatp-pin, bit for bit; with the real norm
    the kept tokens differ."""
    model = model_for(key)
    prompts = rand_prompts([50, 50], seed=5)
    bufs = {}
    real_alloc = E.allocate

    def run(name, **patch):
        seen = []
        monkeypatch.setattr(E, "allocate", lambda *a: seen.extend(real_alloc(*a)) or seen)
        if patch:
            monkeypatch.setattr(ValueAware, "value_weight", patch["weight"])
        out = run_policy(model, prompts, 10, get_policy(name, budget=0.25, sinks=3, **base),
                         monkeypatch)
        monkeypatch.undo()
        bufs[name + ("*" if patch else "")] = seen
        return out

    def ones(self, v):
        return torch.ones(v.shape[:-1], dtype=torch.float32)
    out_pin, log_pin = run("vatp-pin")
    out_ones, log_ones = run("vatp", weight=ones)
    out_vatp, log_vatp = run("vatp")
    assert out_ones == out_pin
    assert all(torch.equal(a, b) for a, b in zip(log_ones, log_pin))
    for a, b in zip(bufs["vatp*"], bufs["vatp-pin"]):
        assert torch.equal(a.pos[a.valid], b.pos[b.valid])
    # the value norm changes what is kept
    assert any(not torch.equal(a.pos.masked_fill(~a.valid, -1), b.pos.masked_fill(~b.valid, -1))
               for a, b in zip(bufs["vatp"], bufs["vatp-pin"]))
    assert not all(torch.equal(a, b) for a, b in zip(log_vatp, log_pin))


# ------------------------------------------------------------------ options and bad input

def test_describe_and_cap():
    p = get_policy("vatp", budget_tokens=60, sinks=20)
    d = p.describe(p.layout(200, 10))
    assert (d["prefix"], d["ring"], d["pinned"], d["heavy"]) == (29, 30, 20, 9)
    assert (d["base"], d["norm"], d["sinks"]) == ("h2o", "l1", 20)
    p = get_policy("vatp", budget_tokens=11, sinks=20)   # heavy slots < F: F capped
    d = p.describe(p.layout(200, 10))
    assert (d["pinned"], d["heavy"]) == (5, 0)
    assert get_policy("vatp-pin").norm == "none"
    assert get_policy("vatp", norm="L2", budget=0.5).norm == "l2"


@pytest.mark.parametrize("name,args", [
    ("vatp", {"window": 3}), ("vatp-pin", {"norm": "l1"}), ("vatp", {"base": "tova"}),
    ("vatp", {"norm": "l3"}), ("vatp", {"sinks": -2}), ("vatp", {"sinks": "many"}),
])
def test_bad_args(name, args):
    with pytest.raises(UserError):
        get_policy(name, budget=0.5, **args)


@pytest.mark.parametrize("name", ["vatp", "vatp-pin"])
def test_budget_below_minimum(name):
    p = get_policy(name, budget_tokens=2)
    with pytest.raises(UserError, match="minimum of 3"):
        p.layout(100, 10)
    p = get_policy(name, budget=0.02)                    # floor(0.02 * 110) = 2 slots
    with pytest.raises(UserError, match="minimum"):
        p.layout(100, 10)
    get_policy(name, budget_tokens=3).layout(100, 10)    # the minimum itself is accepted


# ------------------------------------------------------------------ base=scissorhands

def test_scissorhands_variant():
    from flexevict.policies.scissorhands import Scissorhands
    p = get_policy("vatp", budget=0.2, base="Scissorhands", sinks=20)
    assert isinstance(p, Scissorhands) and p.name == "vatp"
    assert {k: getattr(p, k) for k in ("base", "sinks", "norm", "recent", "window", "score")} == \
        {"base": "scissorhands", "sinks": 20, "norm": "l1", "recent": 10, "window": 400,
         "score": "attention"}                        # App. A, Eq. 3
    lay = p.layout(300, 20)
    d = p.describe(lay)
    assert (lay.ring, lay.prefix, d["pinned"], d["heavy"]) == (10, 53, 20, 33)
    q = get_policy("vatp-pin", budget=0.2, base="scissorhands", score="count")
    assert isinstance(q, Scissorhands) and q.norm == "none" and q.counting
    assert type(q) is not type(p)
    with pytest.raises(UserError):
        get_policy("vatp", budget=0.2, window=3)            # a Scissorhands arg without its base
    with pytest.raises(UserError):
        get_policy("vatp", budget=0.2, base="scissorhands", score="nope")
    with pytest.raises(UserError, match="minimum"):
        get_policy("vatp", budget_tokens=11, base="scissorhands").layout(100, 10)


@pytest.mark.parametrize("score", ["attention", "count"])
def test_scissorhands_base_end_to_end(score):
    model = model_for("llama-gqa")
    lens = [60, 37]
    p = get_policy("vatp", budget=0.25, base="scissorhands", recent=4, window=6, sinks=3,
                   score=score)
    check, steps = invariant_checker(lens, model, 3)
    run_policy(model, rand_prompts(lens, seed=6), 10, p, check=check)
    assert p.describe(steps["layout"])["heavy"] > 0
    assert steps["n"] == 9 * model.config.num_layers


@pytest.mark.parametrize("base,args", [("h2o", {}),
                                       ("scissorhands", {"recent": 4, "window": 6,
                                                         "score": "attention"})])
def test_pin_control_without_sinks_is_the_base(base, args, monkeypatch):
    """vatp-pin with sinks=0 is the base policy itself (the example's case (c)), bit for bit."""
    model = model_for("opt")
    prompts = rand_prompts([40, 33], seed=8)
    out_b, log_b = run_policy(model, prompts, 10, get_policy(base, budget=0.25, **args),
                              monkeypatch)
    out_p, log_p = run_policy(model, prompts, 10, get_policy("vatp-pin", budget=0.25, sinks=0,
                                                             base=base, **args), monkeypatch)
    assert out_b == out_p and all(torch.equal(a, b) for a, b in zip(log_b, log_p))


# ------------------------------------------------------------------ the default F

@pytest.mark.parametrize("name", ["vatp", "vatp-pin"])
@pytest.mark.parametrize("base", ["h2o", "scissorhands"])
def test_default_pinned_count_is_the_papers_in_its_settings(name, base):
    """App. A: F = 20 at 4K tokens and F = 40 at 8K under a 50% budget (half of it heavy for
    H2O); the default derives both from the context and the heavy slots."""
    for context, want in ((4096, 20), (8192, 40)):
        p = get_policy(name, budget_tokens=context // 2 + 1, base=base)
        lay = p.layout(context - 1, 1)
        assert p.sinks == -1 and p.pinned_count(lay) == want, (context, lay.prefix)


@pytest.mark.parametrize("budget, heavy, want", [(0.05, 12, 1), (0.1, 25, 1), (0.2, 50, 1),
                                                  (0.4, 101, 1), (0.6, 153, 2)])
def test_default_pinned_count_on_short_contexts(budget, heavy, want):
    """512 tokens: round(512 / 204.8) = 2 (1/200 of the context) capped at 2% of the heavy
    slots, at least 1 - not 20 pinned tokens taking 40-100% of the heavy slots."""
    p = get_policy("vatp", budget=budget)
    lay = p.layout(511, 1)
    assert lay.prefix == heavy and p.pinned_count(lay) == want
    d = p.describe(lay)
    assert (d["pinned"], d["heavy"]) == (want, heavy - want)
    # a given F is kept as given (capped at the heavy slots) and F = 0 pins nothing
    assert get_policy("vatp", budget=budget, sinks=20).pinned_count(lay) == min(20, heavy)
    assert get_policy("vatp", budget=budget, sinks=0).pinned_count(lay) == 0


def test_default_sinks_end_to_end():
    """The derived F holds on a real run: the first F real tokens stay at every step."""
    model = model_for("llama-gqa")
    lens = [120, 97]
    policy = get_policy("vatp", budget_tokens=60)
    check, steps = invariant_checker(lens, model, None)
    run_policy(model, rand_prompts(lens, seed=2), 6, policy, check=check)
    assert steps["F"] == policy.pinned_count(steps["layout"]) == 1     # 126 tokens: round(0.6)
    assert steps["n"] == 5 * model.config.num_layers
