"""`vatp` and `vatp-pin`: Value-Aware Token Pruning (Guo, Kamigaito, Watanabe 2024, paper 004).

VATP (paper Sec. 3.2, Eq. 4) ranks a token by its attention-based score times the l1 norm of its
value vector, `I_k = S_k * ||v_k||_1`, per (sequence, kv-head), and always keeps the first F
tokens ("Attention Sink Tokens", Sec. 3.2; App. A: F = 20 for LLaMA2-7B-chat, 40 for the 8K
Vicuna). Everything else is the base policy's (App. A: "the only differences are the token
importance score and intentionally keeping attention sink tokens"):

- `base=h2o` (default, "H2O w/ VATP"): S_k is H2O's accumulated attention (Eq. 2), half the
  committed slots heavy and half recent (App. A), exactly `h2o` of this package. `buf.score`
  keeps S_k (prompt column sums, then every decode step's probabilities); the importance
  S_k * ||v_k||_1 is formed only where a decision is made - the prefill selection
  (`prefix_rank`) and each full step's victim (`victim_candidates`). Since ||v_k|| is fixed once the
  token exists, this equals the paper's incremental `I += a * ||v||` (seed-vatp.md §2.2).
- `base=scissorhands` ("Scissorhands w/ VATP", Eq. 3): the same rule over the `scissorhands`
  policy of this package, imported lazily (`_scissorhands_variant`), with the VATP paper's
  settings as defaults (App. A): 10 recent tokens, the rest selected by the attention summed
  over a history window of w = 400 queries (`score=attention`, `window=400`, `recent=10`; its
  other options pass through). That policy's prompt ranking is its own (today: column sums over
  all prompt queries, spread over the window; see its docstring for the proposed hook that gives
  the last-w-queries statistic of Eq. 3).

`vatp-pin` is the control the paper lacks (seed-vatp.md §6.2, §7.6): the same base policy with the
same first-F pinning, without the value norm. It is `vatp` with `norm=none`; the two differ only
in the value weight (tests/test_policy_vatp.py checks that).

Decisions (seed-vatp.md §6), where the paper is silent:
- Sinks are inside the budget (§6.1, as in the authors' code): the first F tokens occupy heavy
  (prefix) slots and are never a victim. "First F" counts each row's real tokens (absolute
  positions, which count real tokens only; pads are never sinks, §6.9). F is capped at the
  heavy slots (§6.1): a budget with fewer heavy slots than F pins the first `prefix` tokens and
  selects nothing by score (the run's `describe()` prints `pinned` and `heavy`).
- The value norm is taken from the cached V of each slot (`buf.v`, the per-head value
  projection output with its bias; values carry no RoPE), in fp32, recomputed on the fly for the
  candidate slots only (prefix + the token leaving the window: about capacity/2 rows of V per
  decision, the same order as the attention that just read all of V). Nothing is cached in
  `buf.state`, so the base policy keeps that scratchpad (Scissorhands may need it) and no norm
  can go stale when a slot is overwritten or moved.
- Norm: l1 (Sec. 3.2 / App. B); `norm=l2|linf` give the App. B ablation, `norm=none` the
  `vatp-pin` control.
- GQA (beyond the paper, Limitations; §6.10): S_k is the sum over the query heads sharing a kv
  head (the package's contract); the sum is g times the mean, so rankings equal the mean's.
- Budget: the package's `--budget` contract (a fraction of prompt + generation); the paper's
  setting is 50% of the prompt, i.e. `--budget-tokens` = P/2 + 1 (+1 = the scratch slot).
- No layers are exempt (paper and code; seed §6.5). The policy cannot know the layer index, so
  the seed's optional `exempt_layers` ablation is not offered.
"""
from __future__ import annotations

import torch

from flexevict.errors import UserError

from flexevict.core.kernels import candidate_slots

from flexevict.policies import register
from flexevict.policies.h2o import H2O

NORMS = ("l1", "l2", "linf", "none")
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
    """The VATP rule, mixed over a base policy whose `buf.score` is S_k (higher = keep)."""
    fixed_norm = None                           # vatp-pin: "none" (no --policy-arg norm)

    def __init__(self, budget=None, budget_tokens=None, **args):
        super().__init__(budget, budget_tokens, **args)
        self.opts["base"] = str(self.opts["base"]).lower()
        self.opts["norm"] = self.fixed_norm or str(self.opts["norm"]).lower()
        self._check()
        self._prompt_v = None

    def _check(self) -> None:
        if self.opts["base"] not in BASES:
            raise UserError(f"--policy-arg base={self.opts['base']}: expected one of "
                            f"{', '.join(BASES)}")
        if self.opts["norm"] not in NORMS:
            raise UserError(f"--policy-arg norm={self.opts['norm']}: expected one of "
                            f"{', '.join(NORMS)}")
        if self.opts["sinks"] < 0:
            raise UserError(f"--policy-arg sinks={self.opts['sinks']}: must be >= 0")

    def min_prefix(self) -> int:
        return min(1, self.opts["sinks"])       # room for at least the first token

    def pinned_count(self) -> int:
        """F, capped at the heavy (prefix) slots (seed-vatp.md §6.1)."""
        return min(self.opts["sinks"], self.prefix)

    def describe(self) -> dict:
        pinned = self.pinned_count()
        return {**super().describe(), "pinned": pinned, "heavy": self.prefix - pinned}

    def value_weight(self, v: torch.Tensor) -> torch.Tensor | None:
        """(n, rows, d) -> (n, rows) fp32 multiplier of the score, or None (no weight)."""
        return value_norm(v, self.opts["norm"])

    def value_aware(self, score, v, pos, valid) -> torch.Tensor:
        """I = S * ||v|| (Eq. 4); the first F real tokens get +inf (never evicted)."""
        w = self.value_weight(v)
        imp = score if w is None else score * w
        sink = valid & (pos < self.pinned_count())
        return torch.where(sink, float("inf"), imp)

    # ----------------------------------------------------------------- prefill
    def prefill(self, buf, k, v, pos, valid, scores=None):
        self._prompt_v = v                      # read by prefix_rank during this call only
        try:
            super().prefill(buf, k, v, pos, valid, scores)
        finally:
            self._prompt_v = None

    def prefix_rank(self, scores, pos, valid):
        return self.value_aware(super().prefix_rank(scores, pos, valid), self._prompt_v,
                                pos, valid)

    # ----------------------------------------------------------------- decode
    def base_score(self, buf, slots) -> torch.Tensor:
        """The base policy's S_k of `slots` (n, rows), >= 0, higher = keep: its
        `importance(buf, slots)` hook if it has one (scissorhands), else `buf.score` (h2o)."""
        hook = getattr(super(), "importance", None)
        return hook(buf, slots) if hook is not None else buf.score[slots]

    def victim_candidates(self, buf):
        slots = candidate_slots(buf, buf.ring_start, True)
        imp = self.value_aware(self.base_score(buf, slots), buf.v[slots], buf.pos[slots],
                               buf.valid[slots])
        return buf.ring_start, True, imp


@register
class VATP(ValueAware, H2O):
    name = "vatp"
    args = {"base": "h2o", "sinks": 20, "norm": "l1"}

    def __new__(cls, budget=None, budget_tokens=None, **args):
        if str(args.get("base", cls.args["base"])).lower() != "scissorhands":
            return super().__new__(cls)
        # not an instance of cls, so Python does not call __init__ again
        policy = object.__new__(_scissorhands_variant(cls))
        policy.__init__(budget, budget_tokens, **args)
        return policy


@register
class VATPPin(VATP):
    """The ablation: first-F pinning over the base policy, no value norm (seed-vatp.md §6.2)."""
    name = "vatp-pin"
    args = {"base": "h2o", "sinks": 20}
    fixed_norm = "none"


_VARIANTS: dict = {}


def _scissorhands_variant(cls):
    """`cls`'s rule (vatp or vatp-pin) over the `scissorhands` policy, built on first use.

    Uses from `policies/scissorhands.py` (a RingPolicy): `prefix_rank` (the prompt selection,
    scaled here) and `importance(buf, slots)` (its non-negative per-slot score, higher = keep,
    scaled in the value-aware `victim_candidates` that replaces its own). The defaults follow the
    VATP paper's Scissorhands (App. A, Eq. 3): 10 recent tokens, the rest selected by the
    attention summed over a history window of 400 queries (`score=attention`; the
    Scissorhands paper's low-attention counter stays available as `score=count`).
    """
    if cls in _VARIANTS:
        return _VARIANTS[cls]
    try:
        from flexevict.policies.scissorhands import Scissorhands
    except ImportError as e:
        raise UserError(f"policy '{cls.name}' with base=scissorhands needs the 'scissorhands' "
                        f"policy, which is not available ({e})") from None
    variant = type(f"{cls.__name__}Scissorhands", (ValueAware, Scissorhands),
                   {"name": cls.name, "fixed_norm": cls.fixed_norm, "__module__": __name__,
                    "args": {**Scissorhands.args, "score": "attention", **cls.args}})
    _VARIANTS[cls] = variant
    return variant
