"""A job's input, read lazily: JSONL rows checked one at a time, a validating pre-pass that
keeps only the ids it has seen, and look-ahead windows re-read from their byte offsets.

Line formats:
    {"id": 7, "prompt": "..."}                       (id optional: the line number)
    {"id": 7, "messages": [{"role": "user", "content": "..."}]}          (needs --chat)
    {"custom_id": "r1", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "..."}}                      (OpenAI batch requests, as vLLM's run-batch;
                                                      "body": {"messages": [...]} needs --chat)
Length, sampling and stop settings come from the command line; other body fields are kept in
the output row but not used.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

from flexevict.errors import UserError, for_cli, setting


class RowError(Exception):
    """One row that cannot run: its line, its id (None when unreadable) and the reason."""

    def __init__(self, line: int, rid, reason: str):
        super().__init__(reason)
        self.line, self.id, self.reason = line, rid, reason

    def where(self, path: str) -> str:
        rid = "" if self.id is None else f" (id {json.dumps(self.id)})"
        return f"{path}:{self.line}{rid}"

    def as_user_error(self, path: str) -> UserError:
        return UserError(f"{self.where(path)}: {self.reason}")

    def as_record(self) -> dict:
        """The row's line in the errors file (of `generate --input --on-error skip`: settings
        named as flags)."""
        return {"id": self.id, "line": self.line, "error": for_cli(self.reason)}


@dataclass
class Row:
    line: int                   # 1-based line number in the input file
    id: object                  # "id", "custom_id", or the line number
    raw: dict                   # the line as written: copied into the output row
    prompt: str | None = None
    messages: list | None = None
    ids: list[int] = field(default_factory=list)      # token ids, set by Prompter

    @property
    def key(self) -> str:
        return id_key(self.id)


def id_key(rid) -> str:
    """Ids compare by their JSON text (1 and "1" are different ids)."""
    return json.dumps(rid, sort_keys=True)


def parse_line(text: str | bytes, n: int, chat: bool) -> Row:
    """One input line -> Row; a malformed line, a missing, empty or whitespace-only prompt, or
    chat messages without --chat -> RowError."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise RowError(n, None, f"malformed JSON line ({e.msg}); expected "
                       '{"id": ..., "prompt": "..."}') from None
    except UnicodeDecodeError:
        raise RowError(n, None, "line is not UTF-8 text") from None
    if not isinstance(obj, dict):
        raise RowError(n, None, 'line needs a string "prompt" field')
    if "custom_id" in obj or "body" in obj:                       # an OpenAI batch request
        rid, body = obj.get("custom_id"), obj.get("body")
        if not isinstance(rid, str) or not rid:
            raise RowError(n, None, 'OpenAI batch line needs a string "custom_id"')
        if not isinstance(body, dict):
            raise RowError(n, rid, 'OpenAI batch line needs a "body" object')
        row = Row(n, rid, obj, body.get("prompt"), body.get("messages"))
        fields = 'a string "body.prompt" or "body.messages"'
    else:
        row = Row(n, obj.get("id", n), obj, obj.get("prompt"), obj.get("messages"))
        fields = 'a string "prompt" field'
    if row.messages is not None and row.prompt is None:
        _check_messages(row, chat)
    elif not isinstance(row.prompt, str):
        raise RowError(n, row.id, f"line needs {fields}")
    elif not row.prompt.strip():
        what = "empty" if not row.prompt else "whitespace-only"
        raise RowError(n, row.id, f"{what} prompt; give every line some text")
    return row


def _check_messages(row: Row, chat: bool):
    ok = isinstance(row.messages, list) and row.messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in row.messages)
    if not ok:
        raise RowError(row.line, row.id, '"messages" must be a non-empty list of '
                       '{"role": "...", "content": "..."}')
    if not chat:
        raise RowError(row.line, row.id, f'chat "messages" need {setting("chat")} (the model\'s '
                       "chat template)")


class Prompter:
    """What the engine runs for a row: its prompt (or its messages, with a chat template)
    tokenized, checked to fit the model's positions with max_new_tokens more and, with a
    policy, to give a budget the policy can run with."""

    def __init__(self, tokenizer, max_positions: int, max_new_tokens: int, template=None,
                 policy=None):
        self.tokenizer, self.limit, self.max_new = tokenizer, max_positions, max_new_tokens
        self.template = template               # chat.ChatTemplate with --chat, else None
        self.policy = policy                   # a Policy: only its slots_for (no state) is used

    def text(self, row: Row) -> str:
        if self.template is None:
            return row.prompt
        messages = row.messages or [{"role": "user", "content": row.prompt}]
        try:
            return self.template.render(messages)
        except Exception as e:             # the template's own raise_exception, or a bad use
            raise RowError(row.line, row.id, f"chat template failed ({e})") from None

    def encode(self, row: Row) -> list[int]:
        text = self.text(row)
        nbytes = len(text.encode("utf-8"))
        fewest = nbytes // self.tokenizer.max_token_bytes
        if fewest + self.max_new - 1 > self.limit:     # too long by its size: no tokenizing
            raise RowError(row.line, row.id, f"prompt of {nbytes} bytes (at "
                           f"least {fewest} tokens) + {self.max_new} new tokens exceeds the "
                           f"model's maximum of {self.limit} positions; shorten the prompt or "
                           f"{setting('max_new_tokens')}")
        try:        # a template writes its own special tokens (HF's apply_chat_template too)
            ids = self.tokenizer.encode(text, special=self.template is None)
        except Exception as e:
            raise RowError(row.line, row.id, f"tokenizer error ({type(e).__name__}: {e})") from None
        if not ids:
            raise RowError(row.line, row.id, "prompt encodes to no tokens; give it some text")
        if len(ids) + self.max_new - 1 > self.limit:
            raise RowError(row.line, row.id, f"prompt of {len(ids)} tokens + {self.max_new} new "
                           f"tokens exceeds the model's maximum of {self.limit} positions; "
                           f"shorten the prompt or {setting('max_new_tokens')}")
        if self.policy is not None:
            try:       # e.g. --budget 0.1 of a short prompt is below the policy's minimum
                self.policy.slots_for(len(ids), self.max_new)
            except UserError as e:
                raise RowError(row.line, row.id, e.message) from None
        return ids


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


def scan(path: str, prompter: Prompter, window: int, chat: bool, on_error=None) -> Scan:
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
                row = parse_line(raw, n, chat)
                if row.key in seen:
                    raise RowError(n, row.id, f"duplicate id, first used on line "
                                   f"{seen[row.key]}; give every line its own id")
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


def read_window(path: str, win: Window, size: int, prompter: Prompter, chat: bool) -> list[Row]:
    """The window's rows (at most `size`), tokenized, read from its offset; lines the pre-pass
    found bad are skipped. A line that now fails means the file changed under the job."""
    rows, skip = [], set(win.skip)
    with open(path, "rb") as f:
        f.seek(win.offset)
        for n, raw in enumerate(f, win.first_line):
            if not raw.strip() or n in skip:
                continue
            try:
                row = parse_line(raw, n, chat)
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
