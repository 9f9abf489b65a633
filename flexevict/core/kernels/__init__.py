"""The eviction hot path: CUDA kernels (cuda/, built as `flexevict._C`), each with a pure-PyTorch
reference (`reference.py`) and one dispatch function here.

A dispatch function runs the kernel when its tensors are on a GPU, the extension is built (ahead
of time or just in time, see `ext.py`) and FLEXEVICT_KERNELS is not 0, and the kernel supports
the sizes; otherwise it runs the reference (always on CPU). Both paths check their arguments the
same way and raise a one-line ValueError naming the argument. `backend()` says which path a
device gets; benchmarks record it.

Shapes: R buffer rows (batch * kv heads), g query heads per kv head, d head dim, n attended
slots, S prompt length, B batch, H / Hk query / kv heads, c candidate slots.
"""
from __future__ import annotations

import torch

from flexevict.core.kernels import ext, reference
from flexevict.core.kernels.ext import backend
from flexevict.core.kernels.quant import Packed4bit, dequantize_4bit, quantize_4bit
from flexevict.core.kernels.reference import (FP32_CODE_BITS, WORD_BITS, CascadeRule, SubCaches,
                                              accumulate_scores, at_slots,
                                              buzz_select, candidate_slots, compaction, hamming,
                                              hash_bits, kv_head_probs, lowest, pack_codes,
                                              page_tokens, popcount, reduce_heads)

__all__ = [  # the dispatch functions (kernel or reference) ...
           "backend", "decode_attention", "split_decode_attention", "prefill_attention",
           "prefill_attention_scores",
           "evict_commit", "ring_commit",
           "hash_codes", "hash_victims", "compact_prompt", "buzz_pass", "cascade_update",
           "cascade_attention", "cascade_fold",
           "quantize_4bit", "dequantize_4bit", "Packed4bit", "gather_pages", "put_rows",
           "page_select", "hash_replay",
           # ... and reference helpers the policies share (no kernel of their own)
           "FP32_CODE_BITS", "WORD_BITS", "CascadeRule", "SubCaches", "accumulate_scores",
           "at_slots", "buzz_select", "candidate_slots", "compaction", "hamming", "hash_bits",
           "kv_head_probs", "lowest", "pack_codes", "page_tokens", "popcount", "reduce_heads"]

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
COMMITS = {"none": 0, "mask": 1, "replace": 2, "ring": 3}
REDUCTIONS = ("mean", "max", "median")     # CascadeRule.reduce (the binding maps the names)


def _fail(op: str, message: str):
    raise ValueError(f"flexevict.core.kernels.{op}: {message}")


def _expect(op: str, name: str, t, shape=None, dtype=None, device=None) -> None:
    """One argument's type, shape (None entries are free), dtype (or tuple) and device."""
    if not isinstance(t, torch.Tensor):
        _fail(op, f"{name} must be a tensor (got {type(t).__name__})")
    if shape is not None and (t.dim() != len(shape) or
                              any(w is not None and w != s for w, s in zip(shape, t.shape))):
        want = "(" + ", ".join("*" if w is None else str(w) for w in shape) + ")"
        _fail(op, f"{name} must have shape {want} (got {tuple(t.shape)})")
    if dtype is not None and t.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)):
        _fail(op, f"{name} must be {dtype} (got {t.dtype}); convert it with .to()")
    if device is not None and t.device != device:
        _fail(op, f"{name} is on {t.device} but the other inputs are on {device}; move it there")


def _lastdim(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dim is contiguous (what the kernels need), else a copy."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _buffer_module(buf):
    """The extension for a plain CUDA KV buffer, else None."""
    return ext.module_for(buf.k) if isinstance(buf.k, torch.Tensor) else None


# ------------------------------------------------------------------------------ attention

def decode_attention(q, k, v, valid, scale: float, score=None):
    """Decode attention of one query token per buffer row over n slots, skipping invalid ones.

    q (R, g, d); k, v (n, R, d) of q's dtype; valid (n, R) bool; score (>= n, R) fp32 or None:
    slot i gains its probability summed over the g query heads (H2O's accumulation, fused).
    -> out (R, g, d), probs (R, g, n) fp32. A row with no valid slot gets zeros.

    Torch ops on every device (batched GEMMs and one softmax): the specification the kernels
    are tested against. The model calls `split_decode_attention` (the same contract; on a GPU
    the split-slot kernel, which passed its 140 GPU tests on an H200, 2026-11-28). The older
    one-block-per-row kernel (5-7x slower than these ops on an H200) is kept, tested and timed
    apart as `decode_attention_kernel`.
    """
    _check_decode_attention(q, k, v, valid, score)
    return reference.decode_attention(q, k, v, valid, scale, score)


def decode_attention_kernel(q, k, v, valid, scale: float, score=None):
    """`decode_attention` through the extension's kernel where it is built and the shape fits
    (else the same torch ops): for its tests and the kernel benchmark."""
    _check_decode_attention(q, k, v, valid, score)
    module = ext.module_for(q)
    rows, g, d = q.shape
    fits = module is not None and ext.decode_attention_fits(module, g, d)
    if not fits or (score is not None and score.stride(1) != 1):
        return reference.decode_attention(q, k, v, valid, scale, score)
    return module.decode_attention(_lastdim(q), _lastdim(k), _lastdim(v), valid.contiguous(),
                                   score, float(scale), ext.stream(q))


def split_decode_attention(q, k, v, valid, scale: float, score=None, heads: bool = True,
                           splits: int | None = None):
    """Decode attention at the memory bound: on a GPU the split-slot (flash-decoding) kernel,
    `cuda/split_decode.cu`; elsewhere, and for shapes it does not take, its reference
    (`reference.split_decode_attention`, which with splits None is `decode_attention`'s torch
    ops). Two launches, no host synchronisation, launch shapes fixed by the sizes: it can be
    captured in a CUDA graph.

    q (R, g, d); k, v (n, R, d) of q's dtype; valid (n, R) bool (empty slots, a filling
    buffer's span past the new token, padding: every mask the buffer has); score (>= n, R) fp32
    or None: each valid slot gains its probability summed over the g query heads (H2O's
    accumulation, fused) -> out (R, g, d) in q's dtype and probs fp32: (R, g, n) per query head
    when `heads` (`decode_attention`'s contract), else (R, 1, n), each slot's probability mass
    summed over its kv head's query heads: `kv_head_probs` reads the same (n, R) scores from
    either (a caller that reads g off probs.shape[1] needs `heads`). A row with no valid slot
    gets zeros.

    splits: blocks per row (None: the kernel picks from (R, n) alone; the reference then runs
    unsplit). The kernel takes head dims that are multiples of 8 up to 256 (64, 96, 128, 256),
    g <= 8, fp32/fp16/bf16, K and V rows 16-byte aligned (a buffer's, or a view of its rows).
    """
    _check_decode_attention(q, k, v, valid, score, "split_decode_attention")
    if splits is not None and (not isinstance(splits, int) or splits < 1):
        _fail("split_decode_attention", f"splits must be an int >= 1 or None (got {splits!r})")
    module = ext.module_for(q)
    if module is None or not _split_decode_fits(module, q, k, v, score):
        return reference.split_decode_attention(q, k, v, valid, scale, score, heads, splits)
    if valid.shape[1] > 1 and valid.stride(1) != 1:
        valid = valid.contiguous()
    return module.split_decode_attention(_lastdim(q), k, v, valid, score, float(scale),
                                         splits or 0, bool(heads), ext.stream(q))


def _split_decode_fits(module, q, k, v, score) -> bool:
    """The split decode kernel takes these tensors: head dim, group and the alignment of K and
    V rows it loads 16 bytes at a time (host-side facts: no synchronisation)."""
    rows, g, d = q.shape
    lim = ext.limits(module)
    if "split_decode_max_group" not in lim:        # an extension built before the kernel
        return False
    if not (1 <= g <= lim["split_decode_max_group"] and 0 < d <= lim["split_decode_max_dim"]
            and d % lim["split_decode_dim_multiple"] == 0):
        return False
    if score is not None and rows > 1 and score.stride(1) != 1:
        return False
    step = lim["split_decode_dim_multiple"]
    return all(t.stride(2) == 1 and t.stride(0) % step == 0 and t.stride(1) % step == 0
               and t.data_ptr() % 16 == 0 for t in (k, v))


def _check_decode_attention(q, k, v, valid, score, op: str = "decode_attention") -> None:
    _expect(op, "q", q, (None, None, None), FLOATS)
    rows, g, d = q.shape
    _expect(op, "k", k, (None, rows, d), q.dtype, q.device)
    n = k.shape[0]
    _expect(op, "v", v, (n, rows, d), q.dtype, q.device)
    _expect(op, "valid", valid, (n, rows), torch.bool, q.device)
    if score is not None:
        _expect(op, "score", score, (None, rows), torch.float32, q.device)
        if score.shape[0] < n:
            _fail(op, f"score has {score.shape[0]} slots, fewer than the {n} attended")


def prefill_attention(q, k, v, mask, valid, scale: float, block: int = 256, fold=None):
    """Causal prefill attention that also returns, per key, the attention it receives summed over
    the query heads of its kv head and over the valid queries (H2O's column sums), without the
    S x S matrix.

    q (B, H, S, d); k, v (B, Hk, S, d); mask (B, 1, S, S) bool (True = may attend); valid (B, S)
    -> out (B, H, S, d), colsum (B, Hk, S) fp32. fold(acc, p, first, valid) replaces the column
    sums with a policy's own statistic (reference only; see `reference.prefill_attention`).
    Any mask; the model's causal prefill uses `prefill_attention_scores` instead (the
    kernel runs one scalar thread per query row, no tensor cores).
    """
    op = "prefill_attention"
    _expect(op, "q", q, (None, None, None, None), FLOATS)
    b, h, s, d = q.shape
    _expect(op, "k", k, (b, None, s, d), q.dtype, q.device)
    hk = k.shape[1]
    if hk == 0 or h % hk:
        _fail(op, f"query heads ({h}) must be a multiple of kv heads ({hk})")
    _expect(op, "v", v, (b, hk, s, d), q.dtype, q.device)
    _expect(op, "mask", mask, (b, 1, s, s), torch.bool, q.device)
    _expect(op, "valid", valid, (b, s), torch.bool, q.device)
    module = ext.module_for(q)
    if module is None or fold is not None or not ext.within(
            module, prefill_max_dim=d, prefill_max_batch_heads=b * h):
        return reference.prefill_attention(q, k, v, mask, valid, scale, block, fold)
    return module.prefill_attention(_lastdim(q), _lastdim(k), _lastdim(v), mask,
                                    valid.contiguous(), float(scale), ext.stream(q))


def prefill_attention_scores(q, k, v, valid, scale: float, fold=None, block=None):
    """Causal prefill attention of left-padded rows and, from the same probabilities, each
    key's attention received, summed over the query heads of its kv head and over the valid
    queries (H2O's column sums); the model calls it for a policy that wants prompt scores and
    SDPA otherwise.

    q (B, H, S, d); k, v (B, Hk, S, d); valid (B, S) bool (pads first) -> out (B, S, H, d),
    and (B, Hk, S) fp32 or fold(acc, p, first, valid)'s statistic; block: query rows per
    block (default: the device's). Torch ops on every device:
    batched GEMMs (tensor cores) and a fused softmax per query block, which beats the
    extension's prefill kernel (one scalar thread per query, see `prefill_attention`) by far
    on a GPU.
    """
    op = "prefill_attention_scores"
    _expect(op, "q", q, (None, None, None, None), FLOATS)
    b, h, s, d = q.shape
    _expect(op, "k", k, (b, None, s, d), q.dtype, q.device)
    if k.shape[1] == 0 or h % k.shape[1]:
        _fail(op, f"query heads ({h}) must be a multiple of kv heads ({k.shape[1]})")
    _expect(op, "v", v, (b, k.shape[1], s, d), q.dtype, q.device)
    _expect(op, "valid", valid, (b, s), torch.bool, q.device)
    return reference.prefill_attention_scores(q, k, v, valid, scale, fold, block)


# ------------------------------------------------------------------------------ victims

def evict_commit(buf, end: int, cursor: bool = True, value=None, commit: str = "ring"):
    """Victim selection and commit of the scratch token, in one launch on a GPU.

    Candidates are slots [0, end) plus the ring's oldest `buf.cursor` when `cursor`; per row the
    lowest `value` (c, R) fp32 (default `buf.score`) goes, empty slots first, ties -> the oldest
    position (`lowest`). commit "ring": `buf.ring_commit(victims)`, "replace": `buf.replace`,
    "none": nothing. -> victims (R,) int64.
    """
    op = "evict_commit"
    if commit not in ("ring", "replace", "none"):
        _fail(op, f"commit must be 'ring', 'replace' or 'none' (got {commit!r})")
    if not 0 <= end <= buf.capacity + 1 or end + bool(cursor) == 0:
        _fail(op, f"no valid candidate range: end={end}, cursor={cursor}, "
                  f"slots={buf.capacity + 1}")
    if value is not None:
        _expect(op, "value", value, (end + bool(cursor), buf.score.shape[1]), torch.float32,
                buf.score.device)
    module = _buffer_module(buf)
    if module is None:
        return reference.evict_commit(buf, end, cursor, value, commit)
    old_cursor = buf.cursor
    victims = module.select_commit(
        buf, end, old_cursor if cursor else -1, None if value is None else value.contiguous(),
        COMMITS[commit], old_cursor, None, ext.stream(buf.k))
    if commit != "none":
        buf.mark(victims)
    if commit == "ring":
        buf.mark(old_cursor)
        buf.advance_cursor()
    return victims


def ring_commit(buf, victims) -> None:
    """`buf.ring_commit(victims)` (victims (R,) int64 chosen earlier, e.g. by `hash_victims`)."""
    _expect("ring_commit", "victims", victims, (buf.score.shape[1],), torch.int64,
            buf.score.device)
    module = _buffer_module(buf)
    if module is None:
        return buf.ring_commit(victims)
    cursor = buf.cursor
    module.select_commit(buf, 0, -1, None, COMMITS["ring"], cursor, victims.contiguous(),
                         ext.stream(buf.k))
    buf.mark(victims)
    buf.mark(cursor)
    buf.advance_cursor()


# ------------------------------------------------------------------------------ SimHash

def hash_codes(x: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    """SimHash codes: x (..., d) -> (..., ceil(bits / 32)) int64; bit j (bit j % 32 of word
    j // 32) is 1 iff (proj x)_j >= 0. proj (bits, d) fp32 on x's device."""
    op = "hash_codes"
    _expect(op, "x", x, None, FLOATS)
    if x.dim() == 0:
        _fail(op, "x must have a last dim (the head dim)")
    _expect(op, "proj", proj, (None, x.shape[-1]), torch.float32, x.device)
    module = ext.module_for(x)
    if module is None or not ext.within(module, lsh_max_bits=proj.shape[0],
                                        lsh_max_dim=x.shape[-1]):
        return reference.hash_codes(x, proj)
    flat = _lastdim(x.reshape(-1, x.shape[-1]))
    words = -(-proj.shape[0] // WORD_BITS)
    codes = torch.empty(flat.shape[0], words, dtype=torch.int64, device=x.device)
    module.lsh_hash(flat, proj.contiguous(), codes, ext.stream(x))
    return codes.view(*x.shape[:-1], words)


def hash_victims(buf, query_codes, protect: int, codes=None, bits: int = WORD_BITS):
    """HashEvict before attention: per row, among the prefix slots [0, ring_start) and the ring's
    oldest token, the key whose code is farthest (Hamming distance summed over the query heads)
    from query_codes (R, g, words); empty slots first, ties -> the oldest; the first `protect`
    candidates are kept while valid. Key codes: `codes` (slots, R, words) int64, or one word
    stored in `buf.state`; bits: a single word's code width (the reference's popcount needs one
    table lookup for <= 16). The victims are masked out of this step's attention. -> (R,) int64."""
    op = "hash_victims"
    rows = buf.score.shape[1]
    _expect(op, "query_codes", query_codes, (rows, None, None), torch.int64, buf.score.device)
    if codes is None and query_codes.shape[-1] != 1:
        _fail(op, "codes kept in buf.state hold one word; pass codes for longer hashes")
    if codes is not None:
        _expect(op, "codes", codes, (buf.score.shape[0], rows, query_codes.shape[-1]),
                torch.int64, buf.score.device)
    module = _buffer_module(buf)
    if module is None:
        return reference.hash_victims(buf, query_codes, protect, codes, bits)
    return module.hash_select(buf, buf.ring_start, buf.cursor, protect, query_codes.contiguous(),
                              None if codes is None else codes.contiguous(), ext.stream(buf.k))


def hash_replay(keys, pool, live, first: int, ring: int, all_live: int,
                empty: bool = True) -> None:
    """HashEvict's prompt replay (Algorithm 1 on token indices) over one chunk of steps
    t = first .. first + c - 1, per row: the pool member (pool[:, :P]; -1 empty, competing as
    token 0 plus one) or the token leaving the ring, a = t - ring, with the largest key goes,
    and a takes its place (a row evicting its arrival writes the spare column P); a row takes
    part while t < live[row] (every row below all_live). keys (c, rows, n) fp32, keys[i, r, x]
    token x's key at step first + i; pool (rows, P + 1) int64, changed in place; live (rows,)
    int64; empty: a member may be -1. One launch on a GPU, the steps in order in each row's
    block; the reference's loop is a gather, a max and a scatter per step."""
    op = "hash_replay"
    _expect(op, "keys", keys, (None, None, None), torch.float32)
    c, rows, n = keys.shape
    _expect(op, "pool", pool, (rows, None), torch.int64, keys.device)
    _expect(op, "live", live, (rows,), torch.int64, keys.device)
    if pool.shape[1] < 2 or first < ring or first + c - 1 - ring >= n:
        _fail(op, f"needs a pool and arrivals within the keys (pool {tuple(pool.shape)}, steps "
                  f"{first}..{first + c - 1}, ring {ring}, {n} tokens)")
    module = ext.module_for(keys)
    if module is None or not pool.is_contiguous():
        return reference.hash_replay(keys, pool, live, first, ring, all_live, empty)
    module.hash_replay(keys.contiguous(), pool, live.contiguous(), first, ring, all_live,
                       ext.stream(keys))


# ------------------------------------------------------------------------------ compaction

def compact_prompt(buf, k, v, pos, valid, scores, rank) -> None:
    """RingPolicy's prefill of a prompt longer than the buffer (`buf.layout`'s prefix + ring
    slots): per row, the last `ring` real tokens and the `prefix` best by rank among the older
    ones (ties -> the earliest), in position order, into slots [0, prefix + ring); short rows
    leave holes.

    k, v (S, R, d); pos int32, valid bool, scores fp32 or None, rank (S, R) in prompt order."""
    op = "compact_prompt"
    _expect(op, "k", k, (None, buf.score.shape[1], None))
    s, rows, d = k.shape
    _expect(op, "v", v, (s, rows, d), k.dtype, k.device)
    _expect(op, "pos", pos, (s, rows), None, k.device)
    _expect(op, "valid", valid, (s, rows), torch.bool, k.device)
    _expect(op, "rank", rank, (s, rows), None, k.device)
    if scores is not None:
        _expect(op, "scores", scores, (s, rows), None, k.device)
    prefix, ring = buf.layout.prefix, buf.layout.ring
    if prefix < 0 or ring < 0 or prefix + ring != buf.capacity or s <= buf.capacity:
        _fail(op, f"prefix ({prefix}) + ring ({ring}) must equal the buffer's {buf.capacity} "
                  f"committed slots, below the prompt's {s} tokens")
    module = _buffer_module(buf)
    if module is None or not ext.within(module, compact_max_seq=s) or \
            k.device != buf.k.device or k.dtype != buf.k.dtype:
        return reference.compact_prompt(buf, k, v, pos, valid, scores, rank)
    as_f32 = lambda t: None if t is None else t.to(torch.float32).contiguous()  # noqa: E731
    module.compact_prompt(_lastdim(k), _lastdim(v), pos.to(torch.int32).contiguous(),
                          valid.contiguous(), as_f32(scores), as_f32(rank), buf, ext.stream(k))
    buf.used = buf.capacity
    buf.touch_all()


# ------------------------------------------------------------------------------ recall

def page_select(q, summary, limit, page: int, sinks: int, pages: int) -> torch.Tensor:
    """Recall's pages for this step (Quest's bound, Tang et al. 2024, Sec. 3): per row, the
    `pages` pages of highest bound sum_e s+_e max_e + s-_e min_e (fp32; s+ and s- the positive
    and negative parts of the row's query heads, summed in q's dtype) among the candidates, a
    page whose first token is below limit[row] and that holds a token past the first `sinks`;
    ties and too few candidates go to the lower page. q (rows, g, d); summary (rows, 2, d, P)
    [max; min] in q's dtype; limit (rows,) int64 -> (rows, pages) int64. One launch on a GPU
    (the bound, the mask and the top-k)."""
    op = "page_select"
    _expect(op, "q", q, (None, None, None), FLOATS)
    rows, _, d = q.shape
    _expect(op, "summary", summary, (rows, 2, d, None), q.dtype, q.device)
    _expect(op, "limit", limit, (rows,), torch.int64, q.device)
    n_pages = summary.shape[-1]
    if page < 1 or sinks < 0 or not 0 <= pages <= n_pages:
        _fail(op, f"needs page >= 1, sinks >= 0 and 0 <= pages <= {n_pages} (got page={page}, "
                  f"sinks={sinks}, pages={pages})")
    module = ext.module_for(q)
    if module is None or not ext.within(module, page_max_pages=n_pages, page_max_dim=d):
        return reference.page_select(q, summary, limit, page, sinks, pages)
    return module.page_select(q.contiguous(), summary.contiguous(), limit.contiguous(), page,
                              sinks, pages, ext.stream(q))


# ------------------------------------------------------------------------------ row copies

def gather_pages(history: torch.Tensor, pages: torch.Tensor, fetch: torch.Tensor,
                 region: torch.Tensor) -> None:
    """Recall's page gather: place j of row r in `region` holds page pages[r, j] of row r's
    history afterwards. A place where fetch is False already holds exactly that page (the
    caller's guarantee): neither the GPU kernel nor, on a CPU, the reference reads it again.

    history (rows, n_pages x page, d), where the cache's home is; pages (rows, P) int64 and
    fetch (rows, P) bool on the region's device; region (P x page, rows, d): the buffer's
    recalled slots, place j being slots [j x page, (j + 1) x page). With the region on a GPU
    and the history on it or in pinned host memory, one kernel copies the fetched pages' token
    rows straight into the region (`copy_rows`; over PCIe for a host history), so the step does
    not synchronise. Otherwise whole pages are gathered where the history lives and copied in
    through a view of the region by place."""
    op = "gather_pages"
    _expect(op, "pages", pages, (None, None), torch.int64, region.device)
    rows, n = pages.shape
    _expect(op, "fetch", fetch, (rows, n), torch.bool, region.device)
    page = region.shape[0] // n if n and region.dim() else 0
    _expect(op, "region", region, (n * page, rows, None))
    _expect(op, "history", history, (rows, None, region.shape[-1]), region.dtype)
    if page == 0 or history.shape[1] % page:
        _fail(op, f"history's {history.shape[1]} tokens per row must be whole pages of the "
                  f"region's {region.shape[0]} slots / {n} places")
    if not (region.is_contiguous() and history.is_contiguous()):
        _fail(op, "history and region must be contiguous (a buffer's slots, a home's field)")
    module = _rows_module(history, pages, region.device)
    if module is None:
        return reference.gather_pages(history, pages, fetch, region)
    d = region.shape[-1]
    index = reference.page_rows(torch.where(fetch, pages, -1), page, history.shape[1])
    module.copy_rows(history.view(-1, d), region.view(-1, d), index, False, ext.stream(region))


def put_rows(table: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """table[index] = rows: table (N, ...), index (n,) int64 with distinct entries in [0, N),
    rows (n, ...) of the table's dtype. Rows on a GPU go to a table on it or in pinned host
    memory by one kernel, without a host synchronisation (recall's history append)."""
    module = _rows_module(table, index, rows.device)
    if module is None:
        return reference.put_rows(table, index, rows)
    module.copy_rows(table, rows.contiguous(), index.contiguous(), True, ext.stream(rows))


def _rows_module(table, index, device):
    """The extension for a row copy between `device` (a GPU, where index is) and a table on
    it or in pinned host memory, else None."""
    if not (_same_gpu(index.device, device) and table.is_contiguous()):
        return None
    if not (_same_gpu(table.device, device) or table.device.type == "cpu" and table.is_pinned()):
        return None
    return ext.module_for(index)


def _same_gpu(a: torch.device, b: torch.device) -> bool:
    """a and b name one GPU ("cuda" is the current one, as torch places it)."""
    if a.type != "cuda" or b.type != "cuda":
        return False
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def buzz_pass(buf, n: int, k: int, w: int, T: int, s: int, used: int | None = None) -> None:
    """One BUZZ pass over slots [0, n) of every row (`reference.buzz_select`), compacting each
    row's kept tokens to the front in slot order; `buf.used` becomes the longest row's count.
    The counts follow BUZZ's rules alone, so the policy predicts it on the host and passes it as
    `used`; without it, it is read from the device (a host sync). Where the buffer keeps its
    fill count on the device (`used_at`, a graphed run), it is set there from the kept counts,
    and the reference clears slots [used, n) through the same gather as the rest, so that no
    shape of the pass depends on the host's count."""
    if not 0 <= n <= buf.capacity + 1:
        _fail("buzz_pass", f"n ({n}) exceeds the buffer's {buf.capacity + 1} slots")
    if used is not None and not 0 <= used <= n:
        _fail("buzz_pass", f"used ({used}) must be in [0, n={n}]")
    module = _buffer_module(buf)
    on_device = buf.used_at is not None
    if module is None or not ext.within(module, buzz_max_slots=n, buzz_max_dim=buf.k.shape[-1]):
        kept = reference.buzz_pass(buf, n, k, w, T, s, n if on_device else used)
    else:
        kept = module.buzz_pass(buf, n, k, w, T, s, ext.stream(buf.k))
    if on_device and kept.numel():
        buf.used_at.copy_(kept.amax())
    if used is None:
        used = int(kept.max()) if kept.numel() else 0
    buf.used = used
    buf.touch_all()


def cascade_attention(buf, probs, rule: CascadeRule) -> None:
    """A stacked cache's layer's part of Cascade's EMA: this step's attention of slots [0, n)
    (probs (R, g, n) fp32, reduced over each sequence's kv heads by `rule.reduce`) into
    buf.score[:n]. The stack's commit folds every layer's into the EMA at once
    (`cascade_fold`), then inserts (`cascade_update` with probs None). Torch ops on every
    device (a stack runs on the reference path)."""
    _check_cascade("cascade_attention", buf, probs, rule)
    reference.cascade_attention(buf, probs, rule)


def cascade_fold(buf, n: int, rule: CascadeRule) -> None:
    """The EMA mu <- gamma mu + (1 - gamma) s of slots [sinks, n) in `buf.state`, s the
    attention `cascade_attention` left in buf.score, for every row of `buf` (a stack: every
    layer) at once. Torch ops on every device."""
    _check_cascade("cascade_fold", buf, None, rule)
    if n > buf.capacity + 1:
        _fail("cascade_fold", f"n = {n} slots, more than the buffer's {buf.capacity + 1}")
    reference.cascade_fold(buf, n, rule)


def _check_cascade(op: str, buf, probs, rule: CascadeRule) -> None:
    if rule.reduce not in REDUCTIONS:
        _fail(op, f"reduce must be one of {', '.join(REDUCTIONS)} (got {rule.reduce!r})")
    if probs is None:
        return
    _expect(op, "probs", probs, (buf.score.shape[1], None, None), torch.float32,
            buf.score.device)
    if probs.shape[-1] > buf.capacity + 1:
        _fail(op, f"probs cover {probs.shape[-1]} slots, more than the buffer's "
                  f"{buf.capacity + 1}")


def cascade_update(buf, sub: SubCaches, probs, rule: CascadeRule) -> None:
    """Cascade's decode step for every row: the attention EMA of slots [sinks, n) in
    `buf.state` (probs (R, g, n) fp32, reduced over each sequence's kv heads by `rule.reduce`;
    None: already taken, `cascade_fold`), then the scratch token's insertion into the
    sub-caches `sub` (Algorithm 1)."""
    _check_cascade("cascade_update", buf, probs, rule)
    kv = buf.kv_heads
    levels = sub.size.numel()
    module = _buffer_module(buf)
    if module is None or not ext.within(module, cascade_max_levels=levels,
                                        cascade_max_kv_heads=kv):
        return reference.cascade_update(buf, sub, probs, rule)
    if probs is None:          # the EMA is taken: zero-width probs leave the kernel's EMA
        probs = buf.score.new_zeros(buf.score.shape[1], 1, 0)   # loop empty, it only inserts
    moved_to = module.cascade_update(buf, probs.contiguous(), sub.start, sub.count,
                                     sub.size.view(-1), rule, ext.stream(buf.k))
    buf.mark(moved_to)
