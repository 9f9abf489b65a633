"""LLaMA (Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language Models") and the
families that only vary it: RMSNorm before each half, RoPE, SwiGLU MLP, no biases, an untied
head; Mistral (a sliding window on every layer) and Qwen2 (q/k/v biases, a sliding window on its
upper layers when `use_sliding_window`)."""
from __future__ import annotations

import torch.nn.functional as F

from flexevict.core.families.base import (Family, fused_qkv, hf_layer_types, layer_types,
                                           parts_of, unless_default)
from flexevict.core.ops import linear, rms_norm
from flexevict.errors import UserError


class LLaMA(Family):
    arch = "llama"
    model_types = ("llama", "mistral", "qwen2")
    attention_keys = ("wqkv", "bqkv", "wo", "bo", "norm1")

    def layer_params(self, c, j):
        h, f, d = c.hidden_size, c.ffn_size, c.dim_head
        q_out, kv_out = c.num_heads * d, c.num_kv_heads * d
        p = f"model.layers.{j}."
        shapes = {p + "input_layernorm.weight": (h,)}
        for name, out in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            shapes[p + f"self_attn.{name}.weight"] = (out, h)
            if c.attention_bias or c.qkv_bias:
                shapes[p + f"self_attn.{name}.bias"] = (out,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        if c.attention_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        shapes.update(self.extra_attention_params(c, p))
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for name, shape in (("gate_proj", (f, h)), ("up_proj", (f, h)), ("down_proj", (h, f))):
            shapes[p + f"mlp.{name}.weight"] = shape
            if c.mlp_bias:
                shapes[p + f"mlp.{name}.bias"] = (shape[0],)
        return shapes

    def extra_attention_params(self, c, prefix: str) -> dict:
        """Parameters a variant adds to the attention (Qwen3's q/k norms); none here."""
        return {}

    def outer_params(self, c):
        h, v = c.hidden_size, c.vocab_size
        shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
        if not c.tie_embeddings:
            shapes["lm_head.weight"] = (v, h)
        return shapes

    def layer_recipe(self, c, j):
        parts = parts_of(c.layer_param_shapes(j), f"model.layers.{j}.")
        a = "self_attn."
        r = fused_qkv(parts, a)
        r.update(wo=parts(a + "o_proj.weight"), bo=parts(a + "o_proj.bias"),
                 norm1=parts("input_layernorm.weight"))
        r.update(self.extra_attention_recipe(parts))
        r.update(norm2=parts("post_attention_layernorm.weight"),
                 wgu=parts("mlp.gate_proj.weight", "mlp.up_proj.weight"))
        bgu = parts("mlp.gate_proj.bias", "mlp.up_proj.bias")
        if bgu:
            r["bgu"] = bgu
        r.update(wd=parts("mlp.down_proj.weight"), bd=parts("mlp.down_proj.bias"))
        return r

    def extra_attention_recipe(self, parts) -> dict:
        return {}

    def outer_weights(self, c, raw):
        w = {"embed": raw["model.embed_tokens.weight"], "norm_w": raw["model.norm.weight"]}
        w["lm_head"] = raw.get("lm_head.weight", w["embed"])
        return w

    def embed(self, c, o, tokens, inp):
        return F.embedding(tokens, o["embed"])

    def head(self, c, o, h):
        return linear(rms_norm(h, o["norm_w"], c.norm_eps), o["lm_head"]).float()

    def attention_input(self, c, w, h):
        return rms_norm(h, w["norm1"], c.norm_eps)

    def mlp_half(self, c, w, h):
        x = rms_norm(h, w["norm2"], c.norm_eps)
        gate, up = linear(x, w["wgu"], w.get("bgu")).chunk(2, dim=-1)
        return h + linear(F.silu(gate) * up, w["wd"], w["bd"])

    def from_hf(self, cfg, name):
        mtype = cfg.get("model_type", "")
        if cfg.get("hidden_act", "silu") != "silu":
            raise UserError(f"{name}: only SiLU (SwiGLU) LLaMA models are supported")
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 1e4)
        max_pos = cfg.get("max_position_embeddings", 4096)
        kinds = self._layer_types(cfg, name)
        return dict(arch=self.arch, layer_types=kinds,
                    sliding_window=cfg["sliding_window"] if kinds else None,
                    num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
                    ffn_size=cfg["intermediate_size"], max_positions=max_pos,
                    norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
                    rope_scaling=scaling, attention_bias=cfg.get("attention_bias", False),
                    qkv_bias=mtype == "qwen2", mlp_bias=cfg.get("mlp_bias", False),
                    head_dim=unless_default(cfg.get("head_dim"),
                                            cfg["hidden_size"] // cfg["num_attention_heads"]),
                    tie_embeddings=cfg.get("tie_word_embeddings", False))

    def _layer_types(self, cfg: dict, name: str) -> tuple:
        """Mistral's window slides on every layer; Qwen2's (when `use_sliding_window`) on the
        layers from `max_window_layers` on, unless the config lists its `layer_types`."""
        if cfg.get("model_type") != "mistral" and not cfg.get("use_sliding_window"):
            return ()
        first = cfg.get("max_window_layers", 0) if cfg.get("model_type") != "mistral" else 0
        return layer_types(cfg, name, lambda i: i >= first)

    def to_hf(self, c):
        qwen = c.qkv_bias and not c.attention_bias     # q/k/v-only biases are Qwen2's layout
        kind = "qwen2" if qwen else ("mistral" if c.layer_types else "llama")
        name = {"qwen2": "Qwen2", "mistral": "Mistral", "llama": "Llama"}[kind]
        return dict(model_type=kind, architectures=[f"{name}ForCausalLM"],
                    **self._rope_and_sizes(c))

    def _rope_and_sizes(self, c) -> dict:
        window = dict(sliding_window=c.sliding_window, layer_types=hf_layer_types(c),
                      use_sliding_window=True) if c.layer_types else {}
        return dict(**window, num_key_value_heads=c.num_kv_heads, intermediate_size=c.ffn_size,
                    rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta, rope_scaling=c.rope_scaling,
                    attention_bias=c.attention_bias, mlp_bias=c.mlp_bias, head_dim=c.dim_head,
                    hidden_act="silu")
