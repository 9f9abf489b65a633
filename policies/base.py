"""The interface every eviction policy implements, and the prefix + recent-ring family.

Budget semantics (the package-wide contract): a run of P prompt and G generated tokens gets
`slots = floor(budget * (P + G))` per (sequence, layer, kv-head), or `budget_tokens`, never more
than P + G. The slots include the scratch slot of the token being decoded, so a buffer holds
`slots - 1` committed tokens and attention reads `slots` tokens per step; the buffer's bytes
are exactly `slots` rows of K, V and per-slot state.

Scores are per (sequence, kv-head): the attention probabilities of the query heads that share a
kv head are summed (GQA).

State: `buf.score` and `buf.state` are every policy's per-slot fp32 rows. Anything more is
DECLARED by `fields(layout)` (`kv.Field`): the buffer allocates it in `buf.policy_state[name]` and
offloading moves it. Per-layer constants (e.g. a projection) come from `buf.constant(name, make)`.
For a policy with `accumulates_attention`, the model adds each step's attention to `buf.score`
(fused into its attention kernel) and calls `after_attention(..., scored=True)`.

A decode step, per layer: the new token is written (to a free slot, or the scratch slot),
`before_attention`, attention, then `after_attention`: `observe` (what the policy learns from
this step's attention, per layer) and `commit` (where the token goes: the eviction decision).
A policy that `stacks` commits row by row with no per-layer constant or host-held state, so
a cache that holds every layer's rows in one buffer (`kv.LayerRows`) commits once per token
step for all layers (the engine does, after the step's last layer).

Arguments and run sizes: a policy is a frozen dataclass whose fields are its arguments; the run's
sizes are a frozen `kv.Layout` from `Policy.layout(P, G)`, carried by every buffer of the run.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass

import torch

from flexevict.core import kernels
from flexevict.errors import UserError, setting
from flexevict.core.kernels import kv_head_probs  # noqa: F401 - the policies' helper
from flexevict.core.kv import Field, KVBuffer, Layout

BUDGET_FIELDS = ("budget", "budget_tokens", "layer_budgets")
LAYER_SCHEDULES = ("pyramid",)   # --policy-arg layer_budgets=NAME (flexevict/runtime/layers.py)


@dataclass(frozen=True)
class Policy:
    """An eviction rule and its arguments (frozen): the arguments are the dataclass fields after
    the budget, with the paper's defaults, checked in `__post_init__`. A run's sizes are not
    the policy's: `layout(P, G)` resolves them into a frozen `Layout` that the run's buffers
    carry (`buf.layout`), and every hook reads them there."""
    budget: float | None = None
    budget_tokens: int | None = None
    # how the global layers share the run's slots: None (each the budget), "pyramid", or one
    # weight per layer "w0,w1,...", the total kept at the budget's (runtime/layers.py)
    layer_budgets: str | None = None

    name = "base"
    min_slots = 2                   # at least one committed slot and the scratch slot
    needs_prompt_scores = False     # prefill must compute attention column sums
    rope_in_cache = False           # LLaMA: cache keys before RoPE, rotate by in-cache rank
    prompt_scores = None            # or fold(layout, acc, p, first, valid): the prompt statistic
                                    # that `prefill` gets instead of column sums (see model.py)
    needs_prompt_queries = False    # prefill also gets the prompt queries q=(S, rows, g, d)
    batch_by_length = False         # decisions depend on the padded prompt length (batch_key)
    accumulates_attention = False   # buf.score[:n] += each step's attention, summed over the
                                    # query heads of a kv head (H2O); the model then fuses the
                                    # sum into its attention kernel (see `after_attention`)
    stacks = False                  # `commit` is row-wise with no per-layer constant or
                                    # host-held state: it may run once per step on a buffer
                                    # holding every layer's rows (kv.LayerRows)
    graph_safe = False              # its decode hooks may be replayed as a CUDA graph: they
                                    # change buffer tensors in place only, keep other state in
                                    # the buffer's scalar attributes, never sync with the host
                                    # (flexevict/runtime/graphs.py)
    graph_safe_filling = False      # ... also while a buffer still fills: its hooks leave the
                                    # new token to KVBuffer.write and commit_appended, which
                                    # index by the fill count kept on the device (`full`,
                                    # `buzz`, whose passes set it there)

    def __post_init__(self):
        if self.budget is not None and not 0 < self.budget <= 1:
            raise UserError(f"{setting('budget')} must be in (0, 1] (got {self.budget}); use "
                            f"{setting('budget_tokens')} for an absolute slot count")
        if self.budget_tokens is not None and self.budget_tokens < 1:
            raise UserError(f"{setting('budget_tokens')} must be >= 1 (got {self.budget_tokens})")
        if self.layer_budgets is not None:
            layer_weights(self.layer_budgets)             # checked now, applied per run

    # ------------------------------------------------------------------ arguments
    @classmethod
    def create(cls, budget: float | None = None, budget_tokens: int | None = None, **args
               ) -> "Policy":
        """The registry's constructor from user arguments (`from_args`); a policy whose class
        depends on its arguments (VATP's `base`) picks the class here."""
        return cls.from_args(budget, budget_tokens, **args)

    @classmethod
    def from_args(cls, budget: float | None = None, budget_tokens: int | None = None, **args
                  ) -> "Policy":
        """This class from arguments given as values or as --policy-arg strings: unknown
        names are refused, strings are converted to the field's type."""
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        known = [n for n in fields if n not in BUDGET_FIELDS]
        unknown = sorted(set(args) - set(known) - {"layer_budgets"})
        if unknown:
            raise UserError(f"unknown {setting('policy_args')} {', '.join(unknown)} for policy "
                            f"'{cls.name}' (its arguments: {', '.join(known) or 'none'})")
        hints = typing.get_type_hints(cls)
        layers = args.pop("layer_budgets", None)
        typed = {k: _coerce(k, v, hints[k]) for k, v in args.items()}
        return cls(budget, budget_tokens, layers, **typed)

    def arguments(self) -> dict:
        """The policy's arguments (not the budget), by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.init and f.name not in BUDGET_FIELDS}

    def for_model(self, config) -> "Policy":
        """This policy for a run of the model `config` (a `ModelConfig`): the engine calls it
        before a run. A policy that needs per-model data (TriAttention's query statistics)
        returns a copy bound to it; default: itself."""
        return self

    # ------------------------------------------------------------------ sizing
    def minimum_slots(self) -> int:
        return self.min_slots

    def slots_for(self, prompt_len: int, gen_len: int) -> int:
        """The resolved slot count for one sequence of prompt_len + gen_len tokens:
        floor(budget * total), or budget_tokens, never more than total."""
        total = prompt_len + gen_len
        if self.budget_tokens is not None:
            slots = self.budget_tokens
        elif self.budget is not None:
            slots = math.floor(self.budget * total)
        else:
            slots = total
        if slots < self.minimum_slots() and slots < total:   # holding everything is always fine
            raise UserError(f"budget of {slots} slots is below policy '{self.name}'s minimum of "
                            f"{self.minimum_slots()}; raise {setting('budget')} or "
                            f"{setting('budget_tokens')}")
        return min(slots, total)

    def layout(self, prompt_len: int, gen_len: int) -> Layout:
        """The run's frozen layout (prompt_len: the batch's padded length)."""
        slots = self.slots_for(prompt_len, gen_len)
        evicts = slots < prompt_len + gen_len
        # a cache that keeps every token ranks each at its position: plain RoPE, as `full`
        return Layout(slots, evicts, rope_in_cache=self.rope_in_cache and evicts,
                      prompt_len=prompt_len, gen_len=gen_len)

    def batch_key(self, prompt_len: int, gen_len: int) -> tuple:
        """Sequences with equal keys may share a padded batch and still get exactly the tokens
        each gets alone (a run resolves one budget, for its longest prompt).

        A sequence that never evicts batches with any other such; one whose prompt fits the
        buffer is stored whole and fills free slots before evicting, so it batches only with
        prompts of its own length (padding would make it compact instead); one whose prompt is
        compacted batches with any other of the same slot count. A policy whose decisions
        depend on the padded prompt length (`batch_by_length`) batches by length whenever it
        evicts."""
        slots = self.slots_for(prompt_len, gen_len)
        if slots >= prompt_len + gen_len:
            return ("keeps-all",)
        # per-layer budgets: a layer may hold a prompt that the budget's slots do not
        if self.batch_by_length or prompt_len <= slots - 1 or self.layer_budgets:
            return ("length", prompt_len, slots)
        return ("compacts", slots)

    def fields(self, layout: Layout) -> tuple[Field, ...]:
        """The per-buffer state this policy keeps beyond score and state (`kv.Field`) in a run
        of `layout`: the buffer allocates it, offloading moves it. Default: none."""
        return ()

    def describe(self, layout: Layout | None = None) -> dict:
        """The arguments and, given a run's layout, its resolved budget: for every CLI's output
        and every JSON result: the resolved sizes first, then the arguments (a size that an
        argument defaults, like BUZZ's w=0, shows its resolved value)."""
        sizes = layout.describe() if layout else {}
        return {"policy": self.name, **sizes,
                **{k: v for k, v in self.arguments().items() if k not in sizes}}

    def wants_prompt_scores(self, layout: Layout) -> bool:
        return self.needs_prompt_scores and layout.evicts

    def logit_scale(self, n_keys: int) -> float:
        """Factor on attention logits with n_keys keys (BUZZ-log n); default 1."""
        return 1.0

    # ------------------------------------------------------------------ hooks
    # Every hook reads the run's sizes from `buf.layout`.
    def prefill(self, buf: KVBuffer, k, v, pos, valid, scores=None) -> None:
        """Keep the prompt. k, v: (S, rows, d); pos, valid, scores (fp32 column sums): (S, rows)."""
        buf.store_prompt(k, v, pos, valid, scores)

    def before_attention(self, buf: KVBuffer, slot: int, q: torch.Tensor) -> None:
        """Hook before decode attention; q: (rows, group, d). Default: nothing."""

    def after_attention(self, buf: KVBuffer, slot: int, probs: torch.Tensor,
                        scored: bool = False) -> None:
        """The hook after decode attention: `observe` it, then `commit` the token in `slot`,
        unless `buf` is one layer of a stacked cache, whose stack commits once per step."""
        self.observe(buf, slot, probs, scored)
        if buf.stack is None:
            self.commit(buf, slot)

    def observe(self, buf: KVBuffer, slot: int, probs: torch.Tensor, scored: bool = False
                ) -> None:
        """Take in this step's attention, per layer. probs: (rows, group, attended) fp32, the
        attention just used by each query head of a kv head. scored: the caller has already
        added probs to buf.score (the model does, fused, for `accumulates_attention`); a
        caller that only hands probs over leaves it False and the policy adds them.
        Default: nothing."""

    def commit(self, buf: KVBuffer, slot: int) -> None:
        """Commit the decoded token written in `slot` (the eviction decision). For a policy
        that `stacks`, `buf` may hold every layer's rows. Default: it stays where it is."""
        buf.commit_appended(slot)


@dataclass(frozen=True)
class RingPolicy(Policy):
    """A pinned prefix of `prefix` slots plus a circular queue of the `ring` most recent tokens.

    Prefill keeps the last `ring` prompt tokens and the `prefix` best others by
    `prefix_rank` (e.g. H2O's column sums, or earliest-first for sinks). Each full decode step
    commits the new token into the ring; the token leaving the ring competes with the prefix
    (`victim_candidates`), and the loser's slot is reused in place (`commit_scratch`: one
    fused selection + commit, `flexevict.core.kernels.evict_commit`). Row-wise throughout, so
    it `stacks` unless a subclass keeps host-held state.
    """
    stacks = True

    def minimum_slots(self) -> int:
        return max(self.min_slots, self.min_prefix() + 2)   # + one ring slot + scratch

    def min_prefix(self) -> int:
        return 0

    def layout(self, prompt_len: int, gen_len: int) -> Layout:
        layout = super().layout(prompt_len, gen_len)
        prefix = self.prefix_slots(layout.capacity)
        return dataclasses.replace(layout, prefix=prefix, ring=layout.capacity - prefix)

    def prefix_slots(self, capacity: int) -> int:
        raise NotImplementedError

    def prefix_rank(self, buf, scores, k, v, pos, valid) -> torch.Tensor:
        """(S, rows) rank of prompt tokens for buf's prefix; higher is kept. scores, pos, valid
        (S, rows) and k, v (S, rows, d) are the prompt's, as `prefill` got them.

        Default: earliest first (attention sinks)."""
        return -pos.to(torch.float32)

    def prefill(self, buf, k, v, pos, valid, scores=None):
        lay = buf.layout
        buf.ring_start = buf.cursor = lay.prefix
        if k.shape[0] <= buf.capacity:
            return buf.store_prompt(k, v, pos, valid, scores)
        rank = self.prefix_rank(buf, scores, k, v, pos, valid)
        kernels.compact_prompt(buf, k, v, pos, valid, scores, rank)

    def commit(self, buf, slot):
        if slot != buf.scratch:
            return buf.commit_appended(slot)
        self.commit_scratch(buf)

    def commit_scratch(self, buf: KVBuffer) -> torch.Tensor:
        """Choose each row's victim and commit the scratch token into the ring (one fused op on
        a GPU); -> victims (rows,)."""
        end, cursor, value = self.victim_candidates(buf)
        return kernels.evict_commit(buf, end, cursor=cursor, value=value, commit="ring")

    def victim_candidates(self, buf: KVBuffer):
        """Which slots compete, by what: (end, cursor, value) = prefix slots [0, end), plus the
        oldest recent token `buf.cursor` when cursor is True; value (candidates, rows) fp32,
        the lowest goes (empty slots first, ties: the oldest), or None for `buf.score`.
        Default: the oldest recent token alone (a sliding window)."""
        return 0, True, None


def layer_weights(spec: str) -> str | list[float]:
    """A `layer_budgets` argument: a schedule's name (LAYER_SCHEDULES), or "w0,w1,..." -> the
    positive weights, one per global layer, that share the run's slots."""
    if spec in LAYER_SCHEDULES:
        return spec
    try:
        weights = [float(x) for x in spec.split(",")]
    except ValueError:
        weights = []
    if not weights or min(weights) <= 0:
        raise UserError(f"{setting('policy_args')} layer_budgets={spec}: expected "
                        f"{' or '.join(LAYER_SCHEDULES)}, or one positive weight per layer "
                        "separated by commas")
    return weights


def add_attention(buf: KVBuffer, probs: torch.Tensor, scored: bool) -> None:
    """H2O's accumulation: buf.score[:n] += each slot's attention summed over its query heads,
    unless the model already added it (`scored`, Policy.accumulates_attention)."""
    if not scored:
        kernels.accumulate_scores(buf.score, probs)


def _coerce(name: str, value, kind):
    """A --policy-arg string as the field's type (int, float, bool or str); values pass."""
    if not isinstance(value, str) or kind is str:
        return value
    if kind is bool:
        if value.lower() in ("1", "true", "yes", "0", "false", "no"):
            return value.lower() in ("1", "true", "yes")
        raise UserError(f"{setting('policy_args')} {name}={value}: expected true or false")
    try:
        return kind(value)
    except ValueError:
        raise UserError(f"{setting('policy_args')} {name}={value}: expected a "
                        f"{kind.__name__}") from None
