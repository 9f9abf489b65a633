"""`snapkv`: SnapKV (Li, Huang, Yang, Venkitesh, Locatelli, Ye, Cai, Lewis, Chen, "SnapKV: LLM
Knows What You are Looking for Before Generation", NeurIPS 2024, arXiv 2404.14469; Sec. 4,
Listing 1 (voting, clustering by pooling, selection); window 32 and kernel 7 as its experiments
(Sec. 5) - section pointers unchecked against a copy of the paper).

Rule (the prompt): the observation window, the prompt's last `window` tokens, attends to the
prefix (the tokens before it); each prefix token's attention is summed over the window's queries
("voting"), smoothed by a 1-D pooling of width `kernel` along the sequence ("clustering"), and
the top prefix tokens by it are kept, together with the whole window.

Decisions where the paper is silent or the engine differs:
- Budget: the window and the selected prefix share the committed slots (`slots - 1`): N - w
  selected plus the w window tokens. The window is resolved per run to at most `slots - 2`
  (at least one slot is selected, the original code's assertion), `layout.window`.
- Decode (the paper compresses the prompt only; a fixed buffer must evict every step): each
  full step applies the same rule to the buffer: the window is the `window` newest tokens (the
  one being decoded included), always kept; every older token in the buffer is a candidate,
  scored by the attention the window's queries gave it, summed and pooled along the candidates'
  position order (zero padding at both ends, as the prompt's prefix is pooled); the lowest goes
  (ties: the oldest; empty slots first). One token leaves per step, so this is the selection
  recomputed every step over the current cache.
- The window's attention is not recomputed: each query's attention is recorded when the query
  attends (the prompt's last `window` queries in the prefill pass, then each decode step's),
  per slot, in the declared field `hist` (window x slots x rows fp32, moved with its token);
  the query `window` steps older is overwritten (row index = the query's position mod window).
  A candidate is older than every window query, so all of them scored it, as the prompt's
  prefix tokens are scored. The recorded probabilities are the ones each query used, over the
  buffer of its step (recomputing them over the current buffer would renormalise over the
  tokens evicted since, one per step).
- GQA: a kv head's score sums its query heads' attention before pooling (kvpress pools each
  query head then averages the group: with average pooling the same up to rounding; with
  `pool=max` this pools the group's sum).
- Pooling: average (the authors' code and kvpress default to it; the paper's Listing 1 names a
  generic pool1d), `pool=max` for max pooling. `kernel` must be odd (same-length output).
- Prompt ties: the newer token stays (as decode, where the oldest goes).
- A caller that hands plain column sums instead of the window statistic (no fold) ranks the
  prompt by them, and its decode history starts from them spread evenly over the window.

Notes: policies/README.md#snapkv
"""
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flexevict.core import kernels
from flexevict.core.kv import Field, Layout, gather_prompt, left_aligned
from flexevict.errors import UserError, setting

from flexevict.policies.registry import register
from flexevict.policies.base import Policy, kv_head_probs
from flexevict.policies.keydiff import top_rows

POOLS = ("avg", "max")


@dataclass(frozen=True)
class SnapLayout(Layout):
    """A SnapKV run's sizes: `window`, the observation window resolved for the run's slots."""
    window: int = 1

    def describe(self) -> dict:
        return {**super().describe(), "window": self.window}


@register
@dataclass(frozen=True)
class SnapKV(Policy):
    window: int = 32
    kernel: int = 7
    pool: str = "avg"
    name = "snapkv"
    graph_safe = True
    stacks = True
    needs_prompt_scores = True
    min_slots = 3                     # a window token, a selected token, the scratch slot

    def __post_init__(self):
        super().__post_init__()
        if self.window < 1:
            raise UserError(f"{setting('policy_args')} window={self.window}: must be >= 1 (the "
                            "observation window's queries score the other tokens)")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise UserError(f"{setting('policy_args')} kernel={self.kernel}: must be odd and "
                            ">= 1 (a pool of the same length; 1: no pooling)")
        if self.pool not in POOLS:
            raise UserError(f"{setting('policy_args')} pool={self.pool}: expected "
                            f"{' or '.join(POOLS)}")

    # ------------------------------------------------------------------ sizing
    def layout(self, prompt_len: int, gen_len: int) -> SnapLayout:
        base = super().layout(prompt_len, gen_len)
        window = max(1, min(self.window, base.capacity - 1))
        return SnapLayout(**dataclasses.asdict(base), window=window)

    def fields(self, layout):
        if not layout.evicts:
            return ()
        return (Field("hist", (layout.window, "slots", "rows"), torch.float32),)

    # ------------------------------------------------------------------ scores
    def prompt_scores(self, layout, acc, p, first, valid):
        """Fold one block of prefill attention into the window statistic (the model passes this
        as the `fold` of kernels.prefill_attention_scores).

        p (B, Hk, g, c, j) fp32 probabilities of prompt queries [first, first + c) over keys
        [0, j) (pad queries zeroed), valid (B, S) -> (B, Hk, S, window): per key, the attention
        of each of the last `window` queries (summed over the group), at index (the query's
        position mod window), as decode keeps them."""
        (b, hk, _, c, j), s, w = p.shape, valid.shape[1], layout.window
        if acc is None:
            acc = p.new_zeros(b, hk, s, w)
        lo = max(first, s - w)
        if lo >= first + c:
            return acc
        rows = p[:, :, :, lo - first:].sum(dim=2)                     # (B, Hk, m, j)
        pads = s - valid.sum(dim=1, keepdim=True)                     # (B, 1)
        at = (torch.arange(lo, first + c, device=p.device) - pads).remainder(w)   # (B, m)
        acc[:, :, :j].scatter_(3, at[:, None, None].expand(b, hk, j, at.shape[1]),
                               rows.transpose(2, 3))
        return acc

    def pooled(self, x: torch.Tensor) -> torch.Tensor:
        """(n, R) -> (n, R): the 1-D pool of width `kernel` along dim 0, zero padding."""
        if self.kernel == 1:
            return x
        op = F.avg_pool1d if self.pool == "avg" else F.max_pool1d
        return op(x.t().unsqueeze(1), self.kernel, stride=1,
                  padding=self.kernel // 2).squeeze(1).t()

    def candidate_scores(self, score, pos, candidate) -> torch.Tensor:
        """score, pos, candidate (n, R) over slots in any order -> (n, R): each candidate's
        score pooled along the row's candidates in position order (the others are zeros at
        the end, the pool's padding)."""
        key = torch.where(candidate, pos, torch.iinfo(pos.dtype).max)
        order = key.sort(dim=0, stable=True).indices
        y = self.pooled(torch.where(candidate, score, 0.0).gather(0, order))
        return torch.empty_like(y).scatter_(0, order, y)

    # ------------------------------------------------------------------ hooks
    def prefill(self, buf, k, v, pos, valid, scores=None):
        lay = buf.layout
        if not lay.evicts:
            return buf.store_prompt(k, v, pos, valid)
        w, n = lay.window, buf.capacity
        order = left_aligned(valid)
        k, v, pos, valid, _ = gather_prompt(order, k, v, pos, valid)
        rows = _window_rows(scores, order, w)                            # (S, R, w)
        keep = None
        if k.shape[0] > n:
            keep = self.prompt_keep(rows.sum(-1), valid, w, n)
            rows = rows.gather(0, keep.unsqueeze(-1).expand(-1, -1, w))
        buf.store_prompt(k, v, pos, valid, keep=keep)
        hist, m = buf.policy_state["hist"], rows.shape[0]
        hist.zero_()
        hist[:, :m] = (rows * buf.valid[:m].unsqueeze(-1)).permute(2, 0, 1)

    def prompt_keep(self, score, valid, w: int, n: int) -> torch.Tensor:
        """score, valid (S, R) of a left-aligned prompt -> (n, R) kept indices in order: the
        last w real tokens, and the n - w best of the older ones by pooled score."""
        idx = torch.arange(score.shape[0], device=score.device).unsqueeze(1)
        window = valid & (idx >= valid.sum(0) - w)
        prefix = valid & ~window
        rank = torch.where(prefix, self.pooled(torch.where(prefix, score, 0.0)), float("-inf"))
        return top_rows(rank.masked_fill(window, float("inf")), n)

    def observe(self, buf, slot, probs, scored=False):
        if not buf.layout.evicts:
            return
        hist = buf.policy_state["hist"]
        hist[:, slot] = 0.0                          # the new token has no history yet
        new = torch.zeros_like(hist[0])
        new[:probs.shape[-1]] = kv_head_probs(probs)
        # this query's row replaces the one of the query `window` positions older
        at = buf.pos[slot].long().remainder(buf.layout.window)
        hist.scatter_(0, at.view(1, 1, -1).expand(1, hist.shape[1], -1), new.unsqueeze(0))

    def commit(self, buf, slot):
        if not buf.layout.evicts or slot != buf.scratch:
            return buf.commit_appended(slot)
        hist, n = buf.policy_state["hist"], buf.scratch + 1
        pos, valid = buf.pos[:n], buf.valid[:n]
        # candidates: the tokens older than the window (the `window` newest, this one included)
        candidate = valid & (pos <= buf.pos[buf.scratch] - buf.layout.window)
        score = self.candidate_scores(hist.sum(0), pos, candidate)
        value = torch.where(candidate, score, float("inf"))
        victims = kernels.evict_commit(buf, n, cursor=False, value=value, commit="replace")
        hist[:, victims, buf.rows_index] = hist[:, buf.scratch]       # its history moves along


def _window_rows(scores, order, w: int) -> torch.Tensor | None:
    """The prompt statistic in left-aligned order, (S, R, w): the fold's window rows; plain
    column sums (S, R) spread evenly over the window; none: zeros."""
    if scores is None:
        return torch.zeros(*order.shape, w, device=order.device)
    scores = scores.float().gather(0, order) if scores.dim() == 2 else \
        scores.float().gather(0, order.unsqueeze(-1).expand(-1, -1, w))
    return scores if scores.dim() == 3 else (scores / w).unsqueeze(-1).expand(-1, -1, w)
