"""GGUF files (LLaMA and Gemma-3 architectures): config from metadata, dequantized tensors in
HF naming and conventions, and the tokenizer (io/gguf_tokenizer.py).

llama.cpp stores LLaMA's q/k projection rows permuted for its interleaved RoPE; `_unpermute`
restores the HF (rotate-half) order so the same white-box code runs GGUF and HF weights alike.
Gemma's RMSNorm scales by (1 + w) and HF checkpoints store w; llama.cpp's converter stores 1 + w,
so the loader subtracts the 1 again (`_gemma_norm`).
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from flexevict.core.config import ModelConfig
from flexevict.core.families.base import unless_default
from flexevict.core.families.gemma3 import PATTERN
from flexevict.errors import UserError

# GGUF tensor name -> HF name, per architecture (per layer names use `blk.{j}.`)
_PROJECTIONS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAMES = {
    "llama": {**_PROJECTIONS, "attn_norm": "input_layernorm",
              "ffn_norm": "post_attention_layernorm"},
    "gemma3": {**_PROJECTIONS, "attn_norm": "input_layernorm",
               "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
}
_OUTER_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


@functools.lru_cache(maxsize=4)
def _reader(path: str):
    import gguf
    try:
        return gguf.GGUFReader(path)
    except FileNotFoundError:
        raise UserError(f"{path}: GGUF file does not exist") from None
    except Exception as e:
        raise UserError(f"{path}: corrupt or unreadable GGUF file ({type(e).__name__}: {e}); "
                        "re-download it") from None


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(path: str) -> ModelConfig:
    r = _reader(path)
    arch = _field(r, "general.architecture")
    if arch not in _LAYER_NAMES:
        raise UserError(f"{path}: GGUF architecture '{arch}' is not supported "
                        f"({', '.join(_LAYER_NAMES)})")

    def key(name, default=None):
        return _field(r, f"{arch}.{name}", default)
    n_tokens = len(r.fields["tokenizer.ggml.tokens"].data)
    heads = int(key("attention.head_count"))
    tied = not any(t.name == "output.weight" for t in r.tensors)
    eos = _field(r, "tokenizer.ggml.eos_token_id")
    common = dict(
        name=str(_field(r, "general.name", "gguf")),
        vocab_size=int(key("vocab_size", n_tokens)), hidden_size=int(key("embedding_length")),
        num_layers=int(key("block_count")), num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        ffn_size=int(key("feed_forward_length")),
        max_positions=int(key("context_length", 4096)),
        # GGUF stores eps as float32; round-trip through it so we match HF's parsed value
        norm_eps=float(np.float32(key("attention.layer_norm_rms_epsilon", 1e-5))),
        tie_embeddings=tied, bos_token_id=_field(r, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(eos,) if eos is not None else (),
        pad_token_id=_field(r, "tokenizer.ggml.padding_token_id"))
    fields = _gemma3_fields(key, common, path) if arch == "gemma3" else \
        dict(arch="llama", rope_theta=float(key("rope.freq_base", 10000.0)))
    return ModelConfig(**common, **fields)


def _gemma3_fields(key, common: dict, path: str) -> dict:
    """What a Gemma-3 GGUF adds to the common fields. The file keeps the global RoPE base and
    the window; the rest is fixed for the architecture as llama.cpp and HF's Gemma3TextConfig
    have it: every 6th layer global, local RoPE base 10000, queries scaled by head_dim ** -0.5
    (hidden / heads for the 62-layer 27B, as its config.json says: 168)."""
    d, n = int(key("attention.key_length")), common["num_layers"]
    if int(key("attention.value_length", d)) != d:
        raise UserError(f"{path}: key and value head sizes differ; not a Gemma-3 file")
    scaling = key("rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        raise UserError(f"{path}: rope scaling '{scaling}' is not supported (linear)")
    window = key("attention.sliding_window")
    return dict(
        arch="gemma3", head_dim=unless_default(d, common["hidden_size"] // common["num_heads"]),
        sliding_window=window,
        layer_types=tuple("global" if (j + 1) % PATTERN == 0 else "sliding" for j in range(n))
        if window else (),
        rope_theta=float(key("rope.freq_base", 1e6)), rope_local_theta=10000.0,
        rope_scaling={"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
        if scaling == "linear" else None,
        query_pre_attn_scalar=common["hidden_size"] // common["num_heads"] if n == 62 else d,
        final_logit_softcap=key("final_logit_softcapping"))


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved pairs -> two halves per head)."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


class GGUFWeights:
    """Dequantizes one GGUF tensor at a time (the file is memory-mapped) to fp32."""

    def __init__(self, path: str, config: ModelConfig):
        self.path, self.config = path, config
        self.reader = _reader(path)
        names = _LAYER_NAMES[config.arch]
        self.tensors = {}
        for t in self.reader.tensors:
            if t.name in _OUTER_NAMES:
                self.tensors[_OUTER_NAMES[t.name]] = t
            elif t.name.startswith("blk."):
                _, j, kind, suffix = t.name.split(".", 3)
                if kind in names:
                    self.tensors[f"model.layers.{j}.{names[kind]}.{suffix}"] = t

    def load(self, name: str, device="cpu", dtype=torch.float32) -> torch.Tensor:
        import gguf
        t = self.tensors.get(name)
        if t is None:
            raise UserError(f"{self.path}: weight '{name}' is missing from the GGUF file")
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        except Exception as e:
            raise UserError(f"{self.path}: cannot decode tensor {t.name} ({e}); "
                            "re-download it") from None
        w = _gemma_norm(name, w) if self.config.arch == "gemma3" else self._unpermuted(name, w)
        want = self.config.param_shapes_cached()[name]
        if tuple(w.shape) != tuple(want):
            raise UserError(f"{self.path}: tensor {t.name} has shape {w.shape}, expected {want}")
        return torch.from_numpy(np.ascontiguousarray(w)).to(device=device, dtype=dtype)

    def _unpermuted(self, name: str, w: np.ndarray) -> np.ndarray:
        if name.endswith("q_proj.weight"):
            return _unpermute(w, self.config.num_heads)
        if name.endswith("k_proj.weight"):
            return _unpermute(w, self.config.num_kv_heads)
        return w

    def close(self):
        pass


def _gemma_norm(name: str, w: np.ndarray) -> np.ndarray:
    """A Gemma norm weight stored as 1 + w (every tensor named *norm.weight) -> w."""
    return w - np.float32(1) if name.endswith("norm.weight") else w


def gguf_tokenizer(path: str):
    """The `tokenizers.Tokenizer` embedded in the GGUF (io/gguf_tokenizer.py)."""
    from flexevict.io import gguf_tokenizer as tokenizers
    return tokenizers.gguf_tokenizer(_reader(path), _field, path)
