"""Tokenizers stored in a GGUF file's metadata (`tokenizer.ggml.*`), built as `tokenizers`
objects: GPT-2-style byte-level BPE (SmolLM2) and SentencePiece BPE (Gemma-3).

SentencePiece BPE (Kudo and Richardson 2018, "SentencePiece: A simple and language independent
subword tokenizer", section 3) starts from characters and repeatedly merges the adjacent pair
whose union is the best-scored piece. A GGUF stores the pieces, their scores and their types
but no merge list, so the merges are derived: every split of a piece into two pieces is a merge,
ranked by the piece. In Gemma's file the ordinary pieces' scores fall with their index, so the
index is the rank; it also ranks the runs of spaces (user-defined pieces, ids 138-167, stored
with literal spaces and respelled here in SentencePiece's "▁") ahead of every ordinary piece, as
if matched whole. Characters outside the pieces fall back to the `<0xNN>` byte pieces.
"""
from __future__ import annotations

from flexevict.errors import UserError

SPACE = "\u2581"                      # SentencePiece's word marker, standing for " "
CONTROL, USER_DEFINED = 3, 4          # llama.cpp's token types (`tokenizer.ggml.token_type`)


def bpe_tokenizer(tokens: list[str], merges: list[str], types: list[int]):
    """GPT-2-style byte-level BPE with digits split one by one (llama.cpp's "smollm")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                               merges=[tuple(m.split(" ", 1)) for m in merges],
                               fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    _add_control(tok, tokens, types)     # <|im_start|> etc.: never split, skipped by decode
    return tok


def spm_tokenizer(tokens: list[str], types: list[int], bos: str | None, unk: str):
    """SentencePiece BPE without a space prefix (Gemma): spaces become "▁", no pre-splitting,
    byte fallback; control pieces are special, other user-defined pieces ("\\n" runs,
    "<start_of_image>"...) are matched whole; `bos` (a piece) is prepended when given."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    pieces = [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
    vocab = {p: i for i, p in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=spm_merges(pieces, vocab), unk_token=unk,
                               fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    _add_control(tok, pieces, types)
    tok.add_tokens([AddedToken(p, special=False, normalized=False)
                    for p, t, ty in zip(pieces, tokens, types) if ty == USER_DEFINED and p == t])
    if bos is not None:
        _prepend(tok, bos, vocab[bos])
    return tok


def spm_merges(pieces: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, best piece first (pieces in rank order), the
    splits of one piece longest left part first."""
    merges = []
    for piece in pieces:
        for cut in range(len(piece) - 1, 0, -1):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges


def _add_control(tok, pieces: list[str], types: list[int]) -> None:
    from tokenizers import AddedToken
    tok.add_special_tokens([AddedToken(p, special=True, normalized=False)
                            for p, ty in zip(pieces, types) if ty == CONTROL])


def _prepend(tok, bos: str, bos_id: int) -> None:
    """encode(..., add_special_tokens=True) starts with `bos` (one per sequence of a pair)."""
    from tokenizers import processors
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, bos_id)])


def gguf_tokenizer(reader, field, path: str):
    """The `tokenizers.Tokenizer` a GGUF describes (reader: gguf.GGUFReader; field(reader, key,
    default) its metadata)."""
    kind = field(reader, "tokenizer.ggml.model")
    tokens = field(reader, "tokenizer.ggml.tokens")
    types = field(reader, "tokenizer.ggml.token_type")
    if kind == "gpt2":
        return bpe_tokenizer(tokens, field(reader, "tokenizer.ggml.merges"), types)
    if kind == "llama" and not field(reader, "tokenizer.ggml.add_space_prefix", True):
        bos = field(reader, "tokenizer.ggml.bos_token_id")
        add_bos = field(reader, "tokenizer.ggml.add_bos_token", True) and bos is not None
        unk = tokens[field(reader, "tokenizer.ggml.unknown_token_id", 0)]
        return spm_tokenizer(tokens, types, tokens[bos] if add_bos else None, unk)
    raise UserError(f"{path}: tokenizer '{kind}' is not supported (GPT-2-style BPE, or "
                    "SentencePiece without a space prefix as in Gemma)")
