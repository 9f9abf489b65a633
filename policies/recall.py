"""`recall`: keep every token, attend to the pages each step needs.

Eviction forgets for good; recall does not. Each layer's whole K/V history stays with the
buffer's home in the cache tier (CPU memory or disk when the placement offloads the cache),
appended every step; the fixed-budget buffer that attention reads holds the attention sinks,
a window of the most recent tokens, and, for each decode step, the `pages` pages of `page`
tokens whose estimated attention for the current query is highest, per kv head, gathered
from the history before attention.

The estimate is Quest's per-page upper bound (Tang et al. 2024, "Quest: Query-Aware Sparsity
for Efficient Long-Context LLM Inference", Sec. 3): with the elementwise minimum m and maximum
M of a page's keys, q.k <= sum_d max(q_d m_d, q_d M_d) for any key of the page. Summed over the
query heads of a kv head it is q+.M + q-.m with q+ (q-) the sum of the heads' positive
(negative) parts: one small batched product per step over the summaries [M; m]. The summaries
travel with the buffer and count against the budget: with K/V of 2 d values per token and two
d-vectors per page, a page's summary costs one slot, so `slots = floor(budget (P + G)) -
ceil((P + G) / page)` hold tokens.

Layout of a row's committed slots: [0, sinks) the first tokens, [sinks, sinks + pages * page)
the recalled pages, then the window, a ring of the most recent tokens (every leftover slot).
A page chosen again keeps its place and is not copied again; the region is stored with the
buffer, so where the cache has a home in another tier, the buffer's load brings last step's
pages back on the load lane, overlapped with the previous layer's compute, and the step
fetches only the pages that changed (`place_pages`); from a lossy home (a 4-bit compressed
cache) kept pages come back rounded, so there every page is copied each step and the region
is not stored.

A token's history index is its position (real tokens counted from 0), so pages, sinks and
window are per row and never depend on a batch-mate's padding. A recalled slot is valid only
for tokens older than the window and past the sinks, so no token is attended twice. A budget
that holds the whole sequence evicts nothing and runs exactly as `full`.

Notes: policies/README.md#recall
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flexevict.core.kernels import gather_pages, page_select, page_tokens, put_rows
from flexevict.core.kv import KV, Field, Layout, gather_prompt, left_aligned
from flexevict.errors import UserError, setting
from flexevict.policies.base import Policy
from flexevict.policies.registry import register


# The default page: 32 tokens, not Quest's 16. The budget pays for the summaries (a page's
# minimum and maximum cost one slot), so a page of 16 spends 1/16 of the sequence's slots on
# them: 62% of a 10% budget. On the retrieval sweep (SmolLM2, 1k and 2k, 64 paired items per
# budget; bench/results/accuracy/retrieval-recall/) pages of 32 answer 0.259 / 0.673 at 10% /
# 20%, pages of 16 0.043 / 0.423, pages of 64 0.074 / 0.398 (the full cache 0.678). Smaller
# pages for a budget that cannot hold a page of 32 besides the summaries.
AUTO_PAGES = (32, 16, 8, 4, 2)


@dataclass(frozen=True)
class RecallLayout(Layout):
    """A recall run's regions: `sinks` slots, `pages` recalled pages of `page` tokens, the
    window ring (prefix = sinks + pages * page, ring = the rest), and `summaries`, the pages of
    the whole run whose key minima and maxima are kept (their slots' worth of the budget)."""
    sinks: int = 4
    page: int = 16
    pages: int = 0
    summaries: int = 0

    @property
    def tokens(self) -> int:
        """History length per row: every prompt and generated token of the run."""
        return self.prompt_len + self.gen_len

    @property
    def home_tokens(self) -> int:
        return self.summaries * self.page if self.evicts else 0     # the history, whole pages

    @property
    def written_per_step(self) -> int:
        return 1 + self.pages * self.page         # the new token and the recalled region

    def describe(self) -> dict:
        return {**super().describe(), "sinks": self.sinks, "page": self.page,
                "pages_per_step": self.pages, "window": self.ring,
                "summary_slots": self.summaries}


@register
@dataclass(frozen=True)
class Recall(Policy):
    page: int = 0                   # tokens per page; 0: 32 (`AUTO_PAGES`), or 16, 8, 4, 2
                                    # when the budget cannot hold a page of 32
    sinks: int = 4                  # first tokens always attended (StreamingLLM's sinks)
    window: int = 64                # most recent tokens always attended (at least; at most a
                                    # quarter of the slots past sinks and summaries)
    name = "recall"
    graph_safe = True

    def __post_init__(self):
        super().__post_init__()
        if self.page < 0 or self.sinks < 0 or self.window < 1:
            raise UserError(f"{setting('policy_args')} page must be >= 0 (0: automatic), "
                            f"window >= 1 and sinks >= 0 (got page={self.page}, "
                            f"sinks={self.sinks}, window={self.window})")

    def minimum_slots(self) -> int:
        return self.sinks + min(self.pages_to_try()) + 3   # a page, a window slot, scratch

    def pages_to_try(self) -> tuple[int, ...]:
        """Page sizes in order of preference: the one asked for, or (page 0, the default)
        32, then smaller ones for a budget that cannot hold a page of 32 besides the
        summaries."""
        return (self.page,) if self.page else AUTO_PAGES

    def layout(self, prompt_len: int, gen_len: int) -> Layout:
        total = prompt_len + gen_len
        slots = self.slots_for(prompt_len, gen_len)
        if slots >= total:                           # holds everything: exactly full
            return RecallLayout(slots, False, prompt_len=prompt_len, gen_len=gen_len,
                                sinks=self.sinks, page=self.pages_to_try()[0])
        for page in self.pages_to_try():
            summaries = math.ceil(total / page)
            capacity = slots - summaries - 1
            room = capacity - self.sinks             # pages and window share it
            if room >= page + 1:
                break
        else:
            need = min(math.ceil(total / p) + self.sinks + p + 2 for p in self.pages_to_try())
            raise UserError(f"budget of {slots} slots leaves no page to recall: recall needs "
                            f"at least {need} for {total} tokens (its page summaries take "
                            f"part of the budget); raise {setting('budget')}")
        window = max(1, min(self.window, room // 4))     # a small budget goes to pages first
        pages = max(1, (room - window) // page)
        prefix = self.sinks + pages * page
        return RecallLayout(capacity + 1, True, prefix=prefix, ring=capacity - prefix,
                            prompt_len=prompt_len, gen_len=gen_len, sinks=self.sinks,
                            page=page, pages=pages, summaries=summaries)

    def batch_key(self, prompt_len: int, gen_len: int) -> tuple:
        # a row's pages, sinks and window follow its own positions; only the sizes depend on
        # the run, and those follow the slot count
        lay = self.layout(prompt_len, gen_len)
        if not lay.evicts:
            return super().batch_key(prompt_len, gen_len)
        return ("recall", lay.sinks, lay.page, lay.pages, lay.ring)

    def fields(self, layout):
        if not layout.evicts:
            return ()
        summaries, page = layout.summaries, layout.page
        # the history row-major, a row's pages whole: a page is one contiguous block of
        # page x d values, so a step's recall copies pages, not tokens (few large copies).
        # A page's summary: its keys' elementwise maximum (first d) and minimum (last d), laid
        # out for one batched product with [q+, q-] per step
        # `resident`: the page each place of the recalled region holds (-1: none usable)
        return (Field("history_k", ("rows", summaries * page, "d"), KV, home=True),
                Field("history_v", ("rows", summaries * page, "d"), KV, home=True),
                Field("summary", ("rows", 2, "d", summaries), KV),
                Field("resident", ("rows", layout.pages), torch.int64))

    # ------------------------------------------------------------------ hooks
    def prefill(self, buf, k, v, pos, valid, scores=None):
        """The whole prompt goes to the history (real tokens first, so index = position), its
        pages are summarised, and the buffer gets the sinks and the window."""
        lay = buf.layout
        if not lay.evicts:
            return buf.store_prompt(k, v, pos, valid)
        s = k.shape[0]
        k, v, pos, valid, _ = gather_prompt(left_aligned(valid), k, v, pos, valid)
        state = buf.policy_state
        state["history_k"][:, :s] = k.transpose(0, 1)
        state["history_v"][:, :s] = v.transpose(0, 1)
        self._summarise(buf, k, valid)
        real = valid.sum(0)                                        # (rows,)
        at = torch.arange(max(lay.sinks, lay.ring), device=k.device).unsqueeze(1)
        sink = at[:lay.sinks].expand(-1, real.shape[0])
        recent = real - lay.ring + at[:lay.ring]                   # the last `ring` tokens
        keep = torch.cat([sink, recent]).clamp(0, s - 1)
        ok = torch.cat([sink < real, recent >= lay.sinks])         # real, not a sink twice
        kept_k, kept_v, kept_pos, _, _ = gather_prompt(keep, k, v, pos, valid)
        window = slice(lay.prefix, lay.capacity)
        for name, first, last in (("k", kept_k[:lay.sinks], kept_k[lay.sinks:]),
                                  ("v", kept_v[:lay.sinks], kept_v[lay.sinks:]),
                                  ("pos", kept_pos[:lay.sinks], kept_pos[lay.sinks:]),
                                  ("valid", ok[:lay.sinks], ok[lay.sinks:])):
            t = getattr(buf, name)
            t[:lay.sinks], t[window] = first, last
        buf.valid[lay.sinks:lay.prefix] = False               # recalled before each step
        buf.pos[lay.sinks:lay.prefix] = -1
        state["resident"].fill_(-1)
        buf.score.zero_()
        buf.state.zero_()
        buf.used, buf.ring_start, buf.cursor = lay.capacity, lay.prefix, lay.prefix
        buf.touch_all()

    def _summarise(self, buf, k, valid) -> None:
        """Key maxima and minima of the prompt's pages (padding excluded); later pages start
        empty (-inf, +inf). k (S, rows, d) and valid (S, rows), real tokens first."""
        page, s = buf.layout.page, k.shape[0]
        n = -(-s // page)
        summary = buf.policy_state["summary"]                      # (rows, 2, d, pages)
        summary[:, 0].fill_(float("-inf"))
        summary[:, 1].fill_(float("inf"))
        for half, fill, fold in ((0, float("-inf"), torch.amax), (1, float("inf"), torch.amin)):
            keys = F.pad(torch.where(valid.unsqueeze(-1), k, fill),
                         (0, 0, 0, 0, 0, n * page - s), value=fill)
            summary[:, half, :, :n] = fold(keys.view(n, page, *k.shape[1:]), 1).permute(1, 2, 0)

    def before_attention(self, buf, slot, q):
        """Append the new token (in `slot`) to the history and its page's summary, then fill
        the recalled region with the pages of highest bound for this query. q (rows, g, d)."""
        lay = buf.layout
        if not lay.evicts:
            return
        state, rows = buf.policy_state, buf.rows_index
        at = buf.pos[slot].to(torch.int64)                          # its position, per row
        key = buf.k[slot]
        flat = rows * state["history_k"].shape[1] + at   # (row, position) in the flat history
        put_rows(state["history_k"].view(-1, buf.head_dim), flat, key)
        put_rows(state["history_v"].view(-1, buf.head_dim), flat, buf.v[slot])
        summary, here = state["summary"], (at // lay.page).view(-1, 1, 1)
        here, key = here.expand(-1, buf.head_dim, 1), key.unsqueeze(-1)      # (rows, d, 1)
        summary[:, 0].scatter_reduce_(2, here, key, "amax")          # its page's maximum
        summary[:, 1].scatter_reduce_(2, here, key, "amin")          # and minimum
        self._recall(buf, self._best_pages(buf, q, at), at)

    def _best_pages(self, buf, q, at):
        """Per row, the `pages` candidate pages of highest bound q+.max + q-.min (summed over
        the group); candidates hold a token past the sinks and older than the window. Stable
        order: ties (and too few candidates) go to the lower page. -> (rows, pages) int64."""
        lay = buf.layout
        return page_select(q, buf.policy_state["summary"], at - lay.ring, lay.page,
                           lay.sinks, lay.pages)

    def _recall(self, buf, top, at) -> None:
        """Bring the pages `top` (rows, pages) into the recalled region: a page already there
        from the last step stays in its place and is not copied again (`place_pages`); the
        others are gathered from the history (`gather_pages`). A slot is valid for a token past
        the sinks and older than the window. The region is marked written, so a cache home
        keeps it: the next step's load brings this step's pages back with the rest of the
        buffer, on the load lane, overlapped with the previous layer."""
        lay, state = buf.layout, buf.policy_state
        placed, fetch = place_pages(state["resident"], top)
        # a page reaching past the new token (a window shorter than a page lets one be a
        # candidate) holds tokens not yet in the history: not kept, copied again next time
        whole = (placed + 1) * lay.page <= at.unsqueeze(1) + 1
        state["resident"].copy_(torch.where(whole, placed, -1))
        if buf.lossy_home:            # the kept pages came back 4-bit: copy them exact again
            fetch = torch.ones_like(fetch)
        region = slice(lay.sinks, lay.prefix)
        for name in ("k", "v"):
            gather_pages(state[f"history_{name}"], placed, fetch, getattr(buf, name)[region])
        if not buf.lossy_home:        # kept by the home for the next load; a lossy home's
            buf.mark(region)          # copy would not be used (every page is copied again)
        index = page_tokens(placed, lay.page)                      # (slots, rows) positions
        valid = (index >= lay.sinks) & (index < (at - lay.ring).unsqueeze(0))
        buf.valid[region] = valid
        buf.pos[region] = torch.where(valid, index, -1)

    def commit(self, buf, slot):
        """The new token joins the window; the one it replaces stays in the history. The
        recalled pages stay too: the next step keeps those it chooses again."""
        if not buf.layout.evicts:
            return buf.commit_appended(slot)
        buf.ring_push()


def place_pages(resident: torch.Tensor, top: torch.Tensor):
    """Where this step's pages go in the recalled region: a page already there keeps its
    place; the others take the places whose pages left, the i-th new page of `top` the i-th
    freed place. resident (rows, pages): each place's page (-1: none); top (rows, pages): this
    step's pages, distinct per row. -> (placed (rows, pages): each place's page now, fetch
    (rows, pages) bool: the places whose page must be copied in). Fixed shapes, no host
    read: freed places and new pages are equally many in each row."""
    same = top.unsqueeze(2) == resident.unsqueeze(1)            # (rows, top's i, place j)
    stays = same.any(1)
    new = ~same.any(2)
    freed = torch.sort(stays.to(torch.int8), dim=1, stable=True).indices     # freed first
    arriving = top.gather(1, torch.sort((~new).to(torch.int8), dim=1, stable=True).indices)
    first = torch.arange(top.shape[1], device=top.device) < new.sum(1, keepdim=True)
    placed = resident.scatter(1, freed, torch.where(first, arriving, resident.gather(1, freed)))
    return placed, ~stays

