"""The policy registry: name -> class, and `PolicySpec`, what a user asked for.

Each policy module registers its class with `register`; `flexevict.policies` imports them all.
"""
from __future__ import annotations

from dataclasses import dataclass

from flexevict.errors import UserError, setting

from flexevict.policies.base import Policy

POLICIES: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    POLICIES[cls.name] = cls
    return cls


def get_policy(name: str, budget: float | None = None, budget_tokens: int | None = None,
               **args) -> Policy:
    """A fresh policy instance (one per generate call) with its budget and arguments."""
    if name not in POLICIES:
        raise UserError(f"unknown policy '{name}'; known policies: {', '.join(POLICIES)}")
    return POLICIES[name].create(budget=budget, budget_tokens=budget_tokens, **args)


@dataclass(frozen=True)
class PolicySpec:
    """What the user asked for; `make()` gives a fresh policy for each generate call (the
    resolved slot count depends on that call's prompt and generation lengths)."""
    name: str = "full"
    budget: float | None = None
    budget_tokens: int | None = None
    args: tuple = ()                  # ((name, value), ...) from --policy-arg

    def make(self) -> Policy:
        return get_policy(self.name, self.budget, self.budget_tokens, **dict(self.args))

    @classmethod
    def parse(cls, name: str, budget=None, budget_tokens=None, policy_args=()) -> "PolicySpec":
        """From CLI strings; checks the policy, budget and `name=value` arguments now."""
        pairs = []
        for item in policy_args or ():
            key, eq, value = item.partition("=")
            if not eq or not key:
                raise UserError(f"{setting('policy_args')} '{item}' must look like name=value")
            pairs.append((key.replace("-", "_"), value))
        spec = cls(name, budget, budget_tokens, tuple(pairs))
        spec.make()
        return spec

