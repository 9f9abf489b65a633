"""Eviction policies, one module per policy, registered by name (installed as `flexevict.policies`).

A policy owns three decisions on a layer's `KVBuffer` and nothing else (no I/O, no device
choice): how a run's budget divides the buffer (`layout`, a frozen `kv.Layout`), which prompt
tokens it keeps after prefill (`prefill`), and where each decoded token goes (`before_attention`
for pre-attention policies; `observe` to read the attention probabilities just used, per layer,
and `commit`, row-wise, which may run once per step over every layer's rows: `Policy.stacks`).

May import `flexevict.core` and `flexevict.errors`.
"""
from flexevict.policies.base import Policy
from flexevict.policies.registry import POLICIES, PolicySpec, get_policy, register

# each module registers itself; a new policy is one file plus one name here
from flexevict.policies import (full, local, streaming, h2o, tova, scissorhands, buzz,  # noqa: E402,F401
                                vatp, hashevict, cascade, recall)
from flexevict.policies import keydiff  # noqa: E402,F401
from flexevict.policies import snapkv  # noqa: E402,F401
from flexevict.policies import triattention  # noqa: E402,F401

__all__ = ["POLICIES", "Policy", "PolicySpec", "get_policy", "register"]
