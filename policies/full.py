"""`full`: no eviction; the buffer holds every token (the reference all policies are checked against)."""
from flexevict.errors import UserError

from flexevict.policies.registry import register
from flexevict.policies.base import Policy


@register
class Full(Policy):
    name = "full"

    def capacity(self, prompt_len: int, gen_len: int) -> int:
        capacity = super().capacity(prompt_len, gen_len)
        if self.evicts:
            raise UserError("policy 'full' keeps every token; drop --budget/--budget-tokens or "
                            "choose an eviction policy")
        return capacity
