"""`local`: a sliding window of the most recent tokens only (H2O's "Local" baseline).

The window holds `slots` tokens including the one being decoded: each full step the oldest
leaves. The "Local" baseline of the H2O paper (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for
Efficient Generative Inference of Large Language Models", Sec. 5): H2O with no heavy slots.
"""
from dataclasses import dataclass

from flexevict.policies.registry import register
from flexevict.policies.base import RingPolicy


@register
@dataclass(frozen=True)
class Local(RingPolicy):
    name = "local"
    graph_safe = True

    def prefix_slots(self, capacity: int) -> int:
        return 0
