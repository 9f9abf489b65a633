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
