"""The model registry: shapes, sizes, HF config round trips and the packaged GGUF's metadata."""
from dataclasses import fields, replace

import pytest

from flexevict.core.config import (REGISTRY, ModelConfig, from_hf_dict, registry_config,
                              to_hf_dict)
from flexevict.errors import UserError
from flexevict.io.weights import DummyWeights

# published parameter counts
KNOWN_SIZES = {
    "opt-125m": 125e6, "opt-1.3b": 1.3e9, "opt-6.7b": 6.7e9, "opt-30b": 30e9, "opt-175b": 175e9,
    "llama-2-7b": 6.74e9, "llama-2-70b": 69e9, "llama-3-8b": 8.03e9,
    "smollm2-135m": 134_515_008,            # general.parameter count in the packaged GGUF
    "gemma3-270m": 268_098_176,             # transformers' Gemma3ForCausalLM of its config
}


@pytest.mark.parametrize("name", list(REGISTRY))
def test_registry_builds(name):
    c = registry_config(name)
    assert c.name == name and isinstance(c, ModelConfig)
    shapes = c.param_shapes()
    assert c.num_params() == sum(_numel(s) for s in shapes.values()) > 0
    assert c.num_heads % c.num_kv_heads == 0
    assert c.num_heads * c.dim_head == c.hidden_size or c.head_dim is not None   # Gemma: 256
    # every layer has the same parameter shapes, renamed
    first = {k.replace(".0.", ".J."): v for k, v in c.layer_param_shapes(0).items()}
    last = {k.replace(f".{c.num_layers - 1}.", ".J."): v
            for k, v in c.layer_param_shapes(c.num_layers - 1).items()}
    assert first == last
    assert c.weight_bytes("float16") == 2 * c.num_params()
    assert c.weight_bytes("float32") == 4 * c.num_params()


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


@pytest.mark.parametrize("name,size", list(KNOWN_SIZES.items()))
def test_param_counts(name, size):
    n = registry_config(name).num_params()
    assert abs(n - size) / size <= 0.02, f"{name}: {n:,} parameters, expected ~{size:,.0f}"


def test_smallest_exact_counts():
    # HF's OPTForCausalLM(facebook/opt-125m) and the GGUF metadata of SmolLM2-135M
    assert registry_config("opt-125m").num_params() == 125_239_296
    assert registry_config("smollm2-135m").num_params() == 134_515_008


def test_kv_bytes_per_token():
    c = registry_config("opt-30b")
    assert c.kv_bytes_per_token("float16") == 2 * 48 * 7168 * 2
    assert c.kv_bytes_per_token("float32") == 2 * 48 * 7168 * 4
    g = registry_config("llama-2-70b")                 # GQA: only the 8 kv heads are cached
    assert g.kv_bytes_per_token() == 2 * 80 * 8 * 128 * 2
    s = registry_config("smollm2-135m")
    assert s.kv_bytes_per_token("float32") == 2 * 30 * 3 * 64 * 4
    assert c.cache_bytes(4, 100) == 4 * 100 * c.kv_bytes_per_token()
    assert c.hidden_bytes(4, 100) == 4 * 100 * 7168 * 2


def test_unknown_name():
    with pytest.raises(UserError) as e:
        registry_config("nope")
    msg = str(e.value)
    assert "nope" in msg
    for name in REGISTRY:
        assert name in msg


def test_hf_style_names():
    assert registry_config("facebook/opt-30b") is REGISTRY["opt-30b"]
    assert registry_config("OPT-1.3B") is REGISTRY["opt-1.3b"]


def _semantic(c: ModelConfig) -> dict:
    """Fields with defaults resolved (head_dim None == hidden/heads, etc.)."""
    d = {f.name: getattr(c, f.name) for f in fields(c) if f.compare and f.name != "name"}
    d["head_dim"], d["word_embed_dim"] = c.dim_head, c.embed_dim
    return d


@pytest.mark.parametrize("name", list(REGISTRY))
def test_hf_dict_round_trip_semantic(name):
    c = REGISTRY[name]
    back = from_hf_dict(to_hf_dict(c), name=name)
    assert _semantic(back) == _semantic(c)
    assert back.param_shapes() == c.param_shapes()


def test_hf_dict_round_trip_exact():
    """`to_hf_dict` is documented as the inverse of `from_hf_dict`: for every registry config,
    `from_hf_dict(to_hf_dict(c)) == c` (ignoring the name)."""
    mismatches = {}
    for name, c in REGISTRY.items():
        back = replace(from_hf_dict(to_hf_dict(c), name=name), name=c.name)
        if back != c:
            mismatches[name] = {f.name: (getattr(back, f.name), getattr(c, f.name))
                                for f in fields(c)
                                if f.compare and getattr(back, f.name) != getattr(c, f.name)}
    assert not mismatches, f"round trip changes (got, registry): {mismatches}"


def test_hf_dict_round_trip_through_transformers():
    """HF's own config classes read what `to_hf_dict` writes, and the engine reads HF's output."""
    from transformers import LlamaConfig, OPTConfig
    for name, cls in (("opt-350m", OPTConfig), ("opt-1.3b", OPTConfig),
                      ("llama-3-8b", LlamaConfig), ("smollm2-135m", LlamaConfig)):
        c = REGISTRY[name]
        d = to_hf_dict(c)
        hf = cls(**{k: v for k, v in d.items() if k not in ("model_type", "architectures")})
        back = from_hf_dict(hf.to_dict(), name=name)
        assert _semantic(back) == _semantic(c), name


def test_from_hf_dict_rejects_unsupported():
    with pytest.raises(UserError):
        from_hf_dict({"model_type": "gpt2", "vocab_size": 10, "hidden_size": 8,
                      "num_hidden_layers": 1, "num_attention_heads": 2})
    d = to_hf_dict(REGISTRY["opt-125m"])
    d["activation_function"] = "gelu"
    with pytest.raises(UserError):
        from_hf_dict(d)


def test_dummy_weights_cover_param_shapes():
    c = REGISTRY["opt-350m"]
    src = DummyWeights(c, 0)
    for n, shape in list(c.param_shapes().items())[:12]:
        assert tuple(src.load(n).shape) == shape


def test_gguf_config_matches_registry(smollm2_path):
    from flexevict.io.gguf_io import gguf_config
    g, r = gguf_config(smollm2_path), REGISTRY["smollm2-135m"]
    assert g.param_shapes() == r.param_shapes()
    assert g.num_params() == 134_515_008
    for f in ("arch", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
              "ffn_size", "max_positions", "rope_theta", "tie_embeddings", "dim_head",
              "bos_token_id", "eos_token_ids", "pad_token_id"):
        assert getattr(g, f) == getattr(r, f), f
    assert g.norm_eps == pytest.approx(r.norm_eps, rel=1e-6)
    assert g.rope_scaling is None
