"""Model configurations: the registry of known shapes, HF `config.json` parsing, and size formulas.

A `ModelConfig` is everything the white-box models need to know about an architecture. The
parameter list (`param_shapes`) in HF naming is the single source of truth for what weights a
model has: dummy weights, loaders, the converter and the size formulas all read it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace

import torch

from flexevict.core.families import MODEL_TYPES, family_of
from flexevict.errors import UserError

# the kinds the planner calibrates: every family is timed as one of them (Family.calibrated_as)
ARCHS = ("opt", "llama")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def default_dtype(device) -> str:
    """The dtype a run computes in unless told: float32 on a CPU (fp16 matmuls there are slow
    and lose precision), float16 on a GPU (FlexGen's and the papers' setting)."""
    return "float32" if torch.device(device).type == "cpu" else "float16"

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class ModelConfig:
    arch: str                      # the model family: a key of families.FAMILIES
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_size: int
    max_positions: int
    norm_eps: float = 1e-5
    # LLaMA families
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    attention_bias: bool = False   # q/k/v and o projections
    qkv_bias: bool = False         # q/k/v only (Qwen2)
    mlp_bias: bool = False
    head_dim: int | None = None    # None: hidden_size // num_heads
    # per-layer attention (Mistral, Gemma-3): a sliding layer attends its last `sliding_window`
    # tokens (the new one included); layer_types: "sliding" or "global" per layer, () = every
    # layer global; rope_local_theta: the sliding layers' RoPE base (None: rope_theta)
    sliding_window: int | None = None
    layer_types: tuple = ()
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None   # logits scaled by its ** -0.5 (None: d)
    final_logit_softcap: float | None = None     # logits -> cap * tanh(logits / cap)
    # OPT family
    pre_layer_norm: bool = True    # False only for opt-350m (post-LN)
    word_embed_dim: int | None = None  # opt-350m projects 512 <-> 1024
    has_final_norm: bool = True
    enable_bias: bool = True
    # both
    tie_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple = ()
    pad_token_id: int | None = None
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def embed_dim(self) -> int:
        return self.word_embed_dim or self.hidden_size

    def layer_window(self, j: int) -> int | None:
        """Layer j's attention window in tokens (the new one included), or None (global)."""
        if self.sliding_window and self.layer_types and self.layer_types[j] == "sliding":
            return self.sliding_window
        return None

    @property
    def family(self):
        """The family that runs this model (`families.Family`)."""
        return family_of(self)

    # ---------------------------------------------------------------- parameters
    def layer_param_shapes(self, j: int) -> dict[str, tuple]:
        """HF names and shapes of layer j's parameters, in declaration order."""
        return self.family.layer_params(self, j)

    def outer_param_shapes(self) -> dict[str, tuple]:
        """Embeddings, final norm and LM head (everything outside the layers)."""
        return self.family.outer_params(self)

    def param_shapes(self) -> dict[str, tuple]:
        shapes = self.outer_param_shapes()
        for j in range(self.num_layers):
            shapes.update(self.layer_param_shapes(j))
        return shapes

    def param_shapes_cached(self) -> dict[str, tuple]:
        """`param_shapes()`, computed once per config (configs are immutable)."""
        if "_shapes" not in self.extra:
            self.extra["_shapes"] = self.param_shapes()
        return self.extra["_shapes"]

    # ---------------------------------------------------------------- size formulas
    def num_params(self) -> int:
        total = 0
        for shape in self.param_shapes().values():
            n = 1
            for s in shape:
                n *= s
            total += n
        return total

    def weight_bytes(self, dtype: str = "float16") -> int:
        return self.num_params() * DTYPE_BYTES[dtype]

    def kv_bytes_per_token(self, dtype: str = "float16") -> int:
        """K and V of one token over all layers (one sequence)."""
        return 2 * self.num_layers * self.num_kv_heads * self.dim_head * DTYPE_BYTES[dtype]

    def cache_bytes(self, batch: int, seq_len: int, dtype: str = "float16") -> int:
        return batch * seq_len * self.kv_bytes_per_token(dtype)

    def hidden_bytes(self, batch: int, seq_len: int, dtype: str = "float16") -> int:
        return batch * seq_len * self.hidden_size * DTYPE_BYTES[dtype]


# -------------------------------------------------------------------- registry

def _opt(name, h, layers, heads, ffn, **kw):
    return ModelConfig(arch="opt", name=name, vocab_size=50272, hidden_size=h, num_layers=layers,
                       num_heads=heads, num_kv_heads=heads, ffn_size=ffn, max_positions=2048,
                       bos_token_id=2, eos_token_ids=(2,), pad_token_id=1, **kw)


def _llama(name, h, layers, heads, kv_heads, ffn, **kw):
    kw.setdefault("vocab_size", 32000)
    kw.setdefault("max_positions", 4096)
    kw.setdefault("tie_embeddings", False)
    kw.setdefault("bos_token_id", 1)
    kw.setdefault("eos_token_ids", (2,))
    return ModelConfig(arch="llama", name=name, hidden_size=h, num_layers=layers, num_heads=heads,
                       num_kv_heads=kv_heads, ffn_size=ffn, **kw)


def _gemma3(name, h, layers, heads, kv_heads, ffn, window, **kw):
    """Gemma-3 text models: head_dim 256, every 6th layer global, RoPE bases 1M and 10k."""
    kinds = tuple("global" if (j + 1) % 6 == 0 else "sliding" for j in range(layers))
    return ModelConfig(arch="gemma3", name=name, vocab_size=262144, hidden_size=h,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, ffn_size=ffn,
                       max_positions=32768, norm_eps=1e-6, rope_theta=1e6, head_dim=256,
                       sliding_window=window, layer_types=kinds, rope_local_theta=1e4,
                       query_pre_attn_scalar=256, tie_embeddings=True, bos_token_id=2,
                       eos_token_ids=(1,), pad_token_id=0, **kw)


REGISTRY: dict[str, ModelConfig] = {c.name: c for c in [
    _opt("opt-125m", 768, 12, 12, 3072),
    _opt("opt-350m", 1024, 24, 16, 4096, pre_layer_norm=False, word_embed_dim=512,
         has_final_norm=False),
    _opt("opt-1.3b", 2048, 24, 32, 8192),
    _opt("opt-2.7b", 2560, 32, 32, 10240),
    _opt("opt-6.7b", 4096, 32, 32, 16384),
    _opt("opt-13b", 5120, 40, 40, 20480),
    _opt("opt-30b", 7168, 48, 56, 28672),
    _opt("opt-66b", 9216, 64, 72, 36864),
    _opt("opt-175b", 12288, 96, 96, 49152),
    _llama("llama-2-7b", 4096, 32, 32, 32, 11008),
    _llama("llama-2-13b", 5120, 40, 40, 40, 13824),
    _llama("llama-2-70b", 8192, 80, 64, 8, 28672),
    _llama("llama-3-8b", 4096, 32, 32, 8, 14336, vocab_size=128256, max_positions=8192,
           rope_theta=500000.0, bos_token_id=128000, eos_token_ids=(128001,)),
    _llama("llama-3-70b", 8192, 80, 64, 8, 28672, vocab_size=128256, max_positions=8192,
           rope_theta=500000.0, bos_token_id=128000, eos_token_ids=(128001,)),
    _llama("smollm2-135m", 576, 30, 9, 3, 1536, vocab_size=49152, max_positions=8192,
           rope_theta=100000.0, tie_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
           pad_token_id=2),
    _gemma3("gemma3-270m", 640, 18, 4, 1, 2048, 512),
]}


def known_names() -> str:
    return ", ".join(REGISTRY)


def registry_config(name: str) -> ModelConfig:
    key = name.lower().split("/")[-1]     # accept "facebook/opt-30b" like FlexGen
    if key not in REGISTRY:
        raise UserError(f"unknown model '{name}'; known models: {known_names()} "
                        "(or a path to an HF folder with config.json, or a .gguf file)")
    return REGISTRY[key]


def from_hf_dict(cfg: dict, name: str = "hf") -> ModelConfig:
    """Build a ModelConfig from an HF `config.json` dictionary (its model_type read by the
    family that implements it)."""
    mtype = cfg.get("model_type", "")
    if mtype not in MODEL_TYPES:
        raise UserError(f"{name}: model_type '{mtype}' is not supported ({', '.join(MODEL_TYPES)})")
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    common = dict(name=name, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                  num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
                  bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids,
                  pad_token_id=cfg.get("pad_token_id"))
    return ModelConfig(**common, **MODEL_TYPES[mtype].from_hf(cfg, name))


def to_hf_dict(c: ModelConfig) -> dict:
    """The inverse of `from_hf_dict`: an HF `config.json` for this config."""
    common = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                  num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                  max_position_embeddings=c.max_positions, bos_token_id=c.bos_token_id,
                  eos_token_id=list(c.eos_token_ids) if len(c.eos_token_ids) > 1 else
                  (c.eos_token_ids[0] if c.eos_token_ids else None),
                  pad_token_id=c.pad_token_id, tie_word_embeddings=c.tie_embeddings)
    return {**c.family.to_hf(c), **common}


def load_hf_config(folder: str) -> ModelConfig:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise UserError(f"{folder}: no config.json (expected an HF-layout model folder)")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: cannot read config ({e}); re-download or re-convert the model")
    return from_hf_dict(cfg, name=os.path.basename(os.path.normpath(folder)))


def with_overrides(c: ModelConfig, **kw) -> ModelConfig:
    return replace(c, **kw)
