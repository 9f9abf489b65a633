"""Prefill + decode over preallocated KV buffers, sampling, and teacher-forced scoring.

Batches of different prompt lengths are left-padded: pad keys are masked everywhere and every
sequence gets its own positions (counted over its real tokens). A run resolves one budget, for
its longest prompt; `plan_batches` groups only sequences that then get exactly the tokens they get
alone (any lengths with `full`; see `Policy.batch_key` for evicting policies).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from flexevict.core.kv import Layout
from flexevict.runtime.engine import Engine, check_length, left_pad  # noqa: F401 - left_pad: callers' helper
from flexevict.errors import UserError, setting
from flexevict.runtime.progress import Progress


@dataclass(frozen=True)
class Sampling:
    """Greedy by default; otherwise temperature -> top-k -> top-p, seeded (HF's order).
    Temperature 0 means greedy, as in vLLM and the OpenAI API."""
    greedy: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0

    def check(self):
        if not self.greedy:
            if self.temperature < 0:
                raise UserError(f"{setting('temperature')} must be >= 0 "
                                f"(got {self.temperature}; 0 is greedy)")
            if not 0 < self.top_p <= 1:
                raise UserError(f"{setting('top_p')} must be in (0, 1] (got {self.top_p})")
            if self.top_k < 0:
                raise UserError(f"{setting('top_k')} must be >= 0 (got {self.top_k})")


class Sampler:
    """Picks the next token from logits. `cfg` is one Sampling for every sequence, with one
    generator seeded by its seed, or one Sampling per sequence, each sequence with a generator
    of its own seeded by its Sampling's seed: then a sequence's samples depend only on its own
    settings, seed and logits, not on which other sequences share its batch (what lets a batch
    job be resumed or spread over workers and still sample the same tokens)."""

    def __init__(self, cfg: Sampling | list[Sampling], device):
        self.cfgs = cfg if isinstance(cfg, list) else None
        self.cfg = None if self.cfgs is not None else cfg
        self.gen = self.row_gens = None
        if self.all_greedy:
            return
        if self.cfgs is None:
            self.gen = torch.Generator(device=device).manual_seed(cfg.seed)
        else:
            self.row_gens = [torch.Generator(device=device).manual_seed(c.seed) for c in cfg]

    @property
    def all_greedy(self) -> bool:
        return all(c.is_greedy for c in self.cfgs) if self.cfgs is not None else self.cfg.is_greedy

    def __call__(self, logits: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
        """logits (B, V) fp32 of the sequences `rows` (per-sequence settings) -> tokens (B,)."""
        if self.all_greedy:
            return logits.argmax(dim=-1)
        if self.cfgs is None:
            probs = _probabilities(logits, self.cfg)
            return torch.multinomial(probs, 1, generator=self.gen).squeeze(-1)
        return torch.cat([_pick(logits[r:r + 1], c, g)
                          for r, (c, g) in enumerate(zip(self.cfgs[rows], self.row_gens[rows]))])


def _pick(logits: torch.Tensor, c: Sampling, gen: torch.Generator) -> torch.Tensor:
    """One sequence's token: logits (1, V) -> (1,)."""
    if c.is_greedy:
        return logits.argmax(dim=-1)
    return torch.multinomial(_probabilities(logits, c), 1, generator=gen).squeeze(-1)


def _probabilities(logits: torch.Tensor, c: Sampling) -> torch.Tensor:
    """logits (B, V) -> sampling probabilities (B, V): temperature, then top-k, then top-p."""
    logits = logits / c.temperature
    if c.top_k > 0:
        kth = torch.topk(logits, min(c.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if c.top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= c.top_p   # keep the token crossing top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return logits.softmax(-1)


def plan_batches(lengths: list[int], max_new_tokens: int | list[int], policy,
                 batch_size: int, sizes: list[int] | None = None) -> list[list[int]]:
    """Indices of sequences grouped into batches of at most batch_size, shortest first, such
    that each sequence's greedy tokens are the same as when it runs alone: only sequences with
    equal `policy.batch_key` share a batch (with `full`, any lengths do). max_new_tokens: one
    for all or one per prompt; a run resolves its budget for its most steps, so with a budget
    prompts of different lengths to generate never share a batch. sizes: the sequences each
    index stands for (a request's several choices, run side by side; default 1 each)."""
    n = len(lengths)
    gens = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * n
    sizes = sizes or [1] * n
    budgeted = policy.budget is not None or policy.budget_tokens is not None
    groups: dict[tuple, list[int]] = {}
    for i in sorted(range(n), key=lambda i: lengths[i]):
        key = policy.batch_key(lengths[i], gens[i])
        groups.setdefault((gens[i], *key) if budgeted else key, []).append(i)
    batches = []
    for group in groups.values():
        batch, used = [], 0
        for i in group:
            if batch and used + sizes[i] > batch_size:
                batches.append(batch)
                batch, used = [], 0
            batch.append(i)
            used += sizes[i]
        batches.append(batch)
    return batches


def as_engine(model):
    """The engine that runs `model`: an Engine as is, or a loaded Transformer with every weight
    resident on its device (no offloading)."""
    return model if isinstance(model, Engine) else Engine.resident(model)


@dataclass(frozen=True)
class Watch:
    """What `generate` calls on the host after each step, both optional. ends(r, ids) -> True
    once sequence r's generated ids so far end its output (e.g. a stop string appeared; the
    output is cut there; checked only when given); on_step(tokens, step, steps): the tokens
    the step generated (the sequences still running), for progress."""
    ends: Callable[[int, list[int]], bool] | None = None
    on_step: Callable[[int, int, int], None] | None = None


def generate(model, prompts: list[list[int]], max_new_tokens: int | list[int], policy,
             sampling: Sampling | list[Sampling] = Sampling(), stop_ids=(), pad_id: int = 0,
             watch: Watch = Watch()) -> list[list[int]]:
    """Generate up to max_new_tokens per prompt with an Engine (or a resident Transformer); a
    sequence stops after emitting a stop id (the stop id is kept in its output).

    max_new_tokens: one for every prompt, or one per prompt (the run decodes for the most;
    each sequence is cut at its own). sampling: one for every prompt (one generator), or one per
    prompt, each seeding a generator of its own (`Sampler`). watch: host callbacks per step."""
    n = len(prompts)
    limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * n
    if min(limits) < 1:
        raise UserError(f"{setting('max_new_tokens')} must be >= 1 (got {min(limits)})")
    for s in (sampling if isinstance(sampling, list) else [sampling]):
        s.check()
    engine = as_engine(model)
    device = engine.tiers.compute
    sample = Sampler(sampling, device)
    rows = engine.placement.batch_rows(n)           # the engine's GPU batches
    stop = torch.tensor(sorted(stop_ids) or [-1], device=device)
    last_step = torch.tensor(limits, device=device) - 1
    ended = _Ends(n, watch.ends)
    done = {}

    def consume(i, k, h, head):
        nxt = sample(head(h[:, -1] if h.dim() == 3 else h), rows[k])
        finished = torch.isin(nxt, stop) | (last_step[rows[k]] <= i)
        if watch.ends is not None:
            finished |= torch.tensor(ended.step(rows[k], nxt.tolist()), device=device)
        done[k] = done.get(k, False) | finished
        return nxt

    running, step, steps = n, 0, max(limits)       # sequences still running, steps run

    def until():
        nonlocal running, step
        step += 1
        left = sum(int((~d).sum()) for d in done.values())
        if watch.on_step is not None:
            watch.on_step(running, step, steps)
        running = left
        return left == 0

    result = engine.run(prompts, steps, policy, consume, pad_id, until=until)
    return [_cut_at_stop(row[:min(limits[r], ended.at[r])], stop_ids)
            for r, row in enumerate(result.tokens.tolist())]


class _Ends:
    """`generate`'s host-side record of each sequence's ids, for its `ends` callback."""

    def __init__(self, n: int, ends):
        self.ends, self.ids = ends, [[] for _ in range(n)]
        self.at = [float("inf")] * n     # how many ids a sequence keeps once it has ended

    def step(self, rows: slice, tokens: list[int]) -> list[bool]:
        """One step's tokens of the sequences `rows` -> whether each has ended."""
        out = []
        for r, t in zip(range(len(self.ids))[rows], tokens):
            if self.at[r] == float("inf"):
                self.ids[r].append(t)
                if self.ends(r, self.ids[r]):
                    self.at[r] = len(self.ids[r])
            out.append(self.at[r] != float("inf"))
        return out


def _cut_at_stop(row: list[int], stop_ids) -> list[int]:
    for i, t in enumerate(row):
        if t in stop_ids:
            return row[:i + 1]
    return row


def token_nll(model, ids: list[int], policy, prefill_tokens: int | None = None,
              chunk: int = 256, progress: bool = False) -> torch.Tensor:
    """Teacher-forced NLL of ids[1:] given their prefixes -> (N-1,) fp32 (one document of
    `stream_nll`)."""
    return stream_nll(model, [ids], policy, prefill_tokens, chunk, progress)[0][0]


def stream_nll(model, docs: list[list[int]], policy, prefill_tokens: int | None = None,
               chunk: int = 256, head_rows: int = 256,
               progress: bool = False) -> tuple[torch.Tensor, Layout]:
    """Teacher-forced NLL of B equal-length documents in one batch -> ((B, N-1) fp32 nats,
    the run's resolved layout).

    A prefill of `prefill_tokens` tokens (default: the policy's slot count with eviction, else
    all), then one token per step through the decode path, evicting exactly as generation
    does. Batching costs about as much as one stream on a CPU (per-op overhead bound).

    The prefill's hidden states go through the head `chunk` tokens per document at a time.
    The next token is known, so no decode step waits for its logits: the steps' hidden states
    go through the head together, about `head_rows` rows at a time (1: each step alone, as
    generation must). One step's head reads the whole (V, D) matrix for a few rows; on a CPU
    that read, not the arithmetic, bounds it, and with a large vocabulary (Gemma-3's 262k) it
    is most of the step (`bench/ppl_head.py` measures both ways).
    """
    n = len(docs[0])
    if any(len(d) != n for d in docs):
        raise ValueError("stream_nll needs documents of equal length")
    check_length(model.config, n - 1, 1)
    layout = policy.layout(n - 1, 1)               # the slots for n tokens in all
    p0 = min(prefill_tokens or (layout.slots if layout.evicts else n - 1), n - 1)
    if p0 < 1:
        raise UserError(f"{setting('prefill_tokens')} must be >= 1 (got {p0})")
    engine = as_engine(model)
    target = torch.tensor(docs, dtype=torch.long, device=engine.tiers.compute)    # (B, N)
    rows = engine.placement.batch_rows(len(docs))
    nll: dict = {}
    waiting: dict = {}                             # k -> decode steps' h (b_k, D), in order

    def consume(i, k, h, head):
        t = target[rows[k]]
        if i == 0:                                 # h (b_k, p0, D) predicts tokens 1..p0
            known = t[:, 1:p0 + 1]
            nll[k] = [_nll(head, h[:, a:a + chunk], known[:, a:a + chunk])
                      for a in range(0, p0, chunk)]
        else:                                      # h (b_k, D) predicts token p0 + i
            waiting.setdefault(k, []).append(h.clone())     # the engine may reuse h's memory
            m = len(waiting[k])
            if m * t.shape[0] >= head_rows or i == n - 1 - p0:
                hs = torch.stack(waiting.pop(k), dim=1)      # (b_k, m, D)
                known = t[:, p0 + i - m + 1:p0 + i + 1]      # (b_k, m)
                nll[k].append(_nll(head, hs, known))
        return t[:, p0 + i]

    with Progress(n - p0, "scoring", "step", "tokens", enabled=progress) as bar:
        result = engine.run([d[:p0] for d in docs], n - p0, policy, consume,
                            until=lambda: bar.update(1, len(docs) * (p0 if bar.done == 0 else 1)))
    return torch.cat([torch.cat(nll[k], dim=1) for k in sorted(nll)]), result.layout


def _nll(head, h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """h (b, m, D), target (b, m) -> NLL (b, m), through one head call on b x m rows (callers
    keep the (b x m, V) logits small)."""
    logp = torch.log_softmax(head(h.reshape(-1, h.shape[-1])), dim=-1)
    return -logp.gather(1, target.reshape(-1, 1)).view(target.shape)
