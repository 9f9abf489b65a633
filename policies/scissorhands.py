"""`scissorhands`: Scissorhands (Liu et al. 2023, "Scissorhands: Exploiting the Persistence of
Importance Hypothesis for LLM KV Cache Compression at Test Time", NeurIPS 2023, arXiv 2305.17118;
Sec. 4, Algorithm 1 "budget KV cache for a single attention head" and Algorithm 2 "compress KV
cache" - section pointers unchecked against a copy of the paper). Defaults as the VATP paper
(Guo et al. 2024, "Attention Score is not All You Need for Token Importance Indicator in KV Cache
Reduction: Value Also Matters", App. A) runs it: 10 recent tokens, a history window of 400.

Rule: a token is *unimportant* for a query when its attention is below 1/n, n the tokens that
query attends. Over the last `window` queries a counter records how often each cached token was
unimportant; when the cache overflows, the token with the highest count goes, except the `recent`
newest tokens, which always stay.

Decisions where the paper is silent:
- A `RingPolicy`: the `recent` newest tokens (the one being decoded included) are the ring; the
  other committed slots hold tokens kept by importance. Drop amount m = 1 per step (Algorithm 2's
  m amortises cost; a fixed-slot buffer drops exactly one), so the cache always holds its budget.
- GQA: a kv head's score sums its g query heads, so "unimportant" = sum < g / n_valid (n_valid
  counts the valid tokens attended, the new one included); with g = 1 exactly attention < 1/n.
- History window = the last `window` query steps, prompt queries included, exact (one bit per
  step and slot, the declared field `hist` in `buf.policy_state`, moved with its token).
- `buf.score` = importance `window - count` (higher = keep; the lowest goes, empty slots first,
  ties: the oldest). `importance(buf, slots)` and `prefix_rank` are the subclass hooks;
  `buf.state` is left free for a subclass (VATP: value norms).
- `score=attention`: the VATP paper's reading (its Eq. 3): importance = attention summed over
  the last `window` queries (`window=0`: over all queries, the VATP authors' code).
- Prompt: the model folds the prompt attention with `prompt_scores` (the `fold` of
  kernels.prefill_attention_scores) into the last `window` prompt queries' statistic; when the
  prompt does not fit, Algorithm 2 runs once: the last `recent` prompt tokens stay, the rest are
  ranked.
- Policy state beyond score/state is declared by `fields()` (`kv.Field`: `hist`, `step`,
  `clock`) and lives in `buf.policy_state[...]`. The query step index that picks the window's
  history row is a host int (`step`) until the buffer keeps its counters on the device (a
  graphed run, `KVBuffer.keep_counters_on_device`); from then on it is `clock` there, so a
  step's launches do not depend on it and one CUDA graph serves every step (`graph_safe`).

Notes: policies/README.md#scissorhands
"""
from dataclasses import dataclass

import torch

from flexevict.errors import UserError, setting

from flexevict.policies.registry import register
from flexevict.core import kernels
from flexevict.core.kv import Field
from flexevict.policies.base import RingPolicy, kv_head_probs

_POPCOUNT = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.uint8)


@register
@dataclass(frozen=True)
class Scissorhands(RingPolicy):
    recent: int = 10
    window: int = 400
    score: str = "count"
    name = "scissorhands"
    stacks = False                  # its step counter is host-held state (`fields`)
    graph_safe = True               # the counter moves to the device with the ring cursor
    needs_prompt_scores = True

    def __post_init__(self):
        super().__post_init__()
        if self.score not in ("count", "attention"):
            raise UserError(f"{setting('policy_args')} score={self.score}: expected 'count' (the "
                            "paper's low-attention counter) or 'attention' (windowed attention "
                            "sum)")
        if self.recent < 1:
            raise UserError(f"{setting('policy_args')} recent={self.recent}: must be >= 1 (the "
                            "token being decoded is always among the recent tokens)")
        if self.window < (1 if self.counting else 0):
            raise UserError(f"{setting('policy_args')} window={self.window}: must be >= 1 "
                            "(score=attention also accepts 0, no window)")

    @property
    def counting(self) -> bool:
        """The paper's low-attention counter (else the windowed attention sum)."""
        return self.score == "count"

    # ------------------------------------------------------------------ sizing
    def minimum_slots(self) -> int:
        return self.recent + 2                    # the recent tokens, one kept by score, scratch

    def prefix_slots(self, capacity: int) -> int:
        return capacity - self.recent

    # ------------------------------------------------------------------ importance (subclass hooks)
    def importance(self, buf, slots: torch.Tensor) -> torch.Tensor:
        """(len(slots), rows) importance of the tokens in `slots`; higher is kept."""
        return kernels.at_slots(buf.score, slots)

    def victim_candidates(self, buf):
        # the lowest importance (buf.score) among the kept tokens and the oldest recent goes
        return buf.ring_start, True, None

    def fields(self, layout):
        # the next query's step index, and when the run evicts the window's history per slot
        # and row (count: one bit per query; attention: one fp32 per query; no window: none)
        # and the step index where the buffer keeps its counters on the device (`_history_row`)
        if not layout.evicts:
            return (Field("step", init=0),)
        w = self.window
        hist = (Field("hist", ((w + 7) // 8, "slots", "rows"), torch.uint8) if self.counting
                else Field("hist", (w, "slots", "rows"), torch.float32))
        return (hist, Field("step", init=0), Field("clock", (1,), torch.int64))

    def prefix_rank(self, buf, scores, k, v, pos, valid):
        # the prompt's base importance (what `buf.score` stores), computed by `prefill`
        return scores

    # ------------------------------------------------------------------ prompt
    def prompt_scores(self, layout, acc, p, first, valid):
        """Fold one block of prefill attention into the prompt statistic (the model passes this as
        the `fold` of kernels.prefill_attention_scores).

        p (B, Hk, g, c, j) fp32 probabilities of prompt queries [first, first + c) over keys
        [0, j) (pad queries zeroed), valid (B, S). Only the last `window` queries count. ->
        count mode: (B, Hk, S, bytes) uint8, bit (i % window) set when query i found the key
        unimportant; attention mode: (B, Hk, S) fp32 attention summed over those queries."""
        (b, hk, g, c, j), s = p.shape, valid.shape[1]
        w = self.window or s
        if acc is None:
            acc = (p.new_zeros(b, hk, s) if not self.counting else
                   torch.zeros(b, hk, s, (w + 7) // 8, dtype=torch.uint8, device=p.device))
        if first + c <= s - w:                                        # no query of the window
            return acc
        qi = torch.arange(first, first + c, device=p.device)
        score = p.sum(dim=2)                                          # (B, Hk, c, j)
        inwin = (qi >= s - w) & (qi < s)
        if not self.counting:
            acc[..., :j] += (score * inwin[:, None]).sum(dim=2)
            return acc
        seen = valid.long().cumsum(1).gather(1, qi.clamp(max=s - 1).expand(b, -1))   # (B, c)
        keys = torch.arange(j, device=p.device)
        visible = (keys <= qi[:, None]) & valid[:, None, :j]         # (B, c, j)
        low = score < g / seen.clamp(min=1)[:, None, :, None]
        low &= (visible & valid.gather(1, qi.clamp(max=s - 1).expand(b, -1))[..., None])[:, None]
        low &= inwin[:, None]
        nbytes = (w + 7) // 8
        bit = qi % w
        weight = torch.zeros(c, nbytes, device=p.device)              # row -> (byte, 1 << bit)
        weight[torch.arange(c, device=p.device), bit // 8] = (1 << (bit % 8)).float()
        packed = torch.einsum("bhcs,cy->bhsy", low.float(), weight).to(torch.uint8)  # sum = or
        acc[..., :j, :] |= packed
        return acc

    def prefill(self, buf, k, v, pos, valid, scores=None):
        buf.policy_state["step"] = k.shape[0]
        if not buf.layout.evicts:
            return super().prefill(buf, k, v, pos, valid)
        buf.policy_state["hist"].zero_()
        if scores is None:
            scores = torch.zeros(pos.shape, device=pos.device)
        w = self.window
        bits = self.counting and scores.dim() == 3
        base = w - _popcount(scores) if bits else scores.float()
        super().prefill(buf, k, v, pos, valid, base)
        if self.counting and not bits:            # no per-query prompt history: count from now
            buf.score[:buf.capacity] = float(w)
        elif bits or w:
            self._seed_history(buf, scores, pos, valid)

    def _seed_history(self, buf, stat, pos, valid):
        """Put the kept prompt tokens' window history into the declared `hist`."""
        s, cap = pos.shape[0], buf.capacity
        # the prompt index of each kept slot, from its (per-row unique) position
        top = int(pos.max()) + 1                  # pads: a spare last row (a prefill-only read)
        where = torch.zeros(top + 1, pos.shape[1], dtype=torch.int64, device=pos.device)
        idx = torch.arange(s, device=pos.device).unsqueeze(1).expand_as(pos)
        where.scatter_(0, torch.where(valid, pos, top).long(), idx)
        src = where.gather(0, buf.pos[:cap].clamp(min=0).long())      # (cap, rows)
        kept = buf.valid[:cap]
        hist = buf.policy_state["hist"]
        if self.counting:
            bits = stat.gather(0, src.unsqueeze(-1).expand(-1, -1, stat.shape[-1]))
            hist[:, :cap] = (bits * kept.unsqueeze(-1)).permute(2, 0, 1).to(torch.uint8)
        elif self.window:
            w = self.window
            steps = torch.arange(max(0, s - w), s, device=pos.device) % w
            share = buf.score[:cap] * kept / len(steps)
            hist[steps, :cap] = share.unsqueeze(0).expand(len(steps), -1, -1)

    # ------------------------------------------------------------------ decode
    def commit(self, buf, slot):
        if not buf.layout.evicts or slot != buf.scratch:
            return buf.commit_appended(slot)
        # the commit advances the cursor: its slot now (a graphed run's is on the device)
        cursor = buf.cursor if buf.cursor_at is None else buf.cursor_at.clone()
        victims = self.commit_scratch(buf)
        hist, rows = buf.policy_state["hist"], buf.rows_index
        hist[:, victims, rows] = hist[:, cursor, rows]               # as ring_commit moved them
        if isinstance(cursor, int):
            hist[:, cursor] = hist[:, buf.scratch]
        else:                        # an indexed write refuses a view of hist itself
            hist[:, cursor] = hist[:, buf.scratch].unsqueeze(1).clone()

    def observe(self, buf, slot, probs, scored=False):
        if not buf.layout.evicts:
            return
        n = probs.shape[-1]
        hist, w = buf.policy_state["hist"], self.window
        at = self._history_row(buf)               # this query's: t mod window
        hist[:, slot] = 0                          # the new token has no history yet
        score = kv_head_probs(probs)               # (n, rows)
        if self.counting:
            valid = buf.valid[:n]
            low = (score < probs.shape[1] / valid.sum(0)) & valid
            new = torch.zeros_like(hist[0])
            new[:n] = low.to(torch.uint8)
            old = _swap_bits(hist, at, new)
            buf.score += old.float() - new.float()                    # importance = window - count
            buf.score[slot] = w - new[slot].float()                   # a fresh token starts at w
        elif w:
            new = torch.zeros_like(hist[0])
            new[:n] = score
            if isinstance(at, int):
                buf.score += new - hist[at]
                hist[at] = new
            else:
                buf.score += new - hist.index_select(0, at)[0]
                hist.index_copy_(0, at, new.unsqueeze(0))
        else:
            buf.score[:n] += score

    def _history_row(self, buf):
        """This query's step index t mod the window (None without a window), and t moves on:
        a host int, or, once the buffer keeps its counters on the device (a graphed run's
        buffers, `KVBuffer.keep_counters_on_device`), a (1,) int64 tensor there, from
        `clock`. The step's launches then do not depend on t; a CPU's eager steps keep the
        host int, whose indexing costs no tensor op."""
        state, w = buf.policy_state, self.window
        if buf.cursor_at is None:
            t = state["step"]
            state["step"] = t + 1
            return t % w if w else None
        clock = state["clock"]
        if state["step"] is not None:             # the first such step: t moves over, once
            clock.fill_(state["step"])
            state["step"] = None
        at = clock % w if w else None
        clock.add_(1)
        return at


def _swap_bits(hist: torch.Tensor, at, new: torch.Tensor) -> torch.Tensor:
    """Bit `at` (a step's bit of the window: a host int, or a (1,) int64 tensor) of every slot
    and row of hist (bytes, slots, rows) uint8 becomes `new` (slots, rows) uint8 0/1;
    -> the bits it held (slots, rows) uint8."""
    if isinstance(at, int):
        byte, bit = at // 8, at % 8
        old = (hist[byte] >> bit) & 1
        hist[byte] = (hist[byte] & (255 ^ (1 << bit))) | (new << bit)
        return old
    byte, bit = at // 8, (at % 8).to(torch.uint8)     # uint8: the shifts stay uint8
    held = hist.index_select(0, byte)[0]
    hist.index_copy_(0, byte, ((held & ~(1 << bit)) | (new << bit)).unsqueeze(0))
    return (held >> bit) & 1


def _popcount(bits: torch.Tensor) -> torch.Tensor:
    """(..., bytes) uint8 -> (...) number of set bits, fp32."""
    return _POPCOUNT.to(bits.device)[bits.long()].sum(-1).float()
