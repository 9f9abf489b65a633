"""`local`: a sliding window of the most recent tokens only (H2O's "Local" baseline).

The window holds `slots` tokens including the one being decoded: each full step the oldest
leaves. H2O paper Sec. 5 and seed-h2o.md §1.4 (H = 0).
"""
from flexevict.policies import register
from flexevict.policies.base import RingPolicy


@register
class Local(RingPolicy):
    name = "local"

    def prefix_slots(self, capacity: int) -> int:
        return 0
