"""`tova`: Token Omission Via Attention (Oren, Hassid, Yarden, Adi, Schwartz 2024, "Transformers are
Multi-State RNNs", EMNLP 2024, arXiv 2401.06104).

The paper is not in shared/papers and has no seed report: the rule below is the paper's policy
(its Eq. 9 and Algorithm 1; head- vs layer-wise ablation in App. A, Table 3 - pointers taken from
a secondary summary, not checked against a copy here) as the authors' code implements it
(schwartz-lab-NLP/TOVA, src/tova_cache.py: `reduce` keeps `topk(cache_size)` of the last query's
attention row averaged over heads, after the attention that used it).

The rule: a decoder is a multi-state RNN whose states are the cached tokens; bounding it to k
states, once the cache is full each decode step drops the ONE state with the lowest attention
score of the CURRENT query. There is no recent window and no sink: every cached token and the
token being decoded compete.

Here k = the committed slots (`slots - 1`): attention each step reads k cached tokens plus the
new token in the scratch slot (k + 1 states, as in the authors' cache, which is reduced back to
`cache_size` after the attention that used it). Decisions:

- Candidates = every committed slot + the scratch slot, committed with `buf.replace`: a victim
  equal to the scratch slot drops the new token (it was attended once, then omitted), which is
  TOVA's rule. A ring of one (RingPolicy) would protect the new token for a step: not TOVA.
- The evicted token took part in this step's attention and disappears from the next one (the
  authors evict after the attention that scored it).
- Score of a slot = the current step's probability, per kv head the SUM over the query heads
  sharing it (GQA; a sum and the authors' mean have the same argmin). `heads=kv` (default)
  evicts per (sequence, kv head), the project's contract granularity and the paper's "TOVA-head".
  `heads=layer` sums over all heads of a layer, so every head of a sequence drops the same
  token: the paper's main variant ("TOVA-layer", App. A / Table 3 report it better than per
  head). It needs the engine to tell a buffer its kv-head count (`buf.kv_heads`); the current
  engine does not, so `heads=layer` raises a UserError until it does.
- Ties: the oldest token goes (`lowest`); empty/pad slots are always taken first.
- Prefill: the authors reduce the prompt once, keeping the top-k prompt tokens by the LAST prompt
  query's attention. `prompt_scores` computes exactly that statistic from the prefill's
  probabilities, for an engine that lets a policy fold the prompt attention itself (a proposed
  hook); the current engine hands every policy the column sums over all prompt queries (H2O's
  statistic), and then the prompt cut ranks by those. Either way prefill keeps the top-k prompt
  tokens by the score it gets (ties: newest kept), in position order.
- Per-slot state: `buf.score` holds the score of the current step (informative; TOVA keeps no
  memory across steps).
"""
import torch

from flexevict.core import kernels
from flexevict.errors import UserError
from flexevict.core.kv import gather_prompt, left_aligned

from flexevict.policies import register
from flexevict.policies.base import Policy, kv_head_probs


@register
class TOVA(Policy):
    name = "tova"
    args = {"heads": "kv"}
    min_slots = 2                     # one cached token + the token being decoded
    needs_prompt_scores = True

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        if self.opts["heads"] not in ("kv", "layer"):
            raise UserError(f"--policy-arg heads={self.opts['heads']}: expected 'kv' (one "
                            "eviction per kv head) or 'layer' (all heads of a layer alike)")

    # ------------------------------------------------------------------ scores
    def prompt_scores(self, acc, p, first, valid):
        """Fold one block of prefill attention into the prompt statistic (proposed engine hook).

        p (B, Hk, g, c, S) fp32 probabilities of prompt queries [first, first + c) (pad queries
        zeroed), valid (B, S) -> (B, Hk, S): the last prompt query's attention (under left
        padding the last position is a real token in every row), summed over the group."""
        last = p.shape[-1] - 1 - first
        if 0 <= last < p.shape[3]:
            return p[:, :, :, last].sum(dim=2)
        return acc if acc is not None else p.new_zeros(p.shape[0], p.shape[1], p.shape[-1])

    def group(self, buf, score: torch.Tensor) -> torch.Tensor:
        """(n, rows) per-kv-head scores -> the scores eviction compares (layer: summed over the
        kv heads of each sequence, repeated for each of them)."""
        if self.opts["heads"] == "kv":
            return score
        h = getattr(buf, "kv_heads", None)
        if not h:
            raise UserError("--policy-arg heads=layer needs an engine whose KV buffers know their "
                            "kv-head count (buf.kv_heads); use heads=kv")
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

    def after_attention(self, buf, slot, probs):
        if not self.evicts:
            return buf.commit_appended(slot)
        n = probs.shape[-1]
        buf.score[:n] = self.group(buf, kv_head_probs(probs))
        if slot != buf.scratch:
            return buf.commit_appended(slot)
        # candidates: every committed slot and the scratch slot (a scratch victim drops it)
        kernels.evict_commit(buf, n, cursor=False, commit="replace")
