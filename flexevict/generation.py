"""Prefill + decode over preallocated KV buffers, sampling, and teacher-forced scoring.

Batches of different prompt lengths are left-padded: pad keys are masked everywhere and every
sequence gets its own positions (counted over its real tokens), so a padded batch produces the
same tokens as each prompt run alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import UserError
from .kv import KVBuffer
from .model import Transformer


@dataclass(frozen=True)
class Sampling:
    """Greedy by default; otherwise temperature -> top-k -> top-p, seeded (HF's order)."""
    greedy: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def check(self):
        if not self.greedy:
            if self.temperature <= 0:
                raise UserError(f"--temperature must be > 0 (got {self.temperature}); use --greedy")
            if not 0 < self.top_p <= 1:
                raise UserError(f"--top-p must be in (0, 1] (got {self.top_p})")
            if self.top_k < 0:
                raise UserError(f"--top-k must be >= 0 (got {self.top_k})")


class Sampler:
    def __init__(self, cfg: Sampling, device):
        self.cfg = cfg
        self.gen = torch.Generator(device=device).manual_seed(cfg.seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (B, V) fp32 -> tokens (B,)."""
        c = self.cfg
        if c.greedy:
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
        return torch.multinomial(logits.softmax(-1), 1, generator=self.gen).squeeze(-1)


def left_pad(prompts: list[list[int]], pad_id: int, device):
    """-> tokens (B, S), valid (B, S) bool, positions (B, S) counted over real tokens."""
    if any(len(p) == 0 for p in prompts):
        raise UserError("empty prompt: every prompt needs at least one token")
    s = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), s), pad_id, dtype=torch.long)
    valid = torch.zeros(len(prompts), s, dtype=torch.bool)
    for i, p in enumerate(prompts):
        tokens[i, s - len(p):] = torch.tensor(p, dtype=torch.long)
        valid[i, s - len(p):] = True
    pos = (valid.long().cumsum(1) - 1).clamp(min=0)
    return tokens.to(device), valid.to(device), pos.to(device)


def check_length(model: Transformer, prompt_len: int, new_tokens: int):
    limit = model.config.max_positions
    if prompt_len + new_tokens - 1 > limit:
        raise UserError(f"prompt of {prompt_len} tokens + {new_tokens} new tokens exceeds the "
                        f"model's maximum of {limit} positions; shorten the prompt or "
                        "--max-new-tokens")


def allocate(model: Transformer, capacity: int, batch: int) -> list[KVBuffer]:
    c = model.config
    return [KVBuffer(capacity, batch * c.num_kv_heads, c.dim_head, model.dtype, model.device,
                     kv_heads=c.num_kv_heads, layer=j)
            for j in range(c.num_layers)]


def forward(model: Transformer, tokens, inp, bufs, policy) -> torch.Tensor:
    """Embed, run every layer over its buffer, return final hidden states (not logits)."""
    h = model.embed(tokens, inp)
    for j, buf in enumerate(bufs):
        h = model.layer(j, h, inp, buf, policy)
    return h


@torch.inference_mode()
def generate(model: Transformer, prompts: list[list[int]], max_new_tokens: int, policy,
             sampling: Sampling = Sampling(), stop_ids=(), pad_id: int = 0) -> list[list[int]]:
    """Generate up to max_new_tokens per prompt; a sequence stops after emitting a stop id
    (the stop id is kept in its output)."""
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1 (got {max_new_tokens})")
    sampling.check()
    tokens, valid, pos = left_pad(prompts, pad_id, model.device)
    b, s = tokens.shape
    check_length(model, max(len(p) for p in prompts), max_new_tokens)
    bufs = allocate(model, policy.capacity(s, max_new_tokens), b)
    sample = Sampler(sampling, model.device)

    h = forward(model, tokens, model.step_input(pos, valid), bufs, policy)
    nxt = sample(model.head(h[:, -1]))
    next_pos = valid.sum(dim=1)
    stop = torch.tensor(sorted(stop_ids) or [-1], device=model.device)
    done = torch.zeros(b, dtype=torch.bool, device=model.device)
    out = []
    for step in range(max_new_tokens):
        out.append(nxt)
        done |= torch.isin(nxt, stop)
        if step == max_new_tokens - 1 or bool(done.all()):
            break
        h = forward(model, nxt, model.step_input(next_pos, None), bufs, policy)
        nxt = sample(model.head(h))
        next_pos = next_pos + 1
    result = torch.stack(out, dim=1).tolist()
    return [_cut_at_stop(row, stop_ids) for row in result]


def _cut_at_stop(row: list[int], stop_ids) -> list[int]:
    for i, t in enumerate(row):
        if t in stop_ids:
            return row[:i + 1]
    return row


@torch.inference_mode()
def token_nll(model: Transformer, ids: list[int], policy, prefill_tokens: int | None = None,
              chunk: int = 256) -> torch.Tensor:
    """Teacher-forced NLL of ids[1:] given their prefixes -> (N-1,) fp32.

    Without eviction: one prefill. With eviction: a prefill of `prefill_tokens` (default: the
    policy's slot count), then one token at a time through the decode path, evicting exactly
    as generation does.
    """
    n = len(ids)
    check_length(model, n - 1, 1)
    policy.capacity(n - 1, 1)                      # resolve the slots for n tokens in all
    p0 = n - 1 if not policy.evicts else min(prefill_tokens or policy.slots, n - 1)
    if p0 < 1:
        raise UserError(f"--prefill-tokens must be >= 1 (got {p0})")
    tokens = torch.tensor([ids], dtype=torch.long, device=model.device)
    bufs = allocate(model, policy.capacity(p0, n - p0), 1)
    valid = torch.ones(1, p0, dtype=torch.bool, device=model.device)
    pos = torch.arange(p0, device=model.device).unsqueeze(0)
    h = forward(model, tokens[:, :p0], model.step_input(pos, valid), bufs, policy)[0]
    target = tokens[0, 1:p0 + 1]
    nll = [_nll(model, h[i:i + chunk], target[i:i + chunk]) for i in range(0, p0, chunk)]
    for t in range(p0, n - 1):
        step = model.step_input(torch.full((1,), t, device=model.device), None)
        h = forward(model, tokens[:, t], step, bufs, policy)
        nll.append(_nll(model, h, tokens[0, t + 1:t + 2]))
    return torch.cat(nll)


def _nll(model: Transformer, h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """h (n, D), target (n,) -> NLL (n,); chunked callers keep (n, V) logits small."""
    logp = torch.log_softmax(model.head(h), dim=-1)
    return -logp.gather(1, target[:, None]).squeeze(1)
