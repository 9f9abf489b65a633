"""`tova`: Token Omission Via Attention (Oren, Hassid, Yarden, Adi, Schwartz, "Transformers are
Multi-State RNNs", EMNLP 2024, arXiv 2401.06104; Eq. 9 and Algorithm 1, head- vs layer-wise
variants in App. A, Table 3 - section pointers unchecked against a copy of the paper).

Rule: the decoder is a multi-state RNN whose states are the cached tokens; bounded to k states,
once the cache is full each decode step drops the ONE state with the lowest attention from the
CURRENT query. No recent window, no sinks: every cached token and the new token compete.

Decisions where the paper is silent (following the authors' code where it says more):
- k = the committed slots (`slots - 1`); the new token attends from the scratch slot and, like
  every committed slot, is a candidate (`commit="replace"`): a scratch victim drops the new token.
- Eviction runs after the attention that scored it (as the authors' code does).
- Score = this step's probability, per kv head summed over its query heads (GQA; same argmin as
  the authors' mean). `heads=kv` (default) decides per (sequence, kv head), the paper's
  "TOVA-head"; `heads=layer` sums the scores over the `buf.kv_heads` kv heads of each sequence,
  so all of them drop the same token (the paper's "TOVA-layer").
- Ties: the oldest token goes; empty/pad slots are taken first.
- Prefill: the model folds the prompt attention with `prompt_scores` (the `fold` of
  kernels.prefill_attention_scores), giving the LAST prompt query's attention; the top-k
  prompt tokens by it are kept (ties: the newest kept), in position order.
- `buf.score` holds the current step's score only (TOVA keeps no memory across steps).

Notes: policies/README.md#tova
"""
from dataclasses import dataclass

import torch

from flexevict.core import kernels
from flexevict.errors import UserError, setting
from flexevict.core.kv import gather_prompt, left_aligned

from flexevict.policies.registry import register
from flexevict.policies.base import Policy, kv_head_probs


@register
@dataclass(frozen=True)
class TOVA(Policy):
    heads: str = "kv"
    name = "tova"
    graph_safe = True
    stacks = True
    min_slots = 2                     # one cached token + the token being decoded
    needs_prompt_scores = True

    def __post_init__(self):
        super().__post_init__()
        if self.heads not in ("kv", "layer"):
            raise UserError(f"{setting('policy_args')} heads={self.heads}: expected 'kv' (one "
                            "eviction per kv head) or 'layer' (all heads of a layer alike)")

    # ------------------------------------------------------------------ scores
    def prompt_scores(self, layout, acc, p, first, valid):
        """Fold one block of prefill attention into the prompt statistic (the model passes this as
        the `fold` of kernels.prefill_attention_scores).

        p (B, Hk, g, c, j) fp32 probabilities of prompt queries [first, first + c) over keys
        [0, j) (pad queries zeroed), valid (B, S) -> (B, Hk, S): the last prompt query's
        attention (under left padding the last position is a real token in every row), summed
        over the group. Its block is the last, where j = S."""
        last = valid.shape[1] - 1 - first
        if 0 <= last < p.shape[3]:
            return p[:, :, :, last].sum(dim=2)
        return acc

    def group(self, buf, score: torch.Tensor) -> torch.Tensor:
        """(n, rows) per-kv-head scores -> the scores eviction compares (layer: summed over the
        kv heads of each sequence, repeated for each of them)."""
        if self.heads == "kv":
            return score
        h = getattr(buf, "kv_heads", None)
        if not h:
            raise UserError(f"{setting('policy_args')} heads=layer needs an engine whose KV "
                            "buffers know their kv-head count (buf.kv_heads); use heads=kv")
        n, rows = score.shape
        return score.view(n, rows // h, h).sum(-1, keepdim=True).expand(-1, -1, h).reshape(n, rows)

    # ------------------------------------------------------------------ hooks
    def prefill(self, buf, k, v, pos, valid, scores=None):
        if scores is not None:
            scores = self.group(buf, scores.float())
        if k.shape[0] <= buf.capacity:
            return buf.store_prompt(k, v, pos, valid, scores)
        order = left_aligned(valid)
        k, v, pos, valid, scores = gather_prompt(order, k, v, pos, valid, scores)
        rank = torch.where(valid, scores, float("-inf"))
        # best first; among equal scores the newest first (so the oldest is the one dropped)
        by_age = torch.sort(pos, dim=0, descending=True, stable=True).indices
        by_rank = torch.sort(rank.gather(0, by_age), dim=0, descending=True, stable=True).indices
        keep = by_age.gather(0, by_rank[:buf.capacity]).sort(dim=0).values
        buf.store_prompt(k, v, pos, valid, scores, keep=keep)   # pads picked stay invalid

    def observe(self, buf, slot, probs, scored=False):
        if buf.layout.evicts:
            buf.score[:probs.shape[-1]] = self.group(buf, kv_head_probs(probs))

    def commit(self, buf, slot):
        if not buf.layout.evicts or slot != buf.scratch:
            return buf.commit_appended(slot)
        # candidates: every committed slot and the scratch slot (a scratch victim drops it)
        kernels.evict_commit(buf, buf.attended(slot), cursor=False, commit="replace")
