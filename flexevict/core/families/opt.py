"""OPT (Zhang et al. 2022, "OPT: Open Pre-trained Transformer Language Models"): learned
positions (offset 2), LayerNorm before each half (after, for opt-350m), ReLU MLP, biases, a
tied head; opt-350m projects its 512-wide embeddings in and out."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flexevict.core.families.base import Family, fused_qkv, parts_of, unless_default
from flexevict.core.ops import linear
from flexevict.errors import UserError

POSITION_OFFSET = 2             # OPT's learned positions start at index 2


class OPT(Family):
    arch = "opt"
    model_types = ("opt",)
    attention_keys = ("wqkv", "bqkv", "wo", "bo", "ln1_w", "ln1_b")
    uses_rope = False
    calibrated_as = "opt"

    def layer_params(self, c, j):
        h, f, d = c.hidden_size, c.ffn_size, c.dim_head
        q_out, kv_out = c.num_heads * d, c.num_kv_heads * d
        p = f"model.decoder.layers.{j}."
        shapes = {}
        for name, out in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            shapes[p + f"self_attn.{name}.weight"] = (out, h)
            if c.enable_bias:
                shapes[p + f"self_attn.{name}.bias"] = (out,)
        shapes[p + "self_attn.out_proj.weight"] = (h, q_out)
        shapes[p + "fc1.weight"] = (f, h)
        shapes[p + "fc2.weight"] = (h, f)
        if c.enable_bias:
            shapes[p + "self_attn.out_proj.bias"] = (h,)
            shapes[p + "fc1.bias"] = (f,)
            shapes[p + "fc2.bias"] = (h,)
        for ln in ("self_attn_layer_norm", "final_layer_norm"):
            shapes[p + f"{ln}.weight"] = (h,)
            shapes[p + f"{ln}.bias"] = (h,)
        return shapes

    def outer_params(self, c):
        h, v = c.hidden_size, c.vocab_size
        p = "model.decoder."
        shapes = {p + "embed_tokens.weight": (v, c.embed_dim),
                  p + "embed_positions.weight": (c.max_positions + POSITION_OFFSET, h)}
        if c.embed_dim != h:
            shapes[p + "project_in.weight"] = (h, c.embed_dim)
            shapes[p + "project_out.weight"] = (c.embed_dim, h)
        if c.has_final_norm:
            shapes[p + "final_layer_norm.weight"] = (h,)
            shapes[p + "final_layer_norm.bias"] = (h,)
        if not c.tie_embeddings:
            shapes["lm_head.weight"] = (v, c.embed_dim)
        return shapes

    def layer_recipe(self, c, j):
        parts = parts_of(c.layer_param_shapes(j), f"model.decoder.layers.{j}.")
        a = "self_attn."
        r = fused_qkv(parts, a)
        r.update(wo=parts(a + "out_proj.weight"), bo=parts(a + "out_proj.bias"),
                 ln1_w=parts("self_attn_layer_norm.weight"),
                 ln1_b=parts("self_attn_layer_norm.bias"),
                 ln2_w=parts("final_layer_norm.weight"), ln2_b=parts("final_layer_norm.bias"),
                 w1=parts("fc1.weight"), b1=parts("fc1.bias"),
                 w2=parts("fc2.weight"), b2=parts("fc2.bias"))
        return r

    def outer_weights(self, c, raw):
        p = "model.decoder."
        w = {"embed": raw[p + "embed_tokens.weight"],
             "pos_embed": raw[p + "embed_positions.weight"],
             "proj_in": raw.get(p + "project_in.weight"),
             "proj_out": raw.get(p + "project_out.weight"),
             "norm_w": raw.get(p + "final_layer_norm.weight"),
             "norm_b": raw.get(p + "final_layer_norm.bias")}
        w["lm_head"] = raw.get("lm_head.weight", w["embed"])
        return w

    def embed(self, c, o, tokens, inp):
        h = F.embedding(tokens, o["embed"])
        if o.get("proj_in") is not None:
            h = linear(h, o["proj_in"])
        pos = inp.pos if inp.valid is None else torch.where(inp.valid, inp.pos, -1)
        return h + F.embedding(pos + POSITION_OFFSET, o["pos_embed"])

    def head(self, c, o, h):
        if o.get("norm_w") is not None:
            h = F.layer_norm(h, (c.hidden_size,), o["norm_w"], o.get("norm_b"), c.norm_eps)
        if o.get("proj_out") is not None:
            h = linear(h, o["proj_out"])
        return linear(h, o["lm_head"]).float()

    def attention_input(self, c, w, h):
        if not c.pre_layer_norm:
            return h
        return F.layer_norm(h, (c.hidden_size,), w["ln1_w"], w["ln1_b"], c.norm_eps)

    def attention_output(self, c, w, h, attn):
        h = h + attn
        if not c.pre_layer_norm:          # opt-350m: LayerNorm after the residual
            h = F.layer_norm(h, (c.hidden_size,), w["ln1_w"], w["ln1_b"], c.norm_eps)
        return h

    def mlp_half(self, c, w, h):
        x = F.layer_norm(h, (c.hidden_size,), w["ln2_w"], w["ln2_b"], c.norm_eps) \
            if c.pre_layer_norm else h
        h = h + linear(torch.relu(linear(x, w["w1"], w["b1"])), w["w2"], w["b2"])
        if not c.pre_layer_norm:
            h = F.layer_norm(h, (c.hidden_size,), w["ln2_w"], w["ln2_b"], c.norm_eps)
        return h

    def from_hf(self, cfg, name):
        if cfg.get("activation_function", "relu") != "relu":
            raise UserError(f"{name}: only ReLU OPT models are supported")
        pre = cfg.get("do_layer_norm_before", True)
        return dict(arch=self.arch, num_kv_heads=cfg["num_attention_heads"],
                    ffn_size=cfg["ffn_dim"], max_positions=cfg["max_position_embeddings"],
                    pre_layer_norm=pre,
                    word_embed_dim=unless_default(cfg.get("word_embed_proj_dim"),
                                                  cfg["hidden_size"]),
                    has_final_norm=pre and not cfg.get("_remove_final_layer_norm", False),
                    enable_bias=cfg.get("enable_bias", True),
                    tie_embeddings=cfg.get("tie_word_embeddings", True))

    def to_hf(self, c):
        return dict(model_type="opt", architectures=["OPTForCausalLM"], ffn_dim=c.ffn_size,
                    do_layer_norm_before=c.pre_layer_norm, word_embed_proj_dim=c.embed_dim,
                    activation_function="relu", enable_bias=c.enable_bias,
                    _remove_final_layer_norm=c.pre_layer_norm and not c.has_final_norm)
