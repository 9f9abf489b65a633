"""Offload files never outlive their run: every entry point removes its run folder on success,
error, Ctrl-C and SIGTERM; after `kill -9` the next run removes it; unwritable --offload-dir is
named as such."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from flexevict.runtime import rundir
from flexevict.errors import UserError
from test_cli import assert_user_error, run, run_process, tiny_dir  # noqa: F401 (fixture)

DISK = ["--percent", "0", "0", "100", "0", "100", "0"]           # every weight on disk


def runs(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith(rundir.PREFIX)) \
        if os.path.isdir(folder) else []


@pytest.mark.slow
def test_generate_and_eval_remove_their_run_folder(tmp_path, tiny_dir):  # noqa: F811
    """By the time the process has exited (real processes: the folder goes at exit)."""
    off = tmp_path / "off"
    proc = run_process("generate", "--model", tiny_dir, "--prompt", "hello", "--max-new-tokens",
                       "3", *DISK, "--offload-dir", str(off))
    assert proc.returncode == 0, proc.stderr
    (tmp_path / "t.txt").write_text("some text to score " * 5)
    proc = run_process("eval", "ppl", "--model", tiny_dir, "--text", str(tmp_path / "t.txt"),
                       *DISK, "--max-tokens", "30", "--offload-dir", str(off))
    assert proc.returncode == 0, proc.stderr
    assert os.path.isdir(off) and runs(off) == []


def test_an_error_after_loading_removes_the_folder(tmp_path, tiny_dir):  # noqa: F811
    off = tmp_path / "off"
    code = (f"from flexevict import LLM\nfrom flexevict.runtime.placement import Placement\n"
            f"llm = LLM({tiny_dir!r}, placement=Placement(0, 0, offload_dir={str(off)!r}))\n"
            f"import os; assert os.listdir({str(off)!r})\nraise RuntimeError('boom')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "boom" in proc.stderr and proc.returncode == 1
    assert runs(off) == []


def _start_long_job(tmp_path, tiny_dir, off):  # noqa: F811
    rows = "".join(json.dumps({"id": i, "prompt": "abc" * (1 + i % 5)}) + "\n" for i in range(400))
    (tmp_path / "in.jsonl").write_text(rows)
    proc = subprocess.Popen([sys.executable, "-m", "flexevict.generate", "--model", tiny_dir,
                             "--input", str(tmp_path / "in.jsonl"), "--output",
                             str(tmp_path / "out.jsonl"), "--max-new-tokens", "40",
                             "--batch-size", "1", *DISK, "--offload-dir", str(off)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not runs(off):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.1)
    time.sleep(1.0)                                       # well into generation
    assert proc.poll() is None
    return proc


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signals_remove_the_run_folder(tmp_path, tiny_dir, sig, code):  # noqa: F811
    off = tmp_path / "off"
    proc = _start_long_job(tmp_path, tiny_dir, off)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert runs(off) == []


@pytest.mark.slow
def test_kill_9_leaves_files_only_until_the_next_run(tmp_path, tiny_dir):  # noqa: F811
    off = tmp_path / "off"
    proc = _start_long_job(tmp_path, tiny_dir, off)
    proc.kill()
    proc.wait()
    left = runs(off)
    assert len(left) == 1                                  # nothing runs after SIGKILL
    proc = run("generate", "--model", tiny_dir, "--prompt", "hi", "--max-new-tokens", "2", *DISK,
               "--offload-dir", str(off))
    assert proc.returncode == 0, proc.stderr
    assert runs(off) == []                                 # the next run removed it


def test_a_live_owner_keeps_its_folder_and_a_reused_pid_does_not(tmp_path):
    mine = rundir.create(str(tmp_path))
    fake = tmp_path / f"{rundir.PREFIX}{os.getpid()}-old"
    fake.mkdir()
    (fake / rundir.OWNER).write_text(f"{os.getpid()} 1\n")  # our pid, another start time
    assert rundir.remove_stale(str(tmp_path)) == [str(fake)]
    assert os.path.isdir(mine)
    rundir.remove(mine)
    assert not os.path.exists(mine)


@pytest.mark.parametrize("where", ["/proc/nope", "FILE"])
def test_unwritable_offload_dir_says_so(tmp_path, where):
    if where == "FILE":
        where = str(tmp_path / "a-file")
        open(where, "w").close()
    with pytest.raises(UserError, match="not a writable directory"):
        rundir.check_writable(where)


def test_bench_names_an_unwritable_offload_dir():
    proc = run("bench", "--model", "opt-125m", "--device", "cpu", "--prompt-len", "8",
               "--gen-len", "2", "--gpu-batch-size", "1", *DISK, "--offload-dir", "/proc/nope")
    assert_user_error(proc, "/proc/nope", "not a writable directory")
