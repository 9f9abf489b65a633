"""What every CLI says before a run loads anything: the thread count `--threads auto` picks,
the warning for a run predicted to be slow (with what runs in reasonable time), the plan of a
generate job for its own prompts, and the limits that cannot apply here. Synthetic
calibrations and probes throughout: nothing here measures this machine or asserts a timing."""
import copy
import json
import os
import re
import sys

import pytest
import torch
from test_cli import TINY, assert_user_error, run, tiny_dir  # noqa: F401 (fixture)

from flexevict import generate
from flexevict.core.config import REGISTRY
from flexevict.planner import advice, calibration, probe

FIXTURE = os.environ["FLEXEVICT_CALIBRATION"]


def _calibration(tmp_path, scaling: float, one_thread_overhead: float = 1.0,
                 slower: float = 1.0, quick: bool = False) -> str:
    """The fixture calibration as if measured on 4 threads, where one thread takes `scaling`
    times as long for every kind of work and the engine's fixed costs are
    `one_thread_overhead` times the 4 threads' ones; every time `slower` times as long ->
    its file."""
    data = copy.deepcopy(json.load(open(FIXTURE)))
    data["host"]["threads"], data["gpu_memory_gb"], data["quick"] = 4, None, quick
    cpu = data["devices"]["cpu:float32"]
    cpu["thread_scaling"] = dict.fromkeys(("compute", "memory", "elementwise"), scaling)
    cpu["overhead_one_thread"] = _scaled(cpu["overhead"], lambda key, x: x * one_thread_overhead)
    data = _scaled(data, lambda key, x: x / slower if key == "rate" else x * slower)
    path = tmp_path / f"cal-{scaling}-{one_thread_overhead}-{slower}-{quick}.json"
    path.write_text(json.dumps(data))
    return str(path)


def _scaled(x, f, key=""):
    """Every float of a calibration's record through f(kind, value), kind "rate" for a rate
    (bytes or flop/s) and "time" for seconds; counts, sizes and flags as they are."""
    if isinstance(x, dict):
        return {k: _scaled(v, f, "rate" if k in ("links", "layers", "big") else k)
                for k, v in x.items()}
    if isinstance(x, list):
        return [_scaled(v, f, key) for v in x]
    if not isinstance(x, float):
        return x
    if key == "rate" or key.endswith(("_bw", "_flops")):
        return f("rate", x)
    return f("time", x) if key.endswith("_s") else x


@pytest.fixture
def quiet(monkeypatch):
    """A 4-core machine that nothing else keeps busy."""
    monkeypatch.setattr(calibration, "_cores", lambda: 4)
    monkeypatch.setattr(calibration, "other_work_cores", lambda seconds=0.25: 0.0)
    monkeypatch.setattr(sys.stdin, "isatty", lambda: False, raising=False)


@pytest.fixture
def ran(monkeypatch):
    """generate --prompt without loading the model: what the run would have used."""
    seen = {}

    def generate_one(spec, prompt):
        seen.update(threads=torch.get_num_threads(), spec_threads=spec.threads,
                    placement=spec.placement)
        return "(not generated)"
    monkeypatch.setattr(generate, "generate_one", generate_one)
    return seen


def _generate(model, *extra):
    return run("generate", "--model", model, "--prompt", "hello there", "--max-new-tokens", "4",
               *extra)


# ------------------------------------------------------------------ --threads auto

@pytest.mark.parametrize("scaling, one_thread, expected", [(1.8, 3.0, 4), (1.05, 0.1, 1)])
def test_auto_threads_pick_the_faster_of_one_and_all_by_the_calibration(
        tmp_path, tiny_dir, quiet, ran, scaling, one_thread, expected):  # noqa: F811
    """All cores where the calibration measured them faster (work 1.8x, fixed costs per op 3x
    as long on one thread); one thread where its fixed costs are a tenth of all threads' (a
    small model is made of them). The run uses it, and its first line on stderr says so and
    why."""
    cal = _calibration(tmp_path, scaling, one_thread)
    proc = _generate(tiny_dir, "--threads", "auto", "--calibration", cal)
    assert proc.returncode == 0, proc.stderr
    assert ran["threads"] == ran["spec_threads"] == expected
    first = proc.stderr.splitlines()[0]
    other = 1 if expected == 4 else 4
    assert first.startswith(f"threads: {expected} (auto: predicted "), first
    assert re.search(rf"\d\.\dx as fast as {other} for \S+ here, by the calibration {cal};",
                     first), first


def test_an_explicit_thread_count_is_used_as_given(tmp_path, tiny_dir, quiet, ran):  # noqa: F811
    proc = _generate(tiny_dir, "--threads", "3", "--calibration", _calibration(tmp_path, 1.8))
    assert proc.returncode == 0, proc.stderr
    assert ran["threads"] == ran["spec_threads"] == 3
    assert "threads:" not in proc.stderr


def test_auto_threads_on_a_busy_machine_leave_the_busy_cores(
        tmp_path, tiny_dir, monkeypatch, ran):  # noqa: F811
    """Other work on the cores now: a thread per free core, whatever a quiet machine's
    calibration says (one waiting thread stalls every op: the issue's 10x)."""
    monkeypatch.setattr(calibration, "_cores", lambda: 4)
    monkeypatch.setattr(calibration, "other_work_cores", lambda seconds=0.25: 2.6)
    proc = _generate(tiny_dir, "--threads", "auto", "--calibration", _calibration(tmp_path, 1.8))
    assert proc.returncode == 0, proc.stderr
    assert ran["threads"] == 1
    assert "other work keeps 2.6 of 4 cores busy now" in proc.stderr.splitlines()[0]


def test_without_a_calibration_a_quick_probe_decides_once_per_machine(tmp_path, monkeypatch,
                                                                     quiet):
    """No calibration: the probe's one-thread and all-core times decide, measured once and
    kept in the calibration cache folder; the next choice reads them."""
    monkeypatch.delenv("FLEXEVICT_CALIBRATION")
    monkeypatch.setenv("FLEXEVICT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(probe, "_gemm", lambda: {"1": 1e11, "4": 3e11})
    monkeypatch.setattr(probe, "_layer_seconds", lambda config: {"1": 1e-3, "4": 8e-3})
    config = REGISTRY["smollm2-135m"]
    from flexevict.planner.search import Workload
    from flexevict.policies import PolicySpec
    from flexevict.runtime.placement import Placement
    work = Workload(config, 8, 32, PolicySpec.parse("full"), "cpu", torch.float32)
    threads, why = advice.best_threads(work, None, Placement(gpu_batch_size=1), 1)
    assert threads == 1 and "by a quick probe of this machine" in why
    assert os.path.dirname(probe.path()) == str(tmp_path) and os.path.exists(probe.path())

    def measured(*a):
        raise AssertionError("probed again")
    monkeypatch.setattr(probe, "_layer_seconds", measured)
    monkeypatch.setattr(probe, "_gemm", measured)
    assert advice.best_threads(work, None, Placement(gpu_batch_size=1), 1)[0] == 1


# ------------------------------------------------------------------ slow runs

def test_a_slow_run_is_said_with_what_runs_in_reasonable_time_before_loading(
        tmp_path, tiny_dir, quiet, ran):  # noqa: F811
    """A calibration 10^6 times slower: generate says the predicted time, what it rests on and
    a faster way (the same model on a GPU, placed by the search) before anything loads."""
    cal = _calibration(tmp_path, 1.8, slower=1e6)
    proc = _generate(tiny_dir, "--calibration", cal)
    assert proc.returncode == 0, proc.stderr
    slow = [ln for ln in proc.stderr.splitlines() if ln.startswith("slow: ")]
    assert len(slow) == 1, proc.stderr
    assert re.match(r"slow: predicted about \d+ (min|h|days) here \(from the calibration ", slow[0])
    assert cal in slow[0] and re.search(r"; in reasonable time: \S+ on an NVIDIA H100", slow[0])
    assert "--device cuda --percent 100 0 100 0 100 0 --gpu-batch-size 1" in slow[0]
    assert "placement" in ran                  # said, and the run goes on


BENCH = ["--model", "opt-1.3b", "--device", "cpu", "--prompt-len", "16", "--gen-len", "8",
         "--gpu-batch-size", "1", "--no-warmup", "--threads", "1"]


def _no_loading(monkeypatch):
    from flexevict.bench import throughput

    def load(device):
        raise AssertionError("weights would load now")
    monkeypatch.setattr(throughput, "load_kernels", load)


def test_a_bench_predicted_over_an_hour_refuses_and_says_what_the_estimate_rests_on(
        tmp_path, quiet, monkeypatch):
    """A full calibration's estimate over an hour stops bench before anything loads (unless
    --yes), naming the calibration; the slow line before it names a smaller model with the
    same policy and the GPU alternative."""
    _no_loading(monkeypatch)
    cal = _calibration(tmp_path, 1.8, slower=1500)     # opt-1.3b: 77 min, opt-125m: 8 min
    proc = run("bench", *BENCH, "--policy", "h2o", "--budget", "0.5", "--calibration", cal)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[-1].startswith("flexevict.bench: error: this run is predicted to take about ")
    assert f"from the calibration {cal})" in lines[-1] and "add --yes" in lines[-1]
    slow = [ln for ln in lines if ln.startswith("slow: ")]
    assert len(slow) == 1 and "in reasonable time: " in slow[0], proc.stderr
    smaller = re.search(r"in reasonable time: (\S+) with the same policy here \(about", slow[0])
    assert smaller, slow[0]
    assert REGISTRY[smaller.group(1)].num_params() < REGISTRY["opt-1.3b"].num_params()
    assert "opt-1.3b on an NVIDIA H100" in slow[0] and "--device cuda" in slow[0]


def test_a_quick_calibrations_estimate_alone_never_refuses(tmp_path, quiet, monkeypatch):
    _no_loading(monkeypatch)
    cal = _calibration(tmp_path, 1.8, slower=1500, quick=True)
    with pytest.raises(AssertionError, match="weights would load now"):
        run("bench", *BENCH, "--calibration", cal)


def test_the_bench_fits_suggestion_is_the_plans_answer(quiet, monkeypatch):
    """A batch too big for the memory limit: bench's error names the placement `plan` answers
    for the same flags, and what that prediction rests on (the test calibration)."""
    _no_loading(monkeypatch)
    flags = ["--model", "opt-1.3b", "--device", "cpu", "--cpu-mem-limit", "3",
             "--gpu-batch-size", "2", "--threads", "1"]
    bench, plan = run("bench", *flags), run("plan", *flags)
    fix = re.compile(r"smallest change that fits: (.*?) \(predicted ([\d.]+) token/s, about "
                     r"\d+ \w+ for the batch, from the (?:quick )?calibration (\S+)\)")
    assert_user_error(bench, "out of CPU memory: opt-1.3b with 1 GPU batch(es) of 2")
    assert_user_error(plan, "does not fit: CPU memory binds")
    ours, theirs = fix.search(bench.stderr), fix.search(plan.stderr)
    assert ours and theirs, (bench.stderr, plan.stderr)
    assert ours.groups() == theirs.groups() and ours.group(3) == FIXTURE


# ------------------------------------------------------------------ a generate job's plan

def test_auto_plans_a_generate_job_for_its_longest_prompt(tmp_path, tiny_dir, monkeypatch):  # noqa: F811
    """--percent auto on a job plans for the longest prompt in tokens (not the model's
    maximum) and no more sequences than the job has."""
    import flexevict.jobs
    from flexevict.io.tokenizer import load_tokenizer
    monkeypatch.setattr(flexevict.jobs, "run_job", lambda spec, **kw: None)
    prompts = ["a short one", "the longest prompt of the three", "mid-sized"]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n"
                            for i, p in enumerate(prompts)))
    proc = run("generate", "--model", tiny_dir, "--input", str(path), "--output",
               str(tmp_path / "out.jsonl"), "--max-new-tokens", "4", "--percent", "auto")
    assert proc.returncode == 0, proc.stderr
    longest = max(len(load_tokenizer(tiny_dir).encode(p)) for p in prompts)
    assert longest < TINY.max_positions - 4
    name = os.path.basename(tiny_dir)               # the model's name: its folder's
    assert f"auto plan for {name}: prompt {longest} + gen 4," in proc.stderr
    batch = int(re.search(r"auto predicted: .*\(batch (\d+):", proc.stderr).group(1))
    assert batch <= len(prompts)


def test_auto_plans_a_prompt_for_its_own_length(tiny_dir, ran):  # noqa: F811
    from flexevict.io.tokenizer import load_tokenizer
    proc = _generate(tiny_dir, "--percent", "auto")
    assert proc.returncode == 0, proc.stderr
    tokens = len(load_tokenizer(tiny_dir).encode("hello there"))
    assert f"auto plan for {os.path.basename(tiny_dir)}: prompt {tokens} + gen 4," in proc.stderr
    assert "(batch 1:" in proc.stderr


# ------------------------------------------------------------------ limits that cannot apply

def test_a_gpu_memory_limit_without_a_gpu_is_said_in_one_line(tiny_dir, ran):  # noqa: F811
    proc = run("plan", "--model", "opt-125m", "--device", "cpu", "--prompt-len", "16",
               "--gen-len", "4", "--gpu-mem-limit", "16")
    assert proc.returncode == 0, proc.stderr
    notes = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(notes) == 1 and notes[0].startswith("note: --gpu-mem-limit 16 does not apply: ")
    assert "limits GPU no limit" in proc.stdout            # planned for the CPU
    proc = _generate(tiny_dir, "--device", "cpu", "--gpu-mem-limit", "16")
    assert proc.returncode == 0, proc.stderr
    assert [ln for ln in proc.stderr.splitlines() if ln.startswith("note: --gpu-mem-limit 16")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_planning_for_a_gpu_on_a_cpu_machine_names_the_calibration_file(tmp_path):
    """`plan --device cuda` here, with no calibration named, has no GPU to calibrate: one line
    naming the way to plan for one (the first try printed a traceback from torch.cuda)."""
    import subprocess
    env = {k: v for k, v in os.environ.items() if k != "FLEXEVICT_CALIBRATION"}
    env["FLEXEVICT_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "flexevict.plan", "--model", "opt-30b",
                           "--device", "cuda", "--percent", "auto"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert_user_error(proc, "--calibration", "--synthetic h100", "GPU")
