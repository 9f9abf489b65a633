"""OpenAI Batch API files: request lines in, batch output lines out, as the Batch API, vLLM's
`run-batch` and OpenAI's Python client read and write them.

A request line:
    {"custom_id": "r1", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "...", "max_tokens": 8, "temperature": 0.7, "stop": "\\n"}}
    {"custom_id": "r2", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "..."}], "max_completion_tokens": 8}}

The url decides the kind: a chat request's messages are rendered with the model's chat template,
a completions request's prompt never is. The body's settings (`SETTINGS`) override the command
line's for that request; a setting the engine does not support, at anything but its no-op value,
makes the request an error row (never silently dropped).

Its output line (`response_line`), one per request:
    {"id": "batch_req_...", "custom_id": "r1", "error": null,
     "response": {"status_code": 200, "request_id": "req_...", "body": {"id": "cmpl-...",
         "object": "text_completion", "created": ..., "model": ..., "choices": [{"index": 0,
         "text": ..., "logprobs": null, "finish_reason": "stop" | "length"}],
         "usage": {"prompt_tokens": ..., "completion_tokens": ..., "total_tokens": ...}}}}
and a failed request's line in the errors file (`error_line`) has status_code 400 and an error
body ({"error": {"message", "type", "param", "code"}}), as the Batch API's error file does.
Ids are derived from the custom_id and `created` from the input file, so a rerun writes the
same bytes.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

URLS = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
IGNORED = ("model", "user", "metadata", "store", "service_tier")   # no effect on the text
# settings the engine does not support, and the values at which they change nothing
NEUTRAL = {
    "stream": (False,), "stream_options": (), "logprobs": (False,), "top_logprobs": (0,),
    "echo": (False,), "best_of": (1,), "suffix": (), "logit_bias": ({},),
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "tools": ([],),
    "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "parallel_tool_calls": (True, False), "response_format": ({"type": "text"},),
    "modalities": (["text"],), "audio": (), "prediction": (), "reasoning_effort": (),
}


class BadRequest(Exception):
    """A request that cannot run: its custom_id (None when it has none) and why."""

    def __init__(self, custom_id, reason: str):
        super().__init__(reason)
        self.custom_id, self.reason = custom_id, reason


@dataclass(frozen=True)
class Parsed:
    """A request line's parts: its kind ("completion" or "chat"), prompt or messages, and the
    settings its body gives (named as `inputs.Request` fields)."""
    custom_id: str
    kind: str
    prompt: str | None
    messages: list | None
    settings: dict


@dataclass(frozen=True)
class Choice:
    """One generated choice: its text, the tokens it took and why it ended."""
    text: str
    tokens: int
    finish_reason: str           # "stop": an end-of-sequence token or a stop string; "length"


def parse_request(obj: dict) -> Parsed:
    """One request line (a JSON object with "custom_id" or "body") -> its parts; BadRequest
    names what is wrong."""
    rid, body = obj.get("custom_id"), obj.get("body")
    if not isinstance(rid, str) or not rid:
        raise BadRequest(None, 'OpenAI batch line needs a string "custom_id"')
    if not isinstance(body, dict):
        raise BadRequest(rid, 'OpenAI batch line needs a "body" object')
    if obj.get("method", "POST") != "POST":
        raise BadRequest(rid, f'"method" must be "POST" (got {obj["method"]!r})')
    url = obj.get("url")
    if url not in URLS:
        raise BadRequest(rid, f'"url" must be one of {", ".join(URLS)} (got {url!r})')
    kind = URLS[url]
    want, other = ("messages", "prompt") if kind == "chat" else ("prompt", "messages")
    if other in body and want not in body:
        target = "/v1/completions" if kind == "chat" else "/v1/chat/completions"
        raise BadRequest(rid, f'a {url} request takes "body.{want}", not "{other}" (send '
                         f'"{other}" to {target})')
    settings = body_settings(rid, body)
    if kind == "chat":
        return Parsed(rid, kind, None, _text_messages(rid, body.get("messages")), settings)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]                          # a list of one prompt is that prompt
    if prompt is not None and not isinstance(prompt, str):
        raise BadRequest(rid, '"body.prompt" must be one string (one prompt per request)')
    return Parsed(rid, kind, prompt, None, settings)


def body_settings(rid: str, body: dict) -> dict:
    """The body's generation settings, checked -> {max_new_tokens, temperature, top_p, top_k,
    seed, stop, n} (only those given)."""
    out = {}
    for key, value in body.items():
        if key in ("prompt", "messages") or key in IGNORED or value is None:
            continue
        if key in SETTINGS:
            name, check = SETTINGS[key]
            out.setdefault(name, []).append((key, check(rid, key, value)))
        elif key in NEUTRAL:
            if not any(type(value) is type(v) and value == v for v in NEUTRAL[key]):
                raise BadRequest(rid, f'"body.{key}" is not supported (flexevict returns text '
                                 "only); remove it from the request")
        else:
            raise BadRequest(rid, f'unknown setting "body.{key}"; remove it from the request')
    for name, given in out.items():                 # max_tokens and max_completion_tokens
        if len({v for _, v in given}) > 1:
            keys = " and ".join(f"body.{k}" for k, _ in given)
            raise BadRequest(rid, f"{keys} disagree; give one of them")
    return {name: given[0][1] for name, given in out.items()}


def _int(rid, key, v, low: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise BadRequest(rid, f'"body.{key}" must be an integer >= {low} (got {v!r})')
    return v


def _number(rid, key, v, low: float, high: float, open_low: bool = False) -> float:
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and \
        (low < v if open_low else low <= v) and v <= high
    if not ok:
        span = f"({low}, {high}]" if open_low else f"[{low}, {high}]"
        raise BadRequest(rid, f'"body.{key}" must be a number in {span} (got {v!r})')
    return float(v)


def _stop(rid, key, v) -> tuple[str, ...]:
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest(rid, f'"body.{key}" must be a non-empty string or a list of them '
                         f"(got {v!r})")
    return tuple(stops)


def _top_k(rid, key, v) -> int:
    return 0 if v == -1 else _int(rid, key, v, 0)     # vLLM's -1: no top-k


SETTINGS = {     # body key -> (inputs.Request field, checked value)
    "max_tokens": ("max_new_tokens", lambda r, k, v: _int(r, k, v, 1)),
    "max_completion_tokens": ("max_new_tokens", lambda r, k, v: _int(r, k, v, 1)),
    "temperature": ("temperature", lambda r, k, v: _number(r, k, v, 0, 2)),
    "top_p": ("top_p", lambda r, k, v: _number(r, k, v, 0, 1, open_low=True)),
    "top_k": ("top_k", _top_k),
    "seed": ("seed", lambda r, k, v: _int(r, k, v, 0)),
    "stop": ("stop", _stop),
    "n": ("n", lambda r, k, v: _int(r, k, v, 1)),
}


def _text_messages(rid, messages) -> list | None:
    """Chat messages with text content only; a content given as text parts is joined."""
    if not isinstance(messages, list):
        return messages                      # `inputs` says what a messages list must be
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and
                       isinstance(p.get("text"), str) for p in content):
                raise BadRequest(rid, "only text message content is supported (parts of "
                                 '{"type": "text", "text": ...})')
            m = {**m, "content": "".join(p["text"] for p in content)}
        out.append(m)
    return out


def _ids(custom_id: str) -> str:
    """The hex that names a request's output objects: from its custom_id only (reruns write
    the same bytes)."""
    return hashlib.sha256(f"flexevict\0{custom_id}".encode()).hexdigest()[:24]


def response_line(custom_id: str, kind: str, choices: list[Choice], prompt_tokens: int,
                  model: str, created: int) -> dict:
    """A finished request's output line (status 200, a text_completion or chat.completion)."""
    h = _ids(custom_id)
    if kind == "chat":
        items = [{"index": i, "message": {"role": "assistant", "content": c.text},
                  "logprobs": None, "finish_reason": c.finish_reason}
                 for i, c in enumerate(choices)]
        head = {"id": f"chatcmpl-{h}", "object": "chat.completion"}
    else:
        items = [{"index": i, "text": c.text, "logprobs": None,
                  "finish_reason": c.finish_reason} for i, c in enumerate(choices)]
        head = {"id": f"cmpl-{h}", "object": "text_completion"}
    completion = sum(c.tokens for c in choices)
    body = {**head, "created": created, "model": model, "choices": items,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                      "total_tokens": prompt_tokens + completion}}
    return {"id": f"batch_req_{h}", "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": f"req_{h}", "body": body},
            "error": None}


def error_line(custom_id: str | None, message: str) -> dict:
    """A failed request's line in the errors file: status 400 and an error body."""
    h = _ids(custom_id if custom_id is not None else "")
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    return {"id": f"batch_req_{h}", "custom_id": custom_id,
            "response": {"status_code": 400, "request_id": f"req_{h}",
                         "body": {"error": error}},
            "error": None}
