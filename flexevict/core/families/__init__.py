"""Model families, one module each: what a family's weights are called, how its blocks compute,
and how its HF config reads. `core/model.py` runs any of them through `family_of(config)`.

A family is a `Family` (base.py): its parameter list in HF naming, the fused weight recipe, the
keys of its attention half, its embedding and head, the norms around each half of a block, the
per-head query/key transform before RoPE, its MLP, and its `config.json` mapping. Adding a
family is its module plus one line in FAMILIES.
"""
from __future__ import annotations

from flexevict.core.families.base import Family
from flexevict.core.families.gemma3 import Gemma3
from flexevict.core.families.llama import LLaMA
from flexevict.core.families.opt import OPT
from flexevict.core.families.qwen3 import Qwen3
from flexevict.errors import UserError

FAMILIES: dict[str, Family] = {f.arch: f for f in (OPT(), LLaMA(), Qwen3(), Gemma3())}
MODEL_TYPES = {t: f for f in FAMILIES.values() for t in f.model_types}   # HF model_type -> family


def family_of(config) -> Family:
    """The family that runs `config` (by its `arch`)."""
    try:
        return FAMILIES[config.arch]
    except KeyError:
        raise UserError(f"unknown architecture '{config.arch}' ({', '.join(FAMILIES)})") from None


__all__ = ["FAMILIES", "MODEL_TYPES", "Family", "family_of"]
