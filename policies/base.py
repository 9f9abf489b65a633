"""The interface every eviction policy implements, and the prefix + recent-ring family.

Budget semantics (DESIGN.md, contract): a run of P prompt and G generated tokens gets
`slots = floor(budget * (P + G))` per (sequence, layer, kv-head), or `budget_tokens`, never more
than P + G. The slots include the scratch slot of the token being decoded, so a buffer holds
`slots - 1` committed tokens and attention reads `slots` tokens per step; the buffer's bytes
are exactly `slots` rows of K, V and per-slot state.

Scores are per (sequence, kv-head): the attention probabilities of the query heads that share a
kv head are summed (GQA).
"""
from __future__ import annotations

import math

import torch

from flexevict.errors import UserError
from flexevict.kv import KVBuffer, left_aligned


class Policy:
    name = "base"
    args: dict = {}                 # policy arguments with the paper's defaults
    min_slots = 2                   # at least one committed slot and the scratch slot
    needs_prompt_scores = False     # prefill must compute attention column sums
    rope_in_cache = False           # LLaMA: cache keys before RoPE, rotate by in-cache rank
    prompt_scores = None            # or fold(acc, p, first, valid): the prompt statistic that
                                    # `prefill` gets instead of column sums (see model.py)
    needs_prompt_queries = False    # prefill also gets the prompt queries q=(S, rows, g, d)

    def __init__(self, budget: float | None = None, budget_tokens: int | None = None, **args):
        unknown = set(args) - set(self.args)
        if unknown:
            known = ", ".join(self.args) or "none"
            raise UserError(f"unknown --policy-arg {', '.join(sorted(unknown))} for policy "
                            f"'{self.name}' (its arguments: {known})")
        self.opts = {k: _coerce(k, v, self.args[k]) for k, v in {**self.args, **args}.items()}
        if budget is not None and not 0 < budget <= 1:
            raise UserError(f"--budget must be in (0, 1] (got {budget}); use --budget-tokens "
                            "for an absolute slot count")
        if budget_tokens is not None and budget_tokens < 1:
            raise UserError(f"--budget-tokens must be >= 1 (got {budget_tokens})")
        self.budget, self.budget_tokens = budget, budget_tokens
        self.slots = None
        self.evicts = False

    # ------------------------------------------------------------------ sizing
    def minimum_slots(self) -> int:
        return self.min_slots

    def capacity(self, prompt_len: int, gen_len: int) -> int:
        """Resolve the budget for this run; -> committed slots (slots - 1)."""
        total = prompt_len + gen_len
        if self.budget_tokens is not None:
            slots = self.budget_tokens
        elif self.budget is not None:
            slots = math.floor(self.budget * total)
        else:
            slots = total
        if slots < self.minimum_slots() and slots < total:   # holding everything is always fine
            raise UserError(f"budget of {slots} slots is below policy '{self.name}'s minimum of "
                            f"{self.minimum_slots()}; raise --budget or --budget-tokens")
        self.slots = min(slots, total)
        self.evicts = self.slots < total
        self.split(self.slots - 1)
        return self.slots - 1

    def split(self, capacity: int) -> None:
        """Divide the committed slots into regions (set attributes; printed by `describe`)."""

    def describe(self) -> dict:
        """The resolved budget, for every CLI's output and every JSON result."""
        return {"policy": self.name, "slots": self.slots, **self.opts}

    def wants_prompt_scores(self) -> bool:
        return self.needs_prompt_scores and self.evicts

    def logit_scale(self, n_keys: int) -> float:
        """Factor on attention logits with n_keys keys (BUZZ-log n); default 1."""
        return 1.0

    # ------------------------------------------------------------------ hooks
    def prefill(self, buf: KVBuffer, k, v, pos, valid, scores=None) -> None:
        """Keep the prompt. k, v: (S, rows, d); pos, valid, scores (fp32 column sums): (S, rows)."""
        buf.store_prompt(k, v, pos, valid, scores)

    def before_attention(self, buf: KVBuffer, slot: int, q: torch.Tensor) -> None:
        """Hook before decode attention; q: (rows, group, d). Default: nothing."""

    def after_attention(self, buf: KVBuffer, slot: int, probs: torch.Tensor) -> None:
        """Commit the decoded token written in `slot`; probs: (rows, group, attended) fp32, the
        attention just used by each query head of a kv head."""
        buf.commit_appended(slot)


class RingPolicy(Policy):
    """A pinned prefix of `prefix` slots plus a circular queue of the `ring` most recent tokens.

    Prefill keeps the last `ring` prompt tokens and the `prefix` best others by
    `prefix_rank` (e.g. H2O's column sums, or earliest-first for sinks). Each full decode step
    commits the new token into the ring; the token leaving the ring competes with the prefix
    (`choose_victim`), and the loser's slot is reused in place.
    """
    prefix = 0
    ring = 0

    def minimum_slots(self) -> int:
        return max(self.min_slots, self.min_prefix() + 2)   # + one ring slot + scratch

    def min_prefix(self) -> int:
        return 0

    def split(self, capacity: int) -> None:
        self.prefix = self.prefix_slots(capacity)
        self.ring = capacity - self.prefix

    def prefix_slots(self, capacity: int) -> int:
        raise NotImplementedError

    def describe(self) -> dict:
        return {**super().describe(), "prefix": self.prefix, "ring": self.ring, "scratch": 1}

    def prefix_rank(self, scores, pos, valid) -> torch.Tensor:
        """(S, rows) rank of prompt tokens for the prefix; higher is kept.

        Default: earliest first (attention sinks)."""
        return -pos.to(torch.float32)

    def prefill(self, buf, k, v, pos, valid, scores=None):
        buf.ring_start = buf.cursor = self.prefix
        if k.shape[0] <= buf.capacity:
            return buf.store_prompt(k, v, pos, valid, scores)
        order = left_aligned(valid)
        rank = self.prefix_rank(scores, pos, valid).gather(0, order)
        n_real = valid.sum(0)                                         # (rows,)
        slot = torch.arange(k.shape[0], device=k.device).unsqueeze(1)
        ring_begin = (n_real - self.ring).clamp(min=0)
        eligible = slot < ring_begin                                  # older than the ring
        rank = torch.where(eligible, rank, float("-inf"))
        top = torch.topk(rank, self.prefix, dim=0, sorted=False)
        heavy = top.indices.sort(dim=0).values                        # keep position order
        ring = (ring_begin + torch.arange(self.ring, device=k.device).unsqueeze(1))
        keep = torch.cat([heavy, ring.clamp(max=k.shape[0] - 1)])     # (capacity, rows)
        buf.store_prompt(k, v, pos, valid, scores, keep=keep)       # keep is in aligned order
        # short rows: prefix picks among ineligible tokens and ring slots past the row's real
        # tokens hold nothing
        holes = torch.cat([~eligible.gather(0, heavy), ring >= n_real])
        buf.valid[:buf.capacity] &= ~holes

    def after_attention(self, buf, slot, probs):
        self.accumulate(buf, slot, probs)
        if slot != buf.scratch:
            return buf.commit_appended(slot)
        buf.ring_commit(self.choose_victim(buf))

    def accumulate(self, buf: KVBuffer, slot: int, probs: torch.Tensor) -> None:
        """Update per-slot scores from this step's attention. Default: nothing."""

    def choose_victim(self, buf: KVBuffer) -> torch.Tensor:
        """(rows,) slot to evict among prefix slots and `buf.cursor`. Default: the oldest recent."""
        return torch.full_like(buf.rows_index, buf.cursor)


def lowest(buf: KVBuffer, value: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Per row, the candidate slot with the lowest value; empty slots first, ties -> oldest.

    value (n, rows) over candidate slots `candidates` (n,) -> (rows,) slot indices.
    """
    value = torch.where(buf.valid[candidates], value, float("-inf"))
    is_min = value == value.min(dim=0, keepdim=True).values
    age = torch.where(is_min, buf.pos[candidates].to(torch.int64), torch.iinfo(torch.int64).max)
    return candidates[age.argmin(dim=0)]


def prefix_and_cursor(buf: KVBuffer) -> torch.Tensor:
    """Slots that may be evicted in a ring policy: the prefix and the oldest recent token."""
    return torch.cat([torch.arange(buf.ring_start, device=buf.k.device),
                      torch.tensor([buf.cursor], device=buf.k.device)])


def kv_head_probs(probs: torch.Tensor) -> torch.Tensor:
    """(rows, group, n) -> (n, rows): a kv head's score is the sum over its query heads."""
    return probs.sum(dim=1).t()


def _coerce(name: str, value, default):
    if isinstance(value, str) and not isinstance(default, str):
        try:
            if isinstance(default, bool):
                return value.lower() in ("1", "true", "yes")
            return type(default)(value)
        except ValueError:
            raise UserError(f"--policy-arg {name}={value}: expected a {type(default).__name__}") from None
    return value
