"""Every CLI error path: one line on stderr naming the problem, exit code 2, no traceback (an
exception escaping main fails the test), and no output file that looks complete. Also a real
end-to-end run of each CLI on a tiny model. The CLIs run in this process (`run`); one check
runs a real interpreter (`run_process`)."""
import contextlib
import importlib
import io
import json
import os
import subprocess
import sys

import pytest

from flexevict.core.config import ModelConfig
from flexevict.io.weights import DummyWeights, convert

TINY = ModelConfig(arch="llama", name="tiny", vocab_size=256, hidden_size=32, num_layers=2,
                   num_heads=4, num_kv_heads=2, ffn_size=64, max_positions=64,
                   eos_token_ids=(), pad_token_id=0)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    convert(DummyWeights(TINY, seed=3), TINY, str(d), "float32", tokenizer="bytes")
    return str(d)


MAINS = {"generate": "flexevict.generate", "eval": "flexevict.eval", "plan": "flexevict.plan",
         "calibrate": "flexevict.calibrate", "convert": "flexevict.convert",
         "bench": "flexevict.bench.throughput"}


def run(module, *args):
    """`python -m flexevict.<module> args`, run in this process: its main(argv) with stdout and
    stderr captured and the exit code from SystemExit (what the interpreter would exit with).
    The CLIs' mains are written to run inside a bigger process (thread counts and signal
    handlers restored); this saves each test the 3-4 s of a fresh interpreter importing torch.
    `run_process` is the real thing, for the tests about what a process prints."""
    main = importlib.import_module(MAINS[module]).main
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    return subprocess.CompletedProcess([module, *args], code, out.getvalue(), err.getvalue())


def run_process(module, *args):
    return subprocess.run([sys.executable, "-m", f"flexevict.{module}", *args],
                          capture_output=True, text=True, timeout=300)


def assert_user_error(proc, *needles):
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "error:" in lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_unknown_model_lists_known_names():
    proc = run_process("generate", "--model", "opt-9b", "--prompt", "hi")   # a real process
    assert_user_error(proc, "opt-9b", "opt-125m", "smollm2-135m")


def test_missing_weight_file_is_named(tiny_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in os.listdir(tiny_dir):
        (broken / f).write_bytes(open(os.path.join(tiny_dir, f), "rb").read())
    victim = "model.layers.1.mlp.up_proj.weight.npy"
    os.remove(broken / victim)
    proc = run("generate", "--model", str(broken), "--prompt", "hi")
    assert_user_error(proc, victim, "missing")


def test_corrupt_safetensors_is_named(tmp_path):
    from flexevict.core.config import to_hf_dict
    (tmp_path / "config.json").write_text(json.dumps(to_hf_dict(TINY)))
    from tokenizers import Tokenizer, models
    Tokenizer(models.WordLevel({"a": 0}, unk_token="a")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    proc = run("eval", "ppl", "--model", str(tmp_path), "--text", __file__)
    assert_user_error(proc, "model.safetensors")


def test_corrupt_gguf_is_named(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    proc = run("generate", "--model", str(bad), "--prompt", "hi")
    assert_user_error(proc, "model.gguf")


def test_prompt_longer_than_model_allows(tiny_dir):
    proc = run("generate", "--model", tiny_dir, "--prompt", "x" * 100, "--max-new-tokens", "4")
    assert_user_error(proc, "maximum of 64 positions")


def test_empty_input_file(tmp_path, tiny_dir):
    (tmp_path / "in.jsonl").write_text("\n")
    out = tmp_path / "out.jsonl"
    proc = run("generate", "--model", tiny_dir, "--input", str(tmp_path / "in.jsonl"),
               "--output", str(out))
    assert_user_error(proc, "no prompts")
    assert not out.exists() and not (tmp_path / "out.jsonl.partial").exists()


def test_malformed_jsonl_names_the_line(tmp_path, tiny_dir):
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "a"}\n{"id": 2, "prompt": \n')
    out = tmp_path / "out.jsonl"
    proc = run("generate", "--model", tiny_dir, "--input", str(tmp_path / "in.jsonl"),
               "--output", str(out))
    assert_user_error(proc, "in.jsonl:2")
    assert not out.exists()


def test_missing_prompt_field_names_the_line(tmp_path, tiny_dir):
    (tmp_path / "in.jsonl").write_text('{"id": 1, "text": "a"}\n')
    proc = run("generate", "--model", tiny_dir, "--input", str(tmp_path / "in.jsonl"),
               "--output", str(tmp_path / "o.jsonl"))
    assert_user_error(proc, "in.jsonl:1", "prompt")


def test_missing_text_file():
    proc = run("eval", "ppl", "--model", "opt-125m", "--text", "/nonexistent/file.txt")
    assert_user_error(proc, "/nonexistent/file.txt")


@pytest.mark.parametrize("args,needles", [
    (["--policy", "h3o"], ["h3o", "h2o", "streaming", "hashevict"]),
    (["--policy", "h2o", "--budget", "0"], ["--budget", "(0, 1]"]),
    (["--policy", "h2o", "--budget", "1.5"], ["--budget", "(0, 1]"]),
    (["--policy", "streaming", "--budget-tokens", "3"], ["minimum of 6"]),
    (["--policy", "h2o", "--budget", "0.5", "--policy-arg", "heavy=3"], ["heavy", "h2o"]),
    (["--policy", "streaming", "--budget", "0.5", "--policy-arg", "sinks"], ["name=value"]),
])
def test_bad_policy_input(tiny_dir, args, needles):
    proc = run("generate", "--model", tiny_dir, "--prompt", "hello there", "--max-new-tokens",
               "8", *args)
    assert_user_error(proc, *needles)


def test_generate_prints_resolved_slots(tiny_dir):
    proc = run("generate", "--model", tiny_dir, "--prompt", "x" * 30, "--max-new-tokens", "10",
               "--policy", "h2o", "--budget", "0.5")
    assert proc.returncode == 0, proc.stderr
    assert "policy=h2o slots=20 prefix=9 ring=10 scratch=1" in proc.stderr


def test_generate_jsonl_end_to_end(tmp_path, tiny_dir):
    rows = [{"id": 1, "prompt": "abc"}, {"id": "x", "prompt": "hello world", "extra": True}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    proc = run("generate", "--model", tiny_dir, "--input", str(tmp_path / "in.jsonl"),
               "--output", str(out), "--max-new-tokens", "5", "--batch-size", "2")
    assert proc.returncode == 0, proc.stderr
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["id"] for g in got] == [1, "x"] and got[1]["extra"] is True
    assert all(g["tokens"] == 5 and isinstance(g["completion"], str) for g in got)
    assert not (tmp_path / "out.jsonl.partial").exists()


def test_eval_ppl_json_end_to_end(tmp_path, tiny_dir):
    (tmp_path / "t.txt").write_text("the quick brown fox jumps over the lazy dog " * 3)
    proc = run("eval", "ppl", "--model", tiny_dir, "--text", str(tmp_path / "t.txt"),
               "--max-tokens", "40", "--json")
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert {"model", "policy", "budget", "tokens", "nll", "ppl", "slots"} <= set(res)
    assert res["tokens"] == 40 and res["policy"] == "full"
    assert abs(res["ppl"] - 2.718281828 ** res["nll"]) < 1e-6 * res["ppl"]
    assert "fewer than --max-tokens" not in proc.stderr
    (tmp_path / "s.txt").write_text("a short text")                    # 12 byte tokens
    short = run("eval", "ppl", "--model", tiny_dir, "--text", str(tmp_path / "s.txt"),
                "--max-tokens", "50", "--json")
    assert json.loads(short.stdout)["tokens"] == 12, short.stderr
    assert "has 12 tokens, fewer than --max-tokens 50: scored all 12" in short.stderr


def test_convert_round_trip(tmp_path, tiny_dir):
    """A converted model gives the same logits as its source."""
    import torch
    from flexevict.api import resolve_model
    from flexevict.core.model import Transformer
    from flexevict.io.weights import open_weights
    cfg, path = resolve_model(tiny_dir)
    a = Transformer.load(cfg, open_weights(path, cfg), onednn=False)
    b = Transformer.load(TINY, DummyWeights(TINY, seed=3), onednn=False)
    for wa, wb in zip(a.layers, b.layers):
        for key in wa:
            if wa[key] is not None:
                assert torch.equal(wa[key], wb[key]), key


# ------------------------------------------------------------------------------ CLI layer

CLI_MODULES = {"flexevict.cli", "flexevict.plan", "flexevict.calibrate", "flexevict.eval",
               "flexevict.generate", "flexevict.convert"}


def _is_cli(module: str) -> bool:
    return module in CLI_MODULES or module == "flexevict.bench" or \
        module.startswith("flexevict.bench.")


def test_library_modules_import_no_command_line_module():
    """The command lines sit on top of the library: no library module imports one of them, at
    module level or in a function (the cost model once needed calibrate.py, and the search
    lived in plan.py, which cli.py and the benchmark imported, a cycle)."""
    import test_architecture as A
    known = A.modules()
    wrong = {m: sorted(d for d in A.imported(m, p, known) if _is_cli(d))
             for m, p in known.items() if m not in A.EXTENSIONS and not _is_cli(m)}
    assert {m: d for m, d in wrong.items() if d} == {}


@pytest.mark.slow
def test_plan_and_calibrate_help_describe_the_library():
    """--help keeps describing the search and the measurements, which moved to
    flexevict.planner.search and flexevict.planner.calibration."""
    plan = run("plan", "--help")
    assert plan.returncode == 0 and "The search is exact over a discrete space" in plan.stdout
    cal = run("calibrate", "--help")
    assert cal.returncode == 0 and "What is measured (each the best of a few" in cal.stdout
    assert "flexevict.planner.calibration." not in cal.stdout


def test_plan_checks_the_policy_flags():
    proc = run("plan", "--model", "opt-125m", "--device", "cpu", "--percent", "auto",
               "--policy", "h2o", "--budget", "0.2", "--budget-tokens", "8")
    assert_user_error(proc, "--budget or --budget-tokens")
