"""Progress under a pipe: every phase that can run long says where it is (per layer loading, per
decode step generating, in one-prompt runs, one-block jobs, `eval agreement` and the Python API
when asked), one line per interval, and the last line is never printed twice."""
import contextlib
import io
import json
import re

import pytest

from flexevict.api import LLM
from flexevict.runtime.progress import Progress
from test_batch_job import write_rows
from test_cli import run, tiny_dir  # noqa: F401 (fixture)


@pytest.fixture
def every_update(monkeypatch):
    """A progress line at every update (the interval is 0 s)."""
    monkeypatch.setenv("FLEXEVICT_PROGRESS_SECONDS", "0")


def lines_of(text: str, what: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(f"{what}: ")]


def test_the_last_line_is_not_repeated(every_update):
    out = io.StringIO()
    with Progress(3, "work", "item", file=out) as bar:
        for _ in range(3):
            bar.update()
    assert lines_of(out.getvalue(), "work") == [
        ln for ln in out.getvalue().splitlines()]            # nothing else printed
    assert len(lines_of(out.getvalue(), "work")) == 3         # one per update, none at close
    out = io.StringIO()
    with Progress(3, "work", "item", file=out) as bar:
        bar.update()
        bar.interval = 3600                                   # the next update prints nothing
        bar.update()
    assert [ln.split(",")[0] for ln in lines_of(out.getvalue(), "work")] == [
        "work: 1/3 items", "work: 2/3 items"]                 # close says the rest, once


def test_a_unit_in_flight_moves_the_eta(every_update):
    out = io.StringIO()
    with Progress(4, "work", "prompt", "tokens", file=out) as bar:
        bar.update(0, 10, partial=2.0)                       # half the work done, none finished
    line = lines_of(out.getvalue(), "work")[0]
    assert line.startswith("work: 0/4 prompts") and "ETA ?" not in line


def test_one_prompt_reports_every_decode_step(every_update, tiny_dir):  # noqa: F811
    proc = run("generate", "--model", tiny_dir, "--prompt", "abc", "--max-new-tokens", "7",
               "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    steps = lines_of(proc.stderr, "generating")
    assert [int(re.match(r"generating: (\d+)/7", s).group(1)) for s in steps] == \
        list(range(1, len(steps) + 1))
    assert len(steps) >= 1 and len(lines_of(proc.stderr, "loading")) >= 2


def test_a_one_block_job_moves_every_step(every_update, tmp_path, tiny_dir):  # noqa: F811
    write_rows(tmp_path / "in.jsonl", [{"id": i, "prompt": "ab" * (i + 1)} for i in range(3)])
    proc = run("generate", "--model", tiny_dir, "--input", str(tmp_path / "in.jsonl"),
               "--output", str(tmp_path / "out.jsonl"), "--max-new-tokens", "9", "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    steps = lines_of(proc.stderr, "generating")
    assert len(steps) >= 9 and len(steps) == len(set(steps)), steps     # no line twice
    assert steps[-1].startswith("generating: 3/3 prompts")
    tokens = sum(json.loads(x)["tokens"] for x in (tmp_path / "out.jsonl").read_text().split("\n")
                 if x)
    summary = json.loads((tmp_path / "out.summary.json").read_text())
    assert summary["generated_tokens"] == tokens


def test_the_python_api_reports_when_asked(every_update, tiny_dir):  # noqa: F811
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        quiet = LLM(tiny_dir)
        quiet.generate(["abc"], max_new_tokens=4)
        quiet.close()
    assert err.getvalue() == ""
    with contextlib.redirect_stderr(err):
        llm = LLM(tiny_dir, progress=True)
        out = llm.generate(["abc", "abcdef"], max_new_tokens=5)
        llm.close()
    assert lines_of(err.getvalue(), "loading")
    steps = lines_of(err.getvalue(), "generating")
    assert steps[-1].startswith("generating: 2/2 prompts") and len(steps) >= 5
    assert sum(o["tokens"] for o in out) >= 2


def test_eval_agreement_reports_every_step(every_update, tmp_path, tiny_dir):  # noqa: F811
    write_rows(tmp_path / "in.jsonl", [{"id": 1, "prompt": "abcabc"}, {"id": 2, "prompt": "xy"}])
    proc = run("eval", "agreement", "--model", tiny_dir, "--policy", "h2o", "--budget", "0.5",
               "--input", str(tmp_path / "in.jsonl"), "--max-new-tokens", "6", "--threads", "1",
               "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["prompts"] == 2                 # stdout: the JSON alone
    assert len(lines_of(proc.stderr, "generating")) >= 2 * 6       # reference and policy runs


def test_a_long_unit_still_prints_a_line_each_interval_from_the_innermost_bar(monkeypatch):
    """No update for several intervals (a long prefill): lines keep coming on the timer, from
    the innermost open bar only, and none once the bars are closed."""
    import time
    monkeypatch.setenv("FLEXEVICT_PROGRESS_SECONDS", "0.05")
    out = io.StringIO()
    with Progress(2, "sweep", "cell", file=out):
        with Progress(8, "generating", "prompt", file=out):
            time.sleep(0.5)
        inner_done = len(out.getvalue().splitlines())
        time.sleep(0.3)
    time.sleep(0.2)
    text = out.getvalue()
    assert len(lines_of(text, "generating")) >= 4            # on the timer, nothing updated
    assert all(ln.startswith("generating: ") for ln in text.splitlines()[:inner_done])
    assert len(lines_of(text, "sweep")) >= 2                 # the outer one, once alone
    closed = len(text.splitlines())
    time.sleep(0.2)
    assert len(out.getvalue().splitlines()) == closed        # closed bars stay quiet
