"""GGUF files (LLaMA architecture): config from metadata, dequantized tensors, and the tokenizer.

llama.cpp stores q/k projection rows permuted for its interleaved RoPE; `_unpermute` restores the
HF (rotate-half) order so the same white-box LLaMA code runs GGUF and HF weights alike.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from flexevict.core.config import ModelConfig
from flexevict.errors import UserError

# GGUF tensor name -> HF name (per layer names use `blk.{j}.`)
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
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
    if arch != "llama":
        raise UserError(f"{path}: GGUF architecture '{arch}' is not supported (llama only)")
    n_tokens = len(r.fields["tokenizer.ggml.tokens"].data)
    heads = int(_field(r, "llama.attention.head_count"))
    tied = not any(t.name == "output.weight" for t in r.tensors)
    eos = _field(r, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        arch="llama", name=str(_field(r, "general.name", "gguf")),
        vocab_size=int(_field(r, "llama.vocab_size", n_tokens)),
        hidden_size=int(_field(r, "llama.embedding_length")),
        num_layers=int(_field(r, "llama.block_count")), num_heads=heads,
        num_kv_heads=int(_field(r, "llama.attention.head_count_kv", heads)),
        ffn_size=int(_field(r, "llama.feed_forward_length")),
        max_positions=int(_field(r, "llama.context_length", 4096)),
        # GGUF stores eps as float32; round-trip through it so we match HF's parsed value
        norm_eps=float(np.float32(_field(r, "llama.attention.layer_norm_rms_epsilon", 1e-5))),
        rope_theta=float(_field(r, "llama.rope.freq_base", 10000.0)),
        tie_embeddings=tied, bos_token_id=_field(r, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(eos,) if eos is not None else (),
        pad_token_id=_field(r, "tokenizer.ggml.padding_token_id"))


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved pairs -> two halves per head)."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


class GGUFWeights:
    """Dequantizes one GGUF tensor at a time (the file is memory-mapped) to fp32."""

    def __init__(self, path: str, config: ModelConfig):
        self.path, self.config = path, config
        self.reader = _reader(path)
        self.tensors = {}
        for t in self.reader.tensors:
            if t.name in _OUTER_NAMES:
                self.tensors[_OUTER_NAMES[t.name]] = t
            elif t.name.startswith("blk."):
                _, j, kind, suffix = t.name.split(".", 3)
                if kind in _LAYER_NAMES:
                    self.tensors[f"model.layers.{j}.{_LAYER_NAMES[kind]}.{suffix}"] = t

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
        if name.endswith("q_proj.weight"):
            w = _unpermute(w, self.config.num_heads)
        elif name.endswith("k_proj.weight"):
            w = _unpermute(w, self.config.num_kv_heads)
        want = self.config.param_shapes_cached()[name]
        if tuple(w.shape) != tuple(want):
            raise UserError(f"{self.path}: tensor {t.name} has shape {w.shape}, expected {want}")
        return torch.from_numpy(np.ascontiguousarray(w)).to(device=device, dtype=dtype)

    def close(self):
        pass


def gguf_tokenizer(path: str):
    """A `tokenizers.Tokenizer` built from the GGUF's embedded GPT-2-style BPE vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    r = _reader(path)
    if _field(r, "tokenizer.ggml.model") != "gpt2":
        raise UserError(f"{path}: only GPT-2-style BPE tokenizers are supported in GGUF files")
    tokens = _field(r, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(r, "tokenizer.ggml.merges")]
    types = _field(r, "tokenizer.ggml.token_type")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    # token_type 3 = control tokens (<|im_start|> etc.): never split, skipped when decoding
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, ty in enumerate(types) if ty == 3])
    return tok
