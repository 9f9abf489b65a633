"""flexevict.core.kernels: the PyTorch references on hand-made and random inputs (CPU), the
dispatch's argument checks, and - on a CUDA machine - every kernel against its reference on fresh
random inputs (outputs poisoned first) plus greedy generation with kernels == without, per policy.

GPU tests skip with "needs a CUDA GPU" elsewhere; on a GPU machine `pytest tests/test_kernels.py`
builds the extension (just in time when setup.py did not) and runs everything."""
import copy
import math

import pytest
import torch

from flexevict.core import kernels, kv
from flexevict.core.config import ModelConfig
from flexevict.runtime.generation import Sampling, generate
from flexevict.core.kernels import ext
from flexevict.core.kernels import reference as ref
from flexevict.core.kv import KVBuffer, Layout
from flexevict.core.model import Transformer
from flexevict.policies import POLICIES, get_policy
from flexevict.policies.base import add_attention
from flexevict.io.weights import DummyWeights
from tiny import prefill_mask

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
FLOATS = list(TOL)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b| (0 when both are all zeros)."""
    scale = b.float().abs().max().clamp_min(1e-30)
    return float((a.float() - b.float()).abs().max() / scale) if b.numel() else 0.0


def buffer_state(buf: KVBuffer) -> dict:
    return {"tensors": [t.clone() for t in buf.tensors()], "used": buf.used,
            "cursor": buf.cursor, "ring_start": buf.ring_start}


def assert_same_buffers(a: KVBuffer, b: KVBuffer, kv_where_valid: bool = False) -> None:
    """Identical selections: every per-slot field equal; K/V equal (at valid slots only when a
    kernel may leave other slots' stale K/V behind, which nothing ever reads)."""
    assert (a.used, a.cursor, a.ring_start) == (b.used, b.cursor, b.ring_start)
    for name in ("valid", "pos", "score", "state"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("k", "v"):
        x, y = getattr(a, name), getattr(b, name)
        if kv_where_valid:
            x, y = x[a.valid], y[b.valid]
        assert torch.equal(x, y), name


# ==================================================================== references on the CPU

def test_backend_names():
    assert kernels.backend("cpu") == "torch-reference"
    assert kernels.backend() in ("cuda-kernels", "torch-reference")


def test_backend_follows_the_switch(monkeypatch):
    monkeypatch.setenv("FLEXEVICT_KERNELS", "0")
    assert kernels.backend("cuda") == "torch-reference"


def test_decode_attention_hand_example():
    q = torch.tensor([[[1.0, 0.0]]])                               # R=1, g=1, d=2
    k = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]], [[5.0, 5.0]]])   # n=3
    v = torch.tensor([[[2.0, 0.0]], [[0.0, 4.0]], [[9.0, 9.0]]])
    valid = torch.tensor([[True], [True], [False]])                # slot 2 is masked
    score = torch.tensor([[1.0], [0.0], [7.0], [3.0]])
    out, p = kernels.decode_attention(q, k, v, valid, 1.0, score)
    e = math.e
    assert torch.allclose(p[0, 0], torch.tensor([e / (e + 1), 1 / (e + 1), 0.0]))
    assert torch.allclose(out[0, 0], torch.tensor([2 * e / (e + 1), 4 / (e + 1)]))
    assert torch.allclose(score[:, 0], torch.tensor([1 + e / (e + 1), 1 / (e + 1), 7.0, 3.0]))


def naive_decode(q, k, v, valid, scale):
    """Row by row, softmax over the valid slots only."""
    rows, g, d = q.shape
    out = torch.zeros(rows, g, d)
    probs = torch.zeros(rows, g, k.shape[0])
    for r in range(rows):
        live = valid[:, r].nonzero().flatten()
        if live.numel() == 0:
            continue
        p = torch.softmax(q[r] @ k[live, r].t() * scale, dim=-1)
        probs[r][:, live] = p
        out[r] = p @ v[live, r]
    return out, probs


@pytest.mark.parametrize("rows,g,n,d", [(1, 1, 1, 4), (3, 2, 17, 8), (4, 3, 33, 5)])
def test_decode_attention_reference_vs_naive(rows, g, n, d):
    gen = torch.Generator().manual_seed(rows * 100 + n)
    q = torch.randn(rows, g, d, generator=gen)
    k, v = torch.randn(2, n, rows, d, generator=gen)
    valid = torch.rand(n, rows, generator=gen) > 0.3
    valid[0, 0] = True
    if rows > 1:
        valid[:, -1] = False                                        # a fully masked row
    score = torch.rand(n + 2, rows, generator=gen)
    before = score.clone()
    out, p = kernels.decode_attention(q, k, v, valid, d ** -0.5, score)
    want_out, want_p = naive_decode(q, k, v, valid, d ** -0.5)
    assert torch.allclose(out, want_out, atol=1e-6) and torch.allclose(p, want_p, atol=1e-6)
    if rows > 1:
        assert not out[-1].any() and not p[-1].any()
    assert torch.allclose(score[:n], before[:n] + want_p.sum(1).t(), atol=1e-6)
    assert torch.equal(score[n:], before[n:])


def test_fused_score_accumulation_counts_once():
    """attend(score=True) adds the step's attention to buf.score itself; add_attention adds
    probabilities only when they were not already scored, so each step counts once."""
    from flexevict.core.model import attend
    buf = KVBuffer(Layout(5), 2, 3, torch.float32, "cpu")
    buf.write(0, torch.randn(2, 3), torch.randn(2, 3), torch.tensor([0, 0], dtype=torch.int32))
    buf.write(1, torch.randn(2, 3), torch.randn(2, 3), torch.tensor([1, 1], dtype=torch.int32))
    q = torch.randn(2, 1, 3)
    _, p = attend(q, buf, 2, 1.0)                                   # not scored: score untouched
    assert torch.equal(buf.score, torch.zeros_like(buf.score))
    add_attention(buf, p, scored=False)                             # the policy adds them
    assert torch.allclose(buf.score[:2], p.sum(1).t())
    _, p2 = attend(q, buf, 2, 1.0, score=True)                      # fused: attend adds
    add_attention(buf, p2, scored=True)                             # ... and this skips
    assert torch.allclose(buf.score[:2], 2 * p.sum(1).t())
    assert torch.equal(buf.score[2:], torch.zeros_like(buf.score[2:]))


def naive_prefill(q, k, v, mask, valid, scale):
    b, h, s, d = q.shape
    g = h // k.shape[1]
    kk, vv = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    logits = (q @ kk.transpose(-1, -2)) * scale
    logits = logits.masked_fill(~mask, float("-inf"))
    p = torch.softmax(logits, dim=-1).nan_to_num(0.0)               # blind rows: zeros
    out = p @ vv
    votes = (p * valid[:, None, :, None]).sum(2)                    # (B, H, S)
    return out, votes.view(b, k.shape[1], g, s).sum(2)


@pytest.mark.parametrize("b,h,hk,s,d,block", [(1, 1, 1, 1, 4, 256), (2, 4, 2, 37, 8, 8),
                                               (3, 3, 3, 20, 6, 7)])
def test_prefill_attention_reference_vs_dense(b, h, hk, s, d, block):
    gen = torch.Generator().manual_seed(s)
    q = torch.randn(b, h, s, d, generator=gen)
    k, v = torch.randn(2, b, hk, s, d, generator=gen)
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[1:, : s // 3] = False                                     # left padding
    mask = prefill_mask(valid)
    if s > 3:
        mask[0, 0, 2] = False                                       # a query that sees nothing
    out, colsum = kernels.prefill_attention(q, k, v, mask, valid, 0.5, block=block)
    want_out, want_col = naive_prefill(q, k, v, mask, valid, 0.5)
    assert torch.allclose(out, want_out, atol=1e-5)
    assert torch.allclose(colsum, want_col, atol=1e-5)


@pytest.mark.parametrize("kind", ["bidirectional", "sliding-window", "random"])
def test_prefill_attention_reference_takes_any_mask(kind):
    """The dispatch accepts any mask, so the reference must not assume a causal one (it once
    skipped every key after each query block)."""
    b, h, hk, s, d = 2, 4, 2, 21, 8
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(b, h, s, d, generator=gen)
    k, v = torch.randn(2, b, hk, s, d, generator=gen)
    valid = torch.ones(b, s, dtype=torch.bool)
    i = torch.arange(s)
    mask = {"bidirectional": torch.ones(s, s, dtype=torch.bool),
            "sliding-window": (i[:, None] - i[None, :]).abs() <= 3,
            "random": torch.rand(s, s, generator=gen) > 0.5}[kind]
    mask = mask.expand(b, 1, s, s).clone()
    out, colsum = kernels.prefill_attention(q, k, v, mask, valid, 0.5, block=4)
    want_out, want_col = naive_prefill(q, k, v, mask, valid, 0.5)
    assert torch.allclose(out, want_out, atol=1e-5) and torch.allclose(colsum, want_col, atol=1e-5)


def hand_buffer():
    """One row, 4 committed slots + scratch: scores 0.5, 0.2, 0.2, 0.9 at positions 3, 1, 0, 2."""
    buf = KVBuffer(Layout(5), 1, 2, torch.float32, "cpu")
    for slot, pos in enumerate([3, 1, 0, 2, 4]):
        buf.write(slot, torch.full((1, 2), float(slot)), torch.full((1, 2), -float(slot)),
                  torch.tensor([pos], dtype=torch.int32))
    buf.score[:, 0] = torch.tensor([0.5, 0.2, 0.2, 0.9, 0.0])
    buf.used = 4
    return buf


def test_victim_ties_go_to_the_oldest_and_empty_slots_first():
    buf = hand_buffer()
    assert kernels.evict_commit(buf, 4, cursor=False, commit="none").tolist() == [2]
    buf.valid[3] = False                                            # an empty slot goes first
    assert kernels.evict_commit(buf, 4, cursor=False, commit="none").tolist() == [3]
    value = torch.tensor([[4.0], [3.0], [2.0], [1.0]])             # an explicit value
    buf.valid[3] = True
    assert kernels.evict_commit(buf, 3, cursor=True, value=value, commit="none").tolist() == [0]


def test_a_nan_score_goes_first_like_an_empty_slot():
    """One semantics for kernel and reference: a NaN value counts as empty (evicted first, by
    age among the empty), never skipped and never index 0 by accident."""
    buf = hand_buffer()
    buf.score[3, 0] = float("nan")                                  # slot 3 (pos 2)
    assert kernels.evict_commit(buf, 4, cursor=False, commit="none").tolist() == [3]
    buf.score[1, 0] = float("nan")                                  # slot 1 (pos 1): older
    assert kernels.evict_commit(buf, 4, cursor=False, commit="none").tolist() == [1]
    value = torch.tensor([[4.0], [float("nan")], [float("inf")]])   # explicit values too
    assert kernels.evict_commit(buf, 3, cursor=False, value=value, commit="none").tolist() == [1]


def test_ring_and_replace_commits():
    buf = hand_buffer()
    buf.ring_start, buf.cursor = 2, 3                               # ring = slots 2, 3
    victims = kernels.evict_commit(buf, 2, cursor=True)            # candidates 0, 1, cursor 3
    assert victims.tolist() == [1]                                  # score 0.2 (0.9 at cursor)
    assert buf.k[:, 0, 0].tolist() == [0, 3, 2, 4, 4]               # cursor -> 1, scratch -> 3
    assert buf.pos[:4, 0].tolist() == [3, 2, 0, 4] and not buf.valid[4, 0]
    assert buf.cursor == 2                                          # wrapped to ring_start
    buf = hand_buffer()
    buf.score[4] = 0.1                                              # scratch is the lowest
    assert kernels.evict_commit(buf, 5, cursor=False, commit="replace").tolist() == [4]
    assert buf.pos[:4, 0].tolist() == [3, 1, 0, 2] and not buf.valid[4, 0]


def ring_buffer(device, cursor: int) -> KVBuffer:
    """A full 33-slot buffer of 5 rows (ring [16, 33)) with random K/V, scores and positions."""
    cap, rows, g = 33, 5, torch.Generator().manual_seed(0)
    buf = KVBuffer(Layout(cap + 1), rows, 16, torch.float32, device)
    for t in (buf.k, buf.v, buf.score):
        t.copy_(torch.rand(t.shape, generator=g))
    buf.pos[:cap] = torch.rand(cap, rows, generator=g).argsort(dim=0).to(torch.int32)
    buf.pos[cap], buf.valid[:] = cap, True
    buf.used, buf.ring_start, buf.cursor = cap, 16, cursor
    return buf


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("cursor", [20, 32])                          # 32: wraps to 16
@pytest.mark.parametrize("commit", ["evict_commit", "ring_commit"])
def test_a_ring_cursor_kept_on_the_device_is_the_one_read(device, cursor, commit):
    """A buffer keeping its ring cursor on the device (`cursor_at`, what lets one CUDA graph
    serve every ring position) is committed at that cursor whatever its host int says, by the
    reference and the kernel alike, and the cursor advances there."""
    if device == "cuda":
        assert ext.load() is not None, "the CUDA kernels did not build"
    kept, plain = ring_buffer(device, cursor), ring_buffer(device, cursor)
    kept.keep_counters_on_device()
    kept.cursor = 17                          # stale: what a replayed graph's launch holds
    victims = torch.arange(5, device=device) * 3 % 16

    def commit_once(buf):
        if commit == "evict_commit":
            return kernels.evict_commit(buf, buf.ring_start, cursor=True)
        kernels.ring_commit(buf, victims)
        return victims
    assert torch.equal(commit_once(kept), commit_once(plain))
    assert int(kept.cursor_at) == plain.cursor == (21 if cursor == 20 else 16)
    kept.cursor = plain.cursor                # the stale mirror, for the comparison below
    assert_same_buffers(kept, plain)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_a_fill_count_kept_on_the_device_is_where_a_token_goes(device, monkeypatch):
    """A filling buffer keeping its fill count on the device (`used_at`, what lets one CUDA
    graph serve a span of filling steps) writes the new token at that count whatever its host
    int says and counts it there; on a GPU it attends over the fill rounded up to FILL_SPAN."""
    monkeypatch.setattr(kv, "FILL_SPAN", 8)
    monkeypatch.setattr(kv, "SPAN_DEVICES", ("cuda", "cpu"))
    buf = KVBuffer(Layout(21), 3, 4, torch.float32, device)          # 20 committed slots
    buf.used = 5
    buf.keep_counters_on_device()
    buf.used_at.fill_(7)                      # ahead of a stale host value, as at a replay
    k, v = torch.ones(3, 4, device=device), torch.full((3, 4), 2.0, device=device)
    slot = buf.incoming_slot()
    buf.write(slot, k, v, torch.full((3,), 9, dtype=torch.int32, device=device))
    assert slot == 5 and buf.valid.any(1).nonzero().flatten().tolist() == [7]
    assert buf.k[7].eq(1).all() and buf.v[7].eq(2).all() and buf.pos[7].eq(9).all()
    assert buf.attended(slot) == 8                     # 6 slots rounded up to the span
    buf.commit_appended(slot)
    assert (buf.used, int(buf.used_at)) == (6, 8)
    buf.used = buf.capacity                            # full: the scratch slot, no span
    assert buf.attended(buf.incoming_slot()) == 21


def test_hash_victims_farthest_key_with_sinks_protected():
    buf = KVBuffer(Layout(6), 1, 2, torch.float32, "cpu")
    codes = [0b1111, 0b0000, 0b0011, 0b0001, 0b0111]                # slot 0 is a sink
    for slot, c in enumerate(codes):
        buf.write(slot, torch.zeros(1, 2), torch.zeros(1, 2),
                  torch.tensor([slot], dtype=torch.int32))
        buf.state[slot] = float(c)
    buf.used, buf.ring_start, buf.cursor = 5, 4, 4
    query = torch.tensor([[[0b1111]]])
    # distances 0 (sink, protected), 4, 2, 3, 1 -> slot 1
    assert kernels.hash_victims(buf, query, protect=1).tolist() == [1]
    assert not buf.valid[1, 0]


def python_compact(valid, rank, prefix, ring):
    """One row: (aligned keep list, holes) by the rule of compact_prompt, in plain Python."""
    real = [i for i in range(len(valid)) if valid[i]]
    order = real + [i for i in range(len(valid)) if not valid[i]]
    begin = max(len(real) - ring, 0)
    ranked = sorted(range(len(order)),
                    key=lambda a: (-(rank[order[a]] if a < begin else -math.inf), a))
    heavy = sorted(ranked[:prefix])
    recent = [begin + j for j in range(ring)]
    keep = heavy + [min(a, len(order) - 1) for a in recent]
    holes = [a >= begin for a in heavy] + [a >= len(real) for a in recent]
    return [order[a] for a in keep], holes


def test_compact_prompt_reference_vs_python():
    gen = torch.Generator().manual_seed(5)
    s, rows, prefix, ring = 23, 4, 5, 6
    k = torch.randn(s, rows, 3, generator=gen)
    valid = torch.ones(s, rows, dtype=torch.bool)
    valid[:4, 1] = False
    valid[:15, 2] = False                                           # shorter than the buffer
    valid[:19, 3] = False
    pos = (valid.long().cumsum(0) - 1).clamp(min=0).to(torch.int32)
    rank = torch.randint(0, 4, (s, rows), generator=gen).float()    # many ties
    buf = KVBuffer(Layout(prefix + ring + 1, prefix=prefix, ring=ring), rows, 3, torch.float32,
                   "cpu")
    kernels.compact_prompt(buf, k, -k, pos, valid, rank, rank)
    for r in range(rows):
        keep, holes = python_compact(valid[:, r].tolist(), rank[:, r].tolist(), prefix, ring)
        assert torch.equal(buf.k[:prefix + ring, r], k[keep, r]), r
        assert buf.valid[:prefix + ring, r].tolist() == [valid[i, r].item() and not h
                                                          for i, h in zip(keep, holes)]
    assert buf.used == prefix + ring


def test_buzz_pass_hand_example():
    """k=1, w=2, T=3, s=3: 8 tokens, middle 5 > T; the 2 old tokens are sampled every 2nd, the
    3 new ones form one chunk that keeps its (first) maximum."""
    buf = KVBuffer(Layout(9), 1, 1, torch.float32, "cpu")
    for slot in range(8):
        buf.write(slot, torch.tensor([[float(slot)]]), torch.tensor([[0.0]]),
                  torch.tensor([slot], dtype=torch.int32))
    buf.used = 8
    buf.state[1:3] = 1.0                                            # positions 1, 2 are old
    buf.score[:8, 0] = torch.tensor([0, 0, 0, 0.5, 0.7, 0.7, 0, 0])
    kernels.buzz_pass(buf, 8, 1, 2, 3, 3)
    assert buf.pos[:buf.used, 0].tolist() == [0, 1, 4, 6, 7] and buf.used == 5
    assert buf.state[:5, 0].tolist() == [0, 1, 1, 0, 0]
    assert not buf.valid[5:, 0].any() and (buf.pos[5:8, 0] == -1).all()


# ---------------------------------------------------------------- 4-bit quantisation

def _pages_by_hand(history, pages, region):
    """gather_pages by its definition, slot by slot."""
    want = region.clone()
    page = region.shape[0] // pages.shape[1]
    for r in range(pages.shape[0]):
        for j, p in enumerate(pages[r].tolist()):
            if p >= 0:
                want[j * page:(j + 1) * page, r] = history[r, p * page:(p + 1) * page]
    return want


def test_page_gather_reference_on_a_cpu_reads_only_the_places_to_fetch():
    """Place j of row r holds page pages[r, j] of row r's history afterwards where fetch is
    set; a CPU leaves the other places as they are (they hold their pages already)."""
    g = torch.Generator().manual_seed(0)
    rows, page, d = 3, 4, 5
    history = torch.randn(rows, 6 * page, d, generator=g)
    pages = torch.tensor([[5, 1], [0, 2], [3, 4]])
    fetch = torch.tensor([[True, False], [False, False], [True, True]])
    region = torch.randn(2 * page, rows, d, generator=g)
    want = _pages_by_hand(history, torch.where(fetch, pages, -1), region)
    kernels.gather_pages(history, pages, fetch, region)
    assert torch.equal(region, want)


def test_page_gather_reference_without_host_reads_copies_every_page(monkeypatch):
    """Where reading `fetch` on the host would synchronise (a GPU's tensors), the reference
    copies every page, fetched or not: the same region when kept places hold their pages."""
    monkeypatch.setattr(ref, "host_reads_free", lambda t: False)
    g = torch.Generator().manual_seed(0)
    rows, page, d = 3, 4, 5
    history = torch.randn(rows, 6 * page, d, generator=g)
    pages = torch.tensor([[5, 1], [0, 2], [3, 4]])
    region = torch.randn(2 * page, rows, d, generator=g)
    want = _pages_by_hand(history, pages, region)
    kernels.gather_pages(history, pages, torch.rand(rows, 2, generator=g) < 0.5, region)
    assert torch.equal(region, want)


def test_page_gather_kernels_row_index_fills_the_region_as_the_reference():
    """The GPU path copies history row index[i] into region row i, skipping negative entries
    (`copy_rows`), with `page_rows`' index of the fetched pages: done here by hand into a
    region whose other places already hold their pages (the caller's guarantee), it equals the
    reference."""
    g = torch.Generator().manual_seed(1)
    rows, page, d, places = 4, 3, 2, 5
    history = torch.randn(rows, 7 * page, d, generator=g)
    pages = torch.stack([torch.randperm(7, generator=g)[:places] for _ in range(rows)])
    fetch = torch.rand(rows, places, generator=g) < 0.6
    region = torch.randn(places * page, rows, d, generator=g)
    held = _pages_by_hand(history, torch.where(fetch, -1, pages), region)   # kept: in place
    by_rows = held.clone()
    index = ref.page_rows(torch.where(fetch, pages, -1), page, history.shape[1])
    assert int((index >= 0).sum()) == int(fetch.sum()) * page
    for i, at in enumerate(index.tolist()):
        if at >= 0:
            by_rows.view(-1, d)[i] = history.view(-1, d)[at]
    kernels.gather_pages(history, pages, fetch, held)
    assert torch.equal(by_rows, held)


def test_row_copies_reference():
    table = torch.arange(12.).view(6, 2)
    kernels.put_rows(table, torch.tensor([0, 5]), torch.tensor([[-1., -2.], [-3., -4.]]))
    assert table[0].tolist() == [-1., -2.] and table[5].tolist() == [-3., -4.]
    assert table[1:5].equal(torch.arange(2., 10.).view(4, 2))


def random_pages(rows, g, d, n_pages, dtype, device, seed):
    """q (rows, g, d), a page summary (rows, 2, d, P) whose max is above its min, limits."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, g, d, generator=gen)
    low = torch.randn(rows, d, n_pages, generator=gen)
    summary = torch.stack([low + torch.rand(rows, d, n_pages, generator=gen), low], 1)
    limit = torch.randint(0, 16 * n_pages + 8, (rows,), generator=gen)
    return q.to(device, dtype), summary.to(device, dtype), limit.to(device)


def test_page_select_reference_vs_python():
    """Recall's page choice: per row, by Quest's bound summed over the group, highest first,
    ties to the lower page, among pages starting below the row's limit and past the sinks."""
    page, sinks, pages = 16, 20, 5
    q, summary, limit = random_pages(4, 3, 8, 12, torch.float32, "cpu", 0)
    limit[0] = 0                                              # no candidate: pages 0.. in order
    summary[1, :, :, 7] = summary[1, :, :, 3]                 # a tie: 3 before 7
    got = kernels.page_select(q, summary, limit, page, sinks, pages)
    for r in range(4):
        plus, minus = q[r].clamp(min=0).sum(0), q[r].clamp(max=0).sum(0)
        bounds = []
        for p in range(12):
            ok = p * page < limit[r] and p * page + page > sinks
            bound = float(plus @ summary[r, 0, :, p] + minus @ summary[r, 1, :, p])
            bounds.append((-(bound if ok else float("-inf")), p))
        assert got[r].tolist() == [p for _, p in sorted(bounds)[:pages]], r
    assert got[0].tolist() == [0, 1, 2, 3, 4]


def test_quantize_hand_example():
    x = torch.tensor([[0.0, 1.0, 1.5, 3.0]])
    p = kernels.quantize_4bit(x, group=4)
    assert p.min.tolist() == [[0.0]] and torch.allclose(p.scale, torch.tensor([[0.2]]))
    # codes 0, 5, 8 (7.5 rounds to even), 15 -> bytes 0 | 5 << 4, 8 | 15 << 4
    assert p.data.tolist() == [[0x50, 0xF8]]
    assert torch.allclose(kernels.dequantize_4bit(p), torch.tensor([[0.0, 1.0, 1.6, 3.0]]))


@pytest.mark.parametrize("shape,dim,group", [((3, 130), -1, 64), ((130, 5), 0, 64),
                                             ((2, 7, 9), 1, 4), ((4, 64), 1, 64), ((5,), 0, 2)])
@pytest.mark.parametrize("dtype", FLOATS)
def test_quantize_roundtrip_any_dim(shape, dim, group, dtype):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    p = kernels.quantize_4bit(x, group=group, dim=dim)
    d = dim % x.dim()
    groups = -(-shape[d] // group)
    assert p.data.dtype == torch.uint8 and p.data.shape[d] == groups * group // 2
    assert p.min.shape[d] == groups and p.min.dtype == dtype and p.shape == x.shape
    y = kernels.dequantize_4bit(p)
    assert y.shape == x.shape and y.dtype == dtype
    step = p.scale.float().repeat_interleave(group, dim=d).narrow(d, 0, shape[d])
    slack = 0.51 * step + (1e-2 if dtype == torch.bfloat16 else 2e-3) * x.float().abs()
    assert ((y.float() - x.float()).abs() <= slack + 1e-6).all()
    assert p.nbytes == p.data.numel() + 2 * p.min.numel() * p.min.element_size()


def test_quantize_constant_group_and_padding():
    x = torch.full((2, 70), 3.0)
    p = kernels.quantize_4bit(x)
    assert (p.scale == 0).all() and (p.data == 0).all()
    assert torch.equal(kernels.dequantize_4bit(p), x)
    x = torch.arange(70.0).view(1, 70)                              # 6 padded elements
    p = kernels.quantize_4bit(x)
    assert p.min[0, 1] == 64.0 and p.scale[0, 1] == (69.0 - 64.0) / 15


# ---------------------------------------------------------------- argument checks

def _buf():
    return KVBuffer(Layout(5), 2, 3, torch.float32, "cpu")


BAD_CALLS = {
    "q dtype": (lambda: kernels.decode_attention(torch.zeros(2, 1, 3, dtype=torch.int32),
                                                 torch.zeros(4, 2, 3), torch.zeros(4, 2, 3),
                                                 torch.ones(4, 2, dtype=torch.bool), 1.0), "q"),
    "k shape": (lambda: kernels.decode_attention(torch.zeros(2, 1, 3), torch.zeros(4, 3, 3),
                                                 torch.zeros(4, 2, 3),
                                                 torch.ones(4, 2, dtype=torch.bool), 1.0), "k"),
    "v dtype": (lambda: kernels.decode_attention(torch.zeros(2, 1, 3), torch.zeros(4, 2, 3),
                                                 torch.zeros(4, 2, 3).half(),
                                                 torch.ones(4, 2, dtype=torch.bool), 1.0), "v"),
    "valid dtype": (lambda: kernels.decode_attention(torch.zeros(2, 1, 3), torch.zeros(4, 2, 3),
                                                     torch.zeros(4, 2, 3), torch.ones(4, 2),
                                                     1.0), "valid"),
    "short score": (lambda: kernels.decode_attention(torch.zeros(2, 1, 3), torch.zeros(4, 2, 3),
                                                     torch.zeros(4, 2, 3),
                                                     torch.ones(4, 2, dtype=torch.bool), 1.0,
                                                     torch.zeros(3, 2)), "score"),
    "heads": (lambda: kernels.prefill_attention(torch.zeros(1, 3, 4, 2), torch.zeros(1, 2, 4, 2),
                                                torch.zeros(1, 2, 4, 2),
                                                torch.ones(1, 1, 4, 4, dtype=torch.bool),
                                                torch.ones(1, 4, dtype=torch.bool), 1.0),
              "multiple of kv heads"),
    "mask shape": (lambda: kernels.prefill_attention(torch.zeros(1, 2, 4, 2),
                                                     torch.zeros(1, 2, 4, 2),
                                                     torch.zeros(1, 2, 4, 2),
                                                     torch.ones(1, 4, 4, dtype=torch.bool),
                                                     torch.ones(1, 4, dtype=torch.bool), 1.0),
                   "mask"),
    "commit": (lambda: kernels.evict_commit(_buf(), 2, commit="swap"), "commit"),
    "no candidate": (lambda: kernels.evict_commit(_buf(), 0, cursor=False), "candidate"),
    "value shape": (lambda: kernels.evict_commit(_buf(), 2, value=torch.zeros(2, 2)), "value"),
    "victims dtype": (lambda: kernels.ring_commit(_buf(), torch.zeros(2, dtype=torch.int32)),
                      "victims"),
    "query codes": (lambda: kernels.hash_victims(_buf(), torch.zeros(2, 1, 2, dtype=torch.long),
                                                 1), "one word"),
    "proj dim": (lambda: kernels.hash_codes(torch.zeros(3, 4), torch.zeros(8, 5)), "proj"),
    "reduce": (lambda: kernels.cascade_update(_buf(), None, torch.zeros(2, 1, 3),
                                              kernels.CascadeRule(0, 0.5, "sum", 3)), "reduce"),
    "odd group": (lambda: kernels.quantize_4bit(torch.zeros(4, 8), group=5), "group"),
    "bad dim": (lambda: kernels.quantize_4bit(torch.zeros(4, 8), dim=2), "dim"),
    "int x": (lambda: kernels.quantize_4bit(torch.zeros(4, 8, dtype=torch.int8)), "x"),
    "not packed": (lambda: kernels.dequantize_4bit(torch.zeros(3)), "Packed4bit"),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_arguments_raise_one_line_value_errors(case):
    call, names = BAD_CALLS[case]
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert names in message and "\n" not in message, message


# ==================================================================== kernels vs references

@pytest.fixture(scope="module")
def built():
    """The extension, built if needed; failing to build on a GPU machine is a test failure."""
    module = ext.load()
    assert module is not None, "the CUDA kernels did not build (see the warning above)"
    return module


@pytest.fixture
def reference_only(monkeypatch):
    """Run a block with FLEXEVICT_KERNELS=0: `with reference_only(): ...`."""
    class Switch:
        def __enter__(self):
            monkeypatch.setenv("FLEXEVICT_KERNELS", "0")

        def __exit__(self, *exc):
            monkeypatch.delenv("FLEXEVICT_KERNELS")
    return Switch


def poison():
    """Fill freed CUDA blocks with 0xFF (NaN in every float dtype, -1 / 255 in integers), so an
    output element a kernel forgot to write cannot pass by luck: torch.empty reuses them."""
    sizes = [64 << 20] + [1 << 19] * 32 + [1 << 12] * 128
    blocks = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
    for b in blocks:
        b.fill_(0xFF)
    del blocks


def cuda_gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


DECODE_SHAPES = [(1, 1, 1, 8), (3, 1, 37, 72), (5, 3, 129, 64), (8, 4, 513, 128),
                 (2, 8, 2049, 128), (4, 2, 300, 256)]


@gpu
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("rows,g,n,d", DECODE_SHAPES)
def test_decode_attention_kernel(built, dtype, rows, g, n, d):
    gen = cuda_gen(rows * 7 + n)
    qkv = torch.randn(rows, g + 3, d, device="cuda", generator=gen).to(dtype)
    q = qkv[:, :g]                                                  # strided, as in the model
    k = torch.randn(n + 1, rows, d, device="cuda", generator=gen).to(dtype)
    v = torch.randn(n + 1, rows, d, device="cuda", generator=gen).to(dtype)
    valid = torch.rand(n + 1, rows, device="cuda", generator=gen) > 0.25
    valid[n - 1] = True                                             # the new token
    if rows > 2:
        valid[:, 1] = False                                         # a fully masked row
    score = torch.rand(n + 1, rows, device="cuda", generator=gen)
    want_score = score.clone()
    want_out, want_p = ref.decode_attention(q, k[:n], v[:n], valid[:n], d ** -0.5, want_score)
    poison()
    out, p = kernels.decode_attention_kernel(q, k[:n], v[:n], valid[:n], d ** -0.5, score)
    assert rel_err(out, want_out) <= TOL[dtype]
    assert rel_err(p, want_p) <= TOL[dtype]
    assert rel_err(score, want_score) <= max(TOL[dtype], 1e-5)
    assert torch.equal(score[n], want_score[n])                     # past n: untouched
    assert not p.isnan().any() and not out.isnan().any()
    if rows > 2:
        assert not p[1].any() and not out[1].any()


PREFILL_SHAPES = [(1, 1, 1, 1, 8), (2, 4, 2, 33, 64), (3, 6, 2, 130, 72), (2, 8, 8, 257, 128),
                  (1, 9, 3, 64, 64)]


@gpu
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("b,h,hk,s,d", PREFILL_SHAPES)
def test_prefill_attention_kernel(built, dtype, b, h, hk, s, d):
    gen = cuda_gen(b * 1000 + s)
    q = torch.randn(b, s, h, d, device="cuda", generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(b, s, hk, d, device="cuda", generator=gen).to(dtype).transpose(1, 2)
    v = torch.randn(b, s, hk, d, device="cuda", generator=gen).to(dtype).transpose(1, 2)
    valid = torch.ones(b, s, dtype=torch.bool, device="cuda")
    for i in range(1, b):
        valid[i, : (s * i) // (b + 1)] = False                      # left padding
    mask = prefill_mask(valid)
    if s > 4:
        mask[0, 0, 3] = False                                       # a query that sees nothing
    want_out, want_col = ref.prefill_attention(q, k, v, mask, valid, d ** -0.5, block=64)
    poison()
    out, col = kernels.prefill_attention(q, k, v, mask, valid, d ** -0.5)
    assert rel_err(out, want_out) <= TOL[dtype]
    assert rel_err(col, want_col) <= TOL[dtype]
    assert not out.isnan().any() and not col.isnan().any()


@gpu
def test_prefill_attention_kernel_with_a_non_causal_mask(built):
    b, h, hk, s, d = 2, 4, 2, 70, 64
    gen = cuda_gen(11)
    q = torch.randn(b, h, s, d, device="cuda", generator=gen)
    k, v = torch.randn(2, b, hk, s, d, device="cuda", generator=gen)
    valid = torch.ones(b, s, dtype=torch.bool, device="cuda")
    mask = (torch.rand(b, 1, s, s, device="cuda", generator=gen) > 0.3)
    want_out, want_col = ref.prefill_attention(q, k, v, mask, valid, d ** -0.5, block=16)
    out, col = kernels.prefill_attention(q, k, v, mask, valid, d ** -0.5)
    assert rel_err(out, want_out) <= TOL[torch.float32]
    assert rel_err(col, want_col) <= TOL[torch.float32]


def random_buffer(cap, rows, d, dtype, seed, ring_start, ties=True) -> KVBuffer:
    """A full buffer with random K/V, tied scores, unique positions and some empty slots, plus a
    token in the scratch slot."""
    gen = cuda_gen(seed)
    buf = KVBuffer(Layout(cap + 1), rows, d, dtype, "cuda")
    buf.k.copy_(torch.randn(cap + 1, rows, d, device="cuda", generator=gen))
    buf.v.copy_(torch.randn(cap + 1, rows, d, device="cuda", generator=gen))
    raw = torch.rand(cap + 1, rows, device="cuda", generator=gen)
    buf.score.copy_((raw * 4).floor() / 4 if ties else raw)
    buf.state.copy_(torch.rand(cap + 1, rows, device="cuda", generator=gen))
    order = torch.rand(cap, rows, device="cuda", generator=gen).argsort(dim=0)
    buf.pos[:cap] = order.to(torch.int32)
    buf.pos[cap] = cap
    buf.valid.copy_(torch.rand(cap + 1, rows, device="cuda", generator=gen) > 0.1)
    buf.valid[cap] = True
    buf.used, buf.ring_start = cap, ring_start
    buf.cursor = ring_start + seed % max(cap - ring_start, 1)
    return buf


def both(fn, buf, reference_only):
    """fn(copy) with kernels, fn(copy) with the reference -> (kernel buf, out), (ref buf, out)."""
    a, b = copy.deepcopy(buf), copy.deepcopy(buf)
    poison()
    out_a = fn(a)
    with reference_only():
        out_b = fn(b)
    return (a, out_a), (b, out_b)


EVICT_CASES = [(1, 1, 8, 0), (7, 3, 8, 3), (33, 5, 64, 16), (410, 24, 128, 205),
               (2047, 3, 128, 1024)]


@gpu
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("cap,rows,d,ring_start", EVICT_CASES)
@pytest.mark.parametrize("mode", ["ring", "ring-heavy-only", "ring-value", "replace", "none"])
def test_evict_commit_kernel(built, reference_only, dtype, cap, rows, d, ring_start, mode):
    buf = random_buffer(cap, rows, d, dtype, cap + rows, ring_start)
    end, cursor = (cap + 1, False) if mode == "replace" else (ring_start, mode != "ring-heavy-only")
    if end + cursor == 0:
        pytest.skip("no candidate in this layout")
    value = None
    if mode == "ring-value":
        value = (torch.rand(end + 1, rows, device="cuda", generator=cuda_gen(3)) * 3).floor()
        value[0] = float("inf")
    commit = {"replace": "replace", "none": "none"}.get(mode, "ring")
    (a, va), (b, vb) = both(lambda x: kernels.evict_commit(x, end, cursor, value, commit), buf,
                            reference_only)
    assert torch.equal(va, vb)
    assert_same_buffers(a, b)


@gpu
@pytest.mark.parametrize("dtype", FLOATS)
def test_evict_commit_kernel_with_nan_scores(built, reference_only, dtype):
    buf = random_buffer(410, 24, 128, dtype, 7, 205)
    buf.score[torch.randperm(410, generator=torch.Generator().manual_seed(0))[:30]] = float("nan")
    (a, va), (b, vb) = both(lambda x: kernels.evict_commit(x, 205, True), buf, reference_only)
    assert torch.equal(va, vb)
    assert torch.equal(a.k, b.k) and torch.equal(a.pos, b.pos) and torch.equal(a.valid, b.valid)
    assert torch.equal(a.score.isnan(), b.score.isnan())


@gpu
@pytest.mark.parametrize("bits", [6, 16, 40, 70])
@pytest.mark.parametrize("rows,g,cap", [(1, 1, 20), (6, 3, 45), (32, 2, 300)])
def test_hash_victims_and_ring_commit_kernels(built, reference_only, bits, rows, g, cap):
    d, sinks = 64, 4
    buf = random_buffer(cap, rows, d, torch.float16, bits + rows, ring_start=cap - 11)
    words = -(-bits // 32)
    gen = cuda_gen(bits)
    codes = None
    if bits <= 24:
        buf.state.copy_(torch.randint(0, 1 << bits, buf.state.shape, device="cuda",
                                      generator=gen).float())
    else:
        codes = torch.randint(0, 1 << 31, (cap + 1, rows, words), device="cuda", generator=gen)
    query = torch.randint(0, 1 << min(bits, 31), (rows, g, words), device="cuda", generator=gen)

    def step(x):
        victims = kernels.hash_victims(x, query, sinks, codes)
        snapshot = x.valid.clone()
        kernels.ring_commit(x, victims)
        return victims, snapshot

    (a, (va, ma)), (b, (vb, mb)) = both(step, buf, reference_only)
    assert torch.equal(va, vb) and torch.equal(ma, mb)
    assert_same_buffers(a, b)


@gpu
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n,bits,d", [(1, 1, 8), (37, 16, 64), (300, 33, 128), (5, 1024, 80)])
def test_hash_codes_kernel(built, dtype, n, bits, d):
    gen = cuda_gen(n + bits)
    x = torch.randn(n, 3, d, device="cuda", generator=gen).to(dtype)[:, 1]   # strided rows
    proj = torch.randn(bits, d, device="cuda", generator=gen)
    want = ref.hash_codes(x, proj)
    poison()
    got = kernels.hash_codes(x, proj)
    assert got.shape == want.shape
    # compare every bit whose projection is not within rounding of zero (summation order)
    clear = (x.double() @ proj.double().t()).abs() > 1e-3                 # (n, bits)
    j = torch.arange(bits, device="cuda")
    bit = lambda c: (c[:, j // 32] >> (j % 32)) & 1                        # noqa: E731
    assert torch.equal(bit(got)[clear], bit(want)[clear])


COMPACT_CASES = [(10, 3, 8, 3, 4), (50, 3, 16, 0, 20), (300, 5, 64, 60, 59),
                 (2048, 4, 128, 205, 204), (4096, 2, 64, 819, 819)]


@gpu
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("s,rows,d,prefix,ring", COMPACT_CASES)
def test_compact_prompt_kernel(built, reference_only, dtype, s, rows, d, prefix, ring):
    gen = cuda_gen(s + rows)
    k = torch.randn(s, rows, d, device="cuda", generator=gen).to(dtype)
    v = torch.randn(s, rows, d, device="cuda", generator=gen).to(dtype)
    valid = torch.ones(s, rows, dtype=torch.bool, device="cuda")
    for r in range(1, rows):                                        # left padding, one short row
        valid[: (s * r) // rows if r < rows - 1 else s - (prefix + ring) // 2, r] = False
    pos = (valid.long().cumsum(0) - 1).clamp(min=0).to(torch.int32)
    scores = (torch.rand(s, rows, device="cuda", generator=gen) * 8).floor()   # ties
    buf = KVBuffer(Layout(prefix + ring + 1, prefix=prefix, ring=ring), rows, d, dtype, "cuda")
    buf.k[:prefix + ring].fill_(float("nan"))                       # poison the destination
    buf.score[:prefix + ring].fill_(float("nan"))
    (a, _), (b, _) = both(
        lambda x: kernels.compact_prompt(x, k, v, pos, valid, scores, scores),
        buf, reference_only)
    assert_same_buffers(a, b)


BUZZ_CASES = [(1, 0, 2, 3, 20), (4, 6, 10, 5, 60), (4, 36, 160, 5, 201), (2, 100, 600, 7, 900)]


@gpu
@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("k,w,T,s,cap", BUZZ_CASES)
def test_buzz_pass_kernel(built, reference_only, rows, k, w, T, s, cap):
    d = 64
    buf = random_buffer(cap, rows, d, torch.float16, cap + k, ring_start=0)
    gen = cuda_gen(cap)
    counts = torch.randint(max(cap // 2, 1), cap + 1, (rows,), device="cuda", generator=gen)
    slot = torch.arange(cap + 1, device="cuda").unsqueeze(1)
    buf.valid.copy_(slot < counts)                                  # compacted rows...
    buf.valid[cap] = True                                           # ... plus the new token
    buf.pos.copy_(torch.where(buf.valid, slot, -1).to(torch.int32))
    buf.state.copy_((torch.rand(cap + 1, rows, device="cuda", generator=gen) < 0.3).float())
    (a, _), (b, _) = both(lambda x: kernels.buzz_pass(x, cap + 1, k, w, T, s), buf,
                          reference_only)
    assert_same_buffers(a, b, kv_where_valid=True)


@gpu
@pytest.mark.parametrize("reduce", ["mean", "max", "median"])
@pytest.mark.parametrize("kv,batch,slots,opts", [
    (1, 3, 13, {}), (2, 3, 40, {"tie_replace": True}), (4, 2, 77, {"eager_fill": True}),
    (32, 2, 410, {})])
def test_cascade_update_kernel(built, reference_only, reduce, kv, batch, slots, opts):
    d, rows, prompt = 32, kv * batch, slots + 20
    policy = get_policy("cascade", budget_tokens=slots, reduce=reduce, **opts)
    layout = policy.layout(prompt, 200)
    buf = KVBuffer(layout, rows, d, torch.float16, "cuda", kv_heads=kv,
                   fields=policy.fields(layout))
    gen = cuda_gen(slots + kv)
    kk = torch.randn(prompt, rows, d, device="cuda", generator=gen).half()
    valid = torch.ones(prompt, rows, dtype=torch.bool, device="cuda")
    valid[:5, :kv] = False                                          # a padded sequence
    pos = (valid.long().cumsum(0) - 1).clamp(min=0).to(torch.int32)
    policy.prefill(buf, kk, kk.clone(), pos, valid, torch.rand(prompt, rows, device="cuda"))
    for t in range(30):
        slot = buf.incoming_slot()
        buf.write(slot, torch.randn(rows, d, device="cuda", generator=gen).half(),
                  torch.randn(rows, d, device="cuda", generator=gen).half(), pos[-1] + 1 + t)
        n = buf.attended(slot)
        probs = torch.softmax(torch.randn(rows, 2, n, device="cuda", generator=gen), dim=-1)
        (a, _), (b, _) = both(lambda x: policy.after_attention(x, slot, probs), buf,
                              reference_only)
        # the EMA's sums over kv heads may round in another order: state to 1e-6, the rest exact
        assert torch.allclose(a.state, b.state, rtol=1e-6, atol=1e-9), t
        a.state.copy_(b.state)
        assert_same_buffers(a, b)
        for name in ("start", "count"):
            assert torch.equal(a.policy_state[name], b.policy_state[name]), (t, name)
        buf = b


@gpu
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape,dim", [((3, 130), -1), ((130, 5), 0), ((2, 7, 9), 1),
                                       ((64, 4096), 1), ((4096, 64), 0), ((1,), 0)])
def test_quantize_kernel(built, dtype, shape, dim):
    x = torch.randn(shape, device="cuda", generator=cuda_gen(len(shape))).to(dtype)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLEXEVICT_KERNELS", "0")
        want = kernels.quantize_4bit(x, dim=dim)
        want_x = kernels.dequantize_4bit(want)
    poison()
    got = kernels.quantize_4bit(x, dim=dim)
    assert torch.equal(got.data, want.data)
    assert torch.equal(got.min, want.min) and torch.equal(got.scale, want.scale)
    poison()
    assert torch.equal(kernels.dequantize_4bit(got), want_x)


@gpu
@pytest.mark.parametrize("dtype", FLOATS)
def test_quantize_kernel_propagates_nan_like_the_reference(built, dtype):
    x = torch.randn(6, 256, device="cuda", generator=cuda_gen(9)).to(dtype)
    x[1, 5] = x[4, 130] = float("nan")                             # two groups of 64 hold one
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLEXEVICT_KERNELS", "0")
        want = kernels.quantize_4bit(x)
        want_x = kernels.dequantize_4bit(want)
    got = kernels.quantize_4bit(x)
    same = lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)  # noqa: E731
    same(got.min, want.min)
    same(got.scale, want.scale)
    assert torch.equal(got.data, want.data)
    back = kernels.dequantize_4bit(got)
    same(back, want_x)
    assert back[1, :64].isnan().all() and not back[1, 64:].isnan().any()


@gpu
@pytest.mark.parametrize("table_on", ["pinned-host", "gpu", "pageable-host"])
@pytest.mark.parametrize("dtype,row", [(torch.float16, (128,)), (torch.bfloat16, (2, 64)),
                                       (torch.float32, (3,)), (torch.uint8, (5,)),
                                       (torch.float16, (1,))])
def test_put_rows_kernel(built, table_on, dtype, row, monkeypatch):
    """Row scatter from a GPU into a table on it or in host memory (pinned: written by the
    kernel over PCIe; pageable: the reference) equals index_copy_, on random rows and indices
    (odd row widths take the narrow-word paths)."""
    if table_on != "pageable-host":              # the kernel must run, not the reference
        monkeypatch.setattr(ref, "put_rows", lambda *a: pytest.fail("the reference ran"))
    gen = torch.Generator().manual_seed(sum(row) + len(table_on))
    table = torch.randint(0, 250, (1000, *row), generator=gen).to(dtype)
    table = table.pin_memory() if table_on == "pinned-host" else \
        table.cuda() if table_on == "gpu" else table
    index = torch.randperm(1000, generator=gen)[:333]
    new = torch.randint(0, 250, (333, *row), generator=gen).to(dtype)
    expect = table.cpu().index_copy(0, index, new)
    kernels.put_rows(table, index.cuda(), new.cuda())
    torch.cuda.synchronize()
    assert torch.equal(table.cpu(), expect)


@gpu
@pytest.mark.parametrize("history_on", ["pinned-host", "gpu", "pageable-host"])
@pytest.mark.parametrize("dtype,page,d", [(torch.float16, 32, 128), (torch.bfloat16, 16, 64),
                                          (torch.float32, 4, 3), (torch.float16, 2, 1)])
def test_page_gather_kernel(built, history_on, dtype, page, d, monkeypatch):
    """Recall's page gather from a history on the GPU or in host memory (pinned: read by the
    kernel over PCIe; pageable: the reference) into a region on the GPU equals the definition
    on random pages; a quarter of the places already hold their page and are not fetched, and
    the kernel leaves them as they were (poisoned here: a read of them would show)."""
    if history_on != "pageable-host":            # the kernel must run, not the reference
        monkeypatch.setattr(ref, "gather_pages", lambda *a: pytest.fail("the reference ran"))
    gen = torch.Generator().manual_seed(page + d + len(history_on))
    rows, n_pages, places = 6, 40, 9
    history = torch.randn(rows, n_pages * page, d, generator=gen).to(dtype)
    pages = torch.stack([torch.randperm(n_pages, generator=gen)[:places] for _ in range(rows)])
    fetch = torch.rand(rows, places, generator=gen) >= 0.25
    region = torch.randn(places * page, rows, d, generator=gen).to(dtype)
    want = _pages_by_hand(history, pages, region)
    if history_on != "pageable-host":            # kept places: left untouched by the kernel
        want = _pages_by_hand(history, torch.where(fetch, pages, -1), region)
    history = history.pin_memory() if history_on == "pinned-host" else \
        history.cuda() if history_on == "gpu" else history
    poison()
    got = region.cuda()
    kernels.gather_pages(history, pages.cuda(), fetch.cuda(), got)
    assert torch.equal(got.cpu(), want)


@gpu
def test_row_copies_with_a_pinned_table_never_sync(built):
    history = torch.randn(8, 64 * 16, 128).half().pin_memory()
    pages = torch.randint(0, 64, (8, 5), device="cuda")
    fetch = torch.rand(8, 5, device="cuda") < 0.5
    region = torch.randn(5 * 16, 8, 128, device="cuda").half()
    table = history.view(-1, 128)
    torch.cuda.set_sync_debug_mode("error")
    try:
        kernels.gather_pages(history, pages, fetch, region)
        kernels.put_rows(table, torch.randperm(table.shape[0], device="cuda")[:100],
                         region.view(-1, 128)[:100])
    finally:
        torch.cuda.set_sync_debug_mode(0)


@gpu
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("rows,g,d,n_pages,page,sinks,pages",
                         [(1, 1, 8, 1, 16, 4, 1), (5, 3, 64, 37, 16, 4, 8),
                          (24, 4, 128, 2048, 16, 4, 72), (3, 2, 256, 4096, 8, 0, 100),
                          (2, 1, 64, 9, 16, 100, 9)])
def test_page_select_kernel(built, reference_only, dtype, rows, g, d, n_pages, page, sinks,
                            pages):
    q, summary, limit = random_pages(rows, g, d, n_pages, dtype, "cuda", n_pages + rows)
    poison()
    got = kernels.page_select(q, summary, limit, page, sinks, pages)
    with reference_only():
        want = kernels.page_select(q, summary, limit, page, sinks, pages)
    assert got.dtype == torch.int64
    assert_same_pages(got, want, q, summary, limit, page, sinks)


def assert_same_pages(got, want, q, summary, limit, page: int, sinks: int):
    """Two page choices agree up to the rounding of their fp32 bounds: the kernel sums each
    Quest bound in its own order and cuBLAS in another, so two pages whose bounds round apart
    may swap. Per row, the chosen pages must carry the same bounds (computed in fp64) position
    by position within the fp32 sum's rounding (4d x 2^-24 of the terms' size), and the same
    non-candidates (bound -inf, lower page first) where candidates run short."""
    assert got.shape == want.shape
    d = q.shape[-1]
    signed = (q.clamp(min=0).sum(1), q.clamp(max=0).sum(1))     # in q's dtype, as both do
    parts = [s.double().unsqueeze(1) @ summary[:, i].double() for i, s in enumerate(signed)]
    sizes = [s.double().abs().unsqueeze(1) @ summary[:, i].double().abs()
             for i, s in enumerate(signed)]
    bound = (parts[0] + parts[1])[:, 0]                           # (rows, P), fp64
    slack = (sizes[0] + sizes[1])[:, 0].amax(1, keepdim=True) * 4 * d * 2 ** -24
    firsts = torch.arange(summary.shape[-1], device=q.device) * page
    candidate = (firsts < limit.unsqueeze(1)) & (firsts + page > sinks)
    bound = torch.where(candidate, bound, float("-inf"))
    got_bound, want_bound = bound.gather(1, got), bound.gather(1, want)
    finite = want_bound.isfinite()
    assert torch.equal(got_bound.isfinite(), finite)
    assert torch.equal(got[~finite], want[~finite])              # the fill: lower pages first
    gap = (got_bound - want_bound).abs().where(finite, 0.0)
    assert (gap <= slack).all(), float((gap - slack).max())


def test_page_choices_compare_up_to_rounding_not_more():
    """What the GPU comparison accepts, on a CPU: two pages of equal bound in either order
    (what two summation orders may do to bounds that round apart), not a chosen page swapped
    for a lower-bound candidate."""
    page, sinks, pages = 16, 4, 72
    q, summary, limit = random_pages(24, 4, 128, 2048, torch.float32, "cpu", 2072)
    limit[0] = 2048 * page                                        # every page a candidate
    first = kernels.page_select(q, summary, limit, page, sinks, pages)
    summary[0, ..., first[0, 1]] = summary[0, ..., first[0, 0]]   # a tie at the top of row 0
    want = kernels.page_select(q, summary, limit, page, sinks, pages)
    swapped = want.clone()
    swapped[0, :2] = want[0, :2].flip(0)
    assert not torch.equal(swapped, want)
    assert_same_pages(swapped, want, q, summary, limit, page, sinks)
    worse = want.clone()
    worse[0, -1] = next(p for p in range(2048) if p not in want[0].tolist()
                        and p * page + page > sinks)              # a page not chosen: lower
    with pytest.raises(AssertionError):
        assert_same_pages(worse, want, q, summary, limit, page, sinks)


@gpu
@pytest.mark.parametrize("rows,members,n,steps,empty", [(1, 1, 8, 4, False),
                                                        (7, 30, 200, 60, True),
                                                        (768, 405, 1700, 42, True)])
def test_hash_replay_kernel(built, reference_only, rows, members, n, steps, empty):
    """HashEvict's prompt replay, one chunk: the same pool as the reference's loop, as a set
    (which of two equal candidates a row replaces, two empty members say, is not specified)."""
    gen, ring = cuda_gen(rows + members), 10
    first = n - steps + ring                                  # the last arrival is token n - 1
    keys = torch.rand(steps, rows, n, device="cuda", generator=gen)
    pool = torch.randint(0, n - steps, (rows, members + 1), device="cuda", generator=gen)
    if empty:
        pool[:, :members][torch.rand(rows, members, device="cuda", generator=gen) < 0.2] = -1
    live = torch.randint(first, first + steps + 1, (rows,), device="cuda", generator=gen)
    got, want = pool.clone(), pool.clone()
    kernels.hash_replay(keys, got, live, first, ring, int(live.min()), empty)
    with reference_only():
        kernels.hash_replay(keys, want, live, first, ring, int(live.min()), empty)
    assert torch.equal(got[:, :members].sort(1).values, want[:, :members].sort(1).values)


# ---------------------------------------------------------------- end to end

E2E = ModelConfig(arch="llama", name="t", vocab_size=128, hidden_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, ffn_size=256, max_positions=512,
                  tie_embeddings=False)
E2E_OPT = ModelConfig(arch="opt", name="t-opt", vocab_size=128, hidden_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=4, ffn_size=256, max_positions=512,
                      tie_embeddings=False)


@gpu
@pytest.mark.parametrize("config", [E2E, E2E_OPT], ids=["llama-gqa", "opt"])
@pytest.mark.parametrize("name", sorted(n for n in POLICIES if n != "full"))
def test_greedy_tokens_with_kernels_equal_reference(built, reference_only, name, config):
    model = Transformer.load(config, DummyWeights(config, seed=0), device="cuda")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 128, (n,), generator=gen).tolist() for n in (70, 55, 64)]
    fast = generate(model, prompts, 24, get_policy(name, budget=0.3), Sampling(), (), 0)
    with reference_only():
        slow = generate(model, prompts, 24, get_policy(name, budget=0.3), Sampling(), (), 0)
    assert fast == slow
