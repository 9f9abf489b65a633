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

`split=buzz` is the H2O that BUZZ's authors compare against (BUZZ, Zhao et al. 2024, Sec. 4):
the recent window is BUZZ's w for the same slots (its Theorem 3.1 with k = 4, s = 5) and the
heavy set its k + T, so the two differ only in how they choose the middle.

Notes: policies/README.md#h2o
"""
from dataclasses import dataclass

from flexevict.errors import UserError, setting
from flexevict.policies.registry import register
from flexevict.policies.base import RingPolicy, add_attention


SPLITS = ("half", "buzz")


@register
@dataclass(frozen=True)
class H2O(RingPolicy):
    split: str = "half"             # heavy/recent: the paper's halves, or BUZZ's T + k / w
    name = "h2o"
    graph_safe = True
    needs_prompt_scores = True
    accumulates_attention = True

    def __post_init__(self):
        super().__post_init__()
        if self.split not in SPLITS:
            raise UserError(f"{setting('policy_args')} split={self.split}: expected one of "
                            f"{', '.join(SPLITS)}")

    def prefix_slots(self, capacity: int) -> int:
        if self.split == "buzz":    # BUZZ's comparison: w recent, the k sinks + T middle heavy
            from flexevict.policies.buzz import Buzz, theorem_window   # keeps registry order
            return capacity - min(theorem_window(capacity - Buzz.k, Buzz.s), capacity)
        return capacity // 2

    def prefix_rank(self, buf, scores, k, v, pos, valid):
        return scores

    def observe(self, buf, slot, probs, scored=False):
        add_attention(buf, probs, scored)

    def victim_candidates(self, buf):
        return buf.ring_start, True, None              # heavy hitters + the oldest recent


@register
@dataclass(frozen=True)
class H2ORing(H2O):
    name = "h2o-ring"

    def __post_init__(self):
        super().__post_init__()
        if self.split != "half":
            raise UserError(f"h2o-ring has the FlexGen code's own split; {setting('policy_args')} "
                            "split is for h2o")

    def prefix_slots(self, capacity: int) -> int:
        return (capacity + 1) // 2

    def victim_candidates(self, buf):
        return buf.ring_start, False, None             # only heavy hitters compete
