"""`keydiff`: KeyDiff (Park, Jones, Morse, Goel, Lee, Lott, "KeyDiff: Key Similarity-Based KV
Cache Eviction for Long-Context LLM Inference in Resource-Constrained Environments", arXiv
2504.15364; Sec. 3, the anchor score and block-wise prompt processing, Fig. 1 - section pointers
unchecked against a copy of the paper).

Rule: no attention weights. A cache of N keys is kept; when more arrive, the anchor is the mean
of the L2-normalised keys present (the cache and the newcomers), each key is scored by its
negative cosine similarity to the anchor, and the N highest scores stay: the keys most similar
to the anchor (the least distinctive) go. Every key competes; the paper's anchor rule keeps no
sinks and no protected recent window (`window=0`, the default, as kvpress's KeyDiffPress).

Decisions where the paper is silent or the engine differs:
- N = the committed slots (`slots - 1`). Decode: once the buffer is full, each new token is
  written to the scratch slot and attended, then the anchor is taken over the `slots` keys
  present (the new one included) and the one most similar to it goes (a block of one token);
  the new token may be that one (it is then dropped after being attended once, as TOVA's
  scratch victim is). Ties: the oldest goes; empty slots first.
- The anchor is recomputed from the buffer's keys at every eviction, not kept as a running sum
  (no drift, no declared state; the step reads the keys about as often as attention does).
  Decode ranks by the dot product of each unit key with the summed unit keys (`anchor_affinity`:
  the cosine times a per-row constant, the same order); the prompt by the cosine itself, as
  kvpress computes it. Keys are the cached ones: after RoPE for LLaMA, as the paper's and
  kvpress's caches hold them.
- Prompt longer than the buffer: `block=B` (default 128, kvpress's `BlockPress` default; the
  paper's own block size is not checked here) replays the paper's block-wise prompt processing
  on the prompt's keys: the first N tokens fill the cache, then each block of B tokens joins
  and the N best of the N + B stay (kvpress's `BlockPress(KeyDiffPress, B)`).
  The prefill attention itself is the engine's full causal pass, so only the kept set is
  block-wise (as in kvpress). `block=0` scores the whole prompt at once, one anchor over every
  prompt key (kvpress's plain `KeyDiffPress`).
- Scores are per (sequence, kv head): keys are per kv head, so GQA needs no reduction.
- `window=W` (not the anchor rule's default): the W newest tokens (the one being decoded
  included; the prompt's last W) are never evicted; the anchor is still taken over every key
  present. Decode evicts one token per step, and with no protected window the rule often drops
  a token just generated (policies/README.md#keydiff measures what that costs).
  Resolved to at most `slots - 2`, so at least two tokens compete.
- Not built: the paper's variants beyond the anchor rule (pairwise similarity).

Notes: policies/README.md#keydiff
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flexevict.core import kernels
from flexevict.core.kv import gather_prompt, left_aligned
from flexevict.errors import UserError, setting

from flexevict.policies.registry import register
from flexevict.policies.base import Policy


def anchor_similarity(k: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """KeyDiff's similarity: k (n, R, d), valid (n, R) -> (n, R) fp32, each key's cosine
    similarity to its row's anchor, the mean of the row's valid keys after L2 normalisation
    (invalid keys take no part; their similarity is meaningless)."""
    kf = k.float()
    unit = F.normalize(kf, dim=-1) * valid.unsqueeze(-1)
    anchor = unit.sum(0) / valid.sum(0).clamp(min=1).unsqueeze(-1)       # (R, d)
    return F.cosine_similarity(kf, anchor.unsqueeze(0), dim=-1)


def anchor_affinity(k: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`anchor_similarity` times the norm of the row's summed unit keys: the same order within
    each row, in two batched products and one norm instead of the cosine's extra passes (a
    decode step's; 2.8x faster on a CPU at SmolLM2's stacked rows) -> (n, R), 0 where invalid."""
    kf = k.float()
    inv = torch.linalg.vector_norm(kf, dim=-1).clamp_min(1e-12).reciprocal() * valid   # (n, R)
    rows = kf.transpose(0, 1)                                                 # (R, n, d)
    anchor = torch.bmm(inv.t().unsqueeze(1), rows)                            # (R, 1, d)
    return torch.bmm(rows, anchor.transpose(1, 2)).squeeze(-1).t() * inv


@register
@dataclass(frozen=True)
class KeyDiff(Policy):
    block: int = 128
    window: int = 0
    name = "keydiff"
    graph_safe = True
    stacks = True
    min_slots = 2                     # one cached key + the token being decoded

    def __post_init__(self):
        super().__post_init__()
        if self.block < 0:
            raise UserError(f"{setting('policy_args')} block={self.block}: must be >= 0 (0 "
                            "scores the whole prompt at once)")
        if self.window < 0:
            raise UserError(f"{setting('policy_args')} window={self.window}: must be >= 0 (the "
                            "newest tokens never evicted; 0: none)")

    def protected(self, capacity: int) -> int:
        """The newest tokens never evicted with `capacity` committed slots (`window`, leaving at
        least two tokens to compete)."""
        return max(0, min(self.window, capacity - 1))

    # ------------------------------------------------------------------ prompt
    def prompt_keep(self, k, valid, n: int) -> torch.Tensor:
        """Which of a left-aligned prompt's tokens stay: k (S, R, d), valid (S, R) with each
        row's real tokens first -> (n, R) indices in position order."""
        s = k.shape[0]
        first_protected = valid.sum(0) - self.protected(n)          # (R,) the last `window`

        def scored(idx, ok, keys):
            score = torch.where(ok, -anchor_similarity(keys, ok), float("-inf"))
            return score.masked_fill(ok & (idx >= first_protected), float("inf"))

        if self.block == 0 or self.block >= s - n:          # one block: one anchor over all
            idx = torch.arange(s, device=k.device).unsqueeze(1)
            return top_rows(scored(idx, valid, k), n)
        kept = torch.arange(n, device=k.device).unsqueeze(1).expand(n, k.shape[1])
        for i in range(n, s, self.block):
            joining = torch.arange(i, min(i + self.block, s), device=k.device)
            cand = torch.cat([kept, joining.unsqueeze(1).expand(-1, k.shape[1])])
            kc = k.gather(0, cand.unsqueeze(-1).expand(-1, -1, k.shape[-1]))
            kept = cand.gather(0, top_rows(scored(cand, valid.gather(0, cand), kc), n))
        return kept.sort(dim=0).values

    def prefill(self, buf, k, v, pos, valid, scores=None):
        n = buf.capacity
        if k.shape[0] <= n:
            return buf.store_prompt(k, v, pos, valid)
        order = left_aligned(valid)
        k, v, pos, valid, _ = gather_prompt(order, k, v, pos, valid)
        buf.store_prompt(k, v, pos, valid, keep=self.prompt_keep(k, valid, n))

    # ------------------------------------------------------------------ decode
    def commit(self, buf, slot):
        if not buf.layout.evicts or slot != buf.scratch:
            return buf.commit_appended(slot)
        n = buf.scratch + 1                  # every committed key and the new one compete
        value = -anchor_affinity(buf.k[:n], buf.valid[:n])
        w = self.protected(buf.capacity)
        if w:                                # the `window` newest stay
            value = value.masked_fill(buf.pos[:n] > buf.pos[buf.scratch] - w, float("inf"))
        # the lowest value goes: the key most similar to the anchor (a scratch victim drops it)
        kernels.evict_commit(buf, n, cursor=False, value=value, commit="replace")


def top_rows(score: torch.Tensor, n: int) -> torch.Tensor:
    """(S, R) scores -> the n highest per row (ties: the newest stay, so the oldest goes, as
    a decode step's `kernels.lowest` breaks them), in index order."""
    s = score.shape[0]
    newest_first = torch.arange(s - 1, -1, -1, device=score.device)
    ranked = torch.sort(score[newest_first], dim=0, descending=True, stable=True).indices[:n]
    return newest_first[ranked].sort(dim=0).values
