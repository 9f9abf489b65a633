"""A job's input, read lazily: JSONL rows checked one at a time, a validating pre-pass that
keeps only the ids it has seen, and look-ahead windows re-read from their byte offsets.

Line formats:
    {"id": 7, "prompt": "..."}                       (id optional: the line number)
    {"id": 7, "messages": [{"role": "user", "content": "..."}]}          (needs --chat)
    {"custom_id": "r1", "method": "POST", "url": "/v1/completions" or "/v1/chat/completions",
     "body": {"prompt" or "messages": ..., "max_tokens": 8, ...}}
                                                     (OpenAI batch requests: openai_batch.py)
A row's `Request` is the command line's settings, overridden by an OpenAI request's body.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field

from flexevict.errors import UserError, for_cli, setting
from flexevict.jobs import openai_batch
from flexevict.runtime.generation import Sampling


class RowError(Exception):
    """One row that cannot run: its line, its id (None when unreadable) and the reason."""

    def __init__(self, line: int, rid, reason: str, batch: bool = False):
        super().__init__(reason)
        self.line, self.id, self.reason = line, rid, reason
        self.batch = batch              # an OpenAI batch request: its record is a batch line

    def where(self, path: str) -> str:
        rid = "" if self.id is None else f" (id {json.dumps(self.id)})"
        return f"{path}:{self.line}{rid}"

    def as_user_error(self, path: str) -> UserError:
        return UserError(f"{self.where(path)}: {self.reason}")

    def as_record(self) -> dict:
        """The row's line in the errors file (of `generate --input --on-error skip`: settings
        named as flags): an OpenAI request's in the Batch API's error shape."""
        if self.batch:
            return openai_batch.error_line(self.id, f"line {self.line}: {for_cli(self.reason)}")
        return {"id": self.id, "line": self.line, "error": for_cli(self.reason)}


@dataclass(frozen=True)
class Request:
    """What one row asks for: the command line's settings, which an OpenAI request's body
    overrides (`openai_batch.SETTINGS`)."""
    max_new_tokens: int
    sampling: Sampling
    stop: tuple[str, ...] = ()       # stop strings: the text ends before the first one
    n: int = 1                       # choices
    seed: int | None = None          # the body's seed; None: from --seed and the row's id

    def merged(self, settings: dict) -> "Request":
        """This request with a body's settings (`openai_batch.body_settings`) applied."""
        s = self.sampling
        if "temperature" in settings:
            s = dataclasses.replace(s, greedy=False, temperature=settings["temperature"])
        s = dataclasses.replace(s, **{k: settings[k] for k in ("top_p", "top_k") if k in settings})
        rest = {k: settings[k] for k in ("max_new_tokens", "stop", "n", "seed") if k in settings}
        return dataclasses.replace(self, sampling=s, **rest)

    @property
    def sequences(self) -> int:
        """Sequences run for it: greedy choices are all alike, so one."""
        return 1 if self.sampling.is_greedy else self.n


@dataclass
class Row:
    line: int                   # 1-based line number in the input file
    id: object                  # "id", "custom_id", or the line number
    raw: dict                   # the line as written: copied into the output row
    prompt: str | None = None
    messages: list | None = None
    kind: str = "plain"         # "plain" (id + prompt or messages), "completion" or "chat"
    request: Request | None = None   # its settings (None where no job reads them: eval)
    ids: list[int] = field(default_factory=list)      # token ids, set by Prompter

    @property
    def key(self) -> str:
        return id_key(self.id)

    @property
    def is_batch_request(self) -> bool:
        return self.kind != "plain"

    def error(self, reason: str) -> RowError:
        return RowError(self.line, self.id, reason, self.is_batch_request)


def id_key(rid) -> str:
    """Ids compare by their JSON text (1 and "1" are different ids)."""
    return json.dumps(rid, sort_keys=True)


def parse_line(text: str | bytes, n: int, chat: bool, defaults: Request | None = None) -> Row:
    """One input line -> Row (with defaults: its Request, the body's settings applied); a
    malformed line, a missing, empty or whitespace-only prompt, plain chat messages without
    --chat, or an OpenAI request that cannot run -> RowError."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise RowError(n, None, f"malformed JSON line ({e.msg}); expected "
                       '{"id": ..., "prompt": "..."}') from None
    except UnicodeDecodeError:
        raise RowError(n, None, "line is not UTF-8 text") from None
    if not isinstance(obj, dict):
        raise RowError(n, None, 'line needs a string "prompt" field')
    settings = {}
    if "custom_id" in obj or "body" in obj:                       # an OpenAI batch request
        try:
            req = openai_batch.parse_request(obj)
        except openai_batch.BadRequest as e:
            raise RowError(n, e.custom_id, e.reason, batch=True) from None
        row = Row(n, req.custom_id, obj, req.prompt, req.messages, req.kind)
        settings = req.settings
        fields = 'a string "body.prompt"' if req.kind == "completion" else '"body.messages"'
    else:
        row = Row(n, obj.get("id", n), obj, obj.get("prompt"), obj.get("messages"))
        fields = 'a string "prompt" field'
    if row.messages is not None and row.prompt is None:
        _check_messages(row, chat)
    elif not isinstance(row.prompt, str):
        raise row.error(f"line needs {fields}")
    elif not row.prompt.strip():
        what = "empty" if not row.prompt else "whitespace-only"
        raise row.error(f"{what} prompt; give every line some text")
    if defaults is not None:
        row.request = defaults.merged(settings)
    return row


def _check_messages(row: Row, chat: bool):
    ok = isinstance(row.messages, list) and row.messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in row.messages)
    if not ok:
        raise row.error('"messages" must be a non-empty list of '
                        '{"role": "...", "content": "..."}')
    if row.kind == "plain" and not chat:
        raise row.error(f'chat "messages" need {setting("chat")} (the model\'s chat template), '
                        'or give OpenAI batch requests with "url": "/v1/chat/completions"')


class Prompter:
    """What the engine runs for a row: its prompt (or its messages, with a chat template)
    tokenized, checked to fit the model's positions with its max_new_tokens more, to give a
    budget the policy can run with, and to fit its choices in a block."""

    def __init__(self, tokenizer, max_positions: int, defaults: Request, chat: bool = False,
                 template=None, policy=None, block_size: int | None = None):
        self.tokenizer, self.limit, self.defaults = tokenizer, max_positions, defaults
        self.chat = chat                       # --chat: plain rows are chat-templated
        self.template = template               # () -> chat.ChatTemplate (UserError: none)
        self.policy = policy                   # a Policy: only its slots_for (no state) is used
        self.block_size = block_size           # sequences a block runs side by side

    def row(self, text: str | bytes, n: int) -> Row:
        """An input line -> its Row, with its Request (`parse_line`)."""
        return parse_line(text, n, self.chat, self.defaults)

    def text(self, row: Row) -> tuple[str, bool]:
        """-> (the text to tokenize, whether a chat template wrote it)."""
        if row.kind == "completion" or (row.kind == "plain" and not self.chat):
            return row.prompt, False
        messages = row.messages or [{"role": "user", "content": row.prompt}]
        try:
            template = self.template()
        except UserError as e:
            raise row.error(e.message) from None
        try:
            return template.render(messages), True
        except Exception as e:             # the template's own raise_exception, or a bad use
            raise row.error(f"chat template failed ({e})") from None

    def encode(self, row: Row) -> list[int]:
        request = row.request or self.defaults
        text, templated = self.text(row)
        max_new, lower = request.max_new_tokens, self._max_new_name(row)
        nbytes = len(text.encode("utf-8"))
        fewest = nbytes // self.tokenizer.max_token_bytes
        if fewest + max_new - 1 > self.limit:         # too long by its size: no tokenizing
            raise row.error(f"prompt of {nbytes} bytes (at least {fewest} tokens) + {max_new} "
                            f"new tokens exceeds the model's maximum of {self.limit} positions; "
                            f"shorten the prompt or {lower}")
        try:        # a template writes its own special tokens (HF's apply_chat_template too)
            ids = self.tokenizer.encode(text, special=not templated)
        except Exception as e:
            raise row.error(f"tokenizer error ({type(e).__name__}: {e})") from None
        if not ids:
            raise row.error("prompt encodes to no tokens; give it some text")
        if len(ids) + max_new - 1 > self.limit:
            raise row.error(f"prompt of {len(ids)} tokens + {max_new} new tokens exceeds the "
                            f"model's maximum of {self.limit} positions; shorten the prompt or "
                            f"{lower}")
        if self.policy is not None:
            try:       # e.g. --budget 0.1 of a short prompt is below the policy's minimum
                self.policy.slots_for(len(ids), max_new)
            except UserError as e:
                raise row.error(e.message) from None
        if self.block_size is not None and request.sequences > self.block_size:
            raise row.error(f"n={request.n} choices run side by side, more than a block of "
                            f"{self.block_size} sequences ({setting('gpu_batch_size')} x "
                            f"{setting('num_gpu_batches')}); lower n or raise the block")
        return ids

    def _max_new_name(self, row: Row) -> str:
        if row.is_batch_request and "max_tokens" in row.raw.get("body", {}):
            return 'lower "body.max_tokens"'
        if row.is_batch_request and "max_completion_tokens" in row.raw.get("body", {}):
            return 'lower "body.max_completion_tokens"'
        return setting("max_new_tokens")


@dataclass(frozen=True)
class Window:
    """Where a look-ahead window of the input starts; `skip`: its lines that failed."""
    offset: int
    first_line: int
    skip: tuple = ()


@dataclass
class Scan:
    """What the pre-pass learned: row counts, the file's identity, the windows."""
    rows: int                   # rows that run
    failed: int                 # rows written to the errors file (--on-error skip)
    size: int
    sha256: str
    windows: list[Window]

    @property
    def identity(self) -> dict:
        return {"size": self.size, "sha256": self.sha256}


def scan(path: str, prompter: Prompter, window: int, on_error=None) -> Scan:
    """Check every line before the model loads, keeping only the ids seen (for duplicates) and
    where each window of `window` good rows starts. A bad line raises UserError naming
    file:line (id), unless `on_error(RowError)` is given (--on-error skip): then it is passed
    there and skipped. The file's SHA-256 is taken on the way."""
    if not os.path.isfile(path):
        raise UserError(f"{path}: input file does not exist")
    digest, seen = hashlib.sha256(), {}
    rows = failed = offset = lines = 0
    windows: list[Window] = []
    skip: list[int] = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            digest.update(raw)
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            lines += 1
            try:
                row = prompter.row(raw, n)
                if row.key in seen:
                    raise row.error(f"duplicate id, first used on line {seen[row.key]}; give "
                                    "every line its own id")
                prompter.encode(row)
            except RowError as e:
                if on_error is None:
                    raise e.as_user_error(path) from None
                on_error(e)
                failed += 1
                skip.append(n)
                continue
            seen[row.key] = n
            if rows % window == 0:
                if windows:
                    windows[-1] = Window(windows[-1].offset, windows[-1].first_line, tuple(skip))
                windows.append(Window(start, n))
                skip = []
            rows += 1
    if windows:
        windows[-1] = Window(windows[-1].offset, windows[-1].first_line, tuple(skip))
    if not lines:
        raise UserError(f"{path}: input file has no prompts")
    return Scan(rows, failed, offset, digest.hexdigest(), windows)


def read_window(path: str, win: Window, size: int, prompter: Prompter) -> list[Row]:
    """The window's rows (at most `size`), tokenized, read from its offset; lines the pre-pass
    found bad are skipped. A line that now fails means the file changed under the job."""
    rows, skip = [], set(win.skip)
    with open(path, "rb") as f:
        f.seek(win.offset)
        for n, raw in enumerate(f, win.first_line):
            if not raw.strip() or n in skip:
                continue
            try:
                row = prompter.row(raw, n)
                row.ids = prompter.encode(row)
            except RowError as e:
                raise UserError(f"{e.where(path)}: line changed while the job ran ({e.reason}); "
                                f"rerun with {setting('restart')}") from None
            rows.append(row)
            if len(rows) == size:
                break
    return rows


def read_all(path: str, chat: bool = False) -> list[dict]:
    """Every row of a small prompt file at once (eval's agreement input), checked like a job's
    pre-pass: [{**row as written, "prompt": ..., "_line": n}]."""
    if not os.path.isfile(path):
        raise UserError(f"{path}: input file does not exist")
    out, seen = [], {}
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                row = parse_line(raw, n, chat)
                if row.key in seen:
                    raise RowError(n, row.id, f"duplicate id, first used on line "
                                   f"{seen[row.key]}; give every line its own id")
            except RowError as e:
                raise e.as_user_error(path) from None
            seen[row.key] = n
            out.append({**row.raw, "prompt": row.prompt, "_line": n})
    if not out:
        raise UserError(f"{path}: input file has no prompts")
    return out
