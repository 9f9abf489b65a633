"""`cascade`: Cascading KV Cache (Willette et al., "Training-Free Exponential Extension of Sliding
Window Context with Cascading KV Cache", arXiv 2406.17808 v1; paper 002, seed-cascade.md).

Rules (paper Sec. 3.1, Algorithm 1, App. B and C; seed report §1):

- `sinks` attention-sink slots (default 4, Sec. 4 "Setup") hold the first tokens forever; they are
  never scored or evicted. The rest of the committed slots, the window |C|, is split into
  `cascades` = N (default 4, Table 5) equal sub-caches C_1..C_N of W = |C| // N slots each; C_1
  holds the newest tokens. Each sub-cache is a circular buffer (Sec. 4.5): a contiguous block of
  W slots with a start index (its oldest slot) and a count.
- Acceptance schedule (Sec. 3.1, Fig. 4, Eq. 4: sub-cache i accepts half of what C_{i-1} evicts):
  with t the 0-based index of the incoming token (sinks included, i.e. its position) and i the
  0-based sub-cache index, C_i is accepting iff (t - sinks) mod 2^i == 0 (seed §1.2 / §5.1, the
  authors' code; the paper does not define "iteration").
- Insertion (Algorithm 1): a token goes to the sinks while they are not full; then, per
  sub-cache: accepting and not full -> append; accepting and full -> push it, and the evicted
  oldest token cascades to the next sub-cache (from C_N it is dropped); not accepting and empty ->
  append ("eager add"); not accepting and not empty -> the incoming token replaces the newest
  token of the sub-cache iff its score is higher (strict `>`, the paper's rule; `tie_replace=True`
  gives the code's `>=`), and the loser is dropped.
- Token-selection score (Sec. 3.1 "Token Selection"): an EMA mu <- gamma*mu + (1-gamma)*s of the
  attention probability s each token receives, kept per slot in `buf.state` (so it travels with
  the token); a new token starts at mu = 0. gamma = exp(-N ln(100) / |C|) (App. B, Eq. 14) unless
  `gamma` is given in [0, 1].
- Homogeneous heads (Sec. 3.1, App. C): one decision per (sequence, layer) for all heads. s is
  reduced over the heads with rho = `reduce` (mean | max | median; default mean, Sec. 4); every
  row of a sequence (rows b*kv_heads + h) gets the same score, so all its rows make the same
  moves and each kept token has one in-cache position.
- Positions (Sec. 3.1 "Positional Encoding"): contiguous in-cache ranks, sinks first
  (`rope_in_cache`: keys cached before RoPE and rotated by rank at attention time). OPT keeps its
  true absolute positions (seed §5.6).

Decisions where the paper is silent or ambiguous (seed §5):

- Order of operations. The engine attends the new token from the scratch slot before the policy
  commits it, so after each attention step this module first updates every non-sink slot's EMA
  (the new token included), then runs the insertion with the updated scores. The seed's worked
  examples (Example A and B) are reproduced exactly under this order.
- Fill phase: the paper's schedule (no "fill first"; tokens can be dropped before the window is
  full, seed §5.2), with an `eager_fill` option (the later code): every sub-cache accepts while
  the window is not full, so nothing is dropped until it is.
- Prefill (not in the paper, seed §1.9 / §5.8): the engine's prefill is one full causal pass, so
  the submission code's token-by-token attention over the cascade is not available. We follow
  the later code's "strided" prefill with one stride covering the whole prompt: each prompt
  token's score is its EMA-weighted column sum sum_q (1-gamma) gamma^(P-1-q) a[q, k] over the
  real prompt queries q (`prompt_scores`, folded from the prefill attention), i.e. exactly the mu
  the decode EMA would give it had the prompt been streamed with full attention; it is the
  token's initial mu for decode. Then the prompt tokens are inserted one by one, in order, by
  Algorithm 1 with these (static) scores. Which slots move where depends only on t and the fill
  counts, never on scores, so that part is computed once per run (plain Python) and shared by
  all rows and layers; per token only the score comparison is a tensor op over all rows.
- GQA: a kv head's probability is the sum over the query heads that share it (the project's
  convention); rho is then taken over the sequence's kv heads. For `mean` this is exactly the
  paper's mean over all query heads times the group size (same decisions); for max/median with
  GQA it is the kv-head variant.
- Budget: slots = sinks + N*W + 1 (scratch); W = (slots - 1 - sinks) // N and any remainder
  goes to C_1 (the recent window). Minimum: sinks + N + 1.
- Counters are per row (per sequence; heads share them), so left-padded batches with different
  prompt lengths each follow their own schedule (seed §5.5).

The number of kv heads per sequence is read from `buf.kv_heads` (set by the engine when it
allocates buffers); a buffer without it is treated as one kv head per sequence, i.e. each row
decides on its own.
"""
from __future__ import annotations

import math

import torch

from flexevict.core import kernels
from flexevict.errors import UserError
from flexevict.core.kernels import reduce_heads
from flexevict.core.kv import left_aligned

from flexevict.policies import register
from flexevict.policies.base import Policy

REDUCTIONS = ("mean", "max", "median")


@register
class Cascade(Policy):
    name = "cascade"
    args = {"sinks": 4, "cascades": 4, "gamma": -1.0, "reduce": "mean",
            "tie_replace": False, "eager_fill": False}
    needs_prompt_scores = True
    rope_in_cache = True

    def __init__(self, budget=None, budget_tokens=None, **args):
        super().__init__(budget=budget, budget_tokens=budget_tokens, **args)
        o = self.opts
        if o["sinks"] < 0:
            raise UserError(f"--policy-arg sinks must be >= 0 (got {o['sinks']})")
        if o["cascades"] < 1:
            raise UserError(f"--policy-arg cascades must be >= 1 (got {o['cascades']})")
        if o["reduce"] not in REDUCTIONS:
            raise UserError(f"--policy-arg reduce must be one of {', '.join(REDUCTIONS)} "
                            f"(got '{o['reduce']}')")
        if o["gamma"] > 1:
            raise UserError(f"--policy-arg gamma must be in [0, 1] (or < 0 for the paper's "
                            f"exp(-N ln(100)/|C|)); got {o['gamma']}")
        self.sinks, self.n = o["sinks"], o["cascades"]
        self.sizes: list[int] = []
        self.gamma = 0.0

    # ------------------------------------------------------------------ sizing
    def minimum_slots(self) -> int:
        return max(self.min_slots, self.sinks + self.n + 1)

    def split(self, capacity: int) -> None:
        window = max(capacity - self.sinks, 0)
        w, rest = divmod(window, self.n)
        self.sizes = [w + rest] + [w] * (self.n - 1)
        g = self.opts["gamma"]
        self.gamma = g if g >= 0 else (math.exp(-self.n * math.log(100) / window) if window else 0.0)

    def describe(self) -> dict:
        return {**super().describe(), "subcaches": list(self.sizes), "gamma": self.gamma,
                "approx_context": sum(s << i for i, s in enumerate(self.sizes)), "scratch": 1}

    # ------------------------------------------------------------------ prompt statistic
    def prompt_scores(self, acc, p, first, valid):
        """Fold one block of prefill attention into the EMA-weighted column sums (engine hook).

        p (B, Hk, g, c, S) fp32 probabilities of prompt queries [first, first + c), valid (B, S)
        -> (B, Hk, S): sum over real queries q of (1 - gamma) gamma^(S-1-q) p[q, k], summed over
        the group (left padding puts every row's last real query at S - 1)."""
        s, c = p.shape[-1], p.shape[3]
        q = torch.arange(first, first + c, device=p.device, dtype=torch.float64)
        w = ((1.0 - self.gamma) * self.gamma ** (s - 1 - q)).to(p.dtype)           # (c,)
        w = w * valid[:, first:first + c]                                        # (B, c)
        total = torch.einsum("bhgcs,bc->bhs", p, w)
        return total if acc is None else acc + total

    # ------------------------------------------------------------------ layout
    def _setup(self, buf) -> None:
        """Per-buffer cascade state, allocated on first use: start/count (N, rows) per row, and
        each sub-cache's first slot, size and acceptance period (N, 1)."""
        dev, rows = buf.k.device, buf.k.shape[1]
        if getattr(buf, "cascade_start", None) is None:
            buf.cascade_start = torch.zeros(self.n, rows, dtype=torch.int64, device=dev)
            buf.cascade_count = torch.zeros(self.n, rows, dtype=torch.int64, device=dev)
            bases = [self.sinks + sum(self.sizes[:i]) for i in range(self.n)]
            col = lambda x: torch.tensor(x, dtype=torch.int64, device=dev).unsqueeze(1)
            buf.cascade_base = col(bases)
            buf.cascade_size = col(self.sizes)
            buf.cascade_period = col([1 << i for i in range(self.n)])
        else:
            buf.cascade_start.zero_()
            buf.cascade_count.zero_()

    def contents(self, buf, row: int = 0) -> list[list[int]]:
        """Positions held by each sub-cache C_1..C_N of one row, oldest first (for inspection)."""
        out = []
        for i, size in enumerate(self.sizes):
            base = self.sinks + sum(self.sizes[:i])
            st, cn = int(buf.cascade_start[i, row]), int(buf.cascade_count[i, row])
            out.append([int(buf.pos[base + (st + k) % size, row]) for k in range(cn)])
        return out

    # ------------------------------------------------------------------ the insertion
    def _schedule(self, p: int) -> tuple:
        """The insertion's structure for prompt tokens 0..p-1 (the same for every row and layer:
        which slots move where depends only on t and the fill counts, never on scores).

        -> per token: (src, dst, compare) where src/dst are the unconditional moves (pushes and
        appends, one simultaneous move) and compare is None or (carry, newest): the carry
        replaces the newest iff it scores higher; plus the (start, count) after each token."""
        key = (p, tuple(self.sizes))
        if getattr(self, "_cached", (None,))[0] == key:
            return self._cached[1]
        S, sc = self.sinks, self.sinks + sum(self.sizes)
        bases = [S + sum(self.sizes[:i]) for i in range(self.n)]
        start, count = [0] * self.n, [0] * self.n
        plan, hist = [], [(tuple(start), tuple(count))]
        for t in range(p):
            src, dst, cmp = [], [], None
            if t < S:
                src, dst = [sc], [t]
            else:
                carry = sc
                not_full = sum(count) < sum(self.sizes)
                for i, (b, w) in enumerate(zip(bases, self.sizes)):
                    acc = (t - S) % (1 << i) == 0 or (self.opts["eager_fill"] and not_full)
                    if acc and count[i] == w:                           # push, cascade on
                        src.append(carry), dst.append(b + start[i])
                        carry = b + start[i]
                        start[i] = (start[i] + 1) % w
                        continue
                    if acc or count[i] == 0:                            # append
                        src.append(carry), dst.append(b + (start[i] + count[i]) % w)
                        count[i] += 1
                    else:                                               # compete with newest
                        cmp = (carry, b + (start[i] + count[i] - 1) % w)
                    break
            plan.append((src, dst, cmp))
            hist.append((tuple(start), tuple(count)))
        self._cached = (key, (plan, hist))
        return plan, hist

    def _schedule_tensors(self, p: int, dev) -> list:
        """`_schedule` as per-token (src, dst) index columns (k, 1) on the buffer's device, the
        competing pair last; cached for the run (every layer inserts the same prompt)."""
        key = (p, tuple(self.sizes), str(dev))
        if getattr(self, "_cached_t", (None,))[0] != key:
            plan, _ = self._schedule(p)
            out = []
            for src, dst, cmp in plan:
                if cmp is not None:
                    src, dst = src + [cmp[0]], dst + [cmp[1]]
                col = lambda x: torch.tensor(x, dtype=torch.int64, device=dev).unsqueeze(1)
                out.append((col(src), col(dst), cmp))
            self._cached_t = (key, out)
        return self._cached_t[1]

    # ------------------------------------------------------------------ hooks
    def prefill(self, buf, k, v, pos, valid, scores=None):
        if not self.evicts:
            return buf.store_prompt(k, v, pos, valid, scores)
        self._setup(buf)
        dev = k.device
        p, rows = valid.shape
        cap, sc = buf.capacity, buf.scratch
        order = left_aligned(valid)
        n_real = valid.sum(0)                                                 # (rows,)
        real = torch.arange(p, device=dev).unsqueeze(1) < n_real
        if scores is None:
            proxy = torch.zeros(p, rows, dtype=torch.float32, device=dev)
        else:   # the EMA-weighted column sums of `prompt_scores`, reduced over heads
            proxy = torch.where(real, scores.float().gather(0, order), 0.0)
            proxy = reduce_heads(proxy, getattr(buf, "kv_heads", 1), self.opts["reduce"])
        # insert the prompt token by token (left-aligned, so token i has t = i in every row) on
        # index maps: which prompt token each slot holds, and its score
        _, hist = self._schedule(p)
        held = torch.full((cap + 1, rows), -1, dtype=torch.int64, device=dev)
        mu = torch.zeros(cap + 1, rows, dtype=torch.float32, device=dev)
        ridx = buf.rows_index
        all_live = int(n_real.min())             # host reads here are prefill-only (once per call)
        tie = self.opts["tie_replace"]
        for i, (s_t, d_t, cmp) in enumerate(self._schedule_tensors(p, dev)):
            held[sc] = i
            mu[sc] = proxy[i]
            move = None
            if cmp is not None:
                a, b = mu[cmp[0]], mu[cmp[1]]
                move = torch.ones(s_t.shape[0], rows, dtype=torch.bool, device=dev)
                move[-1] = a >= b if tie else a > b
            if i >= all_live:                          # rows whose prompt has ended stay put
                live = (i < n_real).expand(s_t.shape[0], rows)
                move = live if move is None else move & live
            if move is not None:
                s_t, d_t = torch.where(move, s_t, sc), torch.where(move, d_t, sc)
            held[d_t, ridx] = held[s_t, ridx]
            mu[d_t, ridx] = mu[s_t, ridx]
        # each row's sub-cache counters as of its last prompt token
        h = torch.tensor([list(a) + list(c) for a, c in hist], device=dev)    # (p+1, 2N)
        at = h[n_real.clamp(max=p)].t()                                       # (2N, rows)
        buf.cascade_start.copy_(at[:self.n])
        buf.cascade_count.copy_(at[self.n:])
        kept = held[:cap] >= 0
        buf.store_prompt(k, v, pos, valid, scores, keep=held[:cap].clamp(min=0))
        buf.valid[:cap] &= kept
        buf.pos[:cap].masked_fill_(~kept, -1)
        buf.state[:cap] = torch.where(kept, mu[:cap], 0.0)
        buf.state[:min(self.sinks, cap)] = 0.0

    def after_attention(self, buf, slot, probs):
        if not self.evicts or slot != buf.scratch:
            return buf.commit_appended(slot)
        # EMA of every non-sink slot (new token included), then Algorithm 1: one launch on a GPU
        kernels.cascade_update(buf, probs, self.sinks, self.gamma, self.opts["reduce"],
                               sum(self.sizes), self.opts["tie_replace"], self.opts["eager_fill"])
