"""`streaming`: StreamingLLM (Xiao et al. 2023) - the first `sinks` tokens (attention sinks) are
kept forever, plus a window of the most recent tokens.

LLaMA keys are cached before RoPE and rotated by their rank inside the cache, the paper's
"positions within the cache" (its Sec. 3.2), so positions never exceed the cache size.
"""
from dataclasses import dataclass

from flexevict.errors import UserError, setting
from flexevict.policies.registry import register
from flexevict.policies.base import RingPolicy


@register
@dataclass(frozen=True)
class Streaming(RingPolicy):
    sinks: int = 4
    name = "streaming"
    graph_safe = True
    rope_in_cache = True

    def __post_init__(self):
        super().__post_init__()
        if self.sinks < 0:
            raise UserError(f"{setting('policy_args')} sinks must be >= 0 (got {self.sinks})")

    def min_prefix(self) -> int:
        return self.sinks

    def prefix_slots(self, capacity: int) -> int:
        return self.sinks
