"""`python -m flexevict.bench` end to end on CPU: the result block and JSON, projection, and the
one-line errors for settings that cannot fit."""
import json

import pytest
from test_cli import assert_user_error, run

from flexevict.bench.throughput import project_decode

SMALL = ["--model", "opt-125m", "--device", "cpu", "--prompt-len", "24", "--gen-len", "6",
         "--gpu-batch-size", "2", "--num-gpu-batches", "2", "--no-warmup"]


def test_result_block_and_json(tmp_path):
    out = tmp_path / "r.json"
    proc = run("bench", *SMALL, "--policy", "h2o", "--budget", "0.5",
               "--percent", "0", "100", "0", "100", "100", "0", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    for label in ("model size:", "cache size:", "hidden size (p):", "peak gpu mem:",
                  "peak cpu rss:", "projected: False", "prefill latency:", "decode throughput:",
                  "total throughput:", "policy: policy=h2o slots=15", "eviction time:",
                  "bytes moved:", "kernels"):
        assert label in proc.stdout, label
    r = json.loads(out.read_text())
    assert r["batch"] == 4 and r["policy"]["slots"] == 15          # floor(0.5 * 30)
    total = r["prefill_latency_s"] + r["decode_latency_s"]
    assert r["total_throughput"] == pytest.approx(4 * 6 / total)
    assert r["prefill_throughput"] == pytest.approx(4 * 24 / r["prefill_latency_s"])
    assert len(r["step_seconds"]) == 6 and not r["projected"]
    assert r["peak_cpu_rss_gb"] > 0.1                               # measured, not a zero
    assert r["bytes_moved"]["cpu->gpu"] > 0 and r["eviction_s"] > 0
    assert r["run"]["commit"] and r["run"]["torch"] and r["run"]["kernels"]


def test_cut_gen_len_projects_the_rest(tmp_path):
    out = tmp_path / "r.json"
    proc = run("bench", *SMALL[:-5], "--gen-len", "12", "--cut-gen-len", "4", "--gpu-batch-size",
               "2", "--num-gpu-batches", "1", "--no-warmup", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert "projected: True" in proc.stdout and r["projected"]
    assert len(r["step_seconds"]) == 4 and r["decode_latency_s"] > sum(r["step_seconds"][1:])


def test_projection_extrapolates_the_measured_trend():
    assert project_decode([1.0, 0.5, 0.5], 3) == (1.0, False)
    latency, projected = project_decode([9.0, 1.0, 1.0, 2.0, 3.0], 8)   # steady steps 1, 2, 3
    assert projected and latency == pytest.approx(1 + 1 + 2 + 3 + 4 + 5 + 6)


def test_model_too_big_for_memory_gives_estimate_and_fix():
    proc = run("bench", "--model", "opt-175b", "--device", "cpu", "--gpu-batch-size", "1")
    assert_user_error(proc, "out of CPU memory", "opt-175b", "GiB", "--percent", "--compress-weight")


def test_gpu_mem_limit_needs_cuda():
    proc = run("bench", *SMALL, "--gpu-mem-limit", "16")
    assert_user_error(proc, "--gpu-mem-limit needs a CUDA device")


def test_long_opt_run_needs_the_timing_only_flag():
    proc = run("bench", "--model", "opt-125m", "--device", "cpu", "--prompt-len", "2048",
               "--gen-len", "8", "--gpu-batch-size", "1")
    assert_user_error(proc, "maximum of 2048 positions")
