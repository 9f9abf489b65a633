"""Tokenizers: `tokenizer.json` (HF folders), the GGUF's embedded BPE, or bytes for dummy
weights."""
from __future__ import annotations

import functools
import os

from flexevict.errors import UserError


class Tokenizer:
    """A thin wrapper over `tokenizers.Tokenizer` with the encode/decode the engine needs."""

    def __init__(self, tok, add_bos_id: int | None = None):
        self.tok = tok
        self.add_bos_id = add_bos_id      # prepended when the tokenizer itself does not

    def encode(self, text: str, special: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=special).ids
        if special and self.add_bos_id is not None and ids[:1] != [self.add_bos_id]:
            ids = [self.add_bos_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """An upper bound of the text bytes one token stands for: a text of B bytes has at
        least B / this many tokens (vocabulary strings in UTF-8 are at least as long as the
        bytes they stand for: byte-level BPE spells each byte as one 1-2 byte character,
        SentencePiece's word marker is 3 bytes for a space), plus one for a prepended BOS."""
        return max(len(t.encode("utf-8")) for t in self.tok.get_vocab(with_added_tokens=True))

    def save(self, folder: str):
        self.tok.save(os.path.join(folder, "tokenizer.json"))


class ByteTokenizer:
    """UTF-8 bytes as token ids: lets dummy-weight models take text prompts (output is noise)."""

    def encode(self, text: str, special: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    max_token_bytes = 1

    def save(self, folder: str):
        pass


def load_tokenizer(path: str | None):
    """Tokenizer for a weight path (None or _DUMMY_ -> bytes)."""
    from tokenizers import Tokenizer as HFTokenizer
    from flexevict.io.weights import DUMMY, native_info
    if path is None or path == DUMMY or (native_info(path) or {}).get("tokenizer") == "bytes":
        return ByteTokenizer()
    if path.endswith(".gguf"):
        from flexevict.io.gguf_io import gguf_tokenizer
        return Tokenizer(gguf_tokenizer(path))
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        raise UserError(f"{path}: no tokenizer.json; copy the model's tokenizer.json "
                        "into the folder")
    try:
        return Tokenizer(HFTokenizer.from_file(file))
    except Exception as e:
        raise UserError(f"{file}: cannot read tokenizer ({e})") from None
