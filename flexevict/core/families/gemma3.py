"""Gemma 3 (Gemma Team 2025, "Gemma 3 Technical Report", section 2, its text decoder): a
decoder of LLaMA's shape with RMSNorm both before and after each half of a block (the norm
weights stored as offsets from 1), QK-norm per head, a GeGLU MLP (tanh GELU), embeddings scaled
by sqrt(hidden), attention logits scaled by `query_pre_attn_scalar`, five sliding-window (local)
layers to one global layer, each kind with its own RoPE base (local 10k, global 1M, the global
one possibly scaled), and a final logit soft-cap when the config has one. HF `gemma3_text`
configs (the text-only models, Gemma-3-270M and 1B).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flexevict.core.families.base import hf_layer_types, layer_types, parts_of, unless_default
from flexevict.core.families.qwen3 import Qwen3
from flexevict.core.ops import linear
from flexevict.errors import UserError

FEEDFORWARD_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
PATTERN = 6            # without layer_types: every 6th layer is global (sliding_window_pattern)


def gemma_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with Gemma's weight convention: x (..., n) normalised and scaled by (1 + w) (n,),
    both in fp32, then cast back to x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + w.float())).to(x.dtype)


class Gemma3(Qwen3):
    arch = "gemma3"
    model_types = ("gemma3_text",)
    attention_keys = Qwen3.attention_keys + ("norm1_post",)

    # ---------------------------------------------------------------- parameters
    def layer_params(self, c, j):
        """Qwen3's (QK-norm) and the norms after each half."""
        p = f"model.layers.{j}."
        return {**super().layer_params(c, j),
                **{p + f"{n}.weight": (c.hidden_size,) for n in FEEDFORWARD_NORMS}}

    def extra_attention_recipe(self, parts):
        return {**super().extra_attention_recipe(parts),
                "norm1_post": parts("post_attention_layernorm.weight")}

    def layer_recipe(self, c, j):
        """The norm before the MLP is `pre_feedforward_layernorm` (LLaMA's norm2 is the
        post-attention one, here the attention half's), and one more after it."""
        parts = parts_of(c.layer_param_shapes(j), f"model.layers.{j}.")
        return {**super().layer_recipe(c, j),
                "norm2": parts("pre_feedforward_layernorm.weight"),
                "norm2_post": parts("post_feedforward_layernorm.weight")}

    # ---------------------------------------------------------------- compute
    def embed(self, c, o, tokens, inp):
        """Scaled by sqrt(hidden) rounded to the weights' dtype first, as Gemma's checkpoints
        were trained (in bf16, 55.4256 becomes 55.5)."""
        scale = float(torch.tensor(c.hidden_size ** 0.5, dtype=o["embed"].dtype))  # host only
        return F.embedding(tokens, o["embed"]) * scale

    def head(self, c, o, h):
        logits = linear(gemma_norm(h, o["norm_w"], c.norm_eps), o["lm_head"]).float()
        cap = c.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def attention_input(self, c, w, h):
        return gemma_norm(h, w["norm1"], c.norm_eps)

    def attention_output(self, c, w, h, attn):
        return h + gemma_norm(attn, w["norm1_post"], c.norm_eps)

    def query_key(self, c, w, q, k):
        d = c.dim_head
        q = gemma_norm(q.unflatten(-1, (-1, d)), w["q_norm"], c.norm_eps).flatten(-2)
        k = gemma_norm(k.unflatten(-1, (-1, d)), w["k_norm"], c.norm_eps).flatten(-2)
        return q, k

    def mlp_half(self, c, w, h):
        gate, up = linear(gemma_norm(h, w["norm2"], c.norm_eps), w["wgu"]).chunk(2, dim=-1)
        out = linear(F.gelu(gate, approximate="tanh") * up, w["wd"])
        return h + gemma_norm(out, w["norm2_post"], c.norm_eps)

    # ---------------------------------------------------------------- config.json
    def from_hf(self, cfg, name):
        self._check(cfg, name)
        rope = cfg.get("rope_parameters") or {}
        full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise UserError(f"{name}: scaled RoPE on sliding layers is not supported")
        scaling = cfg.get("rope_scaling") or (full if full.get("rope_type", "default")
                                              != "default" else None)
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
        kinds = layer_types(cfg, name, lambda i: (i + 1) % (pattern or PATTERN) != 0)
        return dict(arch=self.arch, layer_types=kinds,
                    sliding_window=cfg["sliding_window"] if kinds else None,
                    num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
                    ffn_size=cfg["intermediate_size"],
                    max_positions=cfg.get("max_position_embeddings", 131072),
                    norm_eps=cfg.get("rms_norm_eps", 1e-6),
                    rope_theta=float(full.get("rope_theta", cfg.get("rope_theta", 1e6))),
                    rope_local_theta=float(local.get("rope_theta",
                                                     cfg.get("rope_local_base_freq", 1e4))),
                    rope_scaling=scaling, attention_bias=cfg.get("attention_bias", False),
                    head_dim=unless_default(cfg.get("head_dim", 256),
                                            cfg["hidden_size"] // cfg["num_attention_heads"]),
                    query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256),
                    final_logit_softcap=cfg.get("final_logit_softcapping"),
                    tie_embeddings=cfg.get("tie_word_embeddings", True))

    @staticmethod
    def _check(cfg: dict, name: str) -> None:
        """Refuse what this module does not compute (transformers' Gemma-3 does not apply an
        attention soft-cap either; no released Gemma-3 sets one)."""
        if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise UserError(f"{name}: only tanh-GELU Gemma-3 models are supported")
        if cfg.get("use_bidirectional_attention"):
            raise UserError(f"{name}: bidirectional Gemma-3 (an encoder) is not a decoder")
        if cfg.get("attn_logit_softcapping") is not None:
            raise UserError(f"{name}: attention logit soft-capping is not supported")

    def to_hf(self, c):
        full = dict(c.rope_scaling or {"rope_type": "default"}, rope_theta=c.rope_theta)
        local = {"rope_type": "default", "rope_theta": c.rope_local_theta or c.rope_theta}
        return dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"],
                    num_key_value_heads=c.num_kv_heads, intermediate_size=c.ffn_size,
                    rms_norm_eps=c.norm_eps, head_dim=c.dim_head, attention_bias=c.attention_bias,
                    hidden_activation="gelu_pytorch_tanh",
                    query_pre_attn_scalar=c.query_pre_attn_scalar or c.dim_head,
                    final_logit_softcapping=c.final_logit_softcap,
                    sliding_window=c.sliding_window,
                    layer_types=hf_layer_types(c) or ["full_attention"] * c.num_layers,
                    rope_parameters={"full_attention": full, "sliding_attention": local})
