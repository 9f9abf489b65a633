"""`h2o` and `h2o-ring`: Heavy-Hitter Oracle (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for
Efficient Generative Inference of Large Language Models").

`h2o` is the paper's policy (Sec. 5.1, App. A): half the committed slots hold
heavy hitters, half the most recent tokens (the current one included). A token's score is the sum
of the attention probabilities it has received, in fp32, from every query since it entered the
cache (prompt column sums first). Each full step evicts the lowest score among the heavy set and
the token leaving the recent window (ties: the oldest), and reuses its slot in place.

`h2o-ring` is the ring buffer of the authors' FlexGen integration code: one more heavy slot, one
fewer recent, and the token leaving the window is always promoted; only heavy slots compete.
From the second decode step on it equals `h2o` with one fewer heavy and one more recent slot.

Notes: policies/README.md#h2o
"""
from dataclasses import dataclass

from flexevict.policies.registry import register
from flexevict.policies.base import RingPolicy, add_attention


@register
@dataclass(frozen=True)
class H2O(RingPolicy):
    name = "h2o"
    needs_prompt_scores = True
    accumulates_attention = True

    def prefix_slots(self, capacity: int) -> int:
        return capacity // 2

    def prefix_rank(self, buf, scores, k, v, pos, valid):
        return scores

    def accumulate(self, buf, slot, probs, scored=False):
        add_attention(buf, probs, scored)

    def victim_candidates(self, buf):
        return buf.ring_start, True, None              # heavy hitters + the oldest recent


@register
@dataclass(frozen=True)
class H2ORing(H2O):
    name = "h2o-ring"

    def prefix_slots(self, capacity: int) -> int:
        return (capacity + 1) // 2

    def victim_candidates(self, buf):
        return buf.ring_start, False, None             # only heavy hitters compete
