"""The white-box OPT / LLaMA models reproduce transformers' logits on random-weight configs.

Prefill logits at every position and 16 greedy decode steps (fed HF's argmax token to both
sides) must agree to 1e-4 in fp32. Weights go through `save_pretrained` -> the engine's own
config parsing and weight loading, so those are under test too.
"""
import json
import os
import shutil

import pytest
import torch

import flexevict.api
import flexevict.errors
import flexevict.core.model
import flexevict.policies
import flexevict.io.weights
from flexevict.runtime.engine import Engine
from flexevict.runtime.placement import Placement
from tiny import engine_logits

ATOL = 1e-4
DECODE_STEPS = 16


def _opt(**kw):
    from transformers import OPTConfig
    base = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, ffn_dim=128,
                num_attention_heads=4, max_position_embeddings=128, word_embed_proj_dim=64,
                do_layer_norm_before=True, enable_bias=True, dropout=0.0,
                attention_dropout=0.0, bos_token_id=2, eos_token_id=2, pad_token_id=1)
    base.update(kw)
    return OPTConfig(**base)


def _llama(**kw):
    from transformers import LlamaConfig
    base = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, intermediate_size=128, max_position_embeddings=256,
                rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    base.update(kw)
    return LlamaConfig(**base)


def _qwen2(**kw):
    from transformers import Qwen2Config
    base = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                tie_word_embeddings=False)
    base.update(kw)
    return Qwen2Config(**base)


def _mistral(**kw):
    from transformers import MistralConfig
    base = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                sliding_window=None)
    base.update(kw)
    return MistralConfig(**base)


def _qwen3(**kw):
    from transformers import Qwen3Config
    base = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, intermediate_size=128,
                max_position_embeddings=256, tie_word_embeddings=True, rms_norm_eps=1e-6)
    base.update(kw)
    return Qwen3Config(**base)


def _gemma3(**kw):
    """Gemma-3's text model: 5 sliding layers to 1 global by default, a window of 8 (the tests'
    prompts are longer), attention scaled by query_pre_attn_scalar, a final logit soft-cap."""
    from transformers import Gemma3TextConfig
    base = dict(vocab_size=96, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, intermediate_size=128,
                max_position_embeddings=256, sliding_window=8, query_pre_attn_scalar=24,
                final_logit_softcapping=30.0, rope_theta=1e6, rope_local_base_freq=1e4)
    base.update(kw)
    return Gemma3TextConfig(**base)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

CONFIGS = {
    "opt-preln-bias": lambda: _opt(),
    "opt-350m-style": lambda: _opt(do_layer_norm_before=False, word_embed_proj_dim=32),
    "opt-no-bias": lambda: _opt(enable_bias=False),
    "llama-mha-untied": lambda: _llama(),
    "llama-gqa-tied": lambda: _llama(num_attention_heads=8, num_key_value_heads=2,
                                     tie_word_embeddings=True),
    "llama-biases": lambda: _llama(attention_bias=True, mlp_bias=True, num_key_value_heads=2),
    "llama3-rope-scaling": lambda: _llama(rope_parameters=dict(LLAMA3_ROPE, rope_theta=50000.0),
                                          num_key_value_heads=2),
    "llama-head-dim": lambda: _llama(head_dim=32, num_key_value_heads=2),   # H*d != hidden
    # from_hf_dict also accepts these LLaMA-family model types
    "mistral": lambda: _mistral(),
    "qwen2": lambda: _qwen2(),           # q/k/v biases, no o_proj bias
    "qwen3": lambda: _qwen3(),           # QK-norm per head, H*d != hidden, tied head
    "gemma3": lambda: _gemma3(),         # local/global layers and RoPE bases, soft-cap, tied
    # every other layer global, its RoPE scaled; biases, an untied head, no soft-cap
    "gemma3-scaled": lambda: _gemma3(num_hidden_layers=4, sliding_window_pattern=2,
                                     rope_scaling={"rope_type": "linear", "factor": 4.0},
                                     attention_bias=True, tie_word_embeddings=False,
                                     final_logit_softcapping=None),
}


def load_engine(folder):
    """The model as every command loads it: an Engine under the default placement."""
    cfg, path = flexevict.api.resolve_model(folder)
    src = flexevict.io.weights.open_weights(path, cfg)
    try:
        return Engine.load(cfg, src, Placement(), "cpu", torch.float32)
    finally:
        src.close()


def prompts_for(batch, length, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=gen).tolist()


def engine_run(model, prompts, decode_tokens):
    """Prefill logits (B, S, V) and one (B, V) logits per token fed in decode_tokens, through
    the engine (the path every command runs)."""
    return engine_logits(model, prompts, decode_tokens, flexevict.policies.get_policy("full"))


@torch.inference_mode()
def hf_run(hf, prompts, n_steps):
    """HF prefill logits, then n_steps greedy steps with its KV cache; the fed tokens."""
    ids = torch.tensor(prompts)
    out = hf(input_ids=ids, use_cache=True)
    prefill = out.logits.float()
    past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1)
    fed, steps = [], []
    for _ in range(n_steps):
        fed.append(nxt)
        out = hf(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
        past = out.past_key_values
        steps.append(out.logits[:, -1].float())
        nxt = steps[-1].argmax(-1)
    return prefill, fed, steps


def assert_logits_match(hf, model, prompts):
    hf_pre, fed, hf_steps = hf_run(hf, prompts, DECODE_STEPS)
    en_pre, en_steps = engine_run(model, prompts, fed)
    assert en_pre.shape == hf_pre.shape
    # the comparison means something only if logits are not all ~0
    assert hf_pre.std() > 0.1
    diff = (en_pre - hf_pre).abs().max().item()
    assert diff <= ATOL, f"prefill logits differ by {diff}"
    for i, (a, b) in enumerate(zip(en_steps, hf_steps)):
        d = (a - b).abs().max().item()
        assert d <= ATOL, f"decode step {i} logits differ by {d}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_hf(name, hf_model_factory):
    hf, folder = hf_model_factory(CONFIGS[name](), name, seed=len(name))
    model = load_engine(folder)
    vocab = model.config.vocab_size
    assert_logits_match(hf, model, prompts_for(1, 13, vocab, seed=1))
    assert_logits_match(hf, model, prompts_for(2, 9, vocab, seed=2))


@pytest.mark.parametrize("name,config", [
    ("mistral-swa", lambda: _mistral(sliding_window=8)),
    ("qwen2-swa", lambda: _qwen2(sliding_window=8, use_sliding_window=True, max_window_layers=1,
                                 num_hidden_layers=3)),        # the upper two layers slide
    ("gemma3", CONFIGS["gemma3"])])
def test_sliding_window_shorter_than_the_prompt(name, config, hf_model_factory):
    """A window (8) shorter than the prompt (24), and than the run: windowed prefill attention,
    then each sliding layer's ring of its last 8 tokens, as transformers attends them."""
    hf, folder = hf_model_factory(config(), name)
    model = load_engine(folder)
    assert "sliding" in model.config.layer_types and model.config.sliding_window == 8
    assert model.config.max_positions == 256            # the window no longer caps the length
    vocab = model.config.vocab_size
    assert_logits_match(hf, model, prompts_for(1, 24, vocab, seed=1))
    assert_logits_match(hf, model, prompts_for(2, 21, vocab, seed=2))


def test_engine_config_reads_saved_hf_config(hf_model_factory):
    """What transformers 5 `save_pretrained` writes (rope_parameters) is what the engine uses."""
    hf, folder = hf_model_factory(CONFIGS["llama3-rope-scaling"](), "rope")
    with open(os.path.join(folder, "config.json")) as f:
        saved = json.load(f)
    cfg, _ = flexevict.api.resolve_model(folder)
    assert cfg.rope_theta == 50000.0
    assert cfg.rope_scaling is not None
    assert cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type")) == "llama3"
    assert cfg.num_kv_heads == saved["num_key_value_heads"] == 2
    model = load_engine(folder)
    hf_inv = hf.model.rotary_emb.inv_freq.float()
    torch.testing.assert_close(model.model.inv_freq, hf_inv, rtol=1e-6, atol=0)
    # and the scaling really changed the frequencies (else the test above proves nothing)
    d = cfg.dim_head
    plain = 1.0 / (50000.0 ** (torch.arange(0, d, 2).float() / d))
    assert not torch.allclose(hf_inv, plain)


def test_default_rope_config(hf_model_factory):
    """A default-rope config (rope_parameters with rope_type 'default') has no scaling."""
    hf, folder = hf_model_factory(_llama(rope_theta=12345.0), "plain")
    cfg, _ = flexevict.api.resolve_model(folder)
    assert cfg.rope_scaling is None
    assert cfg.rope_theta == 12345.0
    torch.testing.assert_close(load_engine(folder).model.inv_freq,
                               hf.model.rotary_emb.inv_freq.float(), rtol=1e-6, atol=0)


def _bin_copy(hf, folder, dest, strip_prefix=False, shards=1):
    """Copy config.json and write the state dict as pytorch_model*.bin (transformers 5 only
    writes safetensors). strip_prefix mimics old OPT checkpoints without the `model.` prefix."""
    os.makedirs(dest)
    shutil.copy(os.path.join(folder, "config.json"), dest)
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    if strip_prefix:
        sd = {k[len("model."):] if k.startswith("model.") else k: v for k, v in sd.items()}
    keys = sorted(sd)
    for i in range(shards):
        part = {k: sd[k] for k in keys[i::shards]}          # interleaved: loads hop shards
        torch.save(part, os.path.join(dest, f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"))
    return str(dest)


@pytest.mark.parametrize("name,strip,shards", [("llama-gqa-tied", False, 1),
                                               ("llama-mha-untied", False, 2),
                                               ("opt-350m-style", True, 3)])
def test_bin_weights_equal_safetensors(name, strip, shards, hf_model_factory, tmp_path):
    hf, folder = hf_model_factory(CONFIGS[name](), name)
    bin_folder = _bin_copy(hf, folder, tmp_path / "bin", strip_prefix=strip, shards=shards)
    assert not any(f.endswith(".safetensors") for f in os.listdir(bin_folder))
    a, b = load_engine(folder), load_engine(bin_folder)
    src = flexevict.io.weights.open_weights(bin_folder, a.config)
    assert src.kind == "bin"
    prompts = prompts_for(2, 11, a.config.vocab_size, seed=5)
    fed = [torch.tensor([4, 5]), torch.tensor([6, 7])]
    pa, sa = engine_run(a, prompts, fed)
    pb, sb = engine_run(b, prompts, fed)
    assert torch.equal(pa, pb)
    for x, y in zip(sa, sb):
        assert torch.equal(x, y)


def test_bin_folder_with_training_args(hf_model_factory, tmp_path):
    """HF training folders ship `training_args.bin` (a pickled TrainingArguments, not weights)
    next to `pytorch_model.bin`; it must not stop the weights from loading."""
    import argparse
    hf, folder = hf_model_factory(CONFIGS["llama-gqa-tied"](), "m")
    bin_folder = _bin_copy(hf, folder, tmp_path / "bin")
    torch.save(argparse.Namespace(learning_rate=1e-4, output_dir="out"),
               os.path.join(bin_folder, "training_args.bin"))
    a, b = load_engine(folder), load_engine(bin_folder)
    prompts = prompts_for(1, 7, a.config.vocab_size, seed=3)
    assert torch.equal(engine_run(a, prompts, [])[0], engine_run(b, prompts, [])[0])


def test_bin_legacy_serialization(hf_model_factory, tmp_path):
    """A `.bin` written in torch's pre-1.6 (non-zip) format is still a valid checkpoint."""
    hf, folder = hf_model_factory(CONFIGS["opt-preln-bias"](), "m")
    dest = tmp_path / "legacy"
    os.makedirs(dest)
    shutil.copy(os.path.join(folder, "config.json"), dest)
    torch.save({k: v.detach().clone() for k, v in hf.state_dict().items()},
               os.path.join(dest, "pytorch_model.bin"), _use_new_zipfile_serialization=False)
    a, b = load_engine(folder), load_engine(str(dest))
    prompts = prompts_for(1, 7, a.config.vocab_size, seed=3)
    assert torch.equal(engine_run(a, prompts, [])[0], engine_run(b, prompts, [])[0])
