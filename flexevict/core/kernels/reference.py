"""Pure-PyTorch reference of every CUDA kernel: what CPU runs use, what a GPU uses when the
extension is unavailable or `FLEXEVICT_KERNELS=0`, and what the GPU tests compare the kernels
with. Each function is the one place its logic lives; the policies call it through the dispatch
in `flexevict.core.kernels`.

Shapes: R buffer rows (batch * kv heads), g query heads per kv head, d head dim, n attended
slots, S prompt length, B batch, H / Hk query / kv heads.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from flexevict.core.kv import KVBuffer, left_aligned

WORD_BITS = 32          # SimHash bits per int64 word (values stay non-negative)


# ------------------------------------------------------------------------------ attention

def kv_head_probs(probs: torch.Tensor) -> torch.Tensor:
    """(R, g, n) -> (n, R): a kv head's score is the sum over its query heads."""
    return probs.sum(dim=1).t()


def accumulate_scores(score: torch.Tensor, probs: torch.Tensor) -> None:
    """score (>= n, R) fp32 += probs (R, g, n) summed over the group (H2O's accumulation)."""
    score[:probs.shape[-1]] += kv_head_probs(probs)


def decode_attention(q, k, v, valid, scale: float, score=None):
    """Decode attention of one query token per row over n slots.

    q (R, g, d); k, v (n, R, d); valid (n, R) bool; score (>= n, R) fp32 or None: its first n
    slots gain each slot's probability summed over the group (H2O's accumulation).
    -> out (R, g, d) in q's dtype, probs (R, g, n) fp32. A row with no valid slot gets zeros.
    """
    n = k.shape[0]
    keys, vals = k.transpose(0, 1), v.transpose(0, 1)             # (R, n, d)
    bias = torch.zeros(valid.shape[1], 1, n, dtype=q.dtype, device=q.device)
    bias.masked_fill_(~valid.t().unsqueeze(1), float("-inf"))
    logits = torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=scale)   # (R, g, n)
    p = torch.softmax(logits.float(), dim=-1)
    # no valid slot: 0, not NaN; unconditional, since asking the host whether any row is dead
    # would make a GPU wait. Such a row's logits are all -inf: their max (a reduction along the
    # contiguous slot axis) finds it; valid.any(dim=0), a strided one, took 7.6% of an H200
    # decode step's GPU time (bench/results/README.md, the profile)
    p.masked_fill_(logits.amax(dim=-1, keepdim=True) == float("-inf"), 0.0)
    out = torch.bmm(p.to(vals.dtype), vals)
    if score is not None:
        accumulate_scores(score, p)
    return out, p


def split_decode_attention(q, k, v, valid, scale: float, score=None, heads: bool = True,
                           splits: int | None = None):
    """Decode attention as the split-slot (flash-decoding) kernel computes it: the specification
    of `cuda/split_decode.cu` and its CPU path.

    q (R, g, d); k, v (n, R, d); valid (n, R) bool; score (>= n, R) or None: its first n slots
    gain each valid slot's probability summed over the group -> out (R, g, d) in q's dtype and
    probs: (R, g, n) per query head when `heads`, else (R, 1, n), each slot's probability mass
    summed over the g query heads of its kv head (what `kv_head_probs` reads either way); fp32
    (fp64 for fp64 inputs). Masked slots get 0 and a row with no valid slot zeros throughout.

    splits None: `decode_attention` (torch's batched GEMMs and one softmax, the fast path on a
    CPU). splits s >= 1: the kernel's algorithm. Slots [0, n) fall into s splits of
    ceil(n / s) slots (the last ones shorter, or empty); per split and query head, the logits'
    max m_s (-inf when the split holds no valid slot), l_s = sum exp(logit - m_s) and
    o_s = sum exp(logit - m_s) v; merged, M = max_s m_s, L = sum_s exp(m_s - M) l_s,
    out = sum_s exp(m_s - M) o_s / L and p = exp(logit - M) / L. Logits are q . k in the
    accumulation dtype times scale, rounded to q's dtype (as the kernel and `decode_attention`'s
    matmul in that dtype round them); the rest in fp32 (fp64 for fp64 inputs); V at masked
    slots is never used (the kernel never reads it).
    """
    if splits is None:
        out, p = decode_attention(q, k, v, valid, scale, score)
        return out, (p if heads else p.sum(1, keepdim=True))
    if splits < 1:
        raise ValueError(f"split_decode_attention: splits must be >= 1 or None (got {splits})")
    rows, g, d = q.shape
    n = k.shape[0]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    chunk = -(-n // splits) if n else 1
    width = splits * chunk                                          # >= n: padded with masked
    live = F.pad(valid.t(), (0, width - n), value=False)            # (R, width)
    logits = torch.bmm(q.to(acc), k.to(acc).permute(1, 2, 0)) * scale   # (R, g, n)
    logits = F.pad(logits.to(q.dtype).to(acc), (0, width - n))
    logits = logits.masked_fill(~live.unsqueeze(1), float("-inf")).view(rows, g, splits, chunk)
    vals = torch.where(valid.t().unsqueeze(-1), v.transpose(0, 1).to(acc), 0.0)
    vals = F.pad(vals, (0, 0, 0, width - n)).view(rows, splits, chunk, d)
    # pass 1: each split's max, sum of exponentials and unnormalised output, per head
    m = logits.amax(dim=-1)                                         # (R, g, splits)
    e = torch.exp(logits - _finite(m).unsqueeze(-1))                # masked: exp(-inf) = 0
    sums = e.sum(dim=-1)
    o = torch.einsum("rgsc,rscd->rgsd", e, vals)
    # pass 2: merged max and sum, the output, the probabilities
    big_m = m.amax(dim=-1)                                          # (R, g)
    w = torch.exp(m - _finite(big_m).unsqueeze(-1))                 # empty split: 0
    big_l = (w * sums).sum(dim=-1)
    alive = (big_l > 0).unsqueeze(-1)
    norm = torch.where(alive, big_l.unsqueeze(-1), 1.0)
    out = torch.where(alive, (w.unsqueeze(-1) * o).sum(dim=2) / norm, 0.0)
    logits = logits.view(rows, g, width)[..., :n]
    p = torch.where(alive, torch.exp(logits - _finite(big_m).unsqueeze(-1)) / norm, 0.0)
    mass = p.sum(dim=1, keepdim=True)                               # (R, 1, n)
    if score is not None:
        score[:n] += torch.where(valid, mass[:, 0].t(), 0.0).to(score.dtype)
    return out.to(q.dtype), (p if heads else mass)


def _finite(x: torch.Tensor) -> torch.Tensor:
    """x with -inf (the max of nothing) as 0: exp(-inf - 0) = 0, never exp(-inf + inf)."""
    return torch.where(x == float("-inf"), 0.0, x)


def prefill_attention(q, k, v, mask, valid, scale: float, block: int = 256, fold=None):
    """Prefill attention that also returns each key's attention received (H2O's column sums),
    computed over query blocks so the S x S matrix is never materialised whole.

    q (B, H, S, d), k/v (B, Hk, S, d), mask (B, 1, S, S) bool (any mask; a causal one skips
    the keys after each query block), valid (B, S) -> out (B, H, S, d), column sums (B, Hk, S)
    fp32 summed over query heads, pad queries excluded. A query that may see no key gets a zero
    output and no vote.
    fold(acc, p, first, valid) replaces the column sum with a policy's own prompt statistic;
    p (B, Hk, g, c, S) fp32 are the probabilities of query rows [first, first + c).
    """
    b, h, s, d = q.shape
    hk = k.shape[1]
    g = h // hk
    qg = q.view(b, hk, g, s, d)
    out = torch.empty_like(q).view(b, hk, g, s, d)
    colsum = None if fold else torch.zeros(b, hk, s, dtype=torch.float32, device=q.device)
    blind = ~mask.any(dim=-1)                                      # (B, 1, S) sees no key
    any_blind = bool(blind.any())                                  # prefill only: host reads
    # a causal mask (no query sees a later key) lets query block [i, j) read keys [0, j) only
    causal = not bool(mask.triu(diagonal=1).any())
    kt = k.transpose(-1, -2).unsqueeze(2)                          # (B, Hk, 1, d, S)
    vg = v.unsqueeze(2)
    for i in range(0, s, block):
        e = min(i + block, s)                                      # queries [i, e)
        j = e if causal else s                                     # keys [0, j)
        logits = (qg[:, :, :, i:e] @ kt[..., :j]).float() * scale  # (B, Hk, g, c, j)
        logits.masked_fill_(~mask[:, :, None, i:e, :j], float("-inf"))
        p = logits.softmax(dim=-1)
        if any_blind:
            p.masked_fill_(blind[:, :, None, i:e, None], 0.0)
        out[:, :, :, i:e] = p.to(v.dtype) @ vg[:, :, :, :j]
        if fold:                                                   # folds see all S keys
            colsum = fold(colsum, F.pad(p, (0, s - j)), i, valid)
        else:
            p = p * valid[:, None, None, i:e, None]                # pad queries do not vote
            colsum[..., :j] += p.sum(dim=(2, 3))
    return out.view(b, h, s, d), colsum


# Query rows per block, and bytes of one block's fp32 probabilities (a chunk of sequences x
# Hk x g x rows x S), of `prefill_attention_scores`, by device type. On a CPU the block stays
# near L2 size (measured 1.3-1.5x faster than one 256 MiB block of the whole batch, SmolLM2 at
# 2048 tokens); on a GPU it is large (few launches, tensor cores busy).
PREFILL_BLOCKING = {"cpu": (32, 1 << 22), "cuda": (128, 1 << 28)}


def prefill_blocking(device: torch.device, seqs: int, kv_heads: int, row_bytes: int,
                     block: int | None):
    """(query rows per block, sequences per chunk) of `prefill_attention_scores`; row_bytes:
    the probabilities of one sequence's query row (all heads). The block depends only on the
    device (or the caller), never on the batch, so a sequence's sums do not depend on its
    batch-mates; the chunk bounds memory alone. On a CPU a chunk's matrices (sequences x kv
    heads) are a multiple of the threads, which share the batched GEMMs by matrix."""
    rows, budget = PREFILL_BLOCKING.get(torch.device(device).type, PREFILL_BLOCKING["cuda"])
    rows = block or rows
    chunk = budget // (row_bytes * rows)
    if torch.device(device).type == "cpu":
        threads = torch.get_num_threads()
        step = threads // math.gcd(kv_heads, threads)
        chunk = chunk // step * step or step
    return rows, max(1, min(seqs, chunk))


def prefill_attention_scores(q, k, v, valid, scale: float, fold=None, block=None):
    """Causal prefill attention of left-padded rows that also returns each key's attention
    received (H2O's column sums), from the same probabilities: one pass over query blocks,
    each block's softmax normaliser shared by its output and its sums, so the score costs a
    GEMV over probabilities already in cache and no S x S matrix is ever materialised.

    q (B, H, S, d), k/v (B, Hk, S, d), valid (B, S) bool, real tokens after the pads ->
    out (B, S, H, d) token-major (like `model.causal_attention`), and column sums (B, Hk, S)
    fp32 summed over the query heads of each kv head and over the valid queries. A query sees
    the real keys up to itself; a pad query sees only itself and casts no vote, so no row is
    ever fully masked (its output is finite and never read).
    fold(acc, p, first, valid) replaces the column sum with a policy's own prompt statistic:
    p (b, Hk, g, c, j) fp32 are the probabilities of query rows [first, first + c) over keys
    [0, j) (the later keys get none), pad queries zeroed, for a chunk of b sequences with
    valid (b, S); acc is the chunk's statistic so far (None at its first block).
    block: query rows per block (default: the device's, `PREFILL_BLOCKING`).
    """
    b, h, s, d = q.shape
    hk = k.shape[1]
    g = h // hk
    block, chunk = prefill_blocking(q.device, b, hk, h * s * 4, block)
    q5 = q.view(b, hk, g, s, d)
    keys_t = k.reshape(b * hk, s, d).transpose(1, 2)               # (B*Hk, d, S), one copy
    vals = v.reshape(b * hk, s, d)
    out = torch.empty(b * hk, g, s, d, dtype=q.dtype, device=q.device)
    padded = not bool(valid.all())                                 # prefill: one host read
    votes = valid.to(torch.float32).repeat_interleave(hk, 0).unsqueeze(1)   # (B*Hk, 1, S)
    causal = torch.full((block, block), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
    keys = torch.arange(s, device=q.device)
    unused = q.new_zeros(1, 1, 1)                                  # baddbmm's input, beta=0
    stats = []
    for b0 in range(0, b, chunk):
        b1 = min(b0 + chunk, b)
        r0, r1, n = b0 * hk, b1 * hk, (b1 - b0) * hk
        stat = None if fold else torch.zeros(n, 1, s, dtype=torch.float32, device=q.device)
        for i in range(0, s, block):
            j = min(i + block, s)                                  # causal: keys [0, j) only
            c = j - i
            rows = q5[b0:b1, :, :, i:j].reshape(n, g * c, d)
            logits = torch.baddbmm(unused, rows, keys_t[r0:r1, :, :j], beta=0,
                                   alpha=scale).view(n, g, c, j)
            if padded:     # the small (b, c, j) mask as an additive bias, broadcast over heads
                query = keys[i:j, None]
                sees = ((keys[:j] <= query) & valid[b0:b1, None, :j]) | (keys[:j] == query)
                hidden = torch.zeros(b1 - b0, 1, 1, c, j, dtype=q.dtype, device=q.device)
                hidden.masked_fill_(~sees[:, None, None], float("-inf"))
                logits.view(b1 - b0, hk, g, c, j).add_(hidden)
            else:
                logits[..., i:j].add_(causal[:c, :c])
            p = torch.softmax(logits, dim=-1, dtype=torch.float32)   # (n, g, c, j)
            out[r0:r1, :, i:j] = torch.bmm(p.view(n, g * c, j).to(v.dtype),
                                           vals[r0:r1, :j]).view(n, g, c, d)
            if fold:
                if padded:                                         # pad queries do not vote
                    p = p * votes[r0:r1, :, i:j, None]
                stat = fold(stat, p.view(b1 - b0, hk, g, c, j), i, valid[b0:b1])
            else:                                                  # a GEMV over the queries
                stat[..., :j] += torch.bmm(votes[r0:r1, :, i:j].repeat(1, 1, g),
                                           p.view(n, g * c, j))
        stats.append(stat if fold else stat.view(b1 - b0, hk, s))
    stat = torch.cat(stats) if len(stats) > 1 else stats[0]
    return out.view(b, h, s, d).transpose(1, 2), stat


# ------------------------------------------------------------------------------ victims

def candidate_slots(buf: KVBuffer, end: int, cursor: bool) -> torch.Tensor:
    """Slots [0, end), plus the ring's oldest token `buf.ring_cursor()` when `cursor`: (c,)
    int64.

    Built on the device (arange, then the cursor: a fill with the host int, or a copy of the
    one kept on the device): a tensor made from a Python list would be a blocking
    host-to-device copy every decode step."""
    slots = torch.arange(end + bool(cursor), device=buf.k.device)
    if cursor and buf.cursor_at is not None:
        slots[end:].copy_(buf.cursor_at)
    elif cursor:
        slots[end:].fill_(buf.cursor)
    return slots


def lowest(buf: KVBuffer, value: torch.Tensor, candidates: torch.Tensor | int) -> torch.Tensor:
    """Per row, the candidate slot with the lowest value; empty slots first (a NaN value
    counts as empty: it goes first, never hides), ties -> oldest (smallest pos), then the
    first candidate.

    value (c, R) over candidate slots `candidates`: (c,) slot indices, or an int c for the
    slots [0, c), read as slices (no gathers) -> (R,) slot indices.
    """
    valid, pos = at_slots(buf.valid, candidates), at_slots(buf.pos, candidates)
    value = torch.where(valid, value, float("-inf")).nan_to_num_(
        nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    is_min = value == value.min(dim=0, keepdim=True).values
    # min(dim).indices is the first minimum, like argmin, at half its cost on a CPU
    age = torch.where(is_min, pos, torch.iinfo(torch.int32).max).min(dim=0).indices
    return age if isinstance(candidates, int) else candidates.index_select(0, age)


def at_slots(t: torch.Tensor, slots: torch.Tensor | int) -> torch.Tensor:
    """t's (slots, ...) entries at `slots`: an int c for [0, c) (a view), or a (c,) index.
    index_select, not t[slots]: the same gather at a third of the cost of advanced indexing
    on a CPU, where the per-step bookkeeping is a few dozen such small ops."""
    return t[:slots] if isinstance(slots, int) else t.index_select(0, slots)


def page_select(q, summary, limit, page: int, sinks: int, pages: int) -> torch.Tensor:
    """Recall's pages by Quest's bound (see `kernels.page_select`): one small batched product
    of [s+, s-] with the summaries, the candidates' mask, a top-k.
    q (rows, g, d); summary (rows, 2, d, P); limit (rows,) -> (rows, pages) int64."""
    plus = q.clamp(min=0)
    signed = torch.cat([plus, q - plus], -1).sum(1, keepdim=True)          # (rows, 1, 2d)
    bound = torch.bmm(signed.float(), summary.flatten(1, 2).float())[:, 0]  # (rows, P)
    firsts, past_sinks, lower_first = _page_firsts(summary.shape[-1], page, sinks,
                                                   str(q.device))
    candidate = (firsts < limit.unsqueeze(1)) & past_sinks
    bound = torch.where(candidate, bound, float("-inf"))
    # The stable descending sort's first `pages` as one top-k over distinct int64 keys: the
    # bound's order-preserving integer (+0.0 for -0.0, equal as floats) above the page's
    # rank, the lower page first on ties; a quarter of the sort's time on a CPU.
    bits = (bound + 0.0).view(torch.int32)
    key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64) << 32 | lower_first
    return lower_first[0] - (key.topk(pages, dim=1).values & 0xFFFFFFFF)


@functools.lru_cache(maxsize=64)
def _page_firsts(n_pages: int, page: int, sinks: int, device: str):
    """(first token of each page (P,), whether a page holds a token past the sinks (P,),
    P - 1 - page: larger for a lower page (P,)), made once per layout and device."""
    index = torch.arange(n_pages, device=device)
    firsts = index * page
    return firsts, firsts + page > sinks, n_pages - 1 - index


def gather_pages(history: torch.Tensor, pages: torch.Tensor, fetch: torch.Tensor,
                 region: torch.Tensor) -> None:
    """Recall's page gather (see `kernels.gather_pages`): whole pages as blocks of page x d
    values, gathered where the history lives and written into the region through a view of
    it by place. With both on the CPU only the places to fetch are read (a CPU counts them
    without a host synchronisation): the history is cold in a run, so the 80% of pages kept
    from the last step are bytes not read (bench/README.md, "Pages kept in place"). Otherwise
    every page is copied, the same bytes: the index goes to the history first (from a GPU to
    a CPU history, a host synchronisation) and the pages to the region's device.
    history (rows, n_pages x page, d); pages, fetch (rows, P); region (P x page, rows, d)."""
    rows, n = pages.shape
    page, d = region.shape[0] // n, region.shape[-1]
    per_row = history.shape[1] // page
    blocks = history.view(rows * per_row, page * d)
    places = region.view(n, page, rows, d).permute(2, 0, 1, 3)          # (rows, P, page, d)
    if host_reads_free(fetch) and history.device.type == "cpu":
        row, place = fetch.nonzero(as_tuple=True)
        got = blocks.index_select(0, row * per_row + pages[row, place])
        places.index_put_((row, place), got.view(-1, page, d))      # fetch, region: CPU
        return
    first = torch.arange(rows, device=pages.device).unsqueeze(1) * per_row
    got = blocks.index_select(0, _to((first + pages).flatten(), history.device))
    places.copy_(_to(got, region.device).view(rows, n, page, d))


def host_reads_free(t: torch.Tensor) -> bool:
    """Whether reading t's values on the host (a count, a data-dependent shape) costs no
    synchronisation: t is on the CPU. The decode-step sync check (tests/test_hot_path.py)
    makes it False, so that a CPU runs, and the check sees, the path a GPU takes."""
    return t.device.type == "cpu"


def page_tokens(pages: torch.Tensor, page: int) -> torch.Tensor:
    """The position of the token in each slot of a recalled region: place j of row r holds
    tokens [pages[r, j] x page, (pages[r, j] + 1) x page). pages (rows, P) -> (P x page,
    rows) int64 (negative for a page of -1)."""
    offsets = torch.arange(page, device=pages.device).view(1, -1, 1)
    return (pages.t().unsqueeze(1) * page + offsets).flatten(0, 1)


def page_rows(pages: torch.Tensor, page: int, length: int) -> torch.Tensor:
    """The history rows that fill a region, in its (slot, row) order (the GPU gather's index):
    row r's token t is row r x length + t of the history viewed (rows x length, d); -1 for the
    places of page -1 (not copied).
    pages (rows, P) -> (P x page x rows,) int64."""
    token = page_tokens(pages, page)                                # (P x page, rows); < 0: kept
    first = torch.arange(pages.shape[0], device=pages.device) * length
    return torch.where(token >= 0, first + token, -1).flatten()


def put_rows(table: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """table[index] = rows, where the table lives: table (N, ...), index (n,), rows (n, ...)."""
    table.index_copy_(0, _to(index, table.device), _to(rows, table.device))


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t on `device`, calling Tensor.to only for a real move: the decode-step host-sync check
    (tests/test_hot_path.py) flags every Tensor.to with a device, as a GPU would sync on one."""
    return t if t.device == device else t.to(device)


def evict_commit(buf: KVBuffer, end: int, cursor: bool = True, value=None,
                 commit: str = "ring") -> torch.Tensor:
    """Choose each row's victim among `candidate_slots(buf, end, cursor)` by `lowest` (value
    (c, R), default `buf.score`), then commit the scratch token: "ring" (`buf.ring_commit`),
    "replace" (`buf.replace`) or "none". -> victims (R,)."""
    if cursor:
        slots = candidate_slots(buf, end, cursor)
    else:                                        # slots [0, end): slices
        slots = end
    victims = lowest(buf, at_slots(buf.score, slots) if value is None else value, slots)
    if commit == "ring":
        buf.ring_commit(victims)
    elif commit == "replace":
        buf.replace(victims)
    return victims


# ------------------------------------------------------------------------------ SimHash

def hash_codes(x: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    """SimHash codes: x (..., d) -> (..., words) int64; bit j of the code (bit j % 32 of word
    j // 32) is 1 iff (R x)_j >= 0 (HashEvict's Heaviside, Eq. 2). proj: R (bits, d) fp32.

    A code of <= 24 bits is packed by a product with the bits' values in fp32, exact (sums of
    distinct powers of two below 2**24, which TF32 also holds): a CPU decode step's hash in
    three ops where shifting and summing took five."""
    bits = proj.shape[0]
    if bits > FP32_CODE_BITS:
        return pack_codes(hash_bits(x, proj))
    values = _bit_values(bits, str(x.device))
    code = torch.heaviside(x.to(torch.float32) @ proj.t(), values[:1]) @ values  # H(0) = 2**0
    return code.to(torch.int64).unsqueeze(-1)


def hash_bits(x: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    """The SimHash bits unpacked: x (..., d) -> (..., bits) bool, (R x)_j >= 0."""
    return (x.to(torch.float32) @ proj.t()) >= 0


def pack_codes(bits: torch.Tensor) -> torch.Tensor:
    """(..., c) bool -> (..., ceil(c / 32)) int64 codes, bit j at bit j % 32 of word j // 32."""
    c = bits.shape[-1]
    weighted = bits.to(torch.int64) << (_bit_offsets(c, str(bits.device)))   # bit j's value
    if c <= WORD_BITS:
        return weighted.sum(-1, keepdim=True)
    words = -(-c // WORD_BITS)
    weighted = F.pad(weighted, (0, words * WORD_BITS - c))
    return weighted.view(*weighted.shape[:-1], words, WORD_BITS).sum(-1)


FP32_CODE_BITS = 24      # fp32 holds every integer below 2**24 exactly


@functools.lru_cache(maxsize=16)
def _bit_values(c: int, device: str) -> torch.Tensor:
    """2**j for j < c, (c,) fp32, made once per width and device."""
    return (1 << torch.arange(c, device=device)).to(torch.float32)


@functools.lru_cache(maxsize=16)
def _bit_offsets(c: int, device: str) -> torch.Tensor:
    """j % 32 for j < c, (c,) int64, made once per width and device (a decode step hashes)."""
    return torch.arange(c, device=device) % WORD_BITS


@functools.cache
def _bit_counts(device: str) -> torch.Tensor:
    """Set bits of every 16-bit value: (65536,) uint8 on `device` (64 KiB, made once)."""
    # made on the device itself: a copy from (pageable) host memory would make the GPU's
    # first decode step wait for the host
    values = torch.arange(1 << 16, dtype=torch.int32, device=device)
    table = torch.zeros(1 << 16, dtype=torch.uint8, device=device)
    for b in range(16):
        table += ((values >> b) & 1).to(torch.uint8)
    return table


def popcount(x: torch.Tensor, bits: int = WORD_BITS) -> torch.Tensor:
    """Set bits of each non-negative integer below 2**bits (bits <= 32) -> uint8 (torch has no
    popcount): lookups in a 16-bit table, one for bits <= 16, else two (a third of the ops of
    the SWAR bit tricks). index_select, at half the cost of table[x] on a CPU."""
    table = _bit_counts(str(x.device))

    def look(i):
        return table.index_select(0, i.reshape(-1)).view(i.shape)
    return look(x) if bits <= 16 else look(x & 0xFFFF) + look(x >> 16)


def hamming(hq: torch.Tensor, hk: torch.Tensor, bits: int = WORD_BITS) -> torch.Tensor:
    """Distance of every key code to a kv head's query codes, summed over its query heads.

    hq (R, g, words), hk (n, R, words) of `bits`-bit words (<= 32) -> (n, R) int64. The
    XOR is laid out (g, n, R, words), query heads outermost, so its inner loop runs over the
    rows rather than over a group of two or three (half the time on a CPU)."""
    by_head = hq.transpose(0, 1).contiguous().unsqueeze(1)              # (g, 1, R, words)
    return popcount(by_head ^ hk.unsqueeze(0), bits).sum(dim=(0, -1))


def hash_victims(buf: KVBuffer, query_codes: torch.Tensor, protect: int,
                 codes: torch.Tensor | None = None, bits: int = WORD_BITS) -> torch.Tensor:
    """HashEvict's choice before attention: per row, among the prefix slots and the ring's
    oldest token, the key farthest in Hamming distance from the query codes (R, g, words),
    empty slots first, ties -> oldest; the first `protect` candidates (valid sinks) never go.
    Key codes are `codes` (slots, R, words), or one word stored in `buf.state`; `bits`: the
    width of a word's code (32 but for a single shorter word). The victims are masked out of
    this step's attention. -> victims (R,).

    The rule is one integer key per committed slot, its smallest taken (the first on ties):
    position - distance x 2^32 (farther, then older, first), empty slots below every key
    (the oldest first), valid sinks and ring slots other than the oldest above: a dozen ops
    over slices of the buffer, where gathering the candidates and `lowest`'s generic rule took
    twice as many (a CPU decode step's hook is dispatch-bound)."""
    c, start = buf.capacity, buf.ring_start
    if codes is None:       # one word of <= 24 bits, exact in int32: half the bytes of int64
        keys = buf.state[:c].to(torch.int32).unsqueeze(-1)
        query_codes = query_codes.to(torch.int32)
    else:
        keys = codes[:c]
    pos = buf.pos[:c]
    key = torch.add(pos, hamming(query_codes, keys, bits), alpha=-(1 << 32))
    # empty slots below every key, the oldest of them first (the kernel's order, and `lowest`'s)
    key = torch.where(buf.valid[:c], key, pos.to(torch.int64) + _EMPTY)     # (c, R) int64
    key[:protect].masked_fill_(buf.valid[:protect], _KEEP)
    ring = buf.constant(f"slots:{c}", lambda dev: torch.arange(c, device=dev))[start:]
    key[start:].masked_fill_((ring != buf.ring_cursor()).unsqueeze(1), _NOT_A_CANDIDATE)
    victims = key.min(dim=0).indices
    # valid[victims[r], r] = False; a scatter, since indexed assignment of a Python scalar
    # copies the scalar to the device first (a blocking copy)
    buf.valid.scatter_(0, victims.unsqueeze(0), False)
    return victims


_EMPTY = torch.iinfo(torch.int64).min + (1 << 31)     # hash_victims' keys: an empty slot
                                                      # (plus its int32 position),
_KEEP = torch.iinfo(torch.int64).max - 1              # a valid sink,
_NOT_A_CANDIDATE = torch.iinfo(torch.int64).max       # a ring slot other than the oldest


def hash_replay(keys, pool, live, first: int, ring: int, all_live: int,
                empty: bool = True) -> None:
    """HashEvict's prompt replay over one chunk of steps t = first .. first + c - 1 (see
    `kernels.hash_replay`): per step a gather, an argmax and a scatter. keys (c, rows, n) fp32;
    pool (rows, P + 1) int64, changed in place; live (rows,) int64; empty: a member may be -1
    (else the clamp and the +1 are skipped).

    The arrival competes from the spare column, so one argmax over P + 1 keys decides: keys of
    distinct tokens differ (`_replay_keys`), and a -1 member's key is no token's, so the
    largest is the one `best > arrival` would pick; equal -1 members give the first, as max."""
    npool = pool.shape[1] - 1
    arrival = pool[:, npool]
    live = live.unsqueeze(1)
    for i in range(keys.shape[0]):
        t, kt = first + i, keys[i]
        arrival.fill_(t - ring)
        if empty:                        # a -1 competes as token 0 plus one
            cand = kt.gather(1, pool.clamp(min=0)).add_(pool < 0)
        else:
            cand = kt.gather(1, pool)
        slot = cand.argmax(dim=1, keepdim=True)
        if t >= all_live:                # a row past its length keeps its pool
            slot = torch.where(t < live, slot, npool)
        pool.scatter_(1, slot, t - ring)


# ------------------------------------------------------------------------------ prompt top-k

def compact_prompt(buf: KVBuffer, k, v, pos, valid, scores, rank):
    """RingPolicy's prefill of a prompt longer than the buffer: per row (left-aligned), keep the
    last `ring` real tokens and the `prefix` best by rank among the older ones (ties -> the
    earliest), in position order, into slots [0, prefix + ring) (`buf.layout`'s regions). Rows
    too short to fill a region leave holes (invalid slots).

    k, v (S, R, d); pos, valid, scores (fp32 or None), rank (S, R), all in prompt order."""
    prefix, ring = buf.layout.prefix, buf.layout.ring
    order = left_aligned(valid)
    rank = rank.gather(0, order)
    n_real = valid.sum(0)                                         # (R,)
    slot = torch.arange(k.shape[0], device=k.device).unsqueeze(1)
    ring_begin = (n_real - ring).clamp(min=0)
    eligible = slot < ring_begin                                  # older than the ring
    rank = torch.where(eligible, rank, float("-inf"))
    best = torch.sort(rank, dim=0, descending=True, stable=True).indices[:prefix]
    heavy = best.sort(dim=0).values                               # keep position order
    recent = ring_begin + torch.arange(ring, device=k.device).unsqueeze(1)
    keep = torch.cat([heavy, recent.clamp(max=k.shape[0] - 1)])  # (capacity, R)
    buf.store_prompt(k, v, pos, valid, scores, keep=keep)        # keep is in aligned order
    holes = torch.cat([~eligible.gather(0, heavy), recent >= n_real])
    buf.valid[:prefix + ring] &= ~holes


# ------------------------------------------------------------------------------ BUZZ

def compaction(keep: torch.Tensor, m: int | None = None):
    """Per row, the kept slots first in slot order: keep (n, R) bool -> sel (m, R) int64 slot
    indices with m = the largest kept count, and live (m, R): sel points at a kept slot.
    A caller that knows m passes it; otherwise it is read from the device (a host sync)."""
    count = keep.sum(0)
    if m is None:
        m = int(count.max())
    sel = torch.sort((~keep).to(torch.int8), dim=0, stable=True).indices[:m]
    live = torch.arange(m, device=keep.device).unsqueeze(1) < count
    return sel, live


def buzz_select(valid, old, score, k: int, w: int, T: int, s: int):
    """One BUZZ pass over slots [0, n) of every row. valid, old (n, R) bool, score (n, R).

    Sinks (rank < k) and the window (the last w) stay; the middle's old tokens are
    interval-sampled (every ceil(s/2)-th from the first), its new ones keep the first maximum of
    score per chunk of s. -> keep (n, R), old flag of the kept tokens afterwards (n, R), hit (R,):
    rows whose middle exceeded T (the others keep every valid token)."""
    sh = (s + 1) // 2
    n = valid.shape[0]
    rank = valid.long().cumsum(0) - 1              # a valid slot's index among its row's
    count = valid.sum(0)
    a = (old & valid).sum(0)
    hit = count - k - w > T
    sink = valid & (rank < k)
    window = valid & (rank >= count - w)
    middle = valid & ~sink & ~window
    old_mid = middle & (rank < k + a)
    new_mid = middle & ~old_mid
    old_keep = old_mid & ((rank - k) % sh == 0)    # interval sampling
    chunk = torch.where(new_mid, (rank - k - a) // s, n)          # n: not a new token
    value = torch.where(new_mid, score, float("-inf"))
    best = torch.full((n + 1, valid.shape[1]), float("-inf"), device=score.device)
    best = best.scatter_reduce(0, chunk, value, "amax")
    is_max = new_mid & (value == best.gather(0, chunk))
    first = torch.where(is_max, rank, n)
    first_max = torch.full_like(best, n, dtype=torch.long)
    first_max = first_max.scatter_reduce(0, chunk, first, "amin")
    new_keep = is_max & (rank == first_max.gather(0, chunk))      # local max, first on ties
    sampled = old_keep | new_keep
    keep = torch.where(hit, sink | window | sampled, valid)
    old_after = torch.where(hit, sampled, old & valid)
    return keep, old_after, hit


def buzz_pass(buf: KVBuffer, n: int, k: int, w: int, T: int, s: int,
              used: int | None = None) -> torch.Tensor:
    """Run a BUZZ pass over slots [0, n) and compact every row with one gather per tensor; old
    tokens are flagged by `buf.state` = 1. used: the longest row's kept count when the caller
    knows it (no host sync), or any bound up to n (the gather then clears the slots past each
    row's count too), else None. -> kept tokens per row (R,); the caller sets `buf.used` to
    their maximum."""
    keep, old_after, _ = buzz_select(buf.valid[:n], buf.state[:n] > 0.5, buf.score[:n],
                                     k, w, T, s)
    sel, live = compaction(keep, used)
    m = sel.shape[0]
    at = sel.unsqueeze(-1).expand(-1, -1, buf.k.shape[-1])
    buf.k[:m] = buf.k[:n].gather(0, at)
    buf.v[:m] = buf.v[:n].gather(0, at)
    buf.score[:m] = torch.where(live, buf.score[:n].gather(0, sel), 0.0)
    buf.state[:m] = (old_after.gather(0, sel) & live).float()
    buf.pos[:m] = torch.where(live, buf.pos[:n].gather(0, sel), -1)
    buf.valid[:m] = keep.gather(0, sel) & live
    buf.valid[m:n] = False
    buf.pos[m:n] = -1
    buf.score[m:n] = 0.0
    buf.state[m:n] = 0.0
    return keep.sum(0)


# ------------------------------------------------------------------------------ Cascade

def reduce_heads(x: torch.Tensor, kv_heads: int, how: str, out: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """x (n, R) per kv head -> (n, R) reduced over each sequence's kv heads (Cascade's rho:
    mean, max or median, the lower one for an even count) and repeated for each of them;
    written into `out` (n, R) when given (its last dim contiguous)."""
    n, rows = x.shape
    if kv_heads <= 1:
        return x if out is None else out.copy_(x)
    g = x.view(n, rows // kv_heads, kv_heads)
    r = g.mean(-1) if how == "mean" else g.amax(-1) if how == "max" else g.median(-1).values
    each = r.unsqueeze(-1).expand(n, rows // kv_heads, kv_heads)
    if out is None:
        return each.reshape(n, rows)
    out.view(n, rows // kv_heads, kv_heads).copy_(each)
    return out


class SubCaches(NamedTuple):
    """Cascade's N circular sub-caches after the sink slots: per row, each one's oldest entry
    `start` and fill `count` (N, R) int64 (state: it moves with the buffer); for all rows, each
    one's first slot `base`, `size` and acceptance `period` (N, 1) int64 (constants)."""
    start: torch.Tensor
    count: torch.Tensor
    base: torch.Tensor
    size: torch.Tensor
    period: torch.Tensor


@dataclass(frozen=True)
class CascadeRule:
    """What Cascade's decode step needs besides the buffer (the policy's arguments resolved for
    the run): `sinks` never-scored first slots, the EMA's `gamma`, the kv-head `reduce`
    (mean | max | median), `window` = the sub-caches' total size, and the authors'-code
    switches `tie_replace` (>= instead of >) and `eager_fill`."""
    sinks: int
    gamma: float
    reduce: str
    window: int
    tie_replace: bool = False
    eager_fill: bool = False


def cascade_plan(buf: KVBuffer, sub: SubCaches, mu, t, rule: CascadeRule):
    """One insertion (Cascade's Algorithm 1) of the token in the scratch slot, for every row at
    once (rows of a ragged batch have different t, hence their own counters).

    mu (slots, R) scores, t (R,) int64 token index; `sub` the sub-caches after the rule's sink
    slots. Updates sub.start/count and returns (src, dst), both (N + 1, R): one simultaneous
    move (all sources read before any destination is written) that performs the whole cascade;
    pairs that do nothing read and write the scratch slot.
    """
    sc, S = buf.scratch, rule.sinks
    start, count, base, size = sub.start, sub.count, sub.base, sub.size
    sink = t < S
    acc = (t - S).remainder(sub.period) == 0                              # (N, R)
    if rule.eager_fill:
        acc = acc | (count.sum(0) < rule.window)
    full, empty = count == size, count == 0
    push = acc & full
    # the item reaches level i iff every level before it pushed (and evicted its oldest)
    reach = torch.cat([torch.ones_like(push[:1]), push[:-1]]).long().cumprod(0)
    alive = reach.bool() & ~sink
    oldest = base + start
    newest = base + (start + count - 1).remainder(size)
    tail = base + (start + count).remainder(size)
    scratch = torch.full_like(t, sc).unsqueeze(0)
    carry = torch.cat([scratch, oldest[:-1]])           # slot holding the item at level i
    mu_in, mu_new = mu.gather(0, carry), mu.gather(0, newest)
    win = mu_in >= mu_new if rule.tie_replace else mu_in > mu_new
    do_push = alive & push
    do_append = alive & ~push & (acc | empty)
    do_win = alive & ~acc & ~empty & win
    dst = torch.where(do_push, oldest, torch.where(do_append, tail, newest))
    moved = do_push | do_append | do_win
    dst = torch.where(moved, dst, sc)
    src = torch.where(moved, carry, sc)
    start.copy_(torch.where(do_push, (start + 1).remainder(size), start))
    count.add_(do_append.to(count.dtype))
    sink_dst = torch.where(sink, t, sc).unsqueeze(0)
    return torch.cat([scratch, src]), torch.cat([sink_dst, dst])


def cascade_ema(buf: KVBuffer, probs, rule: CascadeRule) -> None:
    """Every non-sink slot's EMA mu <- gamma mu + (1 - gamma) s of this step's attention s
    (probs (R, g, n), summed over the group, reduced over a sequence's kv heads), kept in
    `buf.state`."""
    s = reduce_heads(kv_head_probs(probs), buf.kv_heads, rule.reduce)     # (n, R)
    _ema_step(buf, s, probs.shape[-1], rule)


def _ema_step(buf: KVBuffer, s: torch.Tensor, n: int, rule: CascadeRule) -> None:
    """mu <- gamma mu + (1 - gamma) s for slots [sinks, n), s (>= n, R)."""
    S, gamma = rule.sinks, rule.gamma
    buf.state[S:n].mul_(gamma).add_(s[S:n], alpha=1.0 - gamma)


def cascade_attention(buf: KVBuffer, probs, rule: CascadeRule) -> None:
    """This step's attention s of every slot (probs (R, g, n), summed over the group, reduced
    over a sequence's kv heads) into buf.score[:n], for a stack's commit to fold every layer's
    into the EMA at once (`cascade_fold`): what `cascade_ema` does in two ops per layer, in two
    per step."""
    s = kv_head_probs(probs)
    reduce_heads(s, buf.kv_heads, rule.reduce, out=buf.score[:s.shape[0]])


def cascade_fold(buf: KVBuffer, n: int, rule: CascadeRule) -> None:
    """`cascade_ema`'s update of slots [sinks, n) from the attention `cascade_attention` left
    in buf.score (the same ops on the same values, over a stack's every layer at once), which
    it then clears: Cascade keeps no score between steps, on either path."""
    _ema_step(buf, buf.score, n, rule)
    buf.score[:n].zero_()


def cascade_update(buf: KVBuffer, sub: SubCaches, probs, rule: CascadeRule) -> None:
    """Cascade's full decode step: the EMA (`cascade_ema`; probs None: already taken), then
    the scratch token's insertion (`cascade_plan`)."""
    if probs is not None:
        cascade_ema(buf, probs, rule)
    src, dst = cascade_plan(buf, sub, buf.state, buf.pos[buf.scratch].to(torch.int64), rule)
    buf.move(src, dst)
    buf.valid[buf.scratch] = False
