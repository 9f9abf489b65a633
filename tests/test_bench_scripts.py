"""Every script under bench/ runs: each is started as `python bench/<script> ...` with tiny
arguments in its own process, must exit 0 and leave a real output (a JSON it wrote, or the
table or text it prints). A new script without a case here fails `test_every_script_has_a_case`.

Scripts that need a GPU or a peer package this machine lacks run the part a CPU can: a dry run,
a table rebuilt from committed results, or `--help` (each case says which). Every script also
answers `--help` with its usage and exit 0 (`test_script_answers_help`)."""
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
SCRIPTS = sorted(os.path.relpath(p, BENCH) for pattern in ("*.py", "*/*.py")
                 for p in glob.glob(os.path.join(BENCH, pattern)))
PLACEMENT = os.path.join(BENCH, "results", "placement", "predicted_vs_measured_cpu.json")
ACCURACY = os.path.join(BENCH, "results", "accuracy")


def _json(path):
    with open(path) as f:
        return json.load(f)


def check_batch_job(out, stdout, tmp):
    r = _json(out)
    assert r["bench_throughput"] > 0 and r["job_throughput"] > 0
    assert r["all_rows_full_length"] and r["run"]["commit"]


def check_batching(out, stdout, tmp):
    r = _json(out)
    assert r["prompts"] == 2 and r["invariant"]["same_as_alone"] == 2
    assert r["length-sorted"]["tokens_per_s"] > 0


def check_dummy_weights(out, stdout, tmp):
    r = _json(out)
    assert [(row["shape"], row["dtype"]) for row in r["rows"]] == [("64x64", "float32"),
                                                                   ("64x64", "float16"),
                                                                   ("3x5", "float32"),
                                                                   ("3x5", "float16")]
    assert all(v > 0 for row in r["rows"] for v in row["gb_per_s"].values())
    assert "after/before" in stdout


def check_readme_commands(out, stdout, tmp):
    r = _json(out)                                           # PREFIX.json
    (conv,) = r["results"]                                   # --only flexevict.convert
    assert conv["rc"] == 0 and conv["wall_s"] >= conv["longest_gap_s"] > 0
    assert "flexevict.convert" in conv["command"] and "wrote" in conv["last_line"]
    assert "| `python -m flexevict.convert" in open(out[:-len("json")] + "md").read()


def check_common(out, stdout, tmp):
    meta = json.loads(stdout)
    assert {"device", "torch", "cuda", "kernels", "commit"} <= set(meta)


def check_placement_table(out, stdout, tmp):
    assert stdout.strip() == _json(PLACEMENT)["table"].strip()       # the committed tables


def check_side_by_side(out, stdout, tmp):
    r = _json(out)                                   # PREFIX.json
    (case,) = r["cases"]
    assert case["case"] == "opt-125m-memory-full" and "| case |" in stdout


def check_eviction_cost(out, stdout, tmp):
    r = _json(out)                                   # PREFIX.json
    for label in ("before", "after"):
        runs = r["runs"][label]["4"]
        assert set(runs) == {"full", "h2o", "keydiff"}
        assert all(run["total_throughput"] > 0 for run in runs.values())
    assert r["runs"]["after"]["4"]["h2o"]["prefill_eviction_s"] > 0
    assert "| keydiff |" in stdout
    assert "### after, 16 + 4" in stdout and "| h2o |" in stdout


def check_recall_speed(out, stdout, tmp):
    r = _json(out)                                   # PREFIX.json
    assert set(r["runs"]) == {"full", "h2o", "recall"}
    assert all(run["decode_throughput"] > 0 for run in r["runs"].values())
    assert "| recall |" in stdout and "--policy recall --budget 0.5" in stdout


def check_hook_cost(out, stdout, tmp):
    (r,) = _json(out)["results"]                     # PREFIX.json
    assert r["policy"] == "hashevict" and len(r["runs"]["before"]) == 1
    assert all(r["median"][t]["prefill_ms"] > 0 and r["median"][t]["decode_us"] > 0
               for t in ("before", "after"))
    assert "| hashevict |" in stdout


def check_hook_share(out, stdout, tmp):
    r = _json(out)                                      # PREFIX.json
    assert r["device"] and r["commit"] and r["torch"]   # the machine at the top level
    assert [row["policy"] for row in r["results"]] == ["h2o", "buzz"]
    for row in r["results"]:
        assert all(row["median_step_ms"][label] > 0 for label in ("with", "without"))
        assert -1 < row["share"] < 1 and row["steps_counted"] == {"with": 3, "without": 3}
        assert row["graphed_steps"] == {"with": 0, "without": 0} and row["goal_met"] is None
        assert len(row["runs"]["with"]) == len(row["runs"]["without"]) == 1
    assert r["settings"]["disabled"] == ["before_attention", "after_attention", "commit",
                                         "replay_host"]
    assert "| h2o | 8 |" in stdout and "| buzz |" in stdout and "n/a (eager)" in stdout
    assert "a CPU never graphs" in open(out[:-len("json")] + "md").read()


def check_ppl_head(out, stdout, tmp):
    r = _json(out)                                           # PREFIX.json
    assert r["decode_steps"] > 0 and r["max_nll_diff"] < 1e-4
    assert all(s > 0 for way in r["ways"].values() for s in way["seconds"])
    assert "| per step |" in stdout and "| together |" in stdout


def check_recall_reuse(out, stdout, tmp):
    (r,) = _json(out)["results"]                     # PREFIX.json
    assert r["steps"] == 2 and r["pages"] > 0 and 0 <= r["share_copied"] <= 1
    assert r["resolved"]["policy"] == "recall" and "| 0.5 |" in stdout


def check_suites(out, stdout, tmp):
    lines = stdout.splitlines()
    assert lines and all(ln.startswith("h2o/opt-") for ln in lines)
    assert any("--policy h2o --yes" in ln and "--budget 0.2" in ln for ln in lines)


def check_profile(out, stdout, tmp):
    r = _json(out)
    assert r["slots"] == 6 and r["wall_ms_per_step"] > 0 and r["device"] == "cpu"
    assert "opt-125m batch 2, h2o (6 slots)" in stdout     # a CPU has no kernel table


def check_gpu_plan(out, stdout, tmp):
    lines = stdout.splitlines()
    assert lines and all(ln.startswith("gpu/") for ln in lines)
    assert any(ln.startswith("gpu/opt-30b-512+512-h2o-0.2 ") and "--budget 0.2" in ln
               for ln in lines)


def check_gpu_tables(out, stdout, tmp):
    assert stdout.startswith("# GPU plan on NVIDIA H200")                  # the committed run
    assert "| opt-30b-512+512-full | 10 90 30 70 100 0 2x16  | 32 |" in stdout
    assert "| 16.04 | 1.24 |" in stdout


def check_help(out, stdout, tmp):
    assert stdout.startswith("usage:")


def check_peer_export(out, stdout, tmp):
    r = _json(out)
    assert set(r["tasks"]) == {"passkey", "agreement"} and r["gguf"].endswith(".gguf")


def check_hf_generate(out, stdout, tmp):
    r = _json(out)
    assert r["peer"] == "transformers" and r["batch"] == 2 and r["total_throughput"] > 0


def before_tree(tmp) -> str:
    """A plain source copy of this tree for side_by_side's --before (the script links its
    policies/ in, so never point it at the shared checkout itself)."""
    tree = os.path.join(tmp, "before")
    for name in ("flexevict", "policies"):
        shutil.copytree(os.path.join(ROOT, name), os.path.join(tree, name),
                        ignore=shutil.ignore_patterns("__pycache__"))
    return tree


# script -> (arguments, the check of what it left). In the arguments OUT is the JSON the check
# reads (tmp/out.json), PREFIX that path less ".json", BEFORE a source copy of this tree.
CASES = {
    "batch_job.py": (["--prompt-len", "8", "--gen-len", "2", "--gpu-batch-size", "1",
                      "--num-gpu-batches", "1", "--blocks", "1", "--repeats", "1",
                      "--json", "OUT"], check_batch_job),
    "batching.py": (["--prompts", "2", "--batch-size", "2", "--max-new-tokens", "2",
                     "--json", "OUT"], check_batching),
    # not a benchmark: the helpers the others import; run, it prints the metadata they record
    "common.py": ([], check_common),
    # two small tensors (one of odd length), one repeat
    "dummy_weights.py": (["--shapes", "64x64,3x5", "--repeats", "1", "--json", "OUT"],
                         check_dummy_weights),
    # README's convert command alone (the whole list runs for many minutes)
    "readme_commands.py": (["--only", "flexevict.convert", "--out", "PREFIX"],
                           check_readme_commands),
    # the tables from the committed results (the suite itself measures for minutes)
    "placement_table.py": ([PLACEMENT], check_placement_table),
    # one CPU case, one round, 2 tokens, against a copy of this same tree
    "side_by_side.py": (["--before", "BEFORE", "--rounds", "1", "--case", "opt-125m-memory-full",
                         "--gen-len", "2", "--out", "PREFIX"], check_side_by_side),
    # three policies (one of 2025), a 16-token prompt, 4 tokens, against a copy of this tree
    "eviction_cost.py": (["--before", "BEFORE", "--policy", "full", "--policy", "h2o",
                          "--policy", "keydiff",
                          "--prompt-len", "16", "--gen-len", "4", "--batch", "2",
                          "--out", "PREFIX"], check_eviction_cost),
    # HashEvict's hooks on a 256-token prompt, 2 timed steps, one round
    "hook_cost.py": (["--before", "BEFORE", "--policy", "hashevict", "--rounds", "1",
                      "--prompt-len", "256", "--steps", "2", "--out", "PREFIX"], check_hook_cost),
    # h2o and buzz with and without their hooks, one round: 32 + 8 tokens, 6 steps run
    "hook_share.py": (["--model", "opt-125m", "--prompt-len", "32", "--gen-len", "8",
                       "--cut-gen-len", "6", "--gpu-batch-size", "2", "--policy", "h2o",
                       "--policy", "buzz", "--rounds", "1", "--device", "cpu", "--out", "PREFIX"],
                      check_hook_share),
    # full, h2o and recall on a 64-token prompt, 4 tokens
    "recall_speed.py": (["--model", "opt-125m", "--prompt-len", "64", "--gen-len", "4",
                         "--budget", "0.5", "--out", "PREFIX"], check_recall_speed),
    # SmolLM2's perplexity on two 32-token documents, the head per step and deferred
    "ppl_head.py": (["--tokens", "32", "--docs", "2", "--budget", "0.5", "--rounds", "1",
                     "--out", "PREFIX"], check_ppl_head),
    # SmolLM2 on two 48-token pieces of Hamlet, 4 tokens
    "recall_reuse.py": (["--prompt-len", "48", "--gen-len", "4", "--batch", "2", "--budget",
                         "0.5", "--out", "PREFIX"], check_recall_reuse),
    # the GPU calls' plan (every suite of them needs a GPU; the CPU suite takes minutes)
    "suites.py": (["h2o", "--list"], check_suites),
    # where a decode step's GPU time goes; on a CPU only its wall time
    "profile_decode.py": (["--model", "opt-125m", "--batch", "2", "--prompt-len", "16",
                           "--gen-len", "16", "--steps", "1", "--device", "cpu", "--json", "OUT"],
                          check_profile),
    # kvpress lives in its own environment (transformers < 5.3): its command line only
    "accuracy/kvpress_peer.py": (["--help"], check_help),
    # kvpress lives in its own environment: its command line only
    "peer_kvpress.py": (["--help"], check_help),
    # the export half (the compare half needs kvpress's output)
    "accuracy/peer.py": (["export", "--out", "OUT"], check_peer_export),
    # FlexGen 0.1.8 runs only on CUDA, from its own environment: its command line only
    "peers/flexgen_peer.py": (["--help"], check_help),
    # the GPU plan's steps (running them needs a GPU); its tables from the committed run
    "gpu_plan.py": (["--list"], check_gpu_plan),
    "gpu_tables.py": ([os.path.join(BENCH, "results", "gpu-2026-11-28")], check_gpu_tables),
    # the authors' TriAttention lives in its own environment: its command line only
    "peer_triattention.py": (["--help"], check_help),
    "peers/hf_generate.py": (["--model", "opt-125m", "--prompt-len", "8", "--gen-len", "2",
                              "--gpu-batch-size", "2", "--device", "cpu", "--json", "OUT"],
                             check_hf_generate),
}


def test_every_script_has_a_case():
    assert SCRIPTS and set(SCRIPTS) == set(CASES), \
        f"scripts without a case: {sorted(set(SCRIPTS) - set(CASES))}; " \
        f"cases without a script: {sorted(set(CASES) - set(SCRIPTS))}"


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_script_runs(script, tmp_path):
    if script not in CASES:
        pytest.fail(f"bench/{script} has no case in CASES")
    args, check = CASES[script]
    out = tmp_path / "out.json"
    fill = {"OUT": lambda: str(out), "PREFIX": lambda: str(tmp_path / "out"),
            "BEFORE": lambda: before_tree(str(tmp_path))}
    args = [fill[a]() if a in fill else a for a in args]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(BENCH, script), *args],
                          capture_output=True, text=True, cwd=str(tmp_path), env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check(str(out), proc.stdout, str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_script_answers_help(script, tmp_path):
    """`python bench/<script> --help` prints its usage and exits 0, running nothing."""
    proc = subprocess.run([sys.executable, os.path.join(BENCH, script), "--help"],
                          capture_output=True, text=True, cwd=str(tmp_path),
                          env=dict(os.environ, HF_HUB_OFFLINE="1"), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_help(None, proc.stdout, str(tmp_path))
    assert os.listdir(tmp_path) == []                # nothing written: --help ran nothing


def test_a_peers_driver_runs_in_its_own_folder_and_environment(monkeypatch):
    """`common.run_driver` (peer_kvpress.py, peer_triattention.py): the driver sees its inputs,
    the folder and none of this environment's PYTHONPATH; the reader runs while the driver's
    files exist; a failing driver is one UserError with its stderr."""
    sys.path.insert(0, BENCH)
    from common import read_out, run_driver
    from flexevict.errors import UserError
    monkeypatch.setenv("PYTHONPATH", "/nowhere")
    driver = ("import json, os, sys\nspec = json.load(open(sys.argv[1]))\n"
              "open(os.path.join(spec['tmp'], 'extra.txt'), 'w').write(spec['word'])\n"
              "json.dump({'path': os.environ.get('PYTHONPATH'), 'cwd': os.getcwd()}, "
              "open(spec['out'], 'w'))\n")

    def read(spec):
        with open(os.path.join(spec["tmp"], "extra.txt")) as f:
            return read_out(spec), f.read(), spec["tmp"]
    out, extra, tmp = run_driver(sys.executable, driver, {"word": "kept"}, "test", read)
    assert out == {"path": None, "cwd": os.path.realpath(tmp)} and extra == "kept"
    assert not os.path.exists(tmp)                          # the folder goes afterwards
    with pytest.raises(UserError, match="the test driver failed:\n(.|\n)*boom"):
        run_driver(sys.executable, "raise SystemExit('boom')", {}, "test", read_out)


def test_the_peer_qwen3_is_a_folder_transformers_and_flexevict_read_alike(monkeypatch, tmp_path):
    """`common.peer_model("qwen3-tiny")`: an HF folder (config, safetensors, tokenizer) of
    flexevict's dummy weights, whose logits transformers' Qwen3 reproduces (shrunk here)."""
    transformers = pytest.importorskip("transformers")
    import torch
    sys.path.insert(0, BENCH)
    import common
    from flexevict.api import LLM
    from flexevict.policies import get_policy
    small = dict(common.QWEN3_TINY, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=32, ffn_size=96)
    monkeypatch.setattr(common, "QWEN3_TINY", small)
    source, path, line = common.peer_model("qwen3-tiny", str(tmp_path))
    assert source == {"folder": path} and "Qwen3" in line
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors", "tokenizer.json"]
    llm = LLM(path)
    assert (llm.config.arch, llm.config.num_kv_heads, llm.config.head_dim) == ("qwen3", 2, 32)
    ids = [5, 900, 17, 3000, 42, 7]
    got = []
    llm.engine.run([ids], 1, get_policy("full"),
                   lambda i, k, h, head: got.append(head(h)) or torch.zeros(1, dtype=torch.long))
    llm.close()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = hf(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got[0][0].float(), want, rtol=1e-4, atol=1e-4)


def _buffer_state(buf):
    """A KV buffer's tensors (cloned) and host values, its policy state's included."""
    import torch
    state = list(buf.policy_state.items())
    tensors = [t.clone() for t in buf.tensors()]
    tensors += [v.clone() for _, v in state if isinstance(v, torch.Tensor)]
    host = {k: v for k, v in list(vars(buf).items()) + state
            if isinstance(v, (int, float, bool, str, tuple, type(None)))}
    return tensors, host


def _same_state(a, b) -> bool:
    import torch
    return len(a[0]) == len(b[0]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0])) \
        and a[1] == b[1]


# hook_share.py's default policies: the seed policies and recall
@pytest.mark.parametrize("name", ["h2o", "buzz", "cascade", "hashevict", "vatp", "tova",
                                  "recall"])
def test_hook_share_variant_runs_no_decode_hook(name):
    """bench/hook_share.py's "P without hooks": P's class, arguments, layout, fields and flags,
    no scores accumulated; after P's own prefill, the model's decode step with it
    (`cache_attention`), the engine's stacked commit and BUZZ's after-replay host step leave the
    buffer as the token's write left it, where P's own step changes it."""
    import torch
    from flexevict.core.kv import KVBuffer
    from flexevict.core.model import cache_attention
    from flexevict.planner.calibration import _prefill, _prompt
    from flexevict.policies import get_policy
    sys.path.insert(0, BENCH)
    from hook_share import without_hooks
    policy = get_policy(name, budget=0.2)
    bare = without_hooks(policy)
    assert type(bare).__mro__[1] is type(policy) and bare.arguments() == policy.arguments()
    assert not bare.accumulates_attention and bare.describe() == policy.describe()
    for flag in ("graph_safe", "graph_safe_filling", "stacks", "rope_in_cache", "name",
                 "needs_prompt_scores", "needs_prompt_queries"):
        assert getattr(bare, flag) == getattr(policy, flag), flag
    prompt, gen, rows, d, g = 200, 40, 4, 16, 2               # 48 slots: the prompt compacts
    layout = policy.layout(prompt, gen)
    assert bare.layout(prompt, gen) == layout and bare.fields(layout) == policy.fields(layout)
    for p in (policy, bare):
        torch.manual_seed(0)
        buf = KVBuffer(layout, rows, d, torch.float32, "cpu", fields=p.fields(layout))
        _prefill(p, buf, *_prompt("cpu", torch.float32, prompt, rows, d, g))
        slot, new = buf.incoming_slot(), torch.randn(rows, d)
        buf.write(slot, new, new, torch.full((rows,), prompt, dtype=torch.int32))
        written = _buffer_state(buf)
        cache_attention(torch.randn(rows, g, d), buf, slot, p, d ** -0.5)
        if p is bare:                  # what the engine calls besides, per step
            bare.commit(buf, slot)
            if buf.replay_host is not None:
                buf.replay_host(buf)
        assert _same_state(written, _buffer_state(buf)) == (p is bare), p
