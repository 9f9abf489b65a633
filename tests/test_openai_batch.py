"""OpenAI Batch API files (`flexevict.generate --input` with {"custom_id", "url", "body"} lines):
each output line is a Batch API output object whose body OpenAI's own client models parse;
a request's url decides its template, its body's settings are honoured and change nothing but
its own line; unsupported settings are error rows in the Batch API's error shape; a killed job
reruns to the same bytes."""
import json
import os
import shutil

import pytest

# OpenAI's client (the [test] extra) validates the output lines; a machine without it (the
# GPU machine, collecting for --gpu-only) skips this module and says so
pytest.importorskip("openai", reason="the openai package (pip install -e '.[test]') is needed")
from openai.types import Completion  # noqa: E402
from openai.types.chat import ChatCompletion  # noqa: E402
from openai.types.shared import ErrorObject  # noqa: E402

from flexevict.io.tokenizer import load_tokenizer
from flexevict.jobs.chat import load_chat_template
from test_batch_job import job, write_rows
from test_cli import assert_user_error, tiny_dir  # noqa: F401 (fixture)

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>"
            "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory, tiny_dir):  # noqa: F811
    """The tiny random model with a chat template in its tokenizer_config.json."""
    d = tmp_path_factory.mktemp("tiny-chat") / "model"
    shutil.copytree(tiny_dir, d)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return str(d)


def completion(cid, prompt, **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {"model": "any", "prompt": prompt, **body}}


def chat(cid, content, **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "any", "messages": [{"role": "user", "content": content}], **body}}


MIXED = [
    completion("short", "abcabc", max_tokens=2),
    completion("long", "hello there", max_tokens=9),
    chat("chat", "hello there", max_completion_tokens=5),
    completion("hot", "abcabc", temperature=1.3, seed=7, n=2, max_tokens=6),
    completion("top", "xyz", temperature=0.9, top_p=0.8, top_k=20, max_tokens=7),
    chat("chat-hot", "xyz", temperature=1.1, n=3, max_tokens=4),
    completion("default", "a b c d e f"),
]


def write_requests(path, requests):
    write_rows(path, requests)
    os.utime(path, (CREATED, CREATED))


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


CREATED = 1_700_000_000      # the input files' modification time: the lines' "created"


def run_requests(tmp_path, model, requests, *flags, name="out"):
    write_requests(tmp_path / f"{name}-in.jsonl", requests)
    proc = job(tmp_path, model, *flags, inp=f"{name}-in.jsonl", out=f"{name}.jsonl")
    assert proc.returncode == 0, proc.stderr
    return (tmp_path / f"{name}.jsonl").read_bytes()


def test_output_lines_are_batch_api_objects_that_openai_parses(tmp_path, chat_dir):
    run_requests(tmp_path, chat_dir, MIXED)
    got = lines(tmp_path / "out.jsonl")
    assert [g["custom_id"] for g in got] == [r["custom_id"] for r in MIXED]
    assert len({g["id"] for g in got}) == len(got)
    for g, req in zip(got, MIXED):
        assert set(g) == {"id", "custom_id", "response", "error"} and g["error"] is None
        assert g["id"].startswith("batch_req_")
        resp = g["response"]
        assert set(resp) == {"status_code", "request_id", "body"} and resp["status_code"] == 200
        is_chat = req["url"] == "/v1/chat/completions"
        body = (ChatCompletion if is_chat else Completion).model_validate(resp["body"])
        assert body.object == ("chat.completion" if is_chat else "text_completion")
        assert body.model == "model" and body.created == CREATED
        n = req["body"].get("n", 1)
        assert [c.index for c in body.choices] == list(range(n))
        limit = req["body"].get("max_tokens", req["body"].get("max_completion_tokens", 6))
        assert body.usage.total_tokens == body.usage.prompt_tokens + body.usage.completion_tokens
        assert body.usage.completion_tokens <= n * limit
        for c in body.choices:
            assert c.finish_reason in ("stop", "length")
            text = c.message.content if is_chat else c.text
            assert isinstance(text, str)
            if is_chat:
                assert c.message.role == "assistant"


def usage_and_texts(line):
    body = line["response"]["body"]
    texts = [c["message"]["content"] if "message" in c else c["text"] for c in body["choices"]]
    return body["usage"], texts, [c["finish_reason"] for c in body["choices"]]


@pytest.mark.parametrize("flags", [[], ["--policy", "h2o", "--budget", "0.5"]],
                         ids=["full", "h2o"])
def test_each_line_depends_only_on_its_own_request(tmp_path, chat_dir, flags):
    """The mixed batch's lines equal each request run alone (other lengths, temperatures,
    seeds, n and templates beside it change nothing)."""
    together = run_requests(tmp_path, chat_dir, MIXED, *flags).splitlines()
    for i, req in enumerate(MIXED):
        alone = run_requests(tmp_path, chat_dir, [req], *flags, name=f"alone{i}")
        assert alone.splitlines() == [together[i]], req["custom_id"]


def test_max_tokens_and_stop_are_honoured(tmp_path, tiny_dir):  # noqa: F811
    free = [completion(f"r{i}", p, max_tokens=12) for i, p in enumerate(["abcabc", "hello"])]
    base = [usage_and_texts(x) for x in lines_of(run_requests(tmp_path, tiny_dir, free))]
    stop = base[0][1][0][3:5]                     # two characters from the middle of its text
    assert len(stop) == 2
    asked = [completion("r0", "abcabc", max_tokens=12, stop=[stop, "\x00never"]),
             completion("r1", "hello", max_tokens=3),
             completion("r2", "hello", max_tokens=12, stop="\x00never")]
    got = [usage_and_texts(x) for x in lines_of(run_requests(tmp_path, tiny_dir, asked,
                                                             name="asked"))]
    cut = base[0][1][0].find(stop)
    assert got[0][1] == [base[0][1][0][:cut]] and got[0][2] == ["stop"]
    assert got[0][0]["completion_tokens"] < 12          # generation stopped at the stop string
    assert got[1][0]["completion_tokens"] <= 3 and base[1][1][0].startswith(got[1][1][0])
    if got[1][0]["completion_tokens"] == 3:
        assert got[1][2] == ["length"]
    assert got[2][1] == base[1][1]                      # a stop that never appears: no change


def lines_of(data: bytes):
    return [json.loads(x) for x in data.splitlines()]


def test_the_url_decides_the_template(tmp_path, chat_dir):
    """/v1/completions never templates its prompt, even with --chat; /v1/chat/completions
    always renders its messages; --chat still templates plain prompt rows."""
    text = "hello there"
    reqs = [completion("c", text, max_tokens=3), chat("m", text, max_tokens=3)]
    tok = load_tokenizer(chat_dir)
    rendered = load_chat_template(chat_dir, "tiny").render([{"role": "user", "content": text}])
    want = [len(tok.encode(text)), len(tok.encode(rendered, special=False))]
    assert want[0] != want[1]
    for flags in ([], ["--chat"]):
        got = lines_of(run_requests(tmp_path, chat_dir, reqs, *flags, name=f"t{len(flags)}"))
        assert [g["response"]["body"]["usage"]["prompt_tokens"] for g in got] == want
    plain = [{"id": 1, "prompt": text}]
    write_rows(tmp_path / "plain.jsonl", plain)
    proc = job(tmp_path, chat_dir, "--chat", inp="plain.jsonl", out="plain-out.jsonl",
               )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "plain-out.summary.json").read_text())
    assert summary["prompt_tokens"] == want[1]


BAD = [
    (completion("logprobs", "abc", logprobs=2), '"body.logprobs" is not supported'),
    ({**completion("url", "abc"), "url": "/v1/embeddings"}, '"url" must be one of'),
    (completion("temp", "abc", temperature=5), '"body.temperature" must be a number in [0, 2]'),
    (completion("tools", "abc", tools=[{"type": "function"}]), '"body.tools" is not supported'),
    (completion("unknown", "abc", mirostat=2), 'unknown setting "body.mirostat"'),
    (completion("n", "abc", n=7, temperature=1.0), "n=7 choices"),
    (completion("both", "abc", max_tokens=3, max_completion_tokens=4), "disagree"),
    ({**chat("msg-to-completions", "abc"), "url": "/v1/completions"}, 'takes "body.prompt"'),
    (completion("stop", "abc", stop=[""]), '"body.stop" must be a non-empty string'),
]


def test_unsupported_settings_are_error_rows(tmp_path, chat_dir):
    good = [completion("ok", "abc", max_tokens=2, logprobs=None, stream=False,
                       presence_penalty=0, user="me")]
    requests = good + [r for r, _ in BAD] + [chat("no-template", "abc")]
    write_rows(tmp_path / "in.jsonl", requests)
    proc = job(tmp_path, chat_dir, "--on-error", "skip")
    assert proc.returncode == 0, proc.stderr
    assert [g["custom_id"] for g in lines(tmp_path / "out.jsonl")] == ["ok", "no-template"]
    errors = lines(tmp_path / "out.errors.jsonl")
    assert [e["custom_id"] for e in errors] == [r["custom_id"] for r, _ in BAD]
    for e, (_, why) in zip(errors, BAD):
        assert set(e) == {"id", "custom_id", "response", "error"}
        assert e["response"]["status_code"] == 400 and e["id"].startswith("batch_req_")
        err = ErrorObject.model_validate(e["response"]["body"]["error"])
        assert why in err.message and err.type == "invalid_request_error", err.message
    # without --on-error skip the first bad request stops the job before the model loads
    assert_user_error(job(tmp_path, chat_dir, out="o2.jsonl"), "in.jsonl:2", "body.logprobs")


def test_a_chat_request_to_a_model_without_a_template(tmp_path, tiny_dir):  # noqa: F811
    write_rows(tmp_path / "in.jsonl", [chat("c", "abc")])
    assert_user_error(job(tmp_path, tiny_dir), "in.jsonl:1", "has no chat template")


def test_plain_rows_keep_their_output(tmp_path, tiny_dir):  # noqa: F811
    write_rows(tmp_path / "in.jsonl", [{"id": "a", "prompt": "abc", "extra": 1}])
    proc = job(tmp_path, tiny_dir)
    assert proc.returncode == 0, proc.stderr
    (got,) = lines(tmp_path / "out.jsonl")
    assert set(got) == {"id", "prompt", "extra", "completion", "tokens"}


def test_a_killed_job_reruns_to_the_same_bytes(tmp_path, chat_dir):
    """Sampled requests with a seed, killed after the first block commit: the rerun's file is
    the uninterrupted run's, byte for byte."""
    requests = [completion(f"r{i}", "abcdefg"[: 1 + i % 5], temperature=1.2, seed=i, n=1 + i % 2)
                for i in range(14)] + [chat("c", "hi", max_tokens=4)]
    whole = run_requests(tmp_path, chat_dir, requests, name="whole")
    write_requests(tmp_path / "in.jsonl", requests)
    proc = job(tmp_path, chat_dir, fault=("KILL", "after-commit", 1))
    assert proc.returncode == -9, proc.stderr
    proc = job(tmp_path, chat_dir)
    assert proc.returncode == 0 and "resuming" in proc.stderr, proc.stderr
    assert (tmp_path / "out.jsonl").read_bytes() == whole
