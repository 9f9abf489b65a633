"""Qwen3 (Qwen Team 2025, "Qwen3 Technical Report", section 2): LLaMA's block with an RMSNorm
over each head's queries and keys after their projection and before RoPE (QK-norm, replacing
Qwen2's q/k/v biases), and an explicit head dimension."""
from __future__ import annotations

from flexevict.core.families.llama import LLaMA
from flexevict.core.ops import rms_norm


class Qwen3(LLaMA):
    arch = "qwen3"
    model_types = ("qwen3",)
    attention_keys = LLaMA.attention_keys + ("q_norm", "k_norm")

    def extra_attention_params(self, c, prefix):
        return {prefix + "self_attn.q_norm.weight": (c.dim_head,),
                prefix + "self_attn.k_norm.weight": (c.dim_head,)}

    def extra_attention_recipe(self, parts):
        return {"q_norm": parts("self_attn.q_norm.weight"),
                "k_norm": parts("self_attn.k_norm.weight")}

    def query_key(self, c, w, q, k):
        d = c.dim_head
        q = rms_norm(q.unflatten(-1, (-1, d)), w["q_norm"], c.norm_eps).flatten(-2)
        k = rms_norm(k.unflatten(-1, (-1, d)), w["k_norm"], c.norm_eps).flatten(-2)
        return q, k

    def from_hf(self, cfg, name):
        return super().from_hf({**cfg, "model_type": "qwen3"}, name)

    def to_hf(self, c):
        return dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"],
                    **self._rope_and_sizes(c))
