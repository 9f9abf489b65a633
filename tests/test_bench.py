"""`python -m flexevict.bench` end to end on CPU: the result block and JSON, projection, and the
one-line errors for settings that cannot fit."""
import json
import os
import subprocess
import sys

import pytest
from test_cli import assert_user_error, run

from flexevict.bench.throughput import project_decode
from flexevict.policies import get_policy
from flexevict.errors import UserError
from flexevict.runtime.memory import GIB
import torch

SMALL = ["--model", "opt-125m", "--device", "cpu", "--prompt-len", "24", "--gen-len", "6",
         "--gpu-batch-size", "2", "--num-gpu-batches", "2", "--no-warmup"]


@pytest.mark.slow
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
    assert r["prefill_eviction_s"] > 0 and r["evicts"]           # decode-time work only:
    assert r["eviction_share_of_decode"] == pytest.approx(r["eviction_s"]
                                                          / sum(r["step_seconds"][1:]))
    assert "eviction time: prefill " in proc.stdout
    assert r["run"]["commit"] and r["run"]["torch"] and r["run"]["kernels"]


@pytest.mark.slow
def test_cut_gen_len_projects_the_rest(tmp_path):
    out = tmp_path / "r.json"
    proc = run("bench", *SMALL[:-5], "--gen-len", "12", "--cut-gen-len", "4", "--gpu-batch-size",
               "2", "--num-gpu-batches", "1", "--no-warmup", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert "projected: True" in proc.stdout and r["projected"]
    assert len(r["step_seconds"]) == 4 and r["decode_latency_s"] > sum(r["step_seconds"][1:])


def test_cut_gen_len_needs_a_decode_step_to_project_from():
    """--cut-gen-len 1 times no decode step: it would report a decode latency of 0."""
    proc = run("bench", *SMALL, "--cut-gen-len", "1")
    assert_user_error(proc, "--cut-gen-len must be >= 2", "(got 1)")


def test_projection_extrapolates_the_measured_trend():
    assert project_decode([1.0, 0.5, 0.5], 3) == (1.0, False)
    latency, projected = project_decode([9.0, 1.0, 1.0, 2.0, 3.0], 8)   # steady steps 1, 2, 3
    assert projected and latency == pytest.approx(1 + 1 + 2 + 3 + 4 + 5 + 6)


def test_projection_never_extrapolates_a_falling_line():
    """Flat steps with noise that happens to fall (the first H200 run's h2o case) project at
    their mean: a fitted negative slope would make the missing steps free."""
    steps = [5.0] + [0.0190 - 0.00002 * i for i in range(63)]
    latency, projected = project_decode(steps, 2048)
    mean = sum(steps[2:]) / 62
    assert projected
    assert latency == pytest.approx(sum(steps[1:]) + mean * (2047 - 63))


def test_projection_of_a_full_buffer_is_flat():
    """A full fixed-budget buffer's steps cost the same however far the run goes: rising noise
    (a host whose speed drifted, the fourth H200 run) is not carried on; a buffer that fills
    during the run grows until it is full, then stays."""
    steps = [5.0] + [0.034 + 0.00008 * i for i in range(63)]
    latency, _ = project_decode(steps, 2048, attended=[400] * 2047)
    assert latency == pytest.approx(sum(steps[1:]) + sum(steps[2:]) / 62 * (2047 - 63))
    assert project_decode(steps, 2048)[0] > 1.5 * latency          # the line it replaces
    # steps 2, 3, 4 attend 12, 13, 14 tokens and take 1, 2, 3 s; full at 15 from step 5
    latency, _ = project_decode([9.0, 1.0, 1.0, 2.0, 3.0], 8, attended=[11, 12, 13, 14, 15, 15, 15])
    assert latency == pytest.approx(1 + 1 + 2 + 3 + 4 + 4 + 4)


def test_projection_follows_buzzs_saw():
    """BUZZ's middle fills to T and a pass samples it down (`BuzzLayout.held`): its steps
    grow and fall with it. A run cut in its first fill projects every later step by the tokens
    it attends, neither the rising line (the second H200 run's BUZZ total, half h2o's) nor the
    mean of the first fill's steps."""
    lay = get_policy("buzz", budget_tokens=400).layout(2048, 2048)
    attended = lay.attended_per_step(2047)
    assert attended[:2] == [n + 1 for n in lay.held(1)]        # step i: held after i - 1, + 1
    assert max(attended[:64]) < max(attended) and min(attended[64:]) < max(attended[:64])
    cost = [1e-3 + 1e-5 * n for n in attended]                # each step: linear in its tokens
    latency, projected = project_decode([5.0] + cost[:64], 2048, attended)
    assert projected and latency == pytest.approx(sum(cost), rel=1e-9)
    assert project_decode([5.0] + cost[:64], 2048)[0] > 1.1 * sum(cost)   # by step index
    mean_of_first = sum(cost[1:64]) / 63 * (2047 - 64) + sum(cost[:64])
    assert abs(mean_of_first - sum(cost)) > 0.01 * sum(cost)    # what `flat` made of it


@pytest.mark.slow
def test_model_too_big_for_memory_gives_estimate_and_fix():
    proc = run("bench", "--model", "opt-175b", "--device", "cpu", "--gpu-batch-size", "1")
    assert_user_error(proc, "out of CPU memory", "opt-175b", "GiB", "--gpu-batch-size",
                      "--offload-dir")


def test_memory_error_names_a_placement_that_fits():
    """A model too big for host memory: the error names placement flags that fit this batch
    (no calibration needed), and that placement passes the same check."""
    import re
    from flexevict.api import resolve_model
    from flexevict.runtime.memory import MemoryPlan, process_anon
    from flexevict.runtime.placement import Placement
    config, _ = resolve_model("opt-1.3b", None)                  # 5.3 GB of fp32 weights
    limit = process_anon() + 3 * GIB

    def plan(percent, **switches):
        p = Placement.from_percent(percent, gpu_batch_size=4, **switches)
        return MemoryPlan(config, p, torch.float32, 4, 512, 32, 544)

    with pytest.raises(UserError) as err:
        plan([100, 0, 100, 0, 100, 0]).check(torch.device("cpu"), None, limit)
    fits = re.search(r"percent ((?:\d+ ){5}\d+)((?: compress_\w+)*) fits", str(err.value))
    assert fits, str(err.value)                    # the library's names: Placement's fields
    percent = [int(x) for x in fits.group(1).split()]
    switches = {s: True for s in fits.group(2).split()}
    assert re.search(r"--percent (\d+ ){5}\d+(?: --compress-\w+)* fits", err.value.for_cli())
    assert percent[0] < 100                                      # weights partly elsewhere
    plan(percent, **switches).check(torch.device("cpu"), None, limit)   # it does fit


@pytest.mark.slow
def test_memory_error_predicts_the_placement_it_names():
    """With a calibration (the suite's fixed one), the error names the placement `plan` would
    (test_before_a_run.py), its predicted wall time in a person's units and the calibration."""
    proc = run("bench", "--model", "opt-1.3b", "--device", "cpu", "--cpu-mem-limit", "3",
               "--gpu-batch-size", "2")
    assert_user_error(proc, "out of CPU memory", "smallest change that fits: --percent ",
                      "token/s, about ", "for the batch, from the quick calibration ")


def test_gpu_mem_limit_names_the_device_index_torch_needs(monkeypatch):
    """torch refuses a bare "cuda" device in set_per_process_memory_fraction (the first
    FlexGen side-by-side on an H200 stopped there): the cap goes to the current device's index."""
    from flexevict.bench import throughput
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: type("P", (), {"total_memory": 80 * 2**30}))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda f, d: calls.append((f, d)))
    assert throughput._set_gpu_limit(torch.device("cuda"), 16) == 16 * 2**30
    assert throughput._set_gpu_limit(torch.device("cuda:1"), 40) == 40 * 2**30
    assert calls == [(0.2, 3), (0.5, 1)]


def test_gpu_mem_limit_needs_cuda():
    proc = run("bench", *SMALL, "--gpu-mem-limit", "16")
    assert_user_error(proc, "--gpu-mem-limit needs a CUDA device")


def test_long_opt_run_needs_the_timing_only_flag():
    proc = run("bench", "--model", "opt-125m", "--device", "cpu", "--prompt-len", "2048",
               "--gen-len", "8", "--gpu-batch-size", "1")
    assert_user_error(proc, "maximum of 2048 positions")


# ------------------------------------------------------------------------------ warm-up

def test_warmup_runs_the_policy_under_test_and_it_evicts(monkeypatch):
    """The warm-up must run the timed policy's own hooks (and kernels), not `full` only: a
    fresh instance from the same spec, evicting during the prefill and at every decode step."""
    from flexevict.runtime.engine import Engine
    from flexevict.policies.h2o import H2O
    from flexevict.bench import throughput

    runs, hooks = [], []
    real_run, real_after, real_prefill = Engine.run, H2O.after_attention, H2O.prefill

    def spy_run(self, prompts, steps, policy, *a, **k):
        stats = real_run(self, prompts, steps, policy, *a, **k)
        runs.append((policy, steps, len(prompts[0]), stats.layout))
        return stats

    def spy_after(self, *a, **k):
        hooks.append((id(self), "decode"))
        return real_after(self, *a, **k)

    def spy_prefill(self, *a, **k):
        hooks.append((id(self), "prefill"))
        return real_prefill(self, *a, **k)
    monkeypatch.setattr(Engine, "run", spy_run)
    monkeypatch.setattr(H2O, "after_attention", spy_after)
    monkeypatch.setattr(H2O, "prefill", spy_prefill)
    args = throughput.parse_args([a for a in SMALL if a != "--no-warmup"]
                                 + ["--policy", "h2o", "--budget", "0.5"])
    result = throughput.run(args)
    (warm, warm_steps, warm_len, warm_layout), (timed, _, _, _) = runs
    assert isinstance(warm, H2O) and warm is not timed and warm_layout.evicts
    assert warm_steps >= 2 and warm_layout.capacity < warm_len   # the prompt itself is compacted
    warm_hooks = [kind for who, kind in hooks if who == id(warm)]
    assert "prefill" in warm_hooks and warm_hooks.count("decode") > 0
    assert result["kernel_build_s"] is None                    # CPU: the reference, no build


@pytest.mark.parametrize("name", ["h2o", "buzz", "cascade", "hashevict", "vatp", "tova",
                                  "scissorhands", "recall", "keydiff", "snapkv",
                                  "triattention"])
def test_warmup_policy_evicts_at_the_warmup_length(name):
    from flexevict.bench.throughput import WARMUP_PROMPT, WARMUP_TOKENS, warmup_policy
    from flexevict.policies import PolicySpec
    policy, length = warmup_policy(PolicySpec.parse(name, 0.2), 2048, WARMUP_TOKENS)
    assert length >= WARMUP_PROMPT and policy.name == name
    layout = policy.layout(length, WARMUP_TOKENS)
    assert layout.evicts and layout.capacity < length


def test_warmup_of_full_is_full_and_fits_short_prompts():
    from flexevict.bench.throughput import warmup_policy
    from flexevict.policies import PolicySpec
    policy, length = warmup_policy(PolicySpec.parse("full"), 16, 8)
    assert policy.name == "full" and length == 16


# ------------------------------------------------------------------------------ run metadata

def _git_head() -> str:
    import subprocess
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()


def test_run_metadata_without_git_on_path(tmp_path, monkeypatch):
    from flexevict.runtime import machine
    expected = _git_head()
    monkeypatch.setenv("PATH", str(tmp_path))                 # an empty folder: no git
    machine.git_commit.cache_clear()
    try:
        meta = machine.run_metadata("cpu")
    finally:
        machine.git_commit.cache_clear()
    assert meta["commit"] == expected and len(expected) == 40


def test_commit_is_read_once_per_process(monkeypatch):
    from flexevict.runtime import machine
    reads = []
    monkeypatch.setattr(machine, "commit_from_tree", lambda start: reads.append(start) or "a" * 40)
    machine.git_commit.cache_clear()
    try:
        assert [machine.run_metadata()["commit"] for _ in range(3)] == ["a" * 40] * 3
    finally:
        machine.git_commit.cache_clear()
    assert len(reads) == 1


def test_commit_from_the_environment_wins_over_a_found_git(monkeypatch):
    """A tree copied to a GPU machine can carry a stale .git (the first H200 run recorded an
    old commit): the commit the GPU plan passes in $FLEXEVICT_COMMIT is the one recorded."""
    from flexevict.runtime import machine
    monkeypatch.setenv("FLEXEVICT_COMMIT", "b" * 40)
    machine.git_commit.cache_clear()
    try:
        assert machine.run_metadata()["commit"] == "b" * 40
    finally:
        machine.git_commit.cache_clear()


@pytest.mark.slow
def test_bench_runs_without_git_on_path(tmp_path):
    expected = _git_head()
    out = tmp_path / "r.json"
    env = dict(os.environ, PATH=str(tmp_path), HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "flexevict.bench", *SMALL, "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert r["run"]["commit"] == expected and r["run_info"]["commit"] == expected
    assert "kernel build/load: n/a" in proc.stdout


def test_commit_from_a_tree_without_git(tmp_path):
    """Loose refs, packed refs, a detached HEAD, a worktree's .git file, and no repository."""
    from flexevict.runtime.machine import commit_from_tree
    sha1, sha2, sha3 = "1" * 40, "2" * 40, "3" * 40
    git = tmp_path / "repo" / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "packed-refs").write_text(f"# pack-refs with: peeled\n{sha2} refs/heads/main\n"
                                     f"{sha3} refs/heads/other\n^{sha1}\n")
    deep = tmp_path / "repo" / "a" / "b"
    deep.mkdir(parents=True)
    assert commit_from_tree(deep) == sha2                     # packed
    (git / "refs" / "heads" / "main").write_text(sha1 + "\n")
    assert commit_from_tree(deep) == sha1                     # loose wins
    wt = git / "worktrees" / "wt"
    wt.mkdir(parents=True)
    (wt / "HEAD").write_text("ref: refs/heads/other\n")
    (wt / "commondir").write_text("../..\n")
    (tmp_path / "wt").mkdir()
    (tmp_path / "wt" / ".git").write_text(f"gitdir: {wt}\n")
    assert commit_from_tree(tmp_path / "wt") == sha3          # worktree -> common packed refs
    (git / "HEAD").write_text(sha2 + "\n")
    assert commit_from_tree(deep) == sha2                     # detached
    lone = tmp_path / "lone"
    lone.mkdir()
    assert commit_from_tree(lone) in (None, _git_head())      # tmp may sit inside a checkout


# ------------------------------------------------------------------------------ kernel timing

def test_kernel_benchmark_runs_on_cpu(tmp_path):
    out = tmp_path / "k.json"
    proc = subprocess.run([sys.executable, "-m", "flexevict.bench.kernels", "--quick",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert r["backend"] == "torch-reference" and r["launches"] == 2 and r["results"]
    for row in r["results"]:
        assert row["kernel_ms"] is None and row["reference_ms"] > 0
        assert row["reference_host_us"] > 0 and row["launches"] >= 1
    assert r["run"]["commit"]


def test_kernel_benchmark_switches_paths_by_api_not_environment(monkeypatch):
    """Both paths of an op are timed through ext.use_kernels: FLEXEVICT_KERNELS (seen by every
    thread and child process) is never written, and the switch is restored after."""
    import torch
    from flexevict.bench.kernels import Op, both_paths
    from flexevict.core.kernels import ext
    monkeypatch.delenv("FLEXEVICT_KERNELS", raising=False)
    seen = []
    op = Op("probe", lambda i: seen.append((ext.enabled(), os.environ.get("FLEXEVICT_KERNELS"))))
    both_paths(op, torch.device("cpu"), launches=1, loops=2, with_kernels=True)
    n = len(seen) // 2
    assert seen == [(True, None)] * n + [(False, None)] * n
    assert ext.enabled() and "FLEXEVICT_KERNELS" not in os.environ


def test_use_kernels_overrides_the_variable_and_restores(monkeypatch):
    from flexevict.core.kernels import ext
    monkeypatch.setenv("FLEXEVICT_KERNELS", "0")
    assert not ext.enabled()
    with ext.use_kernels(True):
        assert ext.enabled()
        with ext.use_kernels(False):
            assert not ext.enabled() and ext.backend("cuda") == ext.REFERENCE
        assert ext.enabled()
    assert not ext.enabled()
    monkeypatch.delenv("FLEXEVICT_KERNELS")
    assert ext.enabled()


def test_timed_loops_launch_back_to_back_with_setup_outside():
    """N launches per loop, the setup once per loop (never between launches), and an op with
    `copies` gets at most that many launches per loop, each on its own copy."""
    import torch
    from flexevict.bench.kernels import Op, time_op
    events = []
    op = Op("count", lambda i: events.append(("launch", i)), lambda: events.append("setup"))
    t = time_op(op, torch.device("cpu"), launches=5, loops=4)
    loops = [chunk for chunk in _split_at_setup(events) if chunk]
    assert t["launches"] == 5 and t["ms"] >= 0 and t["host_us"] >= 0
    assert loops[0] == [("launch", 0)]                            # the untimed first launch
    assert all(chunk == [("launch", i) for i in range(5)] for chunk in loops[1:])
    assert len(loops) == 1 + 2 + 4                                # first, host loops, timed loops
    events.clear()
    t = time_op(Op("copies", lambda i: events.append(("launch", i)),
                   lambda: events.append("setup"), copies=3), torch.device("cpu"), 20, 2)
    launched = [i for chunk in _split_at_setup(events) for _, i in chunk]
    assert t["launches"] == 3 and max(launched) == 2


def _split_at_setup(events):
    chunks = [[]]
    for e in events:
        if e == "setup":
            chunks.append([])
        else:
            chunks[-1].append(e)
    return chunks


# ------------------------------------------------------------------------------ FlexGen peer

FAKE_FLEX_OPT = '''
"""Stands in for flexgen.flex_opt (FlexGen 0.1.8): what it does with the tokenizer and the log."""
import argparse, os
from transformers import AutoTokenizer
p = argparse.ArgumentParser()
p.add_argument("--model"); p.add_argument("--log-file"); p.add_argument("--prompt-len", type=int)
args, _ = p.parse_known_args()
assert os.environ.get("HF_HUB_OFFLINE") == "1", "the hub would be asked"
tok = AutoTokenizer.from_pretrained("facebook/opt-30b", padding_side="left")
ids = tok(["Paris is the capital city of"], padding="max_length",
          max_length=args.prompt_len).input_ids[0]
assert len(ids) == args.prompt_len
with open(args.log_file, "a") as f:
    f.write(f"model size: 12.4 GB\\tcache size: 1.1 GB\\thidden size (p): 0.0 GB\\n"
            f"peak gpu mem: 13.0 GB\\tprojected: False\\n"
            f"prefill latency: 0.5 s\\tprefill throughput: 2048.0 token/s\\n"
            f"decode latency: 1.5 s\\tdecode throughput: 41.3 token/s\\n"
            f"total latency: 2.0 s\\ttotal throughput: 32.0 token/s\\n")
'''


@pytest.mark.slow
def test_flexgen_peer_runs_offline_for_any_opt_model(tmp_path):
    """FlexGen loads facebook/opt-30b's tokenizer whatever the model: the peer must put its
    stand-in there, in FlexGen's working folder, and keep the hub off."""
    site = tmp_path / "site" / "flexgen"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    (site / "flex_opt.py").write_text(FAKE_FLEX_OPT)
    work, out = tmp_path / "work", tmp_path / "peer.json"
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE",
                                                            "TRANSFORMERS_OFFLINE")}
    env.update(FLEXGEN_PYTHON=sys.executable, PYTHONPATH=str(tmp_path / "site"))
    peer = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                        "peers", "flexgen_peer.py")
    proc = subprocess.run([sys.executable, peer, "--model", "opt-6.7b", "--prompt-len", "48",
                           "--workdir", str(work), "--offload-dir", str(tmp_path / "off"),
                           "--json", str(out)], capture_output=True, text=True, env=env,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (work / "facebook" / "opt-30b" / "tokenizer.json").is_file()
    assert not (work / "facebook" / "opt-6.7b").exists()
    r = json.loads(out.read_text())
    assert r["total_throughput"] == 32.0 and r["projected"] is False


def test_flexgen_peer_prepare_writes_where_flexgen_looks(tmp_path, monkeypatch):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "bench", "peers"))
    try:
        import flexgen_peer
    finally:
        sys.path.pop(0)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    env = flexgen_peer.prepare(str(tmp_path))
    assert env["HF_HUB_OFFLINE"] == "1"
    assert (tmp_path / "facebook" / "opt-30b" / "tokenizer_config.json").is_file()


def test_a_run_predicted_over_an_hour_needs_yes(monkeypatch):
    """Refused before the weights load unless --yes (a terminal would be asked); what counts
    is the run's own length: prefill plus the decode steps it times (--cut-gen-len)."""
    from flexevict.bench.throughput import confirm_long_run
    predicted = {"prefill_s": 600.0, "decode_step_s": 2.0, "throughput": 0.5}
    monkeypatch.setattr(sys.stdin, "isatty", lambda: False, raising=False)
    with pytest.raises(UserError, match=r"predicted to take about 1 h .*add --yes"):
        confirm_long_run(predicted, 2048, yes=False)
    confirm_long_run(predicted, 2048, yes=True)
    confirm_long_run(predicted, 64, yes=False)                   # cut: 12 min
    confirm_long_run(None, 2048, yes=False)                      # no prediction: no question
