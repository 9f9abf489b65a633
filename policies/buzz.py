"""`buzz` and `buzz-logn`: BUZZ (Zhao, Fang, Li, Yang, He 2024, "BUZZ: Beehive-structured Sparse KV
Cache with Segmented Heavy Hitters for Efficient LLM Inference"; Sec. 3.3, 3.5, Algorithms 1-2,
Theorem 3.1, App. D.1).

Rule, per (sequence, kv-head) row the cache is ``[k sinks] [middle: old | new] [w window]``
(Sec. 3.3):
- Sinks (the first k tokens) and the window (the last w, the current one included) are kept.
- Buffering (Sec. 3.3, Alg. 1): tokens leaving the window join the middle as *new*; nothing is
  evicted until the middle exceeds the threshold T.
- A pass (Alg. 1 lines 13-19, Alg. 2): new tokens are cut into chunks ("hives") of s from the
  first new token, each keeping its max of accumulated attention (first index on ties; a partial
  last chunk keeps one); old tokens are interval-sampled, every ŝ-th from the first,
  ŝ = ⌊(s+1)/2⌋. Survivors become old, in position order.
- Score (Alg. 2 "accumulated attention scores"): the fp32 attention a token received since it
  entered (prompt column sums first). `accumulates_attention` is set, so the model adds each
  step's attention to `buf.score` itself (`scored=True`).
- `buzz-logn` (Sec. 3.5, Eq. 7/8): attention logits times log_512(n), n = keys attended.

Decisions where the paper is silent or ambiguous:
- T bounds the whole middle (old + new), as in the authors' code and App. D.1's recursion (Alg. 1's
  text counts new tokens only); a pass runs when the middle exceeds T, after the step's attention.
- GQA: a kv head's score sums the attention of its query heads.
- Prefill (Remark 2: "continuously conduct sampling until the selected tokens can fit"): passes
  repeat until the middle fits T, so the buffer is bounded at once. Remark 2 does not say how a
  repeated pass treats the survivors of the previous one. Default (`prompt_sampling=interval`):
  as in decode, they are old and interval-sampled; `prompt_sampling=maxima` reads it as local
  maxima on every pass (all middle tokens count as new each time).
- Budget -> (k, w, T, s): the buffer holds the peak, k + w + T + 1 <= slots; defaults k = 4,
  s = 5; w and T split the rest in Theorem 3.1's ratio T/w (each settable by --policy-arg).
- `budget_basis=average` reads the budget as the paper's Sec. 4.2.1 does, a share of the
  *average* cache: the peak grows until the steady-state average, k + w + (a* + T) / 2 (App.
  D.1's fixed point a*), reaches the tokens a constant-size policy (H2O) keeps at that budget.
  Decision: the steady state, not a run's simulated average, so a budget means the same over a
  512- and an 8k-token stream. Default `peak`: every policy gets the same buffer.
- Positions: keys cached before RoPE and rotated by in-cache rank (`pos_shift=True`, the authors'
  code for every method); `pos_shift=false` keeps true positions.
- The abstract's "log n time complexity" is not claimed: a pass is O(T) work.
- Policy state beyond score/state: the declared field `counts` (`fields()`, `kv.Field`) in
  `buf.policy_state`, the rows' distinct (tokens, old tokens) on the host; `buf.state` = 1 marks
  old tokens.
- CUDA graphs (`graph_safe`): the counts change every step, but by the rules alone, and what a
  step launches depends only on its attention span (a pass runs iff the span exceeds k + w + T
  or the token waits in the scratch slot). A graphed run keeps the fill count on the device
  (the token is written and counted there, a pass sets it from the kept counts); `counts` and
  the fill count are the buffer's host mirrors (`KVBuffer.mirrored`), moved after each replay
  by `replay_host`. `buzz-logn` is not graph-safe: its logit scale is a host float that
  changes with every step's token count.

Notes: policies/README.md#buzz
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from flexevict.core import kernels
from flexevict.errors import UserError, setting
from flexevict.core.kernels import buzz_select, compaction
from flexevict.core.kv import Field, KVBuffer, Layout, left_aligned

from flexevict.policies.registry import register
from flexevict.policies.base import Policy, add_attention

MIN_T = 2          # smallest threshold for which a decode pass always fits (any s >= 3)


@dataclass(frozen=True)
class BuzzLayout(Layout):
    """A BUZZ run's regions per row: k sinks, the w-token window, a middle of at most T tokens
    (the peak k + w + T + 1 <= slots), hives of s. The counts follow from these alone."""
    k: int = 4
    w: int = 1
    T: int = MIN_T
    s: int = 5
    prompt_maxima: bool = False     # every prefill pass takes local maxima (prompt_sampling)

    @property
    def s_hat(self) -> int:
        """The old tokens' sampling stride, ⌊(s+1)/2⌋."""
        return (self.s + 1) // 2

    def a_star(self) -> float:
        """Steady-state old-sample count, the fixed point of App. D.1's recursion (eq. 10)."""
        s = self.s
        return self.T * (s + 1) / (s * s + 1) if s % 2 else self.T / (s - 1)

    def steady_tokens(self) -> float:
        """Average cached tokens in the steady state: the middle saws between a* and T."""
        return self.k + self.w + (self.a_star() + self.T) / 2

    def pass_counts(self, count: int, old: int) -> tuple[int, int]:
        """A row's (tokens, old tokens) after one pass, from the counts alone (`buzz_select`:
        the k sinks, the w window, every ŝ-th old token, one new token per chunk of s); a row
        whose middle fits T is left as it is."""
        k, w = self.k, self.w
        if count - k - w <= self.T:
            return count, old
        new = count - k - w - old
        old = -(-old // self.s_hat) + -(-new // self.s)
        return k + w + old, old

    def held(self, steps: int) -> list[int]:
        """Committed tokens of an unpadded row after prefill and after each of `steps` decode
        steps (the counts follow the rules alone; scores only pick which tokens): the middle
        fills to T, a pass samples it down, and it fills again."""
        n, a = self.prompt_len, 0
        sizes = []
        for step in range(steps + 1):
            n += step > 0
            while self.evicts and n - self.k - self.w > self.T:   # repeats only in prefill
                n, a = self.pass_counts(n, 0 if self.prompt_maxima else a)
            sizes.append(n)
        return sizes

    def describe(self) -> dict:
        sizes = self.held(max(self.gen_len - 1, 0))             # g tokens: g - 1 steps
        decode = sizes[1:] or sizes
        return {**super().describe(), "k": self.k, "w": self.w, "T": self.T, "s": self.s,
                "s_hat": self.s_hat, "pos_shift": self.rope_in_cache,
                "peak_tokens": self.k + self.w + self.T if self.evicts else max(sizes),
                "avg_tokens": round(sum(decode) / len(decode), 2),
                "steady_avg_tokens": round(self.steady_tokens(), 2),
                "a_star": round(self.a_star(), 2)}


@register
@dataclass(frozen=True)
class Buzz(Policy):
    k: int = 4                      # sinks
    w: int = 0                      # window (0: from the budget)
    T: int = 0                      # threshold (0: from the budget)
    s: int = 5                      # hive size
    pos_shift: bool = True
    prompt_sampling: str = "interval"   # Remark 2's repeated prefill passes: interval | maxima
    budget_basis: str = "peak"      # the budget bounds the peak, or the average (Sec. 4.2.1)
    name = "buzz"
    needs_prompt_scores = True
    accumulates_attention = True
    rope_in_cache = True
    # the fill count moves on the device, the counts on the host by `replay_host`
    graph_safe = graph_safe_filling = True

    def __post_init__(self):
        super().__post_init__()
        if self.s < 3:
            raise UserError(f"{setting('policy_args')} s={self.s}: BUZZ's stride must be >= 3 "
                            "(with s <= 2 the old-token stride is 1 and the cache is never "
                            "bounded)")
        if self.k < 0 or self.w < 0:
            raise UserError(f"{setting('policy_args')} k and w must be >= 0 (w=0: derive from the "
                            "budget)")
        if self.T != 0 and self.T < MIN_T:
            raise UserError(f"{setting('policy_args')} T={self.T}: BUZZ's threshold must be >= "
                            f"{MIN_T} (T=0: derive from the budget)")
        if self.prompt_sampling not in ("interval", "maxima"):
            raise UserError(f"{setting('policy_args')} prompt_sampling={self.prompt_sampling}: "
                            "expected 'interval' (survivors of a prefill pass are old tokens) or "
                            "'maxima' (local maxima on every pass)")
        if self.budget_basis not in ("peak", "average"):
            raise UserError(f"{setting('policy_args')} budget_basis={self.budget_basis}: expected "
                            "'peak' (the buffer) or 'average' (the steady-state average cache)")
        if self.budget_basis == "average" and (self.w or self.T):
            raise UserError(f"{setting('policy_args')} budget_basis=average sizes w and T itself; "
                            "leave w and T unset")

    # ------------------------------------------------------------------ sizing
    def fields(self, layout):
        # the distinct (tokens, old tokens) of the rows, on the host (see `prefill`)
        return (Field("counts", init=()),)

    def minimum_slots(self) -> int:
        return self.k + max(self.w, 1) + (self.T or MIN_T) + 1

    def slots_for(self, prompt_len: int, gen_len: int) -> int:
        """The peak slots; with budget_basis=average the largest peak whose steady-state
        average stays within the committed tokens (slots - 1) of the budget's buffer."""
        slots, total = super().slots_for(prompt_len, gen_len), prompt_len + gen_len
        if self.budget_basis == "peak" or slots >= total:
            return slots
        target = slots - 1
        while slots < total and self._steady(slots + 1) <= target:
            slots += 1
        return slots

    def _steady(self, slots: int) -> float:
        room = slots - 1 - self.k
        w = theorem_window(room, self.s)
        return BuzzLayout(slots, k=self.k, w=w, T=room - w, s=self.s).steady_tokens()

    def layout(self, prompt_len: int, gen_len: int) -> BuzzLayout:
        base = super().layout(prompt_len, gen_len)
        s, room = self.s, base.capacity - self.k           # slots for window + middle
        w, T = self.w, self.T
        if not w and not T:
            w = theorem_window(room, s)
            T = room - w
        elif not T:
            T = room - w
        elif not w:
            w = room - T
        if base.evicts and (w < 1 or T < MIN_T or self.k + w + T > base.capacity):
            raise UserError(f"BUZZ needs k + w + T + 1 <= slots with w >= 1, T >= {MIN_T} "
                            f"(k={self.k}, w={w}, T={T}, slots={base.slots}); raise the budget "
                            f"or lower {setting('policy_args')} k/w/T")
        # budget >= sequence: nothing is ever evicted and keys are cached like `full`
        return BuzzLayout(**{**dataclasses.asdict(base),
                             "rope_in_cache": self.pos_shift and base.evicts},
                          k=self.k, w=w, T=T, s=s, prompt_maxima=self.prompt_sampling == "maxima")

    # ------------------------------------------------------------------ hooks
    def prefill(self, buf: KVBuffer, k, v, pos, valid, scores=None) -> None:
        lay = buf.layout
        if not lay.evicts:
            return buf.store_prompt(k, v, pos, valid, scores)
        s_len, rows = valid.shape
        order = left_aligned(valid)
        live = valid.gather(0, order)                  # work on left-aligned rows
        score = (scores if scores is not None else torch.zeros(valid.shape, device=valid.device))
        score = score.float().gather(0, order)
        old = torch.zeros_like(live)
        index = torch.arange(s_len, device=valid.device).unsqueeze(1).expand(s_len, rows)
        for _ in range(s_len):                         # Remark 2: sample until it fits
            seen_as_old = torch.zeros_like(old) if lay.prompt_maxima else old
            keep, old_after, hit = self.select(lay, live, seen_as_old, score)
            if not bool(hit.any()):
                break
            sel, live = compaction(keep)
            index, score = index.gather(0, sel), score.gather(0, sel)
            old = old_after.gather(0, sel) & live
        n = int(live.sum(0).max())                     # rows are left-aligned: trim the tail
        index, live, old = index[:n], live[:n], old[:n]
        buf.store_prompt(k, v, pos, valid, scores, keep=index)
        # a short row's tail points at dropped tokens: those slots hold nothing
        buf.valid[:n] = live
        buf.pos[:n] = torch.where(live, buf.pos[:n], -1)
        buf.score[:n] = torch.where(live, buf.score[:n], 0.0)
        buf.state[:n] = old.float()
        # the distinct (tokens, old tokens) of the rows, on the host: the counts follow the
        # rules alone (`pass_counts`), so decode knows every pass's outcome without reading the
        # device (these host reads, like the loop's, happen once per prefill)
        buf.policy_state["counts"] = _distinct(zip(live.sum(0).tolist(), old.sum(0).tolist()))
        buf.mirrored, buf.replay_host = ("counts",), self.replay_host

    def observe(self, buf: KVBuffer, slot: int, probs: torch.Tensor, scored: bool = False
                ) -> None:
        if buf.layout.evicts:
            add_attention(buf, probs, scored)

    def commit(self, buf: KVBuffer, slot: int) -> None:
        lay = buf.layout
        if not lay.evicts:
            return buf.commit_appended(slot)
        n = buf.attended(slot)
        counts, passes, used = self.step_counts(buf, slot, n)
        if slot != buf.scratch:
            buf.commit_appended(slot)
        if passes:
            self.evict(buf, n, used)
        buf.policy_state["counts"] = counts

    def step_counts(self, buf: KVBuffer, slot: int, n: int) -> tuple[tuple, bool, int]:
        """The host's part of a decode step whose token is in `slot`, attending n slots:
        -> (the rows' distinct counts after it, whether a pass runs, buf.used after it)."""
        lay = buf.layout
        counts = [(c + 1, a) for c, a in buf.policy_state["counts"]]   # each holds the token
        # buf.used is the longest row's count, so this is "some row's middle exceeds T"; a token
        # in scratch cannot stay there (it cannot happen without a pass when k+w+T+1 <= slots,
        # but compacting then still frees room, since no row holds more than k+w+T tokens)
        if n > lay.k + lay.w + lay.T or slot == buf.scratch:
            counts = [lay.pass_counts(c, a) for c, a in counts]
            return _distinct(counts), True, max(c for c, _ in counts)
        return _distinct(counts), False, buf.used + 1

    def replay_host(self, buf: KVBuffer) -> None:
        """A replayed decode step's host part (its kernels moved the device's fill count):
        the counts and the fill count as `commit` moves them (`KVBuffer.replay_host`)."""
        slot = buf.incoming_slot()
        counts, _, buf.used = self.step_counts(buf, slot, buf.attended(slot))
        buf.policy_state["counts"] = counts

    # ------------------------------------------------------------------ the pass
    @staticmethod
    def select(lay: BuzzLayout, valid, old, score):
        """One BUZZ pass over slots [0, n) of every row (`flexevict.core.kernels.buzz_select`).
        valid, old (n, R) bool, score (n, R) -> keep (n, R), old flag of the kept tokens
        afterwards (n, R), hit (R,): rows whose middle exceeded T."""
        return buzz_select(valid, old, score, lay.k, lay.w, lay.T, lay.s)

    def evict(self, buf: KVBuffer, n: int, used: int) -> None:
        """Run a pass over slots [0, n) and compact every row (one kernel launch on a GPU);
        used: the longest row's count afterwards, known on the host (`pass_counts`)."""
        if used > buf.capacity:
            raise RuntimeError(f"BUZZ pass leaves {used} tokens for {buf.capacity} slots")
        lay = buf.layout
        kernels.buzz_pass(buf, n, lay.k, lay.w, lay.T, lay.s, used=used)


def theorem_window(room: int, s: int) -> int:
    """The window w for `room` = w + T slots in Theorem 3.1's ratio T/w (at least 1, leaving T
    at least MIN_T when it can)."""
    w = room * (s + 1) // (s * s + s + 2) if s % 2 else room // s
    return max(1, min(w, room - MIN_T))


def _distinct(counts) -> tuple:
    """Rows with the same (tokens, old tokens) evolve alike: one entry each, sorted."""
    return tuple(sorted(set(counts)))


@register
@dataclass(frozen=True)
class BuzzLogN(Buzz):
    base: int = 512
    name = "buzz-logn"
    batch_by_length = True          # the scale reads the padded key count at prefill
    # log_512(n) of each step's token count: a host float the attention takes, which a CUDA
    # graph would keep at its capture's value (policies/README.md, "CUDA graphs")
    graph_safe = graph_safe_filling = False

    def logit_scale(self, n_keys: int) -> float:
        """log_base(n) (Sec. 3.5, eq. 7/8): exactly 1 at n = base (512, the pre-training length)."""
        return math.log(n_keys) / math.log(self.base)
