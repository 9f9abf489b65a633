"""A run's layers, resolved once from the model's config and the run's policy: which policy
each layer's cache runs and the `Layout` its buffer has.

A global layer runs the run's policy at its budget. A sliding-window layer (Mistral, Gemma-3's
local layers: `ModelConfig.layer_window`) whose window is shorter than the run keeps a plain
ring of its last `window` tokens (the `local` policy at `budget_tokens=window`: the new token
and window - 1 before it, which is exactly what the layer attends), whatever the run's policy:
its memory is already bounded, there is nothing to evict by importance. A sliding layer whose
window holds the whole run never slides in it: it is a global layer for that run.

Per-layer budgets (`--policy-arg layer_budgets=...`) share the global layers' slots unevenly,
their total kept at the uniform budget's: `pyramid` is PyramidKV's schedule (Cai et al. 2024,
"PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling", its method
section, the KV cache budget allocation across layers): the top layer gets 1/beta of the
uniform budget k (beta = 20), the bottom layer 2k minus that, the layers between an arithmetic
sequence; "w0,w1,..." gives each global layer slots in proportion to its weight. Each layer is
kept within [the policy's minimum, prompt + generated] (the rest goes to the other layers).
Allocation (`engine.allocate_layers`), the memory plan (`layer_slots`) and the result block
(`describe_layers`) read each layer's own size from here.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from flexevict.core.kv import Layout
from flexevict.errors import UserError, setting
from flexevict.policies import Policy, get_policy
from flexevict.policies.base import layer_weights

PYRAMID_BETA = 20.0      # PyramidKV's beta: the top layer keeps 1/beta of the uniform budget


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
    windows = [config.layer_window(j) for j in range(config.num_layers)]
    glob = [j for j, w in enumerate(windows) if w is None or w >= prompt_len + gen_len]
    own = dict(zip(glob, layer_policies(policy, len(glob), prompt_len, gen_len)))
    rings: dict[int, tuple] = {}
    specs = []
    for j, w in enumerate(windows):
        if j in own:
            p = own[j]
            specs.append(LayerSpec(j, "global", p, layout if p is policy
                                   else p.layout(prompt_len, gen_len)))
            continue
        if w not in rings:
            ring = get_policy("local", budget_tokens=w)
            rings[w] = (ring, ring.layout(prompt_len, gen_len))
        specs.append(LayerSpec(j, "window", *rings[w]))
    return specs


def layer_policies(policy: Policy, n: int, prompt_len: int, gen_len: int) -> list[Policy]:
    """The policies of a run's n global layers, bottom first: `policy` itself on each, or with
    `layer_budgets` one per layer at its own `budget_tokens` (`layer_budget_slots`)."""
    if not policy.layer_budgets or n == 0:
        return [policy] * n
    return [dataclasses.replace(policy, budget=None, budget_tokens=s, layer_budgets=None)
            for s in layer_budget_slots(policy, n, prompt_len, gen_len)]


def layer_budget_slots(policy: Policy, n: int, prompt_len: int, gen_len: int) -> list[int]:
    """Slots of each of n global layers under `policy.layer_budgets`, bottom first: n times the
    uniform budget's slots in all (`apportion`)."""
    weights = layer_weights(policy.layer_budgets)
    if weights == "pyramid":
        weights = pyramid(n)
    elif len(weights) != n:
        raise UserError(f"{setting('policy_args')} layer_budgets gives {len(weights)} weights "
                        f"for {n} global layers")
    k = policy.slots_for(prompt_len, gen_len)
    return apportion(weights, n * k, policy.minimum_slots(), prompt_len + gen_len)


def pyramid(n: int, beta: float = PYRAMID_BETA) -> list[float]:
    """PyramidKV's budgets relative to the uniform one (their mean is 1), bottom layer first:
    the top layer 1/beta, the bottom 2 - 1/beta, an arithmetic sequence between."""
    if n == 1:
        return [1.0]
    top = 1.0 / beta
    bottom = 2.0 - top
    return [bottom - (bottom - top) * j / (n - 1) for j in range(n)]


def apportion(weights: list[float], total: int, lo: int, hi: int) -> list[int]:
    """Integers in [lo, hi], one per weight, summing to `total` (clipped to [n lo, n hi]), in
    proportion to the weights where the bounds allow: a layer whose share passes a bound is
    fixed at it and the others share the rest; the remainders are rounded by largest fraction
    (ties: the lower layer), so a decreasing schedule stays non-increasing."""
    n, lo = len(weights), min(lo, hi)
    total = max(min(total, n * hi), n * lo)
    fixed: dict[int, int] = {}
    while True:
        free = [j for j in range(n) if j not in fixed]
        left = total - sum(fixed.values())
        if not free:
            break
        mass = sum(weights[j] for j in free)
        share = {j: left * weights[j] / mass for j in free}
        out = ({j: hi for j in free if share[j] > hi}
               or {j: lo for j in free if share[j] < lo})
        if not out:
            break
        fixed.update(out)
    slots = {j: math.floor(share[j]) for j in free}
    by_fraction = sorted(free, key=lambda j: (slots[j] - share[j], j))
    for j in by_fraction[:left - sum(slots.values())]:
        slots[j] += 1
    return [fixed[j] if j in fixed else slots[j] for j in range(n)]


def uniform(specs: list[LayerSpec]) -> bool:
    """Every layer runs the same policy over the same layout (its caches may then stack)."""
    return all(s.policy == specs[0].policy and s.layout == specs[0].layout for s in specs)


def layer_slots(specs: list[LayerSpec]) -> list[int]:
    """Each layer's slots per (sequence, kv head), the scratch slot included."""
    return [s.layout.slots for s in specs]


def describe_layers(specs: list[LayerSpec]) -> dict:
    """What the result block adds for a run whose layers differ: the window layers' count
    and slots, each layer's slots where the global layers' budgets differ, and the total
    slots over all layers (per sequence and kv head)."""
    windows = [s for s in specs if s.kind == "window"]
    out = {}
    if windows:
        out.update(window_layers=len(windows), window_slots=windows[0].layout.slots)
    if not uniform([s for s in specs if s.kind == "global"]):     # per-layer budgets
        out["layer_slots"] = layer_slots(specs)
    if out:
        out["total_slots"] = sum(layer_slots(specs))
    return out


def describe_run(config, policy: Policy, layout: Layout) -> dict:
    """The result block's budget: the policy's resolved layout (`Policy.describe`), and the
    window layers where the model has any that slide in this run (`describe_layers`)."""
    specs = layer_specs(config, policy, layout.prompt_len, layout.gen_len, layout)
    return {**policy.describe(layout), **describe_layers(specs)}
