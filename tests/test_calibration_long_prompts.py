"""The calibration at long prompts and a quick calibration's place: prefill attention is timed
at several prompt lengths and priced at the run's (not one short prompt's rate scaled by S^2),
and a quick calibration is marked in what it predicts and replaced by a full one the next time
a command needs a calibration on a quiet machine. No timing is asserted: the measurements are
stubbed or read from the fixture calibration."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from flexevict.planner import calibration
from flexevict.planner.calibration import PREFILL_RATE_CAP, attention_rate
from flexevict.planner.costmodel import CostModel
from flexevict.policies import PolicySpec
from flexevict.runtime.placement import Placement

FIXTURE = os.path.join(os.path.dirname(__file__), "calibration_cpu.json")
# rates that grow with the prompt, as a CPU's SDPA does (flop/s)
TABLE = [[128, 20e9], [512, 34e9], [2048, 48e9], [4096, 55e9]]


def _fixture() -> dict:
    with open(FIXTURE) as f:
        return json.load(f)


def _with_table(table=TABLE, scored=None) -> dict:
    data = _fixture()
    cpu = data["devices"]["cpu:float32"]
    cpu["prefill_attn"] = {"sdpa": copy.deepcopy(table),
                           "scored": copy.deepcopy(scored or [[s, r / 2] for s, r in table])}
    cpu["sdpa_flops"], cpu["scored_attn_flops"] = table[-1][1], cpu["prefill_attn"]["scored"][-1][1]
    return data


# ------------------------------------------------------------------------------ the rate at S

def test_the_rate_is_the_measured_one_at_each_measured_length():
    section = {"prefill_attn": {"sdpa": TABLE, "scored": TABLE}}
    for s, rate in TABLE:
        assert attention_rate(section, False, s) == pytest.approx(rate)
        assert attention_rate(section, True, s) == pytest.approx(rate)


def test_between_lengths_the_rate_rises_with_the_prompt():
    section = {"prefill_attn": {"sdpa": TABLE}}
    rates = [attention_rate(section, False, s) for s in range(128, 4097, 64)]
    assert all(a <= b * (1 + 1e-12) for a, b in zip(rates, rates[1:]))
    assert TABLE[1][1] < attention_rate(section, False, 1024) < TABLE[2][1]


def test_beyond_the_longest_it_follows_the_last_two_and_is_capped():
    """At 8192 the rate keeps rising along time per flop = a + b / S through 2048 and 4096,
    never above PREFILL_RATE_CAP x 4096's; a rate that fell between the last two (noise) is
    held, not extrapolated downwards."""
    section = {"prefill_attn": {"sdpa": TABLE}}
    at_8k = attention_rate(section, False, 8192)
    a_b = (1 / 48e9 - 1 / 55e9) / (1 / 2048 - 1 / 4096)        # b of a + b / S
    assert at_8k == pytest.approx(1 / (1 / 55e9 - a_b * (1 / 4096 - 1 / 8192)))
    assert 55e9 < at_8k <= PREFILL_RATE_CAP * 55e9
    steep = {"prefill_attn": {"sdpa": [[512, 1e9], [2048, 50e9]]}}
    assert attention_rate(steep, False, 1 << 20) == pytest.approx(PREFILL_RATE_CAP * 50e9)
    fell = {"prefill_attn": {"sdpa": [[512, 40e9], [2048, 38e9]]}}
    assert attention_rate(fell, False, 8192) == pytest.approx(38e9)


def test_below_the_shortest_it_falls_and_stays_positive():
    section = {"prefill_attn": {"sdpa": TABLE}}
    assert 0 < attention_rate(section, False, 16) < TABLE[0][1]


def test_without_a_table_the_one_rate_is_used():
    """A file made before the table (the fixture, a synthetic one) keeps its one rate; a table
    of one length (a GPU's) is that rate everywhere."""
    cpu = _fixture()["devices"]["cpu:float32"]
    for s in (128, 8192):
        assert attention_rate(cpu, False, s) == cpu["sdpa_flops"]
        assert attention_rate(cpu, True, s) == cpu["scored_attn_flops"]
    one = {"prefill_attn": {"sdpa": [[2048, 7e12]]}, "sdpa_flops": 1.0}
    assert attention_rate(one, False, 128) == attention_rate(one, False, 32768) == 7e12


def test_the_cost_model_prices_prefill_attention_at_the_runs_prompt():
    """The prefill with the table is the prefill with the table's rate at P as the one rate
    (full: SDPA; h2o ranks the prompt: the scored pass), and an 8k prompt is priced at a
    faster rate than a 512-token one (less than S^2 from it)."""
    from flexevict.core.config import REGISTRY
    config = REGISTRY["smollm2-135m"]
    cpu = torch.device("cpu")
    table = _with_table()
    del table["devices"]["cpu:float32"]["probe"]     # the probe's halves read the rate at 128
    for pol, scored in ((PolicySpec("full"), False), (PolicySpec.parse("h2o", 0.2), True)):
        for prompt in (512, 4096, 8176):
            section = table["devices"]["cpu:float32"]
            one = copy.deepcopy(table)
            d = one["devices"]["cpu:float32"]
            del d["prefill_attn"]
            d["scored_attn_flops" if scored else "sdpa_flops"] = attention_rate(
                section, scored, prompt)
            got = [CostModel(config, calibration.Calibration(data, None, measure_ok=False),
                             cpu, torch.float32, prompt, 4, pol,
                             efficiency={"prefill": 1.0, "decode": 1.0, "weights": 1.0}
                             ).estimate(Placement(gpu_batch_size=2), 2).prefill_s
                   for data in (table, one)]
            assert got[0] == pytest.approx(got[1], rel=1e-9), (pol.name, prompt)


def test_the_engine_probes_factor_leaves_attention_as_measured():
    """The factors fitted on the six-layer engine probe (short prompts, where attention is a
    sliver of the work) scale the matmuls and passes, not attention, which the calibration
    times at the shapes a run has: halving them takes off half of what attention does not
    cost, in prefill and in decode, at 512 and at 8176 prompt tokens."""
    from flexevict.core.config import REGISTRY
    config, cpu = REGISTRY["smollm2-135m"], torch.device("cpu")
    cal = calibration.Calibration(_with_table(), None, measure_ok=False)
    place = Placement(gpu_batch_size=2)
    for prompt in (512, 8176):
        def model(f, attention_free=False):
            m = CostModel(config, cal, cpu, torch.float32, prompt, 8, PolicySpec("full"),
                          efficiency={"prefill": f, "decode": f, "weights": 1.0})
            if attention_free:
                m._attention = lambda *a: 0.0
            return m.estimate(place, 2)
        whole, half = model(1.0), model(0.5)
        rest, rest_half = model(1.0, True), model(0.5, True)
        for phase in ("prefill_s", "step_s"):
            attention = getattr(whole, phase) - getattr(rest, phase)
            assert attention > 0
            assert getattr(half, phase) - getattr(rest_half, phase) == pytest.approx(attention)
            assert getattr(rest_half, phase) < 0.75 * getattr(rest, phase)


def test_one_thread_scales_the_table_like_every_compute_rate():
    data = _with_table()
    data["host"]["threads"] = 4
    cpu = data["devices"]["cpu:float32"]
    cpu["thread_scaling"] = {"compute": 1.8, "memory": 1.3, "elementwise": 1.2}
    cpu["overhead_one_thread"] = cpu["overhead"]
    one = calibration.Calibration(data, None, measure_ok=False, threads=1).device(
        torch.device("cpu"), torch.float32)
    for kind in ("sdpa", "scored"):
        assert [s for s, _ in one["prefill_attn"][kind]] == [s for s, _ in
                                                             cpu["prefill_attn"][kind]]
        for (_, r1), (_, r4) in zip(one["prefill_attn"][kind], cpu["prefill_attn"][kind]):
            assert r1 == pytest.approx(r4 / 1.8)


# ------------------------------------------------------------------------------ what is timed

def _timed_shapes(monkeypatch, quick: bool, device="cpu") -> dict:
    """measure_attention's shapes, every timing stubbed: {"decode": [slots], "prefill":
    [(heads, kv heads, S)]}, and its result."""
    from flexevict.core import kernels
    from flexevict.core import model
    seen = {"decode": [], "prefill": [], "ring": []}
    monkeypatch.setattr(calibration, "best_time", lambda fn, *a, **k: (fn(), 0.5)[1])
    monkeypatch.setattr(kernels, "split_decode_attention",     # the model's decode attention
                        lambda q, k, v, *a, **kw: seen["decode"].append(k.shape[0])
                        or seen["ring"].append((k.shape[0], k.data_ptr(), v.data_ptr())))
    monkeypatch.setattr(calibration, "decode_ring_bytes", lambda device: 64 << 20)
    monkeypatch.setattr(model, "causal_attention",
                        lambda q, k, *a, **kw: seen["prefill"].append(
                            (q.shape[1], k.shape[1], q.shape[2])))
    monkeypatch.setattr(kernels, "prefill_attention_scores", lambda *a, **k: None)
    monkeypatch.setattr(torch, "randn", lambda *shape, **k: torch.empty(*shape, **k))
    out = calibration.measure_attention(torch.device(device), torch.float32, quick)
    return seen | {"out": out}


@pytest.mark.parametrize("quick", [False, True])
def test_prefill_attention_is_timed_at_prompt_lengths_that_scale(monkeypatch, quick):
    """Several lengths up to thousands of tokens, a quick calibration fewer of them but its
    longest one of those too: it measures less, not at a launch-bound shape (its rate at 128
    tokens scaled by S^2 put a 6144-token prefill at 33x its time). Each shape at least two
    heads, two query heads per kv head."""
    seen = _timed_shapes(monkeypatch, quick)
    lengths = [s for _, _, s in seen["prefill"]]
    assert lengths == list(calibration.PREFILL_LENGTHS["cpu-quick" if quick else "cpu"])
    assert max(lengths) >= 2048 and len(lengths) >= 2
    assert set(calibration.PREFILL_LENGTHS["cpu-quick"]) <= set(calibration.PREFILL_LENGTHS["cpu"])
    assert all(h >= 2 and h == 2 * hk for h, hk, _ in seen["prefill"])
    table = seen["out"]["prefill_attn"]
    assert [s for s, _ in table["sdpa"]] == [s for s, _ in table["scored"]] == lengths
    # the one rate kept beside the table is the longest prompt's
    assert seen["out"]["sdpa_flops"] == table["sdpa"][-1][1]
    assert seen["out"]["scored_attn_flops"] == table["scored"][-1][1]
    # decode attention up to 2048 slots either way, over distinct K and V buffers
    assert sorted(set(seen["decode"])) == list(calibration.DECODE_SLOTS[quick])
    assert max(seen["decode"]) == 2048
    for n in set(seen["decode"]):        # K and V of every call distinct: read from memory
        pointers = [p for m, *pair in seen["ring"] if m == n for p in pair]
        assert len(pointers) == len(set(pointers)) >= 4


def test_the_rounds_keep_the_median_of_each_length(monkeypatch):
    rounds = [{"prefill_attn": {"sdpa": [[128, r], [2048, 10 * r]]}} for r in (3.0, 1.0, 2.0)]
    assert calibration._median_of(rounds) == {"prefill_attn": {"sdpa": [[128, 2.0],
                                                                        [2048, 20.0]]}}


# ------------------------------------------------------------------------------ quick -> full

def _stub_measuring(monkeypatch, tmp_path, busy: float) -> list:
    """Measuring stubbed with the fixture's numbers (and a table); returns the list of the
    `quick` flags each measurement was asked with."""
    fixture = _with_table()
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
    return asked


def _quick_cached(monkeypatch, tmp_path) -> str:
    """A quick calibration made while the machine was busy, cached -> its path."""
    _stub_measuring(monkeypatch, tmp_path, busy=1.5)
    cal = calibration.load(torch.device("cpu"), 1, log=lambda *a, **k: None)
    assert cal.quick and os.path.isfile(cal.path)
    return cal.path


def test_a_quick_calibration_is_replaced_by_a_full_one_on_a_quiet_machine(monkeypatch, tmp_path):
    path = _quick_cached(monkeypatch, tmp_path)
    asked = _stub_measuring(monkeypatch, tmp_path, busy=0.1)
    lines = []
    cal = calibration.load(torch.device("cpu"), 1, log=lambda msg, **kw: lines.append(msg))
    assert asked == [False, False] and not cal.quick and cal.path == path
    assert not json.load(open(path))["quick"]                   # the cache holds the full one
    assert any("quick one" in ln and "quiet" in ln for ln in lines)
    asked.clear()
    assert not calibration.load(torch.device("cpu"), 1, log=lambda *a, **k: None).quick
    assert asked == []                                          # and it serves from then on


def test_a_quick_calibration_serves_while_the_machine_is_busy_and_says_so(monkeypatch, tmp_path):
    path = _quick_cached(monkeypatch, tmp_path)
    asked = _stub_measuring(monkeypatch, tmp_path, busy=1.5)
    lines = []
    cal = calibration.load(torch.device("cpu"), 1, log=lambda msg, **kw: lines.append(msg))
    assert asked == [] and cal.quick and cal.path == path
    assert any("quick one" in ln and "1.5 cores busy" in ln for ln in lines)


def test_a_quick_calibration_asked_for_is_not_measured_again(monkeypatch, tmp_path):
    _quick_cached(monkeypatch, tmp_path)
    asked = _stub_measuring(monkeypatch, tmp_path, busy=0.0)
    monkeypatch.setattr(calibration, "other_work_cores",
                        lambda: pytest.fail("a quick one was asked for: no need to look"))
    assert calibration.load(torch.device("cpu"), 1, quick=True, log=lambda *a, **k: None).quick
    assert asked == []


def test_the_read_only_path_keeps_a_quick_calibration_marked(monkeypatch, tmp_path):
    """What `cached` (every CLI's estimate before a run) reads is the quick one, marked: the
    estimate says so and only warns (bench's over-an-hour refusal skips it)."""
    from flexevict.planner import advice
    _quick_cached(monkeypatch, tmp_path)
    cal = calibration.cached(torch.device("cpu"), 1)
    assert cal.quick and cal.read_only
    assert advice.source(cal).startswith("the quick calibration ")


def test_a_cached_calibration_without_the_table_is_measured_again(monkeypatch, tmp_path):
    asked = _stub_measuring(monkeypatch, tmp_path, busy=0.0)
    old = _fixture() | {"machine": calibration.machine_key(torch.device("cpu")), "quick": False}
    path = calibration.cache_path(old["machine"])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(old, f)
    lines = []
    cal = calibration.load(torch.device("cpu"), 1, log=lambda msg, **kw: lines.append(msg))
    assert asked == [False, False] and "prefill_attn" in cal.data["devices"]["cpu:float32"]
    assert any("one short prompt" in ln for ln in lines)


def test_a_plans_prediction_from_a_quick_calibration_says_so():
    """`plan`'s and an auto run's predicted line names the quick calibration it rests on; a
    full one's line is as before."""
    from flexevict.core.config import REGISTRY
    from flexevict.planner import search as S
    config = REGISTRY["smollm2-135m"]
    lines = {}
    for quick in (False, True):
        data = _fixture() | {"quick": quick}
        cal = calibration.Calibration(data, "/cache/calibration.json", measure_ok=False)
        work = S.Workload(config, 128, 8, PolicySpec("full"), torch.device("cpu"),
                          torch.float32)
        model = S.with_calibration(work, cal)
        request = S.PlacementRequest(percent=(100, 0, 100, 0, 100, 0), gpu_batch_size=2,
                                     num_gpu_batches=1)
        plan = S.search(model, request, S.Limits(), top=1)
        lines[quick] = next(ln for ln in S.report(plan, alternatives=False)
                            if ln.startswith("predicted:"))
    assert lines[True].endswith(", from the quick calibration /cache/calibration.json")
    assert "quick" not in lines[False]


# ------------------------------------------------------------------------------ element-wise work

def test_element_wise_passes_follow_the_probe_at_a_long_prefill():
    """With the probe at a long prefill too, a prefill of as many tokens is priced by its
    passes, a short one by the short probe's, and one in between in between; decode steps (a
    few tokens) by the short probe's; without it, the short probe's everywhere."""
    from flexevict.core.config import REGISTRY
    config = REGISTRY["smollm2-135m"]
    data = _with_table()
    cpu = data["devices"]["cpu:float32"]
    short = cpu["probe"]["llama"]
    tokens = 32 * 256
    cpu["probe_long"] = {arch: {**p, "batch": 32, "prompt": 256,
                                "attn_s": p["attn_s"] * tokens / 256 * 3,
                                "mlp_s": p["mlp_s"] * tokens / 256 * 3}
                         for arch, p in cpu["probe"].items()}
    cal = calibration.Calibration(data, None, measure_ok=False)
    m = CostModel(config, cal, torch.device("cpu"), torch.float32, 4096, 4, PolicySpec("full"))
    at = {n: m._fitted_passes(n) for n in (1, 4, 256, 1024, tokens, 16384)}
    assert at[1] == at[4] == at[256] and at[tokens] == at[16384]
    assert all(at[256][k] < at[1024][k] < at[tokens][k] for k in ("attn", "mlp"))
    del data["devices"]["cpu:float32"]["probe_long"]
    plain = CostModel(config, calibration.Calibration(data, None, measure_ok=False),
                      torch.device("cpu"), torch.float32, 4096, 4, PolicySpec("full"))
    assert plain._fitted_passes(16384) == plain._fitted_passes(4) == at[4]
    assert short["batch"] * short["prompt"] == 256


def test_decode_attention_scales_with_threads_by_its_own_measurement():
    """A run on one thread prices decode attention by the "attention" kind of the thread
    scaling where the calibration measured it, by "memory" (a weight stream) where not."""
    data = _fixture()
    data["host"]["threads"] = 2
    cpu = data["devices"]["cpu:float32"]
    cpu["overhead_one_thread"] = cpu["overhead"]
    base = cpu["attn_decode"]["per_unit_s"]
    for scaling, factor in (({"compute": 1.5, "memory": 1.3, "elementwise": 1.2}, 1.3),
                            ({"compute": 1.5, "memory": 1.3, "elementwise": 1.2,
                              "attention": 1.9}, 1.9)):
        cpu["thread_scaling"] = scaling
        one = calibration.Calibration(data, None, measure_ok=False, threads=1).device(
            torch.device("cpu"), torch.float32)
        assert one["attn_decode"]["per_unit_s"] == pytest.approx(base * factor)
