"""A run's layers, resolved once from the model's config and the run's policy: which policy
each layer's cache runs and the `Layout` its buffer has.

A global layer runs the run's policy at its budget. A sliding-window layer (Mistral, Gemma-3's
local layers: `ModelConfig.layer_window`) whose window is shorter than the run keeps a plain
ring of its last `window` tokens (the `local` policy at `budget_tokens=window`: the new token
and window - 1 before it, which is exactly what the layer attends), whatever the run's policy:
its memory is already bounded, there is nothing to evict by importance. A sliding layer whose
window holds the whole run never slides in it: it is a global layer for that run.
Allocation (`engine.allocate_layers`), the memory plan (`layer_slots`) and the result block
(`describe_layers`) read each layer's own size from here.
"""
from __future__ import annotations

from dataclasses import dataclass

from flexevict.core.kv import Layout
from flexevict.policies import Policy, get_policy


@dataclass(frozen=True)
class LayerSpec:
    """Layer `index` of a run: kind "global" (the run's policy) or "window" (a sliding
    layer's ring); its policy and the layout its buffers carry."""
    index: int
    kind: str
    policy: Policy
    layout: Layout


def layer_specs(config, policy: Policy, prompt_len: int, gen_len: int,
                layout: Layout | None = None) -> list[LayerSpec]:
    """One spec per layer for a run of prompt_len (the batch's padded length) + gen_len
    tokens; layout: the policy's, when already resolved (`Policy.layout` is not free)."""
    layout = layout or policy.layout(prompt_len, gen_len)
    windows: dict[int, tuple] = {}
    specs = []
    for j in range(config.num_layers):
        w = config.layer_window(j)
        if w is None or w >= prompt_len + gen_len:
            specs.append(LayerSpec(j, "global", policy, layout))
            continue
        if w not in windows:
            ring = get_policy("local", budget_tokens=w)
            windows[w] = (ring, ring.layout(prompt_len, gen_len))
        specs.append(LayerSpec(j, "window", *windows[w]))
    return specs


def uniform(specs: list[LayerSpec]) -> bool:
    """Every layer runs the same policy over the same layout (its caches may then stack)."""
    return all(s.policy == specs[0].policy and s.layout == specs[0].layout for s in specs)


def layer_slots(specs: list[LayerSpec]) -> list[int]:
    """Each layer's slots per (sequence, kv head), the scratch slot included."""
    return [s.layout.slots for s in specs]


def describe_layers(specs: list[LayerSpec]) -> dict:
    """What the result block adds for a run whose layers differ: the window layers' count
    and slots, and the total slots over all layers (per sequence and kv head)."""
    windows = [s for s in specs if s.kind == "window"]
    if not windows:
        return {}
    return {"window_layers": len(windows), "window_slots": windows[0].layout.slots,
            "total_slots": sum(layer_slots(specs))}


def describe_run(config, policy: Policy, layout: Layout) -> dict:
    """The result block's budget: the policy's resolved layout (`Policy.describe`), and the
    window layers where the model has any that slide in this run (`describe_layers`)."""
    specs = layer_specs(config, policy, layout.prompt_len, layout.gen_len, layout)
    return {**policy.describe(layout), **describe_layers(specs)}
