"""`streaming`: StreamingLLM (Xiao et al. 2023) - the first `sinks` tokens (attention sinks) are
kept forever, plus a window of the most recent tokens.

LLaMA keys are cached before RoPE and rotated by their rank inside the cache, the paper's
"positions within the cache" (its Sec. 3.2), so positions never exceed the cache size.
"""
from flexevict.policies.registry import register
from flexevict.policies.base import RingPolicy


@register
class Streaming(RingPolicy):
    name = "streaming"
    args = {"sinks": 4}
    rope_in_cache = True

    def min_prefix(self) -> int:
        return self.opts["sinks"]

    def prefix_slots(self, capacity: int) -> int:
        return self.opts["sinks"]
