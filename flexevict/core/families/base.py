"""What a model family is to the engine (`Family`): one object per family, no state."""
from __future__ import annotations

from flexevict.errors import UserError


class Family:
    """A decoder family: weights in HF naming, a block's computation, its config.json.

    Shapes: B batch, S sequence (absent in decode), D hidden, H query heads, Hk kv heads, d head
    dim. `c` is the ModelConfig, `w` a layer's weights (`layer_recipe` keys), `o` the outer
    weights (`outer_weights` keys)."""
    arch = "base"                  # ModelConfig.arch
    model_types: tuple = ()        # the HF model_type values it reads
    attention_keys: tuple = ()     # the weights of a block's attention half (the rest: MLP)
    uses_rope = True               # rotary positions (else learned, in `embed`)
    calibrated_as = "llama"        # whose calibration tables time its kernels (planner)

    # ---------------------------------------------------------------- parameters
    def layer_params(self, c, j: int) -> dict[str, tuple]:
        """HF names and shapes of layer j's parameters, in declaration order."""
        raise NotImplementedError

    def outer_params(self, c) -> dict[str, tuple]:
        """Embeddings, final norm and LM head (everything outside the layers)."""
        raise NotImplementedError

    def layer_recipe(self, c, j: int) -> dict:
        """How each of layer j's weights is made: key -> the HF tensors concatenated along
        dim 0 (q/k/v and gate/up fused), or None for an absent bias."""
        raise NotImplementedError

    def outer_weights(self, c, raw: dict) -> dict:
        """The outer tensors by HF name -> the model's outer weights (tied heads share)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- compute
    def embed(self, c, o: dict, tokens, inp):
        """tokens (B, S) or (B,) -> hidden (B, S, D) or (B, D)."""
        raise NotImplementedError

    def head(self, c, o: dict, h):
        """hidden (..., D) -> fp32 logits (..., V)."""
        raise NotImplementedError

    def attention_input(self, c, w: dict, h):
        """The residual stream -> the attention's input (its norm)."""
        raise NotImplementedError

    def attention_output(self, c, w: dict, h, attn):
        """The residual stream and the projected attention output -> the stream after it."""
        return h + attn

    def query_key(self, c, w: dict, q, k):
        """q (..., H, d), k (..., Hk, d) after the projection, before RoPE -> q, k."""
        return q, k

    def mlp_half(self, c, w: dict, h):
        """Norm, feed-forward, residual: h -> h."""
        raise NotImplementedError

    # ---------------------------------------------------------------- config.json
    def from_hf(self, cfg: dict, name: str) -> dict:
        """An HF config dict (its model_type one of ours) -> the ModelConfig fields this family
        reads (`config.from_hf_dict` adds the ones every family reads alike); name: the
        model's, for messages."""
        raise NotImplementedError

    def to_hf(self, c) -> dict:
        """ModelConfig -> the family's HF config fields (the common ones added by the caller)."""
        raise NotImplementedError


def fused_qkv(parts, attn: str = "self_attn.") -> dict:
    """The q/k/v projections fused into one weight ("wqkv"), and their biases ("bqkv") where
    the model has them (no key otherwise). parts: `parts_of`'s function."""
    qkv = ("q_proj", "k_proj", "v_proj")
    r = {"wqkv": parts(*(attn + p + ".weight" for p in qkv))}
    bqkv = parts(*(attn + p + ".bias" for p in qkv))
    if bqkv:
        r["bqkv"] = bqkv
    return r


def parts_of(names: dict, prefix: str):
    """-> parts(*suffixes): the full names if every one is in `names`, else None (an absent
    bias)."""
    def parts(*suffixes):
        found = [prefix + x for x in suffixes]
        return found if all(n in names for n in found) else None
    return parts


def unless_default(value, default):
    """None when a config value is absent or equals what the architecture derives anyway."""
    return None if value in (None, default) else value


HF_LAYER_TYPES = {"sliding_attention": "sliding", "full_attention": "global"}


def layer_types(cfg: dict, name: str, default) -> tuple:
    """The per-layer attention kinds of an HF config ("sliding" or "global" per layer): its
    `layer_types` list, else default(i) for layer i (a family's own rule); () when no layer
    slides (then every layer is global) or the config has no sliding window."""
    if not cfg.get("sliding_window"):
        return ()
    given = cfg.get("layer_types")
    n = cfg["num_hidden_layers"]
    kinds = [HF_LAYER_TYPES.get(t) for t in given] if given else \
        ["sliding" if default(i) else "global" for i in range(n)]
    if None in kinds or len(kinds) != n:
        raise UserError(f"{name}: layer_types {given} not understood (sliding_attention or "
                        f"full_attention per layer, {n} layers)")
    return tuple(kinds) if "sliding" in kinds else ()


def hf_layer_types(c) -> list | None:
    """`layer_types` the other way, for a config.json."""
    inverse = {v: k for k, v in HF_LAYER_TYPES.items()}
    return [inverse[t] for t in c.layer_types] if c.layer_types else None
