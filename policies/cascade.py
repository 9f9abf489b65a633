"""`cascade`: Cascading KV Cache (Willette et al. 2024, "Training-Free Exponential Extension of
Sliding Window Context with Cascading KV Cache", arXiv 2406.17808 v1; Sec. 3.1, Algorithm 1,
App. B and C).

Rule:
- `sinks` slots (default 4, Sec. 4 "Setup") hold the first tokens forever, never scored. The rest
  of the committed slots, the window |C|, is split into `cascades` = N (default 4, Table 5)
  circular sub-caches C_1..C_N (Sec. 4.5) of W = |C| // N slots; C_1 holds the newest tokens.
- Acceptance (Sec. 3.1, Fig. 4, Eq. 4: C_i accepts half of what C_{i-1} evicts): with t the
  token's position (sinks included) and i the 0-based sub-cache index, C_i accepts iff
  (t - sinks) mod 2^i == 0 (the authors' code; the paper does not define "iteration").
- Insertion (Algorithm 1): accepting and not full -> append; accepting and full -> push, the
  oldest cascades on (dropped from C_N); not accepting and empty -> append; otherwise the incoming
  token replaces the sub-cache's newest iff its score is higher (strict `>`; `tie_replace=True`
  gives the code's `>=`), the loser is dropped.
- Score (Sec. 3.1 "Token Selection"): an EMA mu <- gamma*mu + (1-gamma)*s of the attention each
  token receives, in `buf.state` (it travels with the token); gamma = exp(-N ln(100) / |C|)
  (App. B, Eq. 14) unless given. In a stacked cache (kv.LayerRows) each layer leaves its s in
  `buf.score` and the stack's once-per-step commit folds every layer's into mu and clears it.
- Homogeneous heads (Sec. 3.1, App. C): one decision per (sequence, layer); s is reduced over the
  sequence's `buf.kv_heads` kv heads with `reduce` = mean | max | median (default mean).
- Positions (Sec. 3.1): contiguous in-cache ranks (`rope_in_cache`); OPT keeps its true absolute
  positions (learned position embeddings cannot be re-ranked).

Decisions where the paper is silent:
- Order: the new token attends from the scratch slot first; then every non-sink EMA is updated
  (the new token's included) and the insertion runs with the updated scores.
- Fill phase: the paper's schedule (tokens may drop before the window is full); `eager_fill`
  (the authors' later code) accepts everywhere until the window is full.
- Prefill (not in the paper): one full causal pass; each prompt token's initial mu is its
  EMA-weighted column sum (`prompt_scores`, the `fold` the model passes to
  kernels.prefill_attention_scores), then Algorithm 1 inserts the prompt, batched
  over its tokens (`_insert_prompt`: one argmax per slot over the range the schedule gives it).
- GQA: a kv head's probability sums its query heads (mean: the paper's decisions exactly).
- Budget: |C| = slots - 1 - sinks, W = |C| // N, and the remainder goes to C_1. Minimum slots:
  sinks + N + 1.
- Counters are per sequence (left-padded rows follow their own schedules): the declared fields
  `start`/`count` (`fields()`, `kv.Field`) in `buf.policy_state`; the sub-cache layout is a
  per-layer constant, `buf.constant("cascade_layout", ...)`.

Notes: policies/README.md#cascade
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from flexevict.core import kernels
from flexevict.errors import UserError, setting
from flexevict.core.kernels import REDUCTIONS, CascadeRule, SubCaches, reduce_heads
from flexevict.core.kv import Field, Layout, left_aligned

from flexevict.policies.registry import register
from flexevict.policies.base import Policy


@dataclass(frozen=True)
class CascadeLayout(Layout):
    """A Cascade run's regions: `sinks` slots, then the sub-caches C_1..C_N of `sizes` slots
    (the remainder of |C| in C_1), and the EMA's resolved `gamma`."""
    sinks: int = 4
    sizes: tuple[int, ...] = ()
    gamma: float = 0.0

    def bases(self) -> list[int]:
        """Each sub-cache's first slot."""
        return [self.sinks + sum(self.sizes[:i]) for i in range(len(self.sizes))]

    def describe(self) -> dict:
        return {**super().describe(), "subcaches": list(self.sizes), "gamma": self.gamma,
                "approx_context": sum(s << i for i, s in enumerate(self.sizes)), "scratch": 1}


@register
@dataclass(frozen=True)
class Cascade(Policy):
    sinks: int = 4
    cascades: int = 4
    gamma: float = -1.0             # < 0: App. B's exp(-N ln(100) / |C|)
    reduce: str = "mean"
    tie_replace: bool = False
    eager_fill: bool = False
    # memo: the prompt insertion is the same in every layer (not an argument, not state)
    _schedules: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    name = "cascade"
    stacks = True
    graph_safe = True
    needs_prompt_scores = True
    rope_in_cache = True

    def __post_init__(self):
        super().__post_init__()
        if self.sinks < 0:
            raise UserError(f"{setting('policy_args')} sinks must be >= 0 (got {self.sinks})")
        if self.cascades < 1:
            raise UserError(f"{setting('policy_args')} cascades must be >= 1 (got {self.cascades})")
        if self.reduce not in REDUCTIONS:
            raise UserError(f"{setting('policy_args')} reduce must be one of "
                            f"{', '.join(REDUCTIONS)} (got '{self.reduce}')")
        if self.gamma > 1:
            raise UserError(f"{setting('policy_args')} gamma must be in [0, 1] (or < 0 for the "
                            f"paper's exp(-N ln(100)/|C|)); got {self.gamma}")

    # ------------------------------------------------------------------ sizing
    def minimum_slots(self) -> int:
        return max(self.min_slots, self.sinks + self.cascades + 1)

    def layout(self, prompt_len: int, gen_len: int) -> CascadeLayout:
        base = super().layout(prompt_len, gen_len)
        n = self.cascades
        window = max(base.capacity - self.sinks, 0)
        w, rest = divmod(window, n)
        g = self.gamma if self.gamma >= 0 else (
            math.exp(-n * math.log(100) / window) if window else 0.0)
        return CascadeLayout(**dataclasses.asdict(base), sinks=self.sinks,
                             sizes=(w + rest,) + (w,) * (n - 1), gamma=g)

    # ------------------------------------------------------------------ prompt statistic
    def prompt_scores(self, layout, acc, p, first, valid):
        """Fold one block of prefill attention into the EMA-weighted column sums (engine hook).

        p (B, Hk, g, c, j) fp32 probabilities of prompt queries [first, first + c) over keys
        [0, j), valid (B, S) -> (B, Hk, S): sum over real queries q of
        (1 - gamma) gamma^(S-1-q) p[q, k], summed over the group (left padding puts every
        row's last real query at S - 1)."""
        (b, hk, _, c, j), s = p.shape, valid.shape[1]
        q = torch.arange(first, first + c, device=p.device, dtype=torch.float64)
        g = layout.gamma
        w = ((1.0 - g) * g ** (s - 1 - q)).to(p.dtype)                           # (c,)
        w = w * valid[:, first:first + c]                                        # (B, c)
        if acc is None:
            acc = p.new_zeros(b, hk, s)
        per_row = w[:, None, None].expand(b, hk, p.shape[2], c).reshape(b * hk, 1, -1)
        acc[..., :j] += torch.bmm(per_row, p.reshape(b * hk, -1, j)).view(b, hk, j)  # a GEMV
        return acc

    # ------------------------------------------------------------------ layout
    def fields(self, layout):
        # per row, each sub-cache's oldest entry and fill
        return (Field("start", (self.cascades, "rows"), torch.int64),
                Field("count", (self.cascades, "rows"), torch.int64))

    def subcaches(self, buf) -> SubCaches:
        """The buffer's sub-caches: its declared start/count, and each sub-cache's first slot,
        size and acceptance period (N, 1) (constants of the run)."""
        lay = buf.layout

        def columns(dev):
            col = lambda x: torch.tensor(x, dtype=torch.int64, device=dev).unsqueeze(1)  # noqa: E731
            return col(lay.bases()), col(lay.sizes), col([1 << i for i in range(len(lay.sizes))])
        return SubCaches(buf.policy_state["start"], buf.policy_state["count"],
                         *buf.constant("cascade_layout", columns))

    def contents(self, buf, row: int = 0) -> list[list[int]]:
        """Positions held by each sub-cache C_1..C_N of one row, oldest first (for inspection)."""
        out, lay = [], buf.layout
        for i, (base, size) in enumerate(zip(lay.bases(), lay.sizes)):
            st, cn = (int(buf.policy_state[f][i, row]) for f in ("start", "count"))
            out.append([int(buf.pos[base + (st + k) % size, row]) for k in range(cn)])
        return out

    # ------------------------------------------------------------------ the insertion
    def _schedule(self, lay: CascadeLayout, p: int) -> tuple:
        """The insertion's structure for prompt tokens 0..p-1 (the same for every row and layer:
        which slots move where depends only on t and the fill counts, never on scores).

        -> per token: (src, dst, compare) where src/dst are the unconditional moves (pushes and
        appends, one simultaneous move) and compare is None or (carry, newest): the carry
        replaces the newest iff it scores higher; plus the (start, count) after each token."""
        key = (p, lay.sizes)
        if key in self._schedules:
            return self._schedules[key]
        n, S, sc = len(lay.sizes), lay.sinks, lay.sinks + sum(lay.sizes)
        bases = lay.bases()
        start, count = [0] * n, [0] * n
        plan, hist = [], [(tuple(start), tuple(count))]
        for t in range(p):
            src, dst, cmp = [], [], None
            if t < S:
                src, dst = [sc], [t]
            else:
                carry = sc
                not_full = sum(count) < sum(lay.sizes)
                for i, (b, w) in enumerate(zip(bases, lay.sizes)):
                    acc = (t - S) % (1 << i) == 0 or (self.eager_fill and not_full)
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
        self._schedules[key] = plan, hist
        return plan, hist

    def _held_ranges(self, lay: CascadeLayout, p: int, lengths: tuple[int, ...], dev):
        """What each committed slot holds after the first n prompt tokens, for each n in
        `lengths`: (len(lengths), capacity, width) int64 token indices, -1 padded. Which slots
        move where never depends on scores (`_schedule`), and each compare keeps the better of
        the sub-cache's newest and the incoming carry, whose tokens are all younger; so a
        slot holds the best-scored token of one contiguous range of the prompt (ties: the
        oldest, or with `tie_replace` the youngest), and these ranges are the schedule's
        alone. Cached for the run (every layer inserts the same prompt)."""
        key = ("ranges", p, lay.sizes, lengths, str(dev))
        if key in self._schedules:
            return self._schedules[key]
        plan, _ = self._schedule(lay, p)
        cap = sc = lay.capacity
        held, snapshots = [None] * (cap + 1), {}
        for t, (src, dst, cmp) in enumerate(plan[:max(lengths)]):
            held[sc] = (t, t)
            now = list(held)
            for a, b in zip(src, dst):
                now[b] = held[a]
            if cmp is not None:                    # the winner of both ranges
                now[cmp[1]] = (held[cmp[1]][0], held[cmp[0]][1])
            held = now
            if t + 1 in lengths:
                snapshots[t + 1] = held[:cap]
        width = max((r[1] - r[0] + 1 for h in snapshots.values() for r in h if r), default=1)
        index = torch.full((len(lengths), cap, width), -1, dtype=torch.int64)
        for i, n in enumerate(lengths):
            for slot, r in enumerate(snapshots.get(n, [None] * cap)):
                if r:
                    index[i, slot, :r[1] - r[0] + 1] = torch.arange(r[0], r[1] + 1)
        self._schedules[key] = index.to(dev)
        return self._schedules[key]

    def _insert_prompt(self, lay: CascadeLayout, proxy, n_real) -> torch.Tensor:
        """Algorithm 1 over a left-aligned prompt (token i has t = i in every row), batched:
        each slot keeps the best-scored token of its range (`_held_ranges`), one argmax.
        proxy (p, rows) fp32 scores, n_real (rows,) -> held (capacity, rows) token indices,
        -1 where a slot stays empty."""
        p, rows = proxy.shape
        dev = proxy.device
        lengths = tuple(sorted(set(n_real.clamp(max=p).tolist())))   # prefill-only host read
        ranges = self._held_ranges(lay, p, lengths, dev)             # (L, cap, width)
        group = torch.searchsorted(torch.tensor(lengths, device=dev), n_real.clamp(max=p))
        index = ranges[group].permute(1, 2, 0)                         # (cap, width, rows)
        if self.tie_replace:                                           # ties: the youngest
            index = index.flip(1)
        cap, width = index.shape[:2]
        mu = proxy.gather(0, index.clamp(min=0).reshape(cap * width, rows)).view(cap, width, rows)
        best = mu.masked_fill_(index < 0, float("-inf")).argmax(dim=1, keepdim=True)  # first
        return index.gather(1, best).squeeze(1)

    # ------------------------------------------------------------------ hooks
    def prefill(self, buf, k, v, pos, valid, scores=None):
        lay = buf.layout
        if not lay.evicts:
            return buf.store_prompt(k, v, pos, valid, scores)
        self.subcaches(buf)              # its constants are made here, never in a decode step
        dev = k.device
        p, rows = valid.shape
        cap = buf.capacity
        order = left_aligned(valid)
        n_real = valid.sum(0)                                                 # (rows,)
        real = torch.arange(p, device=dev).unsqueeze(1) < n_real
        if scores is None:
            proxy = torch.zeros(p, rows, dtype=torch.float32, device=dev)
        else:   # the EMA-weighted column sums of `prompt_scores`, reduced over heads
            proxy = torch.where(real, scores.float().gather(0, order), 0.0)
            proxy = reduce_heads(proxy, buf.kv_heads, self.reduce)
        held = self._insert_prompt(lay, proxy, n_real)                # (cap, rows), -1: empty
        mu = proxy.gather(0, held.clamp(min=0))
        _, hist = self._schedule(lay, p)
        # each row's sub-cache counters as of its last prompt token
        h = torch.tensor([list(a) + list(c) for a, c in hist], device=dev)    # (p+1, 2N)
        at = h[n_real.clamp(max=p)].t()                                       # (2N, rows)
        buf.policy_state["start"].copy_(at[:self.cascades])
        buf.policy_state["count"].copy_(at[self.cascades:])
        kept = held >= 0
        buf.store_prompt(k, v, pos, valid, keep=held.clamp(min=0))   # mu lives in `state`
        buf.valid[:cap] &= kept
        buf.pos[:cap].masked_fill_(~kept, -1)
        buf.state[:cap] = torch.where(kept, mu, 0.0)
        buf.state[:min(self.sinks, cap)] = 0.0

    def after_attention(self, buf, slot, probs, scored=False):
        # `observe` and `commit` in one launch on a GPU, unless a stack commits (kv.LayerRows)
        if buf.stack is None and self.inserts(buf, slot):
            return kernels.cascade_update(buf, self.subcaches(buf), probs, self.rule(buf.layout))
        super().after_attention(buf, slot, probs, scored)

    def inserts(self, buf, slot) -> bool:
        """The decoded token (in `slot`) goes through Algorithm 1: the buffer is full (until
        then every token is appended and nothing is scored)."""
        return buf.layout.evicts and slot == buf.scratch

    def observe(self, buf, slot, probs, scored=False):
        # a stack's layer (kv.LayerRows): this step's attention, every slot's, into buf.score;
        # the stack's commit folds all layers' into the EMA at once
        if self.inserts(buf, slot):
            kernels.cascade_attention(buf, probs, self.rule(buf.layout))

    def commit(self, buf, slot):
        if not self.inserts(buf, slot):
            return buf.commit_appended(slot)
        rule = self.rule(buf.layout)    # the EMA of every non-sink slot, the new token's too
        kernels.cascade_fold(buf, buf.attended(slot), rule)
        kernels.cascade_update(buf, self.subcaches(buf), None, rule)

    def rule(self, layout: CascadeLayout) -> CascadeRule:
        """The decode step's arguments, resolved for a run of `layout`."""
        return CascadeRule(self.sinks, layout.gamma, self.reduce, sum(layout.sizes),
                           self.tie_replace, self.eager_fill)
