"""`vatp` and `vatp-pin`: Value-Aware Token Pruning (Guo, Kamigaito, Watanabe 2024, "Attention
Score is not All You Need for Token Importance Indicator in KV Cache Reduction: Value Also
Matters"; Sec. 3.2, Eq. 4, App. A and B).

Rule: a token's importance is its base policy's attention score times the l1 norm of its value
vector, `I_k = S_k * ||v_k||_1`, per (sequence, kv head), and the first F tokens (the "attention
sink tokens") are always kept. Everything else is the base policy's (App. A):
- `base=h2o` (default, "H2O w/ VATP"): S_k = H2O's accumulated attention (Eq. 2) in `buf.score`;
  the product is formed where a decision is made (`prefix_rank`, `victim_candidates`). As ||v_k||
  is fixed once the token exists, this equals the paper's incremental `I += a * ||v||`.
- `base=scissorhands` ("Scissorhands w/ VATP", Eq. 3): the same rule over this package's
  `scissorhands` with the VATP paper's settings (App. A): `score=attention`, `window=400`,
  `recent=10` (its other options pass through). The prompt is ranked by the attention of the
  last `window` prompt queries (that policy's `prompt_scores` fold).

`vatp-pin` is the control the paper lacks: the same base policy and first-F pinning without the
value norm (`vatp` with `norm=none`).

Decisions where the paper is silent:
- F scales with the setting (`sinks=-1`, the default; `sinks=N` fixes it). App. A pins F = 20 for
  LLaMA2-7B-chat at 4K tokens and F = 40 for Vicuna at 8K, with half of a 50% budget as heavy
  slots: F is 1/200 of the context and about 2% (20 of 1024) of the heavy slots. The default
  keeps both ratios: F = round(context / 200), at most floor(heavy * 20 / 1024), at least 1, so
  it is the paper's 20 and 40 in the paper's settings and does not take 40-100% of the heavy
  slots at 5-20% budgets of a 512-token context (the context: prompt + generated tokens, the
  budget's base).
- Sinks count inside the budget (as in the authors' code) and are capped at the heavy (prefix)
  slots; "first F" counts each row's real tokens, pads are never sinks.
- The norm is taken from the cached V of each slot (`buf.v`, bias included, no RoPE), in fp32,
  once, when the token enters the buffer (prefill, or its decode step's commit), and kept in
  `buf.state`, which travels with the token; decisions multiply by it.
- Norm: l1 (Sec. 3.2); `norm=l2|linf` give the App. B ablation.
- GQA: S_k sums the query heads sharing a kv head (the mean's ranking).
- Budget: the package's `--budget`; the paper's 50% of the prompt is `--budget-tokens` = P/2 + 1.
- No layer is exempt (as in the paper and the authors' code); an `exempt_layers` ablation is not
  offered.

Notes: policies/README.md#vatp
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flexevict.errors import UserError, setting

from flexevict.core.kernels import at_slots, candidate_slots

from flexevict.policies.registry import register
from flexevict.policies.base import Policy
from flexevict.policies.h2o import H2O
from flexevict.policies.scissorhands import Scissorhands

NORMS = ("l1", "l2", "linf", "none")
PIN_PER_CONTEXT = 20 / 4096     # App. A: F = 20 at LLaMA2's 4K tokens (40 at Vicuna's 8K)
PIN_PER_HEAVY = 20 / 1024       # ... of the 1024 heavy slots half a 50% budget gives at 4K
BASES = ("h2o", "scissorhands")


def value_norm(v: torch.Tensor, kind: str) -> torch.Tensor | None:
    """Per-token norm of value vectors: v (..., d) -> (...) fp32; None for kind 'none'."""
    if kind == "none":
        return None
    v = v.float()
    if kind == "l1":
        return v.abs().sum(dim=-1)
    if kind == "l2":
        return torch.linalg.vector_norm(v, ord=2, dim=-1)
    return v.abs().amax(dim=-1)


class ValueAware:
    """The VATP rule over a ring base policy whose `buf.score` is S_k (higher = keep): it
    replaces the base's prompt ranking (`prefix_rank`) and victim values
    (`victim_candidates`); everything else is the base's. The concrete classes declare the
    arguments `base`, `sinks` and `norm`."""
    fixed_norm = None                           # vatp-pin: "none", the only norm it accepts

    def __post_init__(self):
        super().__post_init__()
        # a frozen dataclass normalises its own fields once, here
        object.__setattr__(self, "base", str(self.base).lower())
        object.__setattr__(self, "norm", str(self.norm).lower())
        if self.base not in BASES:
            raise UserError(f"{setting('policy_args')} base={self.base}: expected one of "
                            f"{', '.join(BASES)}")
        if self.fixed_norm and self.norm != self.fixed_norm:
            raise UserError(f"policy '{self.name}' pins without a value norm (got "
                            f"{setting('policy_args')} norm={self.norm}); use policy 'vatp' for a "
                            "norm")
        if self.norm not in NORMS:
            raise UserError(f"{setting('policy_args')} norm={self.norm}: expected one of "
                            f"{', '.join(NORMS)}")
        if self.sinks < -1:
            raise UserError(f"{setting('policy_args')} sinks={self.sinks}: must be >= 0 (or -1: "
                            "scale with the context, the default)")

    def min_prefix(self) -> int:
        return 0 if self.sinks == 0 else 1      # room for at least the first token

    def pinned_count(self, layout) -> int:
        """F, capped at the heavy (prefix) slots; sinks=-1 derives it from the paper's ratios
        (see the module docstring)."""
        if self.sinks >= 0:
            return min(self.sinks, layout.prefix)
        scaled = round((layout.prompt_len + layout.gen_len) * PIN_PER_CONTEXT)
        return min(max(1, min(scaled, math.floor(layout.prefix * PIN_PER_HEAVY))), layout.prefix)

    def describe(self, layout=None) -> dict:
        d = super().describe(layout)
        if layout is not None:
            pinned = self.pinned_count(layout)
            d.update(pinned=pinned, heavy=layout.prefix - pinned)
        return d

    def value_weight(self, v: torch.Tensor) -> torch.Tensor | None:
        """(n, rows, d) -> (n, rows) fp32 multiplier of the score, or None (no weight)."""
        return value_norm(v, self.norm)

    def value_aware(self, layout, score, v, pos, valid) -> torch.Tensor:
        """I = S * ||v|| (Eq. 4); the first F real tokens get +inf (never evicted).
        score, pos, valid (n, rows); v (n, rows, d)."""
        return self.weighted(layout, score, self.value_weight(v), pos, valid)

    def weighted(self, layout, score, weight, pos, valid) -> torch.Tensor:
        """`value_aware` from the value weights (n, rows) already taken (or None)."""
        imp = score if weight is None else score * weight
        sink = valid & (pos < self.pinned_count(layout))
        return torch.where(sink, float("inf"), imp)

    # ||v|| is fixed once a token exists: it is taken once, when the token enters the buffer,
    # and kept in `buf.state` (free in both bases), which travels with the token
    def keep_weight(self, buf, slots) -> None:
        """buf.state[slots] = the value weight of those slots, when a decision will read it
        (an evicting run with a norm; `victim_candidates`)."""
        if buf.layout.evicts and self.norm != "none":
            buf.state[slots] = self.value_weight(buf.v[slots])

    def prefill(self, buf, k, v, pos, valid, scores=None):
        super().prefill(buf, k, v, pos, valid, scores)
        self.keep_weight(buf, slice(0, buf.capacity))

    def commit(self, buf, slot):
        self.keep_weight(buf, slot)                     # the new token's, before it commits
        super().commit(buf, slot)

    def prefix_rank(self, buf, scores, k, v, pos, valid):
        return self.value_aware(buf.layout, super().prefix_rank(buf, scores, k, v, pos, valid),
                                v, pos, valid)

    def base_score(self, buf, slots) -> torch.Tensor:
        """The base policy's S_k of `slots` (n, rows), >= 0, higher = keep."""
        return at_slots(buf.score, slots)

    def victim_candidates(self, buf):
        slots = candidate_slots(buf, buf.ring_start, True)
        weight = None if self.norm == "none" else at_slots(buf.state, slots)
        imp = self.weighted(buf.layout, self.base_score(buf, slots), weight,
                            at_slots(buf.pos, slots), at_slots(buf.valid, slots))
        return buf.ring_start, True, imp


@dataclass(frozen=True)
class VATPOverScissorhands(ValueAware, Scissorhands):
    """`vatp` with base=scissorhands. The defaults follow the VATP paper's Scissorhands (App. A,
    Eq. 3): 10 recent tokens, the rest selected by the attention summed over a history window
    of 400 queries (`score=attention`; the Scissorhands paper's low-attention counter stays
    available as `score=count`)."""
    score: str = "attention"
    base: str = "scissorhands"
    sinks: int = -1                 # F; -1: scaled with the context (module docstring)
    norm: str = "l1"
    name = "vatp"

    def base_score(self, buf, slots):
        return self.importance(buf, slots)


@register
@dataclass(frozen=True)
class VATP(ValueAware, H2O):
    base: str = "h2o"
    sinks: int = -1                 # F; -1: scaled with the context (module docstring)
    norm: str = "l1"
    name = "vatp"
    over_scissorhands = VATPOverScissorhands

    @classmethod
    def create(cls, budget=None, budget_tokens=None, **args) -> Policy:
        """The rule over the base policy named by `base`."""
        if str(args.get("base", "h2o")).lower() == "scissorhands":
            return cls.over_scissorhands.from_args(budget, budget_tokens, **args)
        return cls.from_args(budget, budget_tokens, **args)


@dataclass(frozen=True)
class VATPPinOverScissorhands(VATPOverScissorhands):
    """`vatp-pin` with base=scissorhands."""
    norm: str = "none"
    name = "vatp-pin"
    fixed_norm = "none"


@register
@dataclass(frozen=True)
class VATPPin(VATP):
    """The ablation: first-F pinning over the base policy, no value norm (the control the
    paper lacks)."""
    norm: str = "none"
    name = "vatp-pin"
    fixed_norm = "none"
    over_scissorhands = VATPPinOverScissorhands
