"""bench/suites.py: case selection, the peer skipped where the engine's case cannot fit, the
prediction next to the measurement, and a suite run in pieces (results read back, not run
again; --max-minutes stops between cases). Everything here runs on a CPU with a fake engine."""
import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest

from flexevict.errors import UserError

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
_spec = importlib.util.spec_from_file_location("bench_suites", os.path.join(BENCH, "suites.py"))
suites = sys.modules["bench_suites"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(suites)

NO_FIT = ("flexevict.bench: error: out of CPU memory: opt-30b with 3 GPU batch(es) needs about "
          "160.0 GiB; this machine has 120.0 GiB available")


# ------------------------------------------------------------------------------ the suites

def test_h2os_table_runs_uncut_and_its_eager_h2o_apart():
    """full's step grows with the context and graphed h2o captures for a whole ring lap: both
    uncut; the eager h2o (its eviction share timed) is flat and may be cut."""
    cases = {c["name"]: c["argv"] for c in suites.suite_h2o()}
    for bs in (24, 64):
        for policy in ("full", "h2o"):
            assert "--cut-gen-len" not in cases[f"opt-6.7b-2048+2048-bs{bs}-{policy}"]
    eager = cases["opt-6.7b-2048+2048-bs24-h2o-eager"]
    assert "--cut-gen-len" in eager and eager[eager.index("--cuda-graphs") + 1] == "false"
    for c in suites.suite_h2o_policies():
        assert c["argv"][c["argv"].index("--cuda-graphs") + 1] == "false"


def test_case_selection_and_cut_override():
    args = suites.argparse.Namespace(suite="h2o", only=None, cut_gen_len=16,
                                     case=["opt-6.7b-2048+2048-bs24-full"])
    (picked,) = suites.select(args)
    argv = picked["argv"]
    assert argv.count("--cut-gen-len") == 1 and argv[argv.index("--cut-gen-len") + 1] == "16"
    args.case = ["opt-6.7b-2048+2048-bs24-ful"]
    with pytest.raises(UserError, match="not in suite 'h2o'"):
        suites.select(args)


def test_peer_skipped_when_the_engine_case_does_not_fit(tmp_path, monkeypatch):
    peers = []
    monkeypatch.setattr(suites, "run_engine", lambda c, out: {"error": NO_FIT})
    monkeypatch.setattr(suites, "run_peer", lambda c, out: peers.append(c["name"]))
    summary = tmp_path / "summary.json"
    suites.main(["flexgen", "--case", "opt-30b", "--out", str(tmp_path), "--json", str(summary)])
    assert peers == []
    table = (tmp_path / f"flexgen_{suites.device_label()}.md").read_text()
    row = [ln for ln in table.splitlines() if ln.startswith("| opt-30b |")][0]
    assert "out of CPU memory" in row and "peer skipped: engine case does not fit" in row
    (case,) = json.loads(summary.read_text())["cases"]
    assert case["peer"] == {"skipped": suites.PEER_SKIPPED}


def test_peer_runs_when_the_engine_case_fits_or_fails_otherwise(tmp_path, monkeypatch):
    peers = []
    results = iter([{"error": "flexevict.bench: error: some other failure"}])
    monkeypatch.setattr(suites, "run_engine", lambda c, out: next(results))
    monkeypatch.setattr(suites, "run_peer",
                        lambda c, out: peers.append(c["name"]) or {"error": "flexgen failed"})
    suites.main(["flexgen", "--case", "opt-6.7b", "--out", str(tmp_path)])
    assert peers == ["opt-6.7b"]


def test_suite_tables_put_the_prediction_next_to_the_measurement(tmp_path, monkeypatch):
    result = {"gen_len": 33, "prefill_latency_s": 2.0, "decode_latency_s": 3.2,
              "total_throughput": 90.0, "policy": {"policy": "h2o", "slots": 819}, "batch": 24,
              "prefill_throughput": 1e4, "decode_throughput": 200.0, "peak_gpu_mem_gb": 40.0,
              "peak_cpu_rss_gb": 3.0, "eviction_share_of_decode": 0.1,
              "predicted": {"prefill_s": 1.8, "decode_step_s": 0.11, "throughput": 100.0,
                            "bound": "decode: 80% of the step is bound by compute",
                            "calibration": {"synthetic": False, "quick": True}}}
    monkeypatch.setattr(suites, "run_engine", lambda c, out: result)
    monkeypatch.setattr(suites, "run_peer", lambda c, out: None)
    suites.main(["h2o", "--case", "opt-6.7b-2048+2048-bs24-h2o", "--out", str(tmp_path)])
    table = (tmp_path / f"h2o_{suites.device_label()}.md").read_text()
    row = [ln for ln in table.splitlines() if ln.startswith("| opt-6.7b-2048+2048-bs24-h2o |")
           and "quick" in ln]
    assert row == ["| opt-6.7b-2048+2048-bs24-h2o | 1.80 / 2.00 | 110.0 / 100.0 | 100.0 / 90.0 "
                   "| 0.90 | quick | decode: 80% of the step is bound by compute |"]


RESULT = {"gen_len": 33, "prefill_latency_s": 2.0, "decode_latency_s": 3.2,
          "total_throughput": 90.0, "policy": {"policy": "h2o", "slots": 819}, "batch": 24,
          "prefill_throughput": 1e4, "decode_throughput": 200.0, "peak_gpu_mem_gb": 40.0,
          "peak_cpu_rss_gb": 3.0, "eviction_share_of_decode": 0.1}
H2O = ["opt-6.7b-2048+2048-bs24-full", "opt-6.7b-2048+2048-bs24-h2o"]     # suite order


def test_a_suite_goes_on_where_it_stopped(tmp_path, monkeypatch):
    """Run in two pieces: the second reads the first's case back and runs only the other; a
    case whose command changed (another cut) runs again."""
    ran = []
    monkeypatch.setattr(suites, "run_engine", lambda c, out: ran.append(c["name"]) or RESULT)
    picks = ["--case", H2O[0], "--out", str(tmp_path)]
    suites.main(["h2o", *picks])
    suites.main(["h2o", *picks, "--case", H2O[1]])
    assert ran == H2O
    summary = json.loads((tmp_path / f"h2o_{suites.device_label()}.json").read_text())
    assert sorted(c["case"] for c in summary["cases"]) == sorted(H2O)
    assert summary["cases_left"] == []
    suites.main(["h2o", *picks, "--cut-gen-len", "8"])
    assert ran == H2O + [H2O[0]]


def test_max_minutes_starts_no_case_after_the_limit(tmp_path, monkeypatch, capsys):
    clock = iter([0.0, 0.0, 100.0, 100.0])              # start, case 1, case 2 (past 1 min)
    monkeypatch.setattr(suites, "time", types.SimpleNamespace(monotonic=lambda: next(clock)))
    ran = []
    monkeypatch.setattr(suites, "run_engine", lambda c, out: ran.append(c["name"]) or RESULT)
    argv = ["h2o", "--case", H2O[0], "--case", H2O[1], "--out", str(tmp_path), "--max-minutes",
            "1"]
    with pytest.raises(SystemExit) as stop:
        suites.main(argv)
    assert stop.value.code == 3 and ran == H2O[:1]
    assert f"1 case(s) left: {H2O[1]}" in capsys.readouterr().err
    summary = json.loads((tmp_path / f"h2o_{suites.device_label()}.json").read_text())
    assert summary["cases_left"] == H2O[1:]


def test_bad_max_minutes_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "suites.py"), "h2o",
                           "--max-minutes", "0", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--max-minutes 0" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not os.listdir(tmp_path)


@pytest.mark.slow
def test_gpu_only_keeps_only_the_tests_that_need_cuda():
    """`pytest tests --gpu-only` (tests/conftest.py) collects what a GPU machine is for."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--gpu-only", "tests/test_kernels.py",
                           "tests/test_cuda_build.py", "--collect-only", "-q", "-p",
                           "no:cacheprovider"], capture_output=True, text=True,
                          cwd=os.path.dirname(BENCH), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ids = [ln for ln in proc.stdout.splitlines() if "::" in ln]
    assert ids and all(i.startswith("tests/test_kernels.py::") for i in ids)
    assert any("test_decode_attention_kernel" in i for i in ids)
    assert not any("test_backend_names" in i or "reference_vs" in i for i in ids)
