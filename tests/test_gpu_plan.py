"""The GPU plan's runner (bench/gpu_plan.py) on a CPU: resumable, bounded by its deadline,
every result naming the machine at its top level, and FlexGen's batch inside the host limit."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

import gpu_plan  # noqa: E402
from gpu_plan import HOST_LIMIT_GIB, OVERHEAD_GIB, Step, flexgen_batch  # noqa: E402
from suites import device_label  # noqa: E402

from flexevict.core.config import registry_config  # noqa: E402
from flexevict.errors import UserError  # noqa: E402


def _steps(marker):
    py = sys.executable
    write = (f"import sys; open(sys.argv[1], 'w').write('{{\"n\": 1}}'); "
             f"open({marker!r}, 'a').write('x')")
    return [Step("first", "kernels", "command", [py, "-c", write, "{OUT}"], 0.01),
            Step("broken", "kernels", "command", [py, "-c", "raise SystemExit('no GPU here')"],
                 0.01),
            Step("too-long", "kernels", "command", [py, "-c", "pass"], 10.0)]


def test_runs_what_fits_and_resumes(tmp_path, monkeypatch, capsys):
    marker = str(tmp_path / "ran")
    monkeypatch.setattr(gpu_plan, "steps", lambda: _steps(marker))
    assert gpu_plan.run_plan(str(tmp_path), max_minutes=1.0, only=None) == 3
    dev = device_label()
    row = json.loads((tmp_path / "gpu" / f"first_{dev}").read_text())
    assert row == {"n": 1}
    first = json.loads((tmp_path / "gpu" / f"first_{dev}.json").read_text())
    assert first["device"] and first["commit"] and first["driver"]      # machine at the top
    assert first["result"] == {"n": 1} and "error" not in first
    broken = json.loads((tmp_path / "gpu" / f"broken_{dev}.json").read_text())
    assert broken["error"] == "no GPU here"
    assert not (tmp_path / "gpu" / f"too-long_{dev}.json").exists()     # its 10 min don't fit
    summary = json.loads((tmp_path / f"gpu_{dev}.json").read_text())
    assert summary["steps_left"] == ["too-long"] and summary["run"]["device"]
    # again: the finished step is read back, not run; the failed one runs again
    gpu_plan.run_plan(str(tmp_path), max_minutes=1.0, only=None)
    assert open(marker).read() == "x"
    assert "no GPU here" in (tmp_path / f"gpu_{dev}.md").read_text()


def test_a_step_is_killed_at_the_deadline(tmp_path):
    step = Step("sleeper", "kernels", "command", [sys.executable, "-c",
                                                  "import time; time.sleep(30)"], 0.01)
    row = gpu_plan.run_step(step, str(tmp_path / "sleeper"), {}, seconds_left=1.0)
    assert row["rc"] == "timeout" and row["seconds"] < 10 and "error" in row


@pytest.mark.parametrize("prompt,gen", [(512, 32), (512, 512), (512, 1024)])
def test_flexgen_batch_is_the_largest_inside_the_host_limit(prompt, gen):
    c = registry_config("opt-30b")
    weights = 0.8 * c.weight_bytes("float16") / 2**30
    per_seq = 2 * c.num_layers * c.hidden_size * 2 * (prompt + gen - 1) / 2**30

    def host(gbs):
        return weights + 2 * gbs * per_seq + OVERHEAD_GIB
    gbs = flexgen_batch("opt-30b", prompt, gen, 0.8, 2)
    assert host(gbs) <= HOST_LIMIT_GIB < host(gbs + 1)


def test_every_step_names_a_known_command():
    names = [s.name for s in gpu_plan.steps()]
    assert len(names) == len(set(names))
    assert names.index("gpu-tests") < names.index("calibration") < names.index(
        "opt-30b-512+512-h2o-0.2")
    for s in gpu_plan.steps():
        assert s.kind in ("command", "engine", "flexgen") and s.minutes > 0


def test_an_uninstalled_checkout_is_refused_before_any_step(tmp_path, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "flexevict.policies" else real(name, *a))
    monkeypatch.setattr(gpu_plan, "steps", lambda: pytest.fail("a step was planned"))
    with pytest.raises(UserError, match="pip install --no-deps --no-build-isolation -e ."):
        gpu_plan.run_plan(str(tmp_path), max_minutes=1.0, only=None)
    assert not (tmp_path / "gpu").exists()


def _run(ms: float, graphed: bool) -> dict:
    """A bench/hook_share.py run: the prefill, then 6 decode steps of `ms` each."""
    return {"step_seconds": [1.0] + [ms / 1e3] * 6, "graphed": [False] + [graphed] * 6,
            "clock_share": None if graphed else 0.01, "attended": 820.0}


def test_hook_share_runs_last_and_its_table_is_its_own(tmp_path):
    """The hook-share step comes after every other step, graphed, and leaves its JSON where
    the runner reads a command's result (OUT itself, not OUT.json: the step's row); its table
    is hook_share.py's, the goal checked only for replayed steps."""
    from gpu_tables import tables
    from hook_share import summarise
    *others, last = gpu_plan.steps()
    assert last.group == "hook-share" and last.kind == "command" and last.minutes >= 3
    assert all(s.group != "hook-share" for s in others)
    cmd = last.command(str(tmp_path / "out"))
    assert cmd[1].endswith("hook_share.py") and "--cuda-graphs" in cmd
    assert cmd[cmd.index("--json") + 1] == str(tmp_path / "out") and "--out" not in cmd
    assert cmd[cmd.index("--model") + 1] == "opt-6.7b"
    rows = [summarise("h2o", 819, {"with": [_run(20.0, True)], "without": [_run(19.2, True)]}),
            summarise("tova", 819, {"with": [_run(20.0, False)], "without": [_run(18, False)]})]
    assert rows[0]["replayed"] and rows[0]["goal_met"] and abs(rows[0]["share"] - 0.04) < 1e-9
    assert not rows[1]["replayed"] and rows[1]["goal_met"] is None
    settings = {"model": "opt-6.7b", "prompt_len": 2048, "gen_len": 2048, "steps": 7,
                "batch": 24, "budget": 0.2, "rounds": 1, "settle": 2, "goal": 0.05,
                "dtype": "float16"}
    meta = {"device": "NVIDIA H200", "driver": "1", "torch": "2", "cuda": "13", "commit": "c",
            "cpu_cores": 16, "host_memory_gib": 125.9}
    step = {"step": last.name, "group": last.group, "kind": "command", "seconds": 250.0,
            "rc": 0, "result": {"device": "NVIDIA H200", "settings": settings, "results": rows}}
    text = tables([step], meta)
    assert f"## hook-share ({last.name}, 250.0 s): opt-6.7b, 2048 + 2048" in text
    assert "| h2o | 819 | 20.00 | 19.20 | 4.0% | 4 / 4 | 4 / 4 | n/a | 820 / 820 | yes |" in text
    assert "| tova | 819 | 20.00 | 18.00 | 10.0% | 4 / 4 | 0 / 0 | 1.0% | 820 / 820 | n/a " \
           "(eager) |" in text
    failed = dict(step, rc=1, error="out of GPU memory")
    del failed["result"]
    assert f"{last.name}: error: out of GPU memory" in tables([failed], meta)


def test_the_dummy_weights_step_shows_its_rates_in_the_kernels_table():
    from gpu_tables import command_table
    result = {"rows": [{"shape": "opt-6.7b", "dtype": "float16",
                        "gb_per_s": {"torch.randn": 80.0, "after": 1234.5}}]}
    table = command_table("kernels", [{"step": "dummy-weights", "seconds": 4.0, "rc": 0,
                                       "result": result}])
    assert "| dummy-weights | 4.0 | 0 | opt-6.7b float16: 1234.5 GB/s |" in table
    assert "dummy-weights" in [s.name for s in gpu_plan.steps()]
