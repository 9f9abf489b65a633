"""`recall` (policies/recall.py): the budget pays for the page summaries, every token stays in
the history, each step attends to the sinks, the window and the pages of highest Quest bound
(Quest, Tang et al. 2024, Sec. 3) exactly once each, and a far token that the query needs is
brought back where an eviction policy has lost it."""
import math

import pytest
import torch
from tiny import model_for, rand_prompts

from flexevict.core.kv import KVBuffer
from flexevict.errors import UserError
from flexevict.policies import get_policy
from flexevict.policies import recall as recall_policy
from flexevict.policies.recall import place_pages
from flexevict.runtime.generation import Sampling, generate

ROWS, G, D = 2, 2, 8             # buffer rows (kv heads), query heads per kv head, head dim


def prefilled(policy, prompt, gen, seed=0, pads=(0, 0)):
    """A buffer after `policy`'s prefill of random keys; row r has pads[r] leading pads."""
    lay = policy.layout(prompt, gen)
    buf = KVBuffer(lay, ROWS, D, torch.float32, "cpu", fields=policy.fields(lay))
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(prompt, ROWS, D, generator=g), torch.randn(prompt, ROWS, D, generator=g)
    valid = torch.arange(prompt).unsqueeze(1) >= torch.tensor(pads)
    pos = (valid.long().cumsum(0) - 1).clamp(min=0).to(torch.int32)
    policy.prefill(buf, k, v, pos, valid)
    return buf, g


def step(policy, buf, g, key=None, q=None):
    """One decode step's hooks with a random token (or `key`) and query -> the query."""
    slot = buf.incoming_slot()
    pos = buf.pos[:buf.capacity].max(0).values + 1 if buf.layout.evicts else None
    key = torch.randn(ROWS, D, generator=g) if key is None else key
    buf.write(slot, key, torch.randn(ROWS, D, generator=g), pos.to(torch.int32))
    q = torch.randn(ROWS, G, D, generator=g) if q is None else q
    policy.before_attention(buf, slot, q)
    return slot, q


def attended(buf, r):
    """Positions row r attends to this step (committed slots and the new token)."""
    return buf.pos[:, r][buf.valid[:, r]].tolist()


def test_the_budget_pays_for_the_summaries_and_a_small_one_is_refused():
    lay = get_policy("recall", budget=0.2).layout(2048, 256)
    assert lay.slots + lay.summaries == math.floor(0.2 * 2304)
    assert lay.summaries == math.ceil(2304 / 32) and lay.page == 32
    assert lay.prefix == lay.sinks + lay.pages * lay.page and lay.ring >= 64
    assert lay.prefix + lay.ring == lay.capacity
    small = get_policy("recall", budget_tokens=24).layout(40, 20)       # no page of 16 fits
    assert small.page == 8 and small.slots + small.summaries == 24
    quest = get_policy("recall", budget=0.2, page=16).layout(2048, 256)
    assert quest.page == 16 and quest.summaries == math.ceil(2304 / 16)
    assert get_policy("recall", budget_tokens=24, page=16).layout(10, 10).evicts is False
    with pytest.raises(UserError, match="leaves no page to recall.*raise budget"):
        get_policy("recall", budget_tokens=24, page=16).layout(40, 20)


@pytest.mark.parametrize("pads", [(0, 0), (0, 7)])
def test_each_step_attends_sinks_window_and_pages_each_token_once(pads):
    policy = get_policy("recall", budget_tokens=60, page=4, sinks=2, window=6)
    buf, g = prefilled(policy, 90, 30, pads=pads)
    lay = buf.layout
    for _ in range(25):
        step(policy, buf, g)
        for r in range(ROWS):
            seen = attended(buf, r)
            now = max(seen)
            assert len(seen) == len(set(seen))                          # each token once
            assert set(range(lay.sinks)) <= set(seen)                  # the sinks
            assert set(range(now - lay.ring, now + 1)) <= set(seen)    # window and new token
            assert len(seen) <= lay.sinks + lay.pages * lay.page + lay.ring + 1
        policy.after_attention(buf, buf.scratch, None)
    # every token of the run is in the history, at its position
    history = buf.policy_state["history_k"]                     # (rows, tokens, d)
    assert torch.equal(history[0, :buf.pos[:buf.capacity].max() + 1].isfinite().all(1),
                       torch.ones(90 - pads[0] + 25, dtype=torch.bool))


def test_the_pages_recalled_are_those_of_highest_quest_bound():
    """Against a test-side reference: per row, each page's bound sum_h sum_d max(q m, q M)
    over its keys' minimum m and maximum M; candidates past the sinks and older than the
    window; the highest `pages` of them (ties to the lower page)."""
    policy = get_policy("recall", budget_tokens=70, page=4, sinks=2, window=4)
    buf, g = prefilled(policy, 100, 40, seed=3, pads=(0, 5))
    lay = buf.layout
    for _ in range(6):
        slot, q = step(policy, buf, g)
        hist = buf.policy_state["history_k"]
        for r in range(ROWS):
            now = int(buf.pos[slot, r])
            bounds = {}
            for p in range(math.ceil(now / lay.page)):
                tokens = range(p * lay.page, min((p + 1) * lay.page, now + 1))
                if p * lay.page >= now - lay.ring or (p + 1) * lay.page <= lay.sinks:
                    continue
                keys = hist[r, list(tokens)]
                lo, hi = keys.min(0).values, keys.max(0).values
                bounds[p] = sum(float(torch.maximum(q[r, h] * lo, q[r, h] * hi).sum())
                                for h in range(G))
            best = sorted(bounds, key=lambda p: (-bounds[p], p))[:lay.pages]
            region = buf.pos[lay.sinks:lay.prefix, r]
            got = sorted({int(x) // lay.page for x, ok in
                          zip(region, buf.valid[lay.sinks:lay.prefix, r]) if ok})
            assert got == sorted(best), r
        policy.after_attention(buf, buf.scratch, None)


def test_place_pages_keeps_a_page_in_place_and_fills_freed_places_in_order():
    """Against a test-side loop on random inputs: a page of `top` already resident keeps its
    place; the new ones go, in top's order, to the places whose page left, in place order;
    `fetch` marks exactly the places whose page changed."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        rows, pages = 3, int(torch.randint(1, 7, (1,), generator=g))
        resident = torch.stack([torch.randperm(12, generator=g)[:pages] for _ in range(rows)])
        resident[torch.rand(rows, pages, generator=g) < 0.2] = -1
        top = torch.stack([torch.randperm(12, generator=g)[:pages] for _ in range(rows)])
        placed, fetch = place_pages(resident, top)
        for r in range(rows):
            want, chosen = resident[r].tolist(), top[r].tolist()
            freed = [j for j in range(pages) if want[j] not in chosen]
            for j, page in zip(freed, [p for p in chosen if p not in want]):
                want[j] = page
            assert placed[r].tolist() == want
            assert fetch[r].tolist() == [j in freed for j in range(pages)]


@pytest.mark.parametrize("slots, page, window", [(70, 4, 4), (63, 8, 1)])
def test_recalled_slots_hold_their_tokens_and_a_page_kept_is_not_copied_again(
        monkeypatch, slots, page, window):
    """Step after step every valid recalled slot holds its token's K and V from the history
    exactly, while only the places whose page changed are copied: the first step copies every
    page, a step repeating the last query at most the one page that became a candidate (and,
    with a window shorter than a page, the candidate not yet whole in the history, copied
    again until it is)."""
    policy = get_policy("recall", budget_tokens=slots, page=page, sinks=2, window=window)
    buf, g = prefilled(policy, 120, 30, seed=4, pads=(0, 3))
    lay, state = buf.layout, buf.policy_state
    partial = lay.ring < lay.page - 1          # a candidate page may reach past the history
    assert partial == (slots == 63)
    copied, real = [], recall_policy.gather_pages
    monkeypatch.setattr(recall_policy, "gather_pages", lambda history, pages, fetch, region: (
        copied.append(int(fetch.sum()) * lay.page), real(history, pages, fetch, region)))
    q, direction = None, torch.randn(ROWS, D, generator=g)
    for i in range(30):
        if i < 18:                                  # random queries, every third repeated
            _, q = step(policy, buf, g, q=q if i % 3 == 2 else None)
        else:       # new keys along the query: the newest candidate page scores highest
            step(policy, buf, g, key=4 * direction, q=direction.unsqueeze(1).repeat(1, G, 1))
        assert copied[-1] == copied[-2]                                # K, then V
        if i == 0:
            assert copied[-1] == lay.pages * lay.page * ROWS               # every page
        elif i % 3 == 2:
            assert copied[-1] <= (1 + partial) * lay.page * ROWS
        for s in range(lay.sinks, lay.prefix):
            for r in range(ROWS):
                if buf.valid[s, r]:
                    at = int(buf.pos[s, r])
                    assert torch.equal(buf.k[s, r], state["history_k"][r, at])
                    assert torch.equal(buf.v[s, r], state["history_v"][r, at])
        policy.after_attention(buf, buf.scratch, None)
    assert max(copied[4:24:6]) < copied[0]


def test_pages_that_came_back_through_a_compressed_home_are_copied_again(monkeypatch):
    """A 4-bit compressed cache home returns the region's K/V rounded, not as written: a load
    from one flags the buffer (`lossy_home`) and recall then copies every page each step, so
    its pages stay exact as on any other placement."""
    from flexevict.runtime.engine import compressed
    from flexevict.runtime.offload import load_into
    policy = get_policy("recall", budget_tokens=70, page=4, sinks=2, window=4)
    buf, g = prefilled(policy, 120, 30, seed=6)
    work = KVBuffer(buf.layout, ROWS, D, torch.float32, "cpu", fields=policy.fields(buf.layout))
    home = KVBuffer(buf.layout, ROWS, D, torch.float32, "cpu", fields=policy.fields(buf.layout))
    load_into(work, home)
    assert not work.lossy_home
    home.k, home.v = compressed(home.k, lambda t: t), compressed(home.v, lambda t: t)
    load_into(work, home)
    assert work.lossy_home
    copied, real = [], recall_policy.gather_pages
    monkeypatch.setattr(recall_policy, "gather_pages", lambda history, pages, fetch, region: (
        copied.append(int(fetch.sum())), real(history, pages, fetch, region)))
    buf.lossy_home = True
    q = torch.randn(ROWS, G, D, generator=g)
    region = slice(buf.layout.sinks, buf.layout.prefix)
    for _ in range(4):
        buf.dirty = []
        step(policy, buf, g, q=q)                          # one query: pages would stay
        policy.after_attention(buf, buf.scratch, None)
        assert region not in buf.dirty                     # not stored: never read back
    assert copied == [ROWS * buf.layout.pages] * 8


def test_a_far_token_the_query_needs_comes_back():
    """A key planted early in a long prompt, aligned with a later query: recall attends to it;
    the window and sinks alone (what streaming keeps) do not hold it."""
    policy = get_policy("recall", budget_tokens=120, page=4, sinks=2, window=4)
    buf, g = prefilled(policy, 300, 20, seed=5)
    direction = torch.randn(ROWS, D, generator=g)
    needle = 40
    buf.policy_state["history_k"][:, needle] = 8 * direction
    policy._summarise(buf, buf.policy_state["history_k"][:, :300].transpose(0, 1),
                      torch.ones(300, ROWS, dtype=torch.bool))
    assert all(needle not in attended(buf, r) for r in range(ROWS))
    step(policy, buf, g, q=direction.unsqueeze(1).expand(ROWS, G, D).contiguous())
    assert all(needle in attended(buf, r) for r in range(ROWS))


def test_generation_runs_and_the_whole_budget_is_full():
    m = model_for("opt")
    ps = rand_prompts([50, 37], seed=9)
    full = generate(m, ps, 12, get_policy("full"), Sampling(), (), 0)
    assert generate(m, ps, 12, get_policy("recall", budget=1.0), Sampling(), (), 0) == full
    out = generate(m, ps, 12, get_policy("recall", budget=0.6), Sampling(), (), 0)
    assert [len(o) for o in out] == [12, 12]


def test_the_memory_plan_counts_the_history_in_the_cache_home():
    """The history stays with the cache's home (CPU here), the buffer's slots as before."""
    from flexevict.core.config import registry_config
    from flexevict.runtime.memory import MemoryPlan
    from flexevict.runtime.placement import Placement
    config = registry_config("smollm2-135m")
    lay = get_policy("recall", budget=0.1).layout(6144, 64)
    placement = Placement.from_percent((100, 0, 0, 100, 100, 0), gpu_batch_size=2)
    without = MemoryPlan(config, placement, torch.float16, 2, 6144, 64, lay.slots)
    plan = MemoryPlan(config, placement, torch.float16, 2, 6144, 64, lay.slots, lay.home_tokens)
    history = config.num_layers * 2 * 6208 * 2 * config.num_kv_heads * config.dim_head * 2
    assert lay.home_tokens == 6208
    assert plan.cache_part(False)["cpu"] - without.cache_part(False)["cpu"] == history
    assert plan.cache_part(False)["gpu"] == without.cache_part(False)["gpu"]
