"""`full`: no eviction; the buffer holds every token (the reference all policies are checked
against)."""
from dataclasses import dataclass

from flexevict.core.kv import Layout
from flexevict.errors import UserError, setting

from flexevict.policies.registry import register
from flexevict.policies.base import Policy


@register
@dataclass(frozen=True)
class Full(Policy):
    name = "full"
    graph_safe = graph_safe_filling = True     # the base hooks: write, attend, append

    def __post_init__(self):
        super().__post_init__()
        if self.budget is not None and self.budget < 1:
            raise UserError(f"policy 'full' keeps every token; drop {setting('budget')} "
                            f"{self.budget} or choose an eviction policy "
                            f"({setting('policy')} h2o, ...)")

    def layout(self, prompt_len: int, gen_len: int) -> Layout:
        layout = super().layout(prompt_len, gen_len)
        if layout.evicts:
            raise UserError("policy 'full' keeps every token; drop "
                            f"{setting('budget')}/{setting('budget_tokens')} or choose an eviction "
                            "policy")
        return layout
