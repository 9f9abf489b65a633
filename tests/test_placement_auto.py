"""Automatic placement: the calibration, the cost model, the search (`--percent auto` and
friends), `python -m flexevict.plan`, and the predictions every bench run records.

Plans for a GPU use the synthetic H100 calibration (datasheet numbers, no GPU needed); plans for
this CPU use the test fixture calibration (tests/calibration_cpu.json, via conftest.py). Nothing
here asserts a timing."""
import argparse
import copy
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from test_cli import assert_user_error, run

from flexevict import plan as plan_cli
from flexevict.planner import calibration, search as P
from flexevict.api import resolve_model
from flexevict.cli import add_placement_args, add_policy_args, placement_from_args
from flexevict.planner.costmodel import CostModel
from flexevict.errors import UserError
from flexevict.runtime.memory import GIB, MemoryPlan
from flexevict.runtime.placement import Placement
from flexevict.policies import POLICIES, PolicySpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100 = os.path.join(ROOT, "bench", "results", "placement", "calibration_h100_synthetic.json")
BIG = 1 << 50                               # "no limit" that still counts as a number


def model_for(name, prompt, gen, policy="full", budget=None, device="cuda", cal=H100,
              dtype=torch.float16):
    config, _ = resolve_model(name, "_DUMMY_")
    return CostModel(config, calibration.read_file(cal), device, dtype, prompt, gen,
                     PolicySpec.parse(policy, budget))


def limits(gpu_gb=None, cpu_gb=1024, disk_gb=4096):
    return P.Limits(gpu=None if gpu_gb is None else int(gpu_gb * GIB), cpu=int(cpu_gb * GIB),
                    disk=int(disk_gb * GIB))


AUTO = P.PlacementRequest(percent=None, gpu_batch_size=None, num_gpu_batches=None)


# ------------------------------------------------------------------------------ H2O's finding

def test_h2o_batch_64_fits_at_20_percent_and_not_with_full(capsys):
    """OPT-6.7B, 2048 + 2048 tokens, 80 GB: batch 64 fits with h2o at 20% (H2O's table), not
    with the full cache, whose one-line error names the GPU and a batch that fits."""
    argv = ["--model", "opt-6.7b", "--device", "cuda", "--prompt-len", "2048", "--gen-len",
            "2048", "--percent", "100", "0", "100", "0", "100", "0", "--gpu-batch-size", "64",
            "--num-gpu-batches", "1", "--gpu-mem-limit", "80", "--calibration", H100]
    plan_cli.main(argv + ["--policy", "h2o", "--budget", "0.2"])
    out = capsys.readouterr().out
    assert "placement: --percent 100 0 100 0 100 0 --gpu-batch-size 64" in out
    with pytest.raises(SystemExit) as exc:
        plan_cli.main(argv + ["--policy", "full"])
    assert exc.value.code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "does not fit: GPU memory binds" in err[0], err
    assert "smallest change that fits: --gpu-batch-size" in err[0]


def test_a_budget_fits_a_larger_batch_and_predicts_more_than_full():
    limit = limits(gpu_gb=80)
    req = P.PlacementRequest(percent=(100, 0, 100, 0, 100, 0), gpu_batch_size=None,
                             num_gpu_batches=1)
    full = P.search(model_for("opt-6.7b", 2048, 2048), req, limit).best
    h2o = P.search(model_for("opt-6.7b", 2048, 2048, "h2o", 0.2), req, limit).best
    assert h2o.n >= 64 > full.n
    assert h2o.throughput > full.throughput


# ------------------------------------------------------------------------------ monotonicity

@pytest.mark.slow
@pytest.mark.parametrize("vary", ["gpu", "cpu"])
def test_more_memory_never_lowers_the_best_prediction(vary):
    m = model_for("opt-1.3b", 512, 32)
    best = []
    for gb in (1, 2, 4, 8, 32):
        lim = limits(gpu_gb=gb, cpu_gb=64) if vary == "gpu" else limits(gpu_gb=2, cpu_gb=gb)
        try:
            best.append(P.search(m, AUTO, lim, top=1).best.throughput)
        except P.Infeasible:
            best.append(0.0)
    assert all(b >= a for a, b in zip(best, best[1:])), best
    assert best[-1] > best[0]                   # the limit did bind somewhere


def largest_feasible_batch(model, limit) -> int:
    fits = [g for g in P.GPU_BATCH_SIZES
            if model.memory_plan(Placement(gpu_batch_size=g), g).overflow(
                model.device, limit.gpu, limit.cpu, limit.disk) is None]
    return max(fits, default=0)


def test_a_smaller_budget_never_lowers_the_largest_feasible_batch():
    limit = limits(gpu_gb=80)
    batches = [largest_feasible_batch(model_for("opt-6.7b", 2048, 2048, pol, b), limit)
               for pol, b in (("full", None), ("h2o", 0.5), ("h2o", 0.2), ("h2o", 0.1),
                              ("h2o", 0.05))]
    assert all(b >= a for a, b in zip(batches, batches[1:])), batches
    assert batches[0] < 64 <= batches[2]


# ------------------------------------------------------------------------------ the search

@pytest.mark.slow
def test_the_search_is_exact(monkeypatch):
    """Pruning (shape bounds, dominated placements) never drops the best: the search agrees
    with a brute force over every placement of a small space, under a binding GPU limit."""
    monkeypatch.setattr(P, "GPU_BATCH_SIZES", (4, 16))
    monkeypatch.setattr(P, "NUM_GPU_BATCHES", (4,))
    monkeypatch.setattr(P, "WEIGHT_STEP", 20)
    m = model_for("opt-1.3b", 512, 32, "h2o", 0.2)
    lim = limits(gpu_gb=1.5, cpu_gb=16)
    req = dataclass_replace(AUTO, compress_weight=None, cpu_cache_compute=None)
    best = P.search(m, req, lim, top=1).best
    brute = 0.0
    for g in P.GPU_BATCH_SIZES:
        for nb in P.NUM_GPU_BATCHES:
            for wg in range(0, 101, 20):
                for wc in range(0, 101 - wg, 20):
                    for cg in range(0, 101, 10):
                        for cc in range(0, 101 - cg, 10):
                            for act in ((100, 0), (0, 100)):
                                for cw in (False, True):
                                    for ccc in (False, True):
                                        p = Placement(wg, wc, cg, cc, *act, gpu_batch_size=g,
                                                      num_gpu_batches=nb, compress_weight=cw,
                                                      cpu_cache_compute=ccc)
                                        plan = m.memory_plan(p, g * nb)
                                        if plan.overflow("cuda", lim.gpu, lim.cpu,
                                                         lim.disk) is None:
                                            brute = max(brute, m.estimate(p, g * nb).throughput)
    assert best.throughput == pytest.approx(brute, rel=1e-3)   # ties: 3 significant digits


def dataclass_replace(obj, **kw):
    import dataclasses
    return dataclasses.replace(obj, **kw)


def test_a_chosen_plan_passes_the_runs_memory_check():
    m = model_for("opt-30b", 512, 32, "h2o", 0.2)
    lim = limits(gpu_gb=16, cpu_gb=200)
    for e in P.search(m, AUTO, lim).ranked:
        need = e.memory
        assert need["gpu"] <= lim.gpu and need["cpu"] <= lim.cpu
        plan = MemoryPlan(m.config, e.placement, torch.float16, e.n, 512, 32, m.slots)
        assert plan.needs("cuda") == need


def test_the_cost_model_names_what_binds():
    """Weights streamed from the CPU tier: decode is weight loading over the link; without
    overlap every term adds up; compressed weights cross the link in a quarter of the bytes."""
    m = model_for("opt-30b", 512, 32)
    p = Placement(0, 100, 100, 0, 100, 0, gpu_batch_size=8)
    e = m.estimate(p, 8)
    name, share = e.bound("decode")
    assert name == "weight loading (cpu->gpu)" and share > 0.8
    serial = m.estimate(dataclass_replace(p, overlap=False), 8)
    assert serial.total_s > e.total_s
    packed = m.estimate(dataclass_replace(p, compress_weight=True), 8)
    assert packed.step_s < 0.5 * e.step_s


def test_a_cache_home_is_priced_storing_what_a_step_writes_recalls_region_too(monkeypatch):
    """With the cache homed on the CPU a decode step stores back the K/V it wrote: one slot
    per row, and for recall its recalled region as well (pages x page slots, kept there so the
    next step's load brings the pages back)."""
    from flexevict.policies.recall import RecallLayout
    p = Placement(100, 0, 0, 100, 100, 0, gpu_batch_size=4)

    def stored(written):
        monkeypatch.setattr(RecallLayout, "written_per_step", property(written))
        m = model_for("llama-3-8b", 32768, 32, "recall", 0.1)
        plan = m.memory_plan(p, 4)
        return m, m._cache_io(p, plan, plan.sizes, 1, m.groups[0])["store"][1]
    lay = PolicySpec.parse("recall", 0.1).make().layout(32768, 32)
    assert lay.written_per_step == 1 + lay.pages * lay.page > 1
    m, region = stored(RecallLayout.written_per_step.fget)
    _, one_slot = stored(lambda self: 1)
    c = m.config
    extra = 2 * lay.pages * lay.page * 4 * c.num_kv_heads * c.dim_head * m.elem
    assert region - one_slot == pytest.approx(extra / m._store_link("cpu", "gpu"), rel=1e-9)
    # a compressed (lossy) home keeps no region: recall copies every page again each step
    packed = dataclass_replace(p, compress_cache=True)
    plan = m.memory_plan(packed, 4)
    monkeypatch.setattr(RecallLayout, "written_per_step", property(lambda self: 1))
    one = model_for("llama-3-8b", 32768, 32, "recall", 0.1)
    assert m._cache_io(packed, plan, plan.sizes, 1, m.groups[0])["store"] == \
        one._cache_io(packed, one.memory_plan(packed, 4), plan.sizes, 1, one.groups[0])["store"]


# ------------------------------------------------------------------------------ CLI


def test_buzzs_decode_is_priced_by_the_tokens_each_step_attends():
    """BUZZ's middle fills to T and is sampled down again (`BuzzLayout.held`), so its steps
    attend from about a* + k + w tokens up to its peak, not its slots every step: the sampled
    estimate equals pricing every step by its own tokens, and is below pricing the peak."""
    m = model_for("opt-6.7b", 2048, 2048, "buzz", 0.2)
    p = Placement(100, 0, 100, 0, 100, 0, gpu_batch_size=24)
    plan = m.memory_plan(p, 24)
    attended = m.attended
    assert min(attended) < 0.6 * m.slots and max(attended) == m.slots
    every = sum(m._step(p, plan, plan.sizes, i, (n,))[0] for i, n in enumerate(attended, 1))
    peak = sum(m._step(p, plan, plan.sizes, i, (m.slots,))[0] for i in range(1, 2048))
    assert m.estimate(p, 24, plan).decode_s == pytest.approx(every, rel=0.01)
    assert every < 0.95 * peak

@pytest.mark.slow
def test_infeasible_request_gives_one_line_with_the_binding_resource():
    proc = run("plan", "--model", "opt-125m", "--device", "cpu", "--prompt-len", "64",
               "--gen-len", "8", "--percent", "auto", "--gpu-batch-size", "auto",
               "--cpu-mem-limit", "0.01")
    assert_user_error(proc, "does not fit: CPU memory binds", "the limit is 0.0 GiB: "
                      "--cpu-mem-limit", "no placement fits")


def test_plan_prints_the_choice_its_bound_and_alternatives(capsys):
    plan_cli.main(["--model", "opt-30b", "--device", "cuda", "--prompt-len", "512",
            "--gen-len", "32", "--percent", "auto", "--gpu-batch-size", "auto",
            "--num-gpu-batches", "4", "--gpu-mem-limit", "16", "--cpu-mem-limit", "200",
            "--calibration", H100])
    out = capsys.readouterr().out
    for needle in ("plan for opt-30b", "placement: --percent", "predicted:", "token/s total",
                   "memory: GPU", "bound: decode:", "% of the step is bound by", "top "):
        assert needle in out, out
    assert "--num-gpu-batches 4" in out.split("placement:")[1].splitlines()[0]
    # every throughput figure comes with the wall time of the batch, in a person's units
    rates = [ln for ln in out.splitlines() if "token/s" in ln]
    assert len(rates) > 2 and all(re.search(r"about \d+ (s|min|h|days)\b", ln) for ln in rates)


def test_wall_time_speaks_in_the_unit_a_person_plans_with():
    from flexevict.planner.search import wall_time
    assert [wall_time(s) for s in (40, 90, 700, 3600, 61200, 200000)] == [
        "about 40 s", "about 2 min", "about 12 min", "about 1 h", "about 17 h", "about 2 days"]


def test_planning_for_a_gpu_here_needs_a_calibration(monkeypatch):
    monkeypatch.delenv("FLEXEVICT_CALIBRATION", raising=False)
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU to calibrate")
    proc = subprocess.run([sys.executable, "-m", "flexevict.plan", "--model", "opt-125m",
                           "--device", "cuda", "--percent", "auto"], capture_output=True,
                          text=True, env={k: v for k, v in os.environ.items()
                                          if k != "FLEXEVICT_CALIBRATION"})
    assert_user_error(proc, "needs --calibration FILE", "--synthetic h100")


def parse(*argv, gbs=4):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="opt-125m")
    p.add_argument("--path", default="_DUMMY_")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=16)
    add_policy_args(p)
    add_placement_args(p, gpu_batch_size=gbs)
    return p.parse_args(list(argv))


def test_explicit_flags_keep_working_and_auto_parses(tmp_path):
    args = parse("--percent", "0", "100", "100", "0", "100", "0", "--compress-weight",
                 "--cpu-cache-compute", "--offload-dir", str(tmp_path))
    p = placement_from_args(args)
    assert p == Placement.from_percent((0, 100, 100, 0, 100, 0), gpu_batch_size=4,
                                       compress_weight=True, cpu_cache_compute=True,
                                       offload_dir=str(tmp_path))
    args = parse("--percent", "auto", "--gpu-batch-size", "auto", "--compress-cache", "auto")
    assert (args.percent, args.gpu_batch_size, args.compress_cache) == (["auto"], "auto", "auto")
    assert args.compress_weight is False
    with pytest.raises(UserError, match="six integers"):
        placement_from_args(parse("--percent", "100", "0", "100"))
    with pytest.raises(UserError, match="'x' is not an integer"):
        placement_from_args(parse("--percent", "100", "0", "100", "0", "100", "x"))


def test_without_lengths_auto_plans_for_the_models_longest_run(monkeypatch, capsys):
    """generate/eval resolve auto before reading their input: the plan is for the model's
    maximum positions, --max-new-tokens of them generated."""
    import flexevict.cli as cli
    seen = {}
    real = cli.resolve_auto

    def spy(args, work, *rest, **kw):
        seen["lengths"] = (work.prompt_len, work.gen_len)
        return real(args, work, *rest, **kw)
    monkeypatch.setattr(cli, "resolve_auto", spy)
    p = placement_from_args(parse("--percent", "auto", "--max-new-tokens", "16"))
    assert seen["lengths"] == (2048 - 16 + 1, 16)            # opt-125m: 2048 positions
    assert p.gpu_batch_size == 4 and p.percent == (100, 0, 100, 0, 100, 0)
    err = capsys.readouterr().err
    assert "auto placement: --percent 100 0 100 0 100 0 --gpu-batch-size 4" in err
    assert "auto predicted:" in err and "auto bound: decode:" in err


# ------------------------------------------------------------------------------ runs

@pytest.mark.slow
def test_bench_records_predicted_and_measured_per_phase(tmp_path):
    out = tmp_path / "r.json"
    proc = run("bench", "--model", "opt-125m", "--device", "cpu", "--prompt-len", "16",
               "--gen-len", "4", "--gpu-batch-size", "2", "--no-warmup", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    pred = r["predicted"]
    for key in ("prefill_s", "decode_step_s", "decode_s", "total_s", "throughput"):
        assert pred[key] > 0, key
    assert pred["total_s"] == pytest.approx(pred["prefill_s"] + pred["decode_s"])
    assert pred["calibration"]["path"].endswith("calibration_cpu.json")
    assert "predicted: prefill" in proc.stdout and "(measured" in proc.stdout
    assert "predicted bound: decode:" in proc.stdout


@pytest.mark.slow
def test_an_auto_plan_stays_under_a_tight_cpu_mem_limit_when_run(tmp_path):
    """Below what the all-in-memory placement needs, auto moves weights to disk; the run's
    measured anonymous memory stays under the limit."""
    common = ["--model", "opt-125m", "--device", "cpu", "--prompt-len", "32", "--gen-len", "4",
              "--gpu-batch-size", "2", "--num-gpu-batches", "2", "--threads", "1",
              "--offload-dir", str(tmp_path / "off")]
    proc = run("plan", *common)
    assert proc.returncode == 0, proc.stderr
    need = float(proc.stdout.split("memory: CPU ")[1].split(" GiB")[0])
    limit = round(need - 0.15, 2)
    out = tmp_path / "r.json"
    proc = run("bench", *common, "--percent", "auto", "--cpu-mem-limit", str(limit),
               "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    w_gpu, w_cpu = r["placement"]["percent"][:2]
    assert w_gpu + w_cpu < 100                                 # some weights went to disk
    assert r["peak_cpu_anon_gb"] <= limit, (r["peak_cpu_anon_gb"], limit)
    assert "auto placement:" in proc.stderr


# ------------------------------------------------------------------------------ calibration

@pytest.mark.slow
def test_quick_calibration_is_cached_per_machine_and_redone_on_request(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXEVICT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLEXEVICT_CALIBRATION")
    cpu = torch.device("cpu")
    quiet = lambda *a, **k: None  # noqa: E731
    cal = calibration.load(cpu, 1, str(tmp_path / "off"), quick=True, log=quiet)
    key = calibration.machine_key(cpu)
    assert cal.path == calibration.cache_path(key) and os.path.isfile(cal.path)
    assert cal.data["host"]["threads"] == calibration._cores()    # one thread per core
    assert cal.path.startswith(str(tmp_path / "cache"))
    d = cal.device(cpu, torch.float32)
    assert d["gemm_flops"] > 0 and d["gemv_bw"] > 0 and d["attn_decode"]["per_unit_s"] >= 0
    assert cal.link("disk_read") > 0 and cal.link("h2d_pinned") > 0
    assert set(d["overhead"]) == {"opt", "llama"}

    def measured(*a, **k):
        raise AssertionError("measured again")
    monkeypatch.setattr(calibration, "measure_machine", measured)
    again = calibration.load(cpu, 1, quick=True, log=quiet)            # from the cache
    assert again.data == json.load(open(cal.path))
    with pytest.raises(AssertionError, match="measured again"):
        calibration.load(cpu, 1, recalibrate=True, quick=True, log=quiet)
    other = calibration.load(cpu, 2, quick=True, log=quiet)     # every thread count: one file
    assert other.path == cal.path and other.threads == 2


SCALING = {"compute": 1.8, "memory": 1.3, "elementwise": 1.2}


def _scaled_calibration(threads: int):
    """The fixture calibration as if measured at 4 threads, where one thread takes SCALING's
    times as long, read for a run on `threads`."""
    import copy
    data = copy.deepcopy(calibration.read_file(os.environ["FLEXEVICT_CALIBRATION"]).data)
    data["host"]["threads"] = 4
    data["gpu_memory_gb"] = None
    cpu = data["devices"]["cpu:float32"]          # fixed costs on one thread: a third of 4's
    cpu["thread_scaling"] = SCALING
    cpu["overhead_one_thread"] = json.loads(json.dumps(cpu["overhead"]),
                                            parse_float=lambda x: float(x) / 3)
    return calibration.Calibration(data, None, measure_ok=False, threads=threads)


def test_one_calibration_serves_every_thread_count():
    """Measured at 4 threads: at 4 (or more) the constants are as measured; at 1 each rate is
    slower by its kind's SCALING (compute 1.8x, weight streams 1.3x, ...), and the engine's fixed
    costs are the ones measured on one thread; 2 threads fall between, on Amdahl's line
    through the two measured points (fixed costs a third of the way). The engine probe stays
    as measured (the efficiency fit runs at the measured count)."""
    cpu = torch.device("cpu")
    probe = {"memory": [1.0, 0.1], "stream": [2.0, 0.3]}        # as a calibration records it
    cals = {}
    for t in (1, 4, 8):
        cals[t] = _scaled_calibration(t)
        cals[t].data["devices"]["cpu:float32"]["engine_probe"] = {"llama": probe}
    base = cals[4].device(cpu, torch.float32)
    assert cals[8].device(cpu, torch.float32) == base
    one = cals[1].device(cpu, torch.float32)
    assert one["gemm_flops"] == pytest.approx(base["gemm_flops"] / 1.8)
    assert one["scored_attn_flops"] == pytest.approx(base["scored_attn_flops"] / 1.8)
    assert one["gemv_bw"] == pytest.approx(base["gemv_bw"] / 1.3)
    assert one["mem_bw"] == pytest.approx(base["mem_bw"] / 1.2)
    assert one["prepare"] == base["prepare"]          # page-fault bound: as measured
    assert one["attn_decode"]["per_unit_s"] == pytest.approx(
        base["attn_decode"]["per_unit_s"] * 1.3)
    assert one["attn_decode"]["fixed_s"] == base["attn_decode"]["fixed_s"]
    assert one["overhead"] == base["overhead_one_thread"] != base["overhead"]
    assert one["probe"]["opt"]["mlp_s"] == pytest.approx(base["probe"]["opt"]["mlp_s"] * 1.8)
    assert one["engine_probe"] == base["engine_probe"]
    # Amdahl: t(n) = a + b / n with t(1) = 1.8, t(4) = 1 -> t(2) = 1 + 0.8 * (1/2 - 1/4) / 0.75
    two = _scaled_calibration(2).device(cpu, torch.float32)
    assert base["gemm_flops"] / two["gemm_flops"] == pytest.approx(1 + 0.8 / 3)
    block = {t: c["overhead"]["opt"]["decode"]["block_s"] for t, c in ((1, one), (2, two),
                                                                       (4, base))}
    assert block[2] == pytest.approx(block[1] + (block[4] - block[1]) / 3)
    # without a GPU the links are host memcpys, on the same threads; the disk is not
    assert _scaled_calibration(1).link("h2d_pinned") == pytest.approx(
        _scaled_calibration(4).link("h2d_pinned") / 1.2)
    assert _scaled_calibration(1).link("disk_read") == _scaled_calibration(4).link("disk_read")


def test_fewer_threads_predict_a_slower_run():
    """The cost model on the scaled sections: a compute-bound prefill on one thread is
    predicted about 1.8x slower than on four."""
    config = resolve_model("opt-125m", "_DUMMY_")[0]
    spec = PolicySpec.parse("full")
    est = {t: CostModel(config, _scaled_calibration(t), "cpu", torch.float32, 512, 8,
                        spec).estimate(Placement(gpu_batch_size=8), 8) for t in (1, 4)}
    assert 1.4 < est[1].prefill_s / est[4].prefill_s < 1.9
    assert est[1].decode_s > 1.1 * est[4].decode_s


def test_a_policys_hook_costs_are_measured_on_first_use(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXEVICT_CACHE_DIR", str(tmp_path))
    fixture = calibration.read_file(os.environ["FLEXEVICT_CALIBRATION"])
    cal = calibration.Calibration(fixture.data, str(tmp_path / "c.json"))
    cal.data["quick"] = True
    hooks = cal.policy(PolicySpec.parse("tova", 0.5), torch.device("cpu"), torch.float32)
    assert hooks["decode"]["fixed_s"] >= 0 and hooks["prefill"]["per_token_row_s"] >= 0
    keys = json.load(open(tmp_path / "c.json"))["policies"]
    assert any(k.endswith(f":tova:[]{calibration.POLICY_COSTS}") for k in keys)


def test_a_policys_hook_costs_are_measured_again_when_their_code_changed(tmp_path, monkeypatch):
    """A cached cost keeps the digest of the code it timed (`hook_code`): the same code is not
    timed again, changed code is (a stale price would mislead `plan`), and a calibration
    file read as given (not this machine's cache) serves its entry whatever code timed it."""
    fixture = calibration.read_file(os.environ["FLEXEVICT_CALIBRATION"])
    cal = calibration.Calibration(copy.deepcopy(fixture.data), str(tmp_path / "c.json"))
    cal.data["quick"] = True
    spec, cpu = PolicySpec.parse("tova", 0.5), torch.device("cpu")
    first = cal.policy(spec, cpu, torch.float32)
    assert first["code"] == calibration.hook_code("tova")
    timed = []
    monkeypatch.setattr(calibration, "measure_policy", lambda *a: timed.append(a) or {"new": 1})
    assert cal.policy(spec, cpu, torch.float32) is first and not timed
    first["code"] = "older"
    assert cal.policy(spec, cpu, torch.float32)["new"] == 1 and len(timed) == 1
    read_as_given = calibration.Calibration(cal.data, None, measure_ok=False)
    tova = next(v for k, v in cal.data["policies"].items() if ":tova:" in k)
    tova["code"] = "older"
    assert read_as_given.policy(spec, cpu, torch.float32) is tova and len(timed) == 1


def test_the_code_a_policys_cost_is_keyed_by_includes_the_model_where_it_rotates_keys():
    """Cascade's and StreamingLLM's timed hooks include the model's in-cache rotation: a change
    to the model times them again; h2o's hooks do not run model code."""
    from flexevict.core import model
    from flexevict.policies import cascade, h2o
    assert {model, cascade}.issubset(calibration.hook_modules("cascade"))
    assert model in calibration.hook_modules("streaming")
    h2o_modules = calibration.hook_modules("h2o")
    assert h2o in h2o_modules and model not in h2o_modules


@pytest.mark.parametrize("quick", [True, False])
def test_recalls_hook_costs_are_measured_over_every_step(quick):
    """Recall appends every decode step to its history: the measurement's buffer is sized for
    the steps it times (it was sized for 8, and a full calibration's 24th step failed)."""
    hooks = calibration.measure_policy(PolicySpec.parse("recall", 0.1), torch.device("cpu"),
                                       torch.float32, quick=quick)
    assert hooks["decode"]["fixed_s"] + hooks["decode"]["per_slot_row_s"] > 0


@pytest.mark.parametrize("name,rotates", [("cascade", True), ("h2o", False)])
def test_hook_costs_include_the_in_cache_rotation(name, rotates, monkeypatch):
    """A policy that keeps keys before RoPE makes the model rotate every attended key each step
    (Cascade's step is 1.5x h2o's on a CPU): its measured decode cost includes that rotation,
    over the attended slots, and a policy that does not is measured without it."""
    from flexevict.core import model
    seen = []
    real = model.rotate_in_cache

    def spy(q, buf, n, table, pos_end=None):
        seen.append((n, buf.attended(buf.incoming_slot()), table.shape[0] >= n))
        return real(q, buf, n, table, pos_end)
    monkeypatch.setattr(model, "rotate_in_cache", spy)
    calibration.measure_policy(PolicySpec.parse(name, 0.5), torch.device("cpu"), torch.float32,
                               quick=True)
    assert bool(seen) == rotates
    assert all(n == attended and fits for n, attended, fits in seen)


def test_cache_folder_and_bad_calibration_files(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXEVICT_CACHE_DIR", str(tmp_path / "a"))
    assert calibration.cache_dir() == str(tmp_path / "a")
    monkeypatch.delenv("FLEXEVICT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert calibration.cache_dir() == str(tmp_path / "xdg" / "flexevict")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="not a calibration JSON"):
        calibration.read_file(str(bad))
    bad.write_text(json.dumps({"schema": 0}))
    with pytest.raises(UserError, match="not a calibration of schema"):
        calibration.read_file(str(bad))
    with pytest.raises(UserError, match="cannot read it"):
        calibration.read_file(str(tmp_path / "missing.json"))


# ------------------------------------------------------------------------------ one source

def test_every_offload_dir_default_is_the_placement_constant():
    from flexevict.runtime.placement import DEFAULT_OFFLOAD_DIR
    p = argparse.ArgumentParser()
    add_placement_args(p)
    assert p.parse_args([]).offload_dir == DEFAULT_OFFLOAD_DIR
    assert Placement().offload_dir == P.PlacementRequest().offload_dir == DEFAULT_OFFLOAD_DIR


@pytest.mark.parametrize("shape", [(64, 128), (3, 100), (5, 64)])
def test_memory_plan_counts_compressed_weights_as_quantize_4bit_makes_them(shape):
    """MemoryPlan's 4-bit sizes use the quantiser's own default group (quant.GROUP)."""
    from dataclasses import replace
    from flexevict.core.kernels.quant import GROUP, quantize_4bit
    config, _ = resolve_model("opt-125m", "_DUMMY_")
    plan = MemoryPlan(config, replace(Placement(), compress_weight=True), torch.float16, 1, 8,
                      8, 17)
    p = quantize_4bit(torch.randn(*shape, dtype=torch.float16))
    made = [t.numel() * t.element_size() for t in (p.data, p.min, p.scale)]
    assert p.group == GROUP and plan._stored(shape) == made


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policys_hooks_can_be_measured(name):
    """A policy's hook costs are measured on a buffer holding its declared state (Cascade's
    sub-cache counters, Scissorhands' history, ...), as the engine allocates it."""
    spec = PolicySpec.parse(name) if name == "full" else PolicySpec.parse(name, 0.5)
    hooks = calibration.measure_policy(spec, torch.device("cpu"), torch.float32, quick=True)
    assert hooks["decode"]["fixed_s"] >= 0 and hooks["prefill"]["fixed_s"] >= 0


def test_calibration_prints_every_step(monkeypatch, tmp_path):
    """A first calibration says what it measures, step i of N, and the time so far: one line
    per step, N known up front (the measurements themselves are stubbed here)."""
    from flexevict.planner import calibration
    for name in ("measure_links", "measure_disk", "measure_matmul", "measure_prepare",
                 "measure_quant", "measure_attention", "measure_overheads", "measure_probe",
                 "measure_engine_probe", "measure_thread_scaling"):
        monkeypatch.setattr(calibration, name, lambda *a, **k: {})
    for name in ("measure_parallel", "measure_lane_job", "measure_mem_bw"):
        monkeypatch.setattr(calibration, name, lambda *a, **k: 1.0)
    monkeypatch.delenv("FLEXEVICT_CALIBRATION", raising=False)
    monkeypatch.setenv("FLEXEVICT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "other_work_cores", lambda: 0.0)     # a quiet machine
    lines = []
    for quick in (True, False):
        calibration.load(torch.device("cpu"), 1, quick=quick, recalibrate=True,
                         log=lambda msg, **kw: lines.append(msg))
        steps = [ln for ln in lines if ln.startswith("calibrating: step ")]
        n = calibration.planned(torch.device("cpu"), quick)
        assert [re.match(r"calibrating: step (\d+)/(\d+): \S.* \(\d+ s elapsed\)$", ln).groups()
                for ln in steps] == [(str(i), str(n)) for i in range(1, n + 1)]
        lines.clear()


@pytest.mark.parametrize("busy", [0.1, 1.5])
def test_a_machine_busy_with_other_work_gets_a_quick_calibration(monkeypatch, tmp_path, busy):
    """Other work keeping cores busy makes every measurement several times slower: a first
    calibration is then a quick one, measured as the machine is, and it says so in one line.
    (The measurements are stubbed with the fixture calibration's.)"""
    from flexevict.planner import calibration
    fixture = json.load(open(os.path.join(os.path.dirname(__file__), "calibration_cpu.json")))
    asked = []

    def machine(device, offload_dir, quick, step):
        asked.append(quick)
        return {k: v for k, v in fixture.items() if k != "devices"} | {"quick": quick}

    def device(device, dtype, quick, step):
        asked.append(quick)
        return fixture["devices"]["cpu:float32"]
    monkeypatch.setattr(calibration, "measure_machine", machine)
    monkeypatch.setattr(calibration, "measure_device", device)
    monkeypatch.setattr(calibration, "other_work_cores", lambda: busy)
    monkeypatch.delenv("FLEXEVICT_CALIBRATION", raising=False)
    monkeypatch.setenv("FLEXEVICT_CACHE_DIR", str(tmp_path))
    lines = []
    cal = calibration.load(torch.device("cpu"), 1, log=lambda msg, **kw: lines.append(msg))
    quick = busy >= calibration.BUSY_CORES
    assert asked == [quick, quick] and cal.quick == quick
    assert cal.data["host"]["busy_cores"] == busy
    said = [ln for ln in lines if "cores busy" in ln]
    assert len(said) == quick and all(f"{busy:.1f} of" in ln and "quiet machine" in ln
                                      for ln in said)


def test_other_work_is_counted_in_cores():
    from flexevict.planner import calibration
    busy = calibration.other_work_cores(0.05)
    assert 0.0 <= busy <= os.cpu_count() + 0.5


def test_other_work_is_counted_on_this_process_cpus_only():
    """On a host larger than this process's CPUs, work on the others does not compete."""
    from flexevict.planner import calibration
    stat = ("cpu  30 0 10 160 0 0 0 0 0 0\n"
            "cpu0 10 0 0 40 0 0 0 0 0 0\ncpu1 20 0 10 20 0 0 0 0 0 0\n"
            "cpu2 0 0 0 50 0 0 0 0 0 0\ncpu3 0 0 0 50 0 0 0 0 0 0\nintr 5\n")
    assert calibration.cpu_ticks(stat, {2, 3}) == (100, 100, 2)
    assert calibration.cpu_ticks(stat, {0, 1}) == (60, 100, 2)
    assert calibration.cpu_ticks(stat, {7}) == (160, 200, 4)          # no line: every CPU


def test_calibrate_summarises_in_the_devices_default_dtype(monkeypatch, capsys):
    """Without --dtype, `python -m flexevict.calibrate` prints the rates of the dtype a run
    would use there (core.config.default_dtype), as a torch dtype."""
    import flexevict.calibrate as cmd
    seen = []
    real = cmd.summary
    monkeypatch.setattr(cmd, "summary", lambda cal, device, dtype: seen.append(dtype) or
                        real(cal, device, dtype))
    cmd.main(["--device", "cpu"])
    assert seen == [torch.float32] and "cpu float32:" in capsys.readouterr().out
