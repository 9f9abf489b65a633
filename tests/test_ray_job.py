"""The batch job on Ray (`--ray auto --workers N`) on a local 2-CPU cluster of CPU workers:
the same bytes as the single-machine path with 1 or 2 workers, every id exactly once when a
worker process dies mid-job, and a job stopped on one machine finished on Ray."""
import glob
import json
import os
import subprocess
import sys
import time

import pytest

try:
    import ray
except ImportError:
    pytest.skip('Ray not installed: pip install "ray[data]==2.60.0" (tests/run.sh does)',
                allow_module_level=True)

from flexevict.generate import main
from flexevict.jobs import ray_job
from test_batch_job import ROWS, job, write_rows
from test_cli import tiny_dir  # noqa: F401 (fixture)
from test_openai_batch import MIXED, chat_dir, write_requests  # noqa: F401 (fixture)

FLAGS = ["--max-new-tokens", "6", "--threads", "1", "--gpu-batch-size", "3",
         "--num-gpu-batches", "2", "--window", "12"]


@pytest.fixture(scope="module")
def cluster():
    """Two CPUs, both taken by two engine actors (the driver reads the input). Its workers
    keep the test's niceness, as a cluster the job starts does: at Ray's default of 15 they
    starve beside the other test workers (20x slower with the cores busy)."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             _system_config={"worker_niceness": 0})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def local_output(tmp_path_factory, tiny_dir):  # noqa: F811
    d = tmp_path_factory.mktemp("local")
    write_rows(d / "in.jsonl", ROWS)
    main(["--model", tiny_dir, "--input", str(d / "in.jsonl"), "--output", str(d / "out.jsonl"),
          *FLAGS])
    return (d / "out.jsonl").read_bytes()


def run_on_ray(tmp_path, model, workers, out="out.jsonl"):
    main(["--model", model, "--input", str(tmp_path / "in.jsonl"), "--output",
          str(tmp_path / out), *FLAGS, "--ray", "auto", "--workers", str(workers)])
    return (tmp_path / out).read_bytes()


@pytest.mark.slow
def test_one_or_two_workers_match_the_local_path(cluster, tmp_path, tiny_dir,  # noqa: F811
                                                 local_output):
    write_rows(tmp_path / "in.jsonl", ROWS)
    assert run_on_ray(tmp_path, tiny_dir, 1, "one.jsonl") == local_output
    assert run_on_ray(tmp_path, tiny_dir, 2, "two.jsonl") == local_output
    summary = json.loads((tmp_path / "two.summary.json").read_text())
    assert summary["ray"] == {"address": "auto", "workers": 2}
    assert not os.path.exists(tmp_path / "two.jsonl.state")


class CrashOnce(ray_job.EngineWorker):
    """A worker that exits its process on its first block while the file `flag` exists
    (deleting it first): exactly one worker dies mid-job. Pickled by value, so the class and
    its `flag` reach the Ray workers without being importable there."""
    flag = ""

    def run(self, block):
        self.blocks = getattr(self, "blocks", 0) + 1
        if self.blocks == 1:
            try:
                os.remove(self.flag)
                os._exit(1)
            except FileNotFoundError:
                pass
        return super().run(block)


@pytest.mark.slow
def test_openai_requests_give_the_local_lines(cluster, tmp_path, chat_dir):  # noqa: F811
    """OpenAI batch requests with their own settings (lengths, temperatures, seeds, n, chat
    and completions): the same output lines on two Ray workers as on this machine."""
    write_requests(tmp_path / "in.jsonl", [
        {**r, "custom_id": f"{r['custom_id']}-{k}"} for k in range(3) for r in MIXED])
    main(["--model", chat_dir, "--input", str(tmp_path / "in.jsonl"), "--output",
          str(tmp_path / "local.jsonl"), *FLAGS])
    local = (tmp_path / "local.jsonl").read_bytes()
    assert local.count(b'"status_code": 200') == 3 * len(MIXED)
    assert run_on_ray(tmp_path, chat_dir, 2, "ray.jsonl") == local


@pytest.mark.slow
def test_a_worker_killed_mid_job_still_gives_every_id_once(
        cluster, tmp_path, tiny_dir, local_output, monkeypatch):  # noqa: F811 (the fixture)
    """The first worker to see the flag file deletes it and exits its process on its first
    block; Ray restarts the actor and retries the block."""
    write_rows(tmp_path / "in.jsonl", ROWS)
    flag = tmp_path / "crash-once"
    flag.write_text("")
    monkeypatch.setattr(CrashOnce, "flag", str(flag))
    monkeypatch.setattr(ray_job, "EngineWorker", CrashOnce)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        got = run_on_ray(tmp_path, tiny_dir, 2)
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    assert not flag.exists()                          # a worker really died
    ids = [json.loads(line)["id"] for line in got.splitlines()]
    assert ids == [r["id"] for r in ROWS]
    assert got == local_output


@pytest.mark.slow
def test_a_job_stopped_here_finishes_on_ray(cluster, tmp_path, tiny_dir,  # noqa: F811
                                            local_output):
    """Both paths use the same commit log: kill -9 a local run after 2 blocks, rerun on Ray."""
    write_rows(tmp_path / "in.jsonl", ROWS)
    proc = job(tmp_path, tiny_dir, fault=("KILL", "after-commit", 2))
    assert proc.returncode == -9
    assert run_on_ray(tmp_path, tiny_dir, 2) == local_output
    summary = json.loads((tmp_path / "out.summary.json").read_text())
    assert summary["rows_resumed"] == 12 and summary["this_run"]["rows"] == len(ROWS) - 12


@pytest.mark.slow
def test_more_workers_than_the_cluster_holds_is_refused(cluster, tmp_path, tiny_dir,  # noqa: F811
                                                        capsys):
    write_rows(tmp_path / "in.jsonl", ROWS[:4])
    with pytest.raises(SystemExit) as exit_:
        run_on_ray(tmp_path, tiny_dir, 3)
    assert exit_.value.code == 2
    assert "--workers 3 needs 3 CPUs on the Ray cluster, which has 2" in capsys.readouterr().err


@pytest.mark.slow
def test_a_job_that_starts_ray_is_quiet_tidy_and_keeps_the_users_niceness(
        tmp_path, tiny_dir, local_output):  # noqa: F811
    """In a fresh process (the CLI starts its own Ray): no error-level log line (Ray Data's
    actor pools logged one per run about their constructor arguments), no Ray process left
    once it exits, and its workers run at the user's niceness (Ray's default is 15)."""
    write_rows(tmp_path / "in.jsonl", ROWS)
    argv = ["--model", tiny_dir, "--input", str(tmp_path / "in.jsonl"), "--output",
            str(tmp_path / "out.jsonl"), *FLAGS, "--ray", "auto", "--workers", "2"]
    before = _ray_pids()
    proc = subprocess.run([sys.executable, "-m", "flexevict.generate", *argv],
                          capture_output=True, text=True, env=_without_ray_address())
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out.jsonl").read_bytes() == local_output
    noisy = [line for line in proc.stderr.splitlines()
             if " E " in line[:40] or "ERROR" in line or "core_worker" in line]
    assert not noisy, noisy
    deadline = time.monotonic() + 10
    while _ray_pids() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _ray_pids() - before
    probe = ("import os, ray\nfrom flexevict.jobs.ray_job import connect\n"
             "assert connect(ray, 'auto')\n"
             "print(ray.get(ray.remote(lambda: os.nice(0)).remote()), os.nice(0))\n")
    nice = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env=_without_ray_address())
    assert nice.returncode == 0, nice.stderr
    worker, user = nice.stdout.split()
    assert worker == user


def _without_ray_address() -> dict:
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}


def _ray_pids() -> set[int]:
    """Running Ray processes (raylet, gcs_server, workers), by pid."""
    found = set()
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "raylet" in cmd or "gcs_server" in cmd or "ray::" in cmd:
            found.add(int(path.split("/")[2]))
    return found
