"""Chat prompts rendered with the model's own template (`--chat`).

The template is the Jinja2 text the model ships: GGUF metadata `tokenizer.chat_template`, or an
HF folder's `tokenizer_config.json` "chat_template" (or `chat_template.jinja`). It is rendered
as Hugging Face's `apply_chat_template` does: a sandboxed Jinja2 environment with trim_blocks and
lstrip_blocks, `raise_exception`, `messages`, `bos_token`, `eos_token` and
`add_generation_prompt=True` (the prompt ends where the assistant's answer starts).
"""
from __future__ import annotations

import json
import os

from flexevict.errors import UserError, setting


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False,
                                                                   indent=indent)
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise UserError(f"the model's chat template does not parse ({e}); "
                            f"drop {setting('chat')}") from None
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token

    def render(self, messages: list[dict]) -> str:
        """[{"role", "content"}, ...] -> the prompt text, ending with the assistant's turn."""
        return self.template.render(messages=messages, add_generation_prompt=True,
                                    bos_token=self.bos_token, eos_token=self.eos_token)


def _raise(message):
    raise ValueError(message)


def load_chat_template(weights: str, model: str) -> ChatTemplate:
    """The chat template shipped with a .gguf file or an HF folder; none -> UserError naming
    the model."""
    if weights.endswith(".gguf"):
        from flexevict.io.gguf_io import _field, _reader
        r = _reader(weights)
        source = _field(r, "tokenizer.chat_template")
        tokens = _field(r, "tokenizer.ggml.tokens") or []
        bos, eos = (_field(r, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos"))
        special = [tokens[i] if i is not None and i < len(tokens) else "" for i in (bos, eos)]
    else:
        source, special = _folder_template(weights)
    if not source:
        raise UserError(f"{setting('chat')}: model {model} has no chat template (looked in "
                        f"{weights}); drop {setting('chat')} and give plain prompts")
    return ChatTemplate(source, *special)


def _folder_template(folder: str) -> tuple[str | None, list[str]]:
    config = {}
    path = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    source = config.get("chat_template")
    if isinstance(source, list):                   # named templates: the default one
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    jinja = os.path.join(folder, "chat_template.jinja")
    if source is None and os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            source = f.read()
    special = [config.get(k) or "" for k in ("bos_token", "eos_token")]
    return source, [s.get("content", "") if isinstance(s, dict) else s for s in special]
