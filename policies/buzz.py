"""`buzz` and `buzz-logn`: BUZZ, the beehive-structured sparse KV cache with segmented heavy
hitters (Zhao, Fang, Li, Yang, He; paper 000; seed-buzz.md).

Per (sequence, kv-head) row the cache is ``[k sinks] [middle: old | new] [w window]`` (Sec. 3.3):

- Sinks (the first k tokens) and the window (the last w tokens, the current one included) are
  kept verbatim (Sec. 3.3 "Attention sink", "Sliding window"; Remark 1: no-op while a row holds
  at most k + w tokens).
- Buffering (Sec. 3.3 "Buffering Strategy", Alg. 1): tokens that leave the window join the
  middle as *new* tokens; nothing is evicted until the middle (old + new) exceeds the threshold T
  (seed §2.3 / §6.1: T bounds the whole middle, as in the authors' code and the D.1 recursion).
- One eviction pass (Alg. 1 lines 13-19, Alg. 2): new tokens are cut into consecutive chunks
  ("hives") of s, aligned to the first new token; each chunk keeps its local max of accumulated
  attention (first index on ties; the last partial chunk keeps one too). Old tokens (survivors
  of earlier passes) are interval-sampled, every ŝ-th from the first, ŝ = ⌊(s+1)/2⌋. All
  survivors become old. Result: sink ++ old_keep ++ new_keep ++ window, in position order.
- Score (Alg. 2 "accumulated attention scores A"; seed §2.2): the fp32 sum of the attention
  probabilities a token received from every query since it entered the cache (prompt column
  sums first), per kv head, summed over the query heads that share it (GQA, seed §2.6). Scores
  are kept across passes (the authors' code zeroes sink/old scores, which changes no decision).
- Prefill (Remark 2): passes repeat until the middle fits T (the first pass sees the whole
  middle as new, later ones only old tokens), so the buffer is bounded right after prefill
  (seed §6.5). The prompt's own attention and the first generated token use the full prompt.
- Decode: a token is appended at `buf.used`; after its attention was accumulated, a row whose
  middle exceeds T gets one pass (the current step saw the uncompressed cache, seed §2.3). All
  rows are compacted by one batched gather per buffer tensor (K, V, score, state, pos, valid):
  every row's kept slots move to the front in slot (= position) order, shorter rows end in
  invalid slots, and `buf.used` becomes the longest row's count. `buf.state` is 1 for old
  tokens (it travels with the token), so the old/new split needs no other per-row state.
  Rows are independent: with left padding, rows reach the threshold at different steps.

Budget -> (k, w, T, s). The buffer must hold the peak, k + w + T committed tokens plus the one
being decoded (seed §2.11, §8), so with `slots` slots (scratch included) we need
k + w + T + 1 <= slots. Defaults k = 4 and s = 5 (the paper's and its code's; seed §5). With
C = slots - 1 - k and Theorem 3.1's ratio r = T/w = (s²+1)/(s+1) for odd s, s-1 for even s:

    w = max(1, floor(C / (1 + r))),   T = C - w

which fills every slot and puts T/w in the theorem's own interval r <= T/w < r + 2s/w (eq. 13/14;
1 + r < 2s). E.g. 201 slots -> k=4, w=36, T=160 (the "cache size 200" setting of Fig. 4 /
Table A, T/w = 4.44) and 165 slots -> (4, 30, 130, 5). Each of k, w, T, s can be set with
--policy-arg (w=0 and T=0 mean "derive"); given w only, T = C - w; given T only, w = C - T.
Constraints: s >= 3 (with s <= 2, ŝ = 1 and old tokens are never evicted, so no buffer bounds
the cache), T >= 2 (the smallest threshold for which one decode pass always brings the middle
back to <= T for every s >= 3), w >= 1. The paper's budgets are *average* cache sizes; this
engine allocates the peak, and `describe()` reports both (the average from an exact simulation
of the token counts, which do not depend on scores, for this run's prompt and generation
lengths; plus the steady-state k + w + (a* + T)/2 with a* = T(s+1)/(s²+1), seed §2.11).

Positions (LLaMA/RoPE; seed §2.7, §6.7 - ambiguous in the paper): the authors' code uses
StreamingLLM's pos-shift (keys cached before RoPE, rotated by their rank in the cache) for every
method, so by default `rope_in_cache` is on (`pos_shift=True`), as in `streaming`;
`--policy-arg pos_shift=false` caches keys after RoPE at their true positions instead. (The seed
report recommended true positions for layout simplicity; in this engine the model already rotates
by in-cache rank, so pos-shift costs no layout change and matches the paper's numbers.) When the
run never evicts (budget >= sequence) keys stay post-RoPE like `full`: the ranks would equal the
positions anyway, and this keeps the logits bit-identical to `full`.

`buzz-logn` (Sec. 3.5, eq. 7/8): attention logits are multiplied by log_512(n), n = the number of
keys attended (cache + current token; the prompt length at prefill), in all layers, prefill and
decode, whether or not the run evicts (it is part of the variant's attention). The "log n time
complexity" claims of the abstract are not implemented or claimed (seed §2.10); eviction work
is O(T) per pass, one pass every T + 1 - a* steps.
"""
from __future__ import annotations

import math

import torch

from flexevict.core import kernels
from flexevict.errors import UserError
from flexevict.core.kernels import buzz_select, compaction
from flexevict.core.kv import KVBuffer, left_aligned

from flexevict.policies import register
from flexevict.policies.base import Policy, add_attention

MIN_T = 2          # smallest threshold for which a decode pass always fits (any s >= 3)


@register
class Buzz(Policy):
    name = "buzz"
    args = {"k": 4, "w": 0, "T": 0, "s": 5, "pos_shift": True}
    needs_prompt_scores = True
    rope_in_cache = True

    def __init__(self, budget=None, budget_tokens=None, **args):
        super().__init__(budget=budget, budget_tokens=budget_tokens, **args)
        o = self.opts
        if o["s"] < 3:
            raise UserError(f"--policy-arg s={o['s']}: BUZZ's stride must be >= 3 (with s <= 2 "
                            "the old-token stride is 1 and the cache is never bounded)")
        if o["k"] < 0 or o["w"] < 0:
            raise UserError("--policy-arg k and w must be >= 0 (w=0: derive from the budget)")
        if o["T"] != 0 and o["T"] < MIN_T:
            raise UserError(f"--policy-arg T={o['T']}: BUZZ's threshold must be >= {MIN_T} "
                            "(T=0: derive from the budget)")
        self.rope_in_cache = bool(o["pos_shift"])
        self.k, self.s = o["k"], o["s"]
        self.sh = (self.s + 1) // 2
        self.w = self.T = None
        self.run_lengths = None

    # ------------------------------------------------------------------ sizing
    def minimum_slots(self) -> int:
        o = self.opts
        return o["k"] + max(o["w"], 1) + (o["T"] or MIN_T) + 1

    def capacity(self, prompt_len: int, gen_len: int) -> int:
        self.run_lengths = (prompt_len, gen_len)
        return super().capacity(prompt_len, gen_len)

    def split(self, capacity: int) -> None:
        o, s = self.opts, self.s
        room = capacity - self.k                       # slots for window + middle
        w, T = o["w"], o["T"]
        if not w and not T:
            theorem_w = room * (s + 1) // (s * s + s + 2) if s % 2 else room // s
            w = max(1, min(theorem_w, room - MIN_T))
            T = room - w
        elif not T:
            T = room - w
        elif not w:
            w = room - T
        self.w, self.T = w, T
        # budget >= sequence: nothing is ever evicted and keys are cached like `full`
        self.rope_in_cache = bool(o["pos_shift"]) and self.evicts
        if self.evicts and (w < 1 or T < MIN_T or self.k + w + T > capacity):
            raise UserError(f"BUZZ needs k + w + T + 1 <= slots with w >= 1, T >= {MIN_T} "
                            f"(k={self.k}, w={w}, T={T}, slots={capacity + 1}); raise the budget "
                            "or lower --policy-arg k/w/T")

    def a_star(self) -> float:
        """Steady-state old-sample count, the fixed point of App. D.1's recursion (eq. 10)."""
        s = self.s
        return self.T * (s + 1) / (s * s + 1) if s % 2 else self.T / (s - 1)

    def simulate(self, prompt_len: int, steps: int) -> list[int]:
        """Committed tokens of an unpadded row after prefill and after each of `steps` decode
        steps (the counts follow the rules alone; scores only pick which tokens)."""
        n, a = prompt_len, 0
        sizes = []
        for step in range(steps + 1):
            n += step > 0
            while self.evicts and n - self.k - self.w > self.T:   # repeats only in prefill
                n, a = self.pass_counts(n, a)
            sizes.append(n)
        return sizes

    def pass_counts(self, count: int, old: int) -> tuple[int, int]:
        """A row's (tokens, old tokens) after one pass, from the counts alone (`buzz_select`:
        the k sinks, the w window, every ŝ-th old token, one new token per chunk of s); a row
        whose middle fits T is left as it is."""
        k, w = self.k, self.w
        if count - k - w <= self.T:
            return count, old
        new = count - k - w - old
        old = -(-old // self.sh) + -(-new // self.s)
        return k + w + old, old

    def describe(self) -> dict:
        d = super().describe()
        if self.slots is None:
            return d
        p, g = self.run_lengths
        sizes = self.simulate(p, max(g - 1, 0))       # g tokens need g - 1 decode steps
        decode = sizes[1:] or sizes
        d.update(k=self.k, w=self.w, T=self.T, s=self.s, s_hat=self.sh,
                 pos_shift=self.rope_in_cache,
                 peak_tokens=self.k + self.w + self.T if self.evicts else max(sizes),
                 avg_tokens=round(sum(decode) / len(decode), 2),
                 steady_avg_tokens=round(self.k + self.w + (self.a_star() + self.T) / 2, 2),
                 a_star=round(self.a_star(), 2))
        return d

    # ------------------------------------------------------------------ hooks
    def prefill(self, buf: KVBuffer, k, v, pos, valid, scores=None) -> None:
        if not self.evicts:
            return buf.store_prompt(k, v, pos, valid, scores)
        s_len, rows = valid.shape
        order = left_aligned(valid)
        live = valid.gather(0, order)                  # work on left-aligned rows
        score = (scores if scores is not None else torch.zeros(valid.shape, device=valid.device))
        score = score.float().gather(0, order)
        old = torch.zeros_like(live)
        index = torch.arange(s_len, device=valid.device).unsqueeze(1).expand(s_len, rows)
        for _ in range(s_len):                         # Remark 2: sample until it fits
            keep, old_after, hit = self.select(live, old, score)
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
        buf.buzz_counts = _distinct(zip(live.sum(0).tolist(), old.sum(0).tolist()))

    def after_attention(self, buf: KVBuffer, slot: int, probs: torch.Tensor) -> None:
        if not self.evicts:
            return buf.commit_appended(slot)
        n = probs.shape[-1]
        add_attention(buf, probs)
        if slot != buf.scratch:
            buf.commit_appended(slot)
        counts = [(c + 1, a) for c, a in buf.buzz_counts]     # every row holds the new token
        # buf.used is the longest row's count, so this is "some row's middle exceeds T"; a token
        # in scratch cannot stay there (it cannot happen without a pass when k+w+T+1 <= slots,
        # but compacting then still frees room, since no row holds more than k+w+T tokens)
        if n > self.k + self.w + self.T or slot == buf.scratch:
            counts = [self.pass_counts(c, a) for c, a in counts]
            self.evict(buf, n, max(c for c, _ in counts))
        buf.buzz_counts = _distinct(counts)

    # ------------------------------------------------------------------ the pass
    def select(self, valid, old, score):
        """One BUZZ pass over slots [0, n) of every row (`flexevict.core.kernels.buzz_select`).
        valid, old (n, R) bool, score (n, R) -> keep (n, R), old flag of the kept tokens
        afterwards (n, R), hit (R,): rows whose middle exceeded T."""
        return buzz_select(valid, old, score, self.k, self.w, self.T, self.s)

    def evict(self, buf: KVBuffer, n: int, used: int) -> None:
        """Run a pass over slots [0, n) and compact every row (one kernel launch on a GPU);
        used: the longest row's count afterwards, known on the host (`pass_counts`)."""
        if used > buf.capacity:
            raise RuntimeError(f"BUZZ pass leaves {used} tokens for {buf.capacity} slots")
        kernels.buzz_pass(buf, n, self.k, self.w, self.T, self.s, used=used)


def _distinct(counts) -> tuple:
    """Rows with the same (tokens, old tokens) evolve alike: one entry each, sorted."""
    return tuple(sorted(set(counts)))


@register
class BuzzLogN(Buzz):
    name = "buzz-logn"
    args = {**Buzz.args, "base": 512}
    batch_by_length = True          # the scale reads the padded key count at prefill

    def logit_scale(self, n_keys: int) -> float:
        """log_base(n) (Sec. 3.5, eq. 7/8): exactly 1 at n = base (512, the pre-training length)."""
        return math.log(n_keys) / math.log(self.opts["base"])
