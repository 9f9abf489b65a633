"""bench/suites.py: a GPU run's two device calls (dry run, file count, deadline, a
failed step does not stop the call), the suites' case selection, and the peer skipped where the
engine's case cannot fit. Everything here runs on a CPU with a fake command runner."""
import fnmatch
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from flexevict.errors import UserError

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
_spec = importlib.util.spec_from_file_location("bench_suites", os.path.join(BENCH, "suites.py"))
suites = sys.modules["bench_suites"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(suites)

NO_FIT = ("flexevict.bench: error: out of CPU memory: opt-30b with 3 GPU batch(es) needs about "
          "160.0 GiB; this machine has 120.0 GiB available")


@pytest.fixture
def wheels(tmp_path, monkeypatch):
    """A bench/wheels/ stand-in holding (empty) gguf and flexgen wheels; per-case files and
    stray files go to a scratch folder under tmp_path."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    for name in ("gguf-0.19.0-py3-none-any.whl", "flexgen-0.1.8-py3-none-any.whl"):
        (folder / name).write_bytes(b"")
    monkeypatch.setattr(suites, "WHEELS", str(folder))
    monkeypatch.setattr(suites, "SCRATCH", str(tmp_path / "scratch"))
    return folder


class FakeRunner:
    """Records every step; writes each declared output (globs made concrete) plus two stray
    files; fails the steps named in `fail`."""

    def __init__(self, out, fail=()):
        self.out, self.fail, self.calls = out, set(fail), []

    def __call__(self, step, log, env, timeout):
        self.calls.append((step, timeout, env))
        log.write(f"fake output of {step.name}\n")
        for name in step.outputs:
            (self.out / name.replace("*", "cpython-312-x86_64-linux-gnu")).write_text("{}")
        (self.out / f"stray-{len(self.calls)}.json").write_text("{}")
        (self.out / "sub").mkdir(exist_ok=True)
        (self.out / "sub" / f"deep-{len(self.calls)}.txt").write_text("x")
        return 1 if step.name in self.fail else 0


def files_under(folder):
    return [os.path.relpath(os.path.join(d, f), folder)
            for d, _, names in os.walk(folder) for f in names]


# ------------------------------------------------------------------------------ the plan

def test_dry_run_prints_two_calls_each_under_nine_minutes():
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "suites.py"), "gpu", "--dry-run"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    calls = re.findall(r"^call (\d): FLEXEVICT_COMMIT=\S+ python3 bench/suites.py gpu --call \1 "
                       r"--out \$OUT$", out, re.M)
    assert calls == ["1", "2"]
    totals = re.findall(r"^  total ([\d.]+) min(?: \(([\d.]+) if [^)]*\))?, limit 9;", out, re.M)
    assert len(totals) == 2
    for total, worst in totals:
        assert 0 < float(total) < 9 and float(worst or total) < 9
    step = re.compile(r"^ +([\d.]+) min  (.+?): (.+)$", re.M)
    blocks = re.split(r"^call \d: .*$", out, flags=re.M)[1:]
    for block, (total, _) in zip(blocks, totals):     # the steps' estimates add up to the total
        assert sum(float(m) for m, _, _ in step.findall(block)) == pytest.approx(float(total),
                                                                                abs=0.051)
    cmds = " ".join(cmd for _, _, cmd in step.findall(out))
    for needle in ("ln -sfn ../policies flexevict/policies", "--no-index --target",
                   "flexevict.bench.kernels --load",
                   "-p flexevict.bench.gpu_tests", "-n 8 --timeout 120",
                   "FLEXGEN_PYTHON=", "flexevict.calibrate --device cuda", "suites.py recall"):
        assert needle in cmds, needle


@pytest.mark.parametrize("call", [1, 2])
def test_each_call_sends_back_at_most_eight_files(call):
    steps = suites.gpu_plan(call, "/out")
    files = suites.call_files(call, steps)
    assert len(files) <= suites.MAX_FILES and len(set(files)) == len(files)
    for name in files:                  # the device tool takes letters, digits, '.', '_', '-'
        assert re.fullmatch(r"[A-Za-z0-9._*-]+", name), name
    assert sum(s.minutes + s.fallback_min for s in steps) < suites.CALL_LIMIT_MIN


@pytest.mark.parametrize("call", [1, 2])
def test_plan_cases_exist_in_their_suites(call):
    """A typo in a case name would only show on the GPU machine, as a lost step."""
    for step in suites.gpu_plan(call, "/out"):
        m = re.search(r"bench/suites\.py (\S+) (.*)", step.cmd)
        if m:
            names = {c["name"] for c in suites.SUITES[m.group(1)]()}
            picked = re.findall(r"--case (\S+)", m.group(2))
            assert picked and set(picked) <= names, (picked, names)


def test_call_continues_after_a_failure_and_keeps_eight_files(tmp_path, wheels, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    fake = FakeRunner(out, fail={"GPU tests"})
    monkeypatch.setattr(suites, "run_shell", fake)
    rc = suites.run_call(1, str(out))
    names = [s.name for s, _, _ in fake.calls]
    assert names == [s.name for s in suites.gpu_plan(1, str(out))]          # none skipped
    assert rc == 1                                                          # one failed
    left = files_under(out)
    assert len(left) <= suites.MAX_FILES
    assert not any(f.startswith(("stray-", "sub")) for f in left)           # moved away
    assert "stray-1.json" in os.listdir(tmp_path / "scratch" / "stray")
    expected = suites.call_files(1, suites.gpu_plan(1, str(out)))
    assert all(any(fnmatch.fnmatch(f, pat) for pat in expected) for f in left)
    record = json.loads((out / "call1-plan.json").read_text())
    status = {s["name"]: s["status"] for s in record["steps"]}
    assert status["GPU tests"] == "failed (exit 1)"
    assert status["flexgen install"] == "ok" and record["commit"]
    log = (out / "call1-log.txt").read_text()
    assert log.count("=====") == 2 * len(names) and "fake output of flexgen install" in log
    assert all(env["HF_HUB_OFFLINE"] == "1" and env["FLEXEVICT_COMMIT"] == record["commit"]
               for _, _, env in fake.calls)


def test_no_step_runs_past_the_call_deadline(tmp_path, wheels, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    fake = FakeRunner(out)
    monkeypatch.setattr(suites, "run_shell", fake)
    monkeypatch.setattr(suites, "DEADLINE_S", 100.0)
    suites.run_call(2, str(out))
    assert fake.calls and all(timeout <= 100.0 for _, timeout, _ in fake.calls)
    monkeypatch.setattr(suites, "DEADLINE_S", 0.0)
    fake.calls.clear()
    assert suites.run_call(2, str(out)) == 1
    record = json.loads((out / "call2-plan.json").read_text())
    assert not fake.calls
    assert all(s["status"].startswith("skipped") for s in record["steps"])


def test_missing_wheels_fail_early_with_one_line(tmp_path, wheels, monkeypatch, capsys):
    (wheels / "flexgen-0.1.8-py3-none-any.whl").unlink()
    fake = FakeRunner(tmp_path)
    monkeypatch.setattr(suites, "run_shell", fake)
    with pytest.raises(SystemExit) as e:
        suites.main(["gpu", "--call", "1", "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and not fake.calls
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "flexgen-0.1.8-*.whl" in err[0] and "pip download" in err[0]


def test_call_2_takes_carried_kernels(tmp_path, wheels, monkeypatch):
    so = tmp_path / "_C.cpython-312-x86_64-linux-gnu.so"
    so.write_bytes(b"")
    step = suites.gpu_plan(2, "/out", so=str(so))[1]
    assert step.name == "place kernels" and f"cp {so} flexevict/" in step.cmd
    assert suites.KNOWN_SO in suites.gpu_plan(2, "/out")[1].cmd
    with pytest.raises(UserError, match="expected the _C"):
        suites.run_call(2, str(tmp_path / "out"), so=str(tmp_path / "kernels.so"))


def test_run_shell_records_output_and_kills_on_timeout(tmp_path):
    log_path = tmp_path / "log.txt"
    with open(log_path, "w") as log:
        ok = suites.run_shell(suites.Step("echo", "echo hello; exit 3", 0.1), log, dict(os.environ),
                              timeout=30)
        late = suites.run_shell(suites.Step("sleep", "sleep 30", 0.1), log, dict(os.environ),
                                timeout=0.5)
    assert ok == 3 and late == 124 and "hello" in log_path.read_text()


@pytest.mark.slow
def test_gpu_tests_plugin_keeps_only_the_tests_that_need_cuda():
    root = os.path.dirname(BENCH)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "flexevict.bench.gpu_tests",
                           "tests/test_kernels.py", "tests/test_cuda_build.py", "--collect-only",
                           "-q", "-p", "no:cacheprovider"], capture_output=True, text=True,
                          cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ids = [ln for ln in proc.stdout.splitlines() if "::" in ln]
    assert ids and all(i.startswith("tests/test_kernels.py::") for i in ids)
    assert any("test_decode_attention_kernel" in i for i in ids)
    assert not any("test_backend_names" in i or "reference_vs" in i for i in ids)


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
