"""Prefill + decode over preallocated KV buffers, sampling, and teacher-forced scoring.

Batches of different prompt lengths are left-padded: pad keys are masked everywhere and every
sequence gets its own positions (counted over its real tokens). A run resolves one budget, for
its longest prompt; `plan_batches` groups only sequences that then get exactly the tokens they get
alone (any lengths with `full`; see `Policy.batch_key` for evicting policies).
"""
from __future__ import annotations

from dataclasses import dataclass

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
    """Picks the next token from logits. One seeded generator for the whole run, or, with
    row_seeds, one per sequence: then a sequence's samples depend only on its own seed and
    logits, not on which other sequences share its batch (what lets a batch job be resumed
    or spread over workers and still sample the same tokens)."""

    def __init__(self, cfg: Sampling, device, row_seeds: list[int] | None = None):
        self.cfg = cfg
        self.gen = torch.Generator(device=device).manual_seed(cfg.seed)
        self.row_gens = None
        if row_seeds is not None and not cfg.is_greedy:
            self.row_gens = [torch.Generator(device=device).manual_seed(s) for s in row_seeds]

    def __call__(self, logits: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
        """logits (B, V) fp32 of the sequences `rows` (with row_seeds) -> tokens (B,)."""
        c = self.cfg
        if c.is_greedy:
            return logits.argmax(dim=-1)
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
        probs = logits.softmax(-1)
        if self.row_gens is None:
            return torch.multinomial(probs, 1, generator=self.gen).squeeze(-1)
        return torch.cat([torch.multinomial(probs[r:r + 1], 1, generator=g)
                          for r, g in enumerate(self.row_gens[rows])]).squeeze(-1)


def plan_batches(lengths: list[int], max_new_tokens: int, policy,
                 batch_size: int) -> list[list[int]]:
    """Indices of sequences grouped into batches of at most batch_size, shortest first, such
    that each sequence's greedy tokens are the same as when it runs alone: only sequences with
    equal `policy.batch_key` share a batch (with `full`, any lengths do)."""
    groups: dict[tuple, list[int]] = {}
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        groups.setdefault(policy.batch_key(lengths[i], max_new_tokens), []).append(i)
    return [g[a:a + batch_size] for g in groups.values() for a in range(0, len(g), batch_size)]


def as_engine(model):
    """The engine that runs `model`: an Engine as is, or a loaded Transformer with every weight
    resident on its device (no offloading)."""
    return model if isinstance(model, Engine) else Engine.resident(model)


def generate(model, prompts: list[list[int]], max_new_tokens: int, policy,
             sampling: Sampling = Sampling(), stop_ids=(), pad_id: int = 0,
             row_seeds: list[int] | None = None) -> list[list[int]]:
    """Generate up to max_new_tokens per prompt with an Engine (or a resident Transformer); a
    sequence stops after emitting a stop id (the stop id is kept in its output). row_seeds:
    one sampling seed per prompt (see `Sampler`); default one generator seeded by sampling.seed."""
    if max_new_tokens < 1:
        raise UserError(f"{setting('max_new_tokens')} must be >= 1 (got {max_new_tokens})")
    sampling.check()
    engine = as_engine(model)
    sample = Sampler(sampling, engine.tiers.compute, row_seeds)
    rows = engine.placement.batch_rows(len(prompts))           # the engine's GPU batches
    stop = torch.tensor(sorted(stop_ids) or [-1], device=engine.tiers.compute)
    done = {}

    def consume(i, k, h, head):
        nxt = sample(head(h[:, -1] if h.dim() == 3 else h), rows[k])
        done[k] = done.get(k, False) | torch.isin(nxt, stop)
        return nxt

    result = engine.run(prompts, max_new_tokens, policy, consume, pad_id,
                        until=lambda: all(bool(d.all()) for d in done.values()))
    return [_cut_at_stop(row, stop_ids) for row in result.tokens.tolist()]


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
               chunk: int = 256, progress: bool = False) -> tuple[torch.Tensor, Layout]:
    """Teacher-forced NLL of B equal-length documents in one batch -> ((B, N-1) fp32 nats,
    the run's resolved layout).

    A prefill of `prefill_tokens` tokens (default: the policy's slot count with eviction, else
    all), then one token per step through the decode path, evicting exactly as generation
    does. Batching costs about as much as one stream on a CPU (per-op overhead bound).
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

    def consume(i, k, h, head):
        t = target[rows[k]]
        if i == 0:                                 # h (b_k, p0, D) predicts tokens 1..p0
            known = t[:, 1:p0 + 1]
            nll[k] = [_nll(head, h[:, a:a + chunk].reshape(-1, h.shape[-1]),
                           known[:, a:a + chunk].reshape(-1)).view(t.shape[0], -1)
                      for a in range(0, p0, chunk)]
        else:                                      # h (b_k, D) predicts token p0 + i
            nll[k].append(_nll(head, h, t[:, p0 + i]).unsqueeze(1))
        return t[:, p0 + i]

    with Progress(n - p0, "scoring", "step", "tokens", enabled=progress) as bar:
        result = engine.run([d[:p0] for d in docs], n - p0, policy, consume,
                            until=lambda: bar.update(1, len(docs) * (p0 if bar.done == 0 else 1)))
    return torch.cat([torch.cat(nll[k], dim=1) for k in sorted(nll)]), result.layout


def _nll(head, h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """h (n, D), target (n,) -> NLL (n,); chunked callers keep (n, V) logits small."""
    logp = torch.log_softmax(head(h), dim=-1)
    return -logp.gather(1, target[:, None]).squeeze(1)
