"""The accuracy sweep (`python -m flexevict.eval sweep`) on the packaged SmolLM2 and texts.

One `--quick` sweep runs once for the run (a few minutes of a 2-core CPU, split over its
cores); the tests read its files. Every policy runs the `ppl` task; the other tasks run the
papers' policies and the reference ones (`SWEPT`): each policy's generation is tested on its
own in test_policy_matrix, so the other policies' cells there would repeat the same paths for
minutes. The tests check the orderings that hold robustly at the quick size (every policy beats
`local` on streaming perplexity at 20%; `full` reproduces the no-eviction engine bit for bit),
resumability, the `--text` override and the one-line errors.
"""
import json
import math
import multiprocessing
import os
import shutil
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from flexevict.errors import UserError
from flexevict.eval import main
from flexevict.evaluation.sweep import TASKS, _locked
from flexevict.policies import POLICIES, PolicySpec


def packaged_texts_or_skip():
    from flexevict.io.packaged import wikipedia_text
    from flexevict.evaluation.tasks import news_articles, shakespeare_text
    try:
        wikipedia_text(1), shakespeare_text(), news_articles()
    except UserError as e:
        pytest.skip(str(e))


def sweep(capsys, *argv) -> dict:
    """Run the sweep CLI in this process -> its --json summary (stderr in ['stderr'])."""
    main(["sweep", *argv, "--json"])
    out, err = capsys.readouterr()
    return {**json.loads(out.strip().splitlines()[-1]), "stderr": err}


SWEPT = ["full", "local", "h2o", "buzz", "cascade", "hashevict", "vatp", "recall"]


def cells(folder) -> dict:
    with open(os.path.join(folder, "results.json")) as f:
        data = json.load(f)["cells"]
    return {(c["task"], c["policy"], c["budget"]): c for c in data.values()}


@pytest.fixture(scope="module")
def quick(tmp_path_factory, smollm2_path):
    """This module's copy of the --quick sweep's folder. Under xdist the first worker to ask
    builds it in the run's shared temp folder and the others wait and copy it: the sweep takes
    minutes of every core, and each worker building its own (as a module fixture would) took
    twice that. Tests may add cells to their copy."""
    packaged_texts_or_skip()
    folder = tmp_path_factory.mktemp("sweep")
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")      # set in each worker of one xdist run
    if run is None:
        build_quick_sweep(str(folder))
        return str(folder)
    shared = tmp_path_factory.getbasetemp().parent / f"quick-sweep-{run}"
    built = shared.with_name(shared.name + ".built")
    with _locked(str(shared.parent)):                  # the sweep's own lock, on the run's folder
        if not built.exists():                         # not yet, or a build that failed
            build_quick_sweep(str(shared))
            built.touch()
    shutil.copytree(shared, folder, dirs_exist_ok=True)
    return str(folder)


def build_quick_sweep(folder: str) -> None:
    """The --quick sweep (`ppl` for every policy, every task for SWEPT), shared out over
    the CPU's cores (a process and a torch thread each, all writing the one results folder,
    which the sweep locks for them), then its tables and plots from the results (--report)."""
    cores = min(len(os.sched_getaffinity(0)), 4)
    rest = [p for p in POLICIES if p not in SWEPT]
    shares = [[(",".join(TASKS), SWEPT[k::cores]), ("ppl", rest[k::cores])]
              for k in range(cores)]
    with ProcessPoolExecutor(cores, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(sweep_share, [folder] * cores, shares))
    main(["sweep", "--quick", "--report", "--out", folder])


def sweep_share(folder: str, share: list[tuple[str, list[str]]]) -> None:
    """In a worker process: the quick sweep of each (tasks, policies) of the share, in turn
    (and `full`, which every sweep runs: cells already finished are skipped)."""
    for tasks, policies in share:
        if policies:
            main(["sweep", "--quick", "--tasks", tasks, "--policies", ",".join(policies),
                  "--threads", "1", "--out", folder])


@pytest.mark.slow
def test_quick_sweep_writes_results_tables_claims_and_plots(quick):
    c = cells(quick)
    items = {"ppl": ("nll", 2), "agreement": ("rouge_l", 2), "passkey": ("accuracy", 2),
             "retrieval": ("accuracy", 4)}                      # quick: 2 docs, prompts, ...
    for task in ("ppl", "agreement", "passkey", "attention-loss", "retrieval"):
        assert (task, "full", 1.0) in c                          # the reference, always run
        evicting = [p for p in (POLICIES if task == "ppl" else SWEPT) if p != "full"]
        assert all((task, p, 0.2) in c for p in evicting)
        if task in items:                                        # the paired units, per cell
            name, n = items[task]
            assert all(len(c[(task, p, 0.2)]["metrics"]["items"][name]) == n
                       for p in evicting if "skipped" not in c[(task, p, 0.2)]["metrics"])
    md = open(os.path.join(quick, "results.md")).read()
    assert all(f"`{p}`" in md for p in POLICIES)
    by_length = md.split("retrieval accuracy by prompt length")[1].splitlines()
    assert by_length[2] == "| policy | budget | 256 |"               # full's row first
    assert by_length[4].startswith("| `full` | 100% |")
    claims = open(os.path.join(quick, "claims.md")).read()
    for paper in ("H2O", "BUZZ", "Cascade", "HashEvict", "VATP"):
        assert f"| {paper} |" in claims
    for name in ("ppl_ppl", "agreement_rouge_l", "passkey_accuracy", "retrieval_accuracy",
                 "attention-loss_attn_error", "attention-loss_per_layer"):
        with open(os.path.join(quick, name + ".png"), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_every_policy_beats_local_at_20_percent_perplexity(quick):
    c = cells(quick)
    local = c[("ppl", "local", 0.2)]["metrics"]["ppl"]
    for p in POLICIES:
        if p not in ("full", "local"):
            metrics = c[("ppl", p, 0.2)]["metrics"]
            if "skipped" in metrics:      # recall: 20% of the quick documents holds no page
                assert p == "recall" and "raise budget" in metrics["skipped"], metrics
                continue
            ppl = metrics["ppl"]
            assert math.isfinite(ppl) and ppl < local, (p, ppl, local)
    assert c[("ppl", "full", 1.0)]["metrics"]["ppl"] < local


@pytest.mark.slow
def test_full_equals_the_no_eviction_engine_exactly(quick, engine_smollm2):
    """The sweep's `full` row is `LLM.score_ids` with no policy, bit for bit, per document."""
    from flexevict.evaluation.tasks import Ppl
    task = Ppl(engine_smollm2, quick=True)
    cell = cells(quick)[("ppl", "full", 1.0)]
    assert cell["settings"] == task.settings                      # the same token ids
    for name, ids in task.docs.items():
        assert cell["metrics"]["per_doc"][name] == engine_smollm2.score_ids(ids)["ppl"]


@pytest.mark.slow
def test_reference_cells_are_exact(quick):
    c = cells(quick)
    assert c[("agreement", "full", 1.0)]["metrics"]["rouge_l"] == 1.0
    assert c[("agreement", "full", 1.0)]["metrics"]["token_agreement"] == 1.0
    assert c[("passkey", "full", 1.0)]["metrics"]["accuracy"] == 1.0  # the task is solvable
    assert c[("attention-loss", "full", 1.0)]["metrics"]["attn_error"] == 0.0


@pytest.mark.slow
def test_attention_error_measures_eviction(quick):
    c = cells(quick)
    err = {p: c[("attention-loss", p, 0.2)]["metrics"] for p in SWEPT if p != "full"}
    ran = {p: m for p, m in err.items() if "skipped" not in m}
    assert "hashevict" not in ran and "below policy" in err["hashevict"]["skipped"]
    for p, m in ran.items():
        assert m["decode_steps"] > 0 and len(m["per_layer"]) == 30
        assert all(e > 0 for e in m["per_layer"]), p
    assert ran["local"]["attn_error"] > ran["h2o"]["attn_error"]  # no sinks: far off


@pytest.mark.slow
def test_rerun_skips_finished_cells_and_resumes_a_missing_one(quick, capsys):
    before = cells(quick)
    swept = ("--quick", "--out", quick, "--policies", ",".join(SWEPT))
    r = sweep(capsys, *swept)
    n = 5 * len(SWEPT)                                           # tasks x policies at 20%
    assert f"{n} cells, {n} already done, 0 to run" in r["stderr"] and r["cells_run"] == 0
    assert cells(quick) == before
    path = os.path.join(quick, "results.json")                    # lose one finished cell
    with open(path) as f:
        data = json.load(f)
    key = next(k for k, v in data["cells"].items()
               if (v["task"], v["policy"]) == ("passkey", "h2o"))
    del data["cells"][key]
    with open(path, "w") as f:
        json.dump(data, f)
    r = sweep(capsys, *swept)
    assert f"{n - 1} already done, 1 to run" in r["stderr"] and r["cells_run"] == 1
    after = cells(quick)
    assert after[("passkey", "h2o", 0.2)]["metrics"] == before[("passkey", "h2o", 0.2)]["metrics"]
    assert all(after[k]["finished"] == v["finished"] for k, v in before.items()
               if k != ("passkey", "h2o", 0.2))


@pytest.mark.slow
def test_text_override_replaces_the_packaged_texts(tmp_path, capsys, smollm2_path):
    text = tmp_path / "mine.txt"
    text.write_text(" ".join(f"Line {i}: the river rose {i} feet after the storm, and the town "
                             f"moved {i * 3} families uphill." for i in range(12)))
    out = str(tmp_path / "out")
    sweep(capsys, "--quick", "--out", out, "--text", str(text), "--tasks", "ppl,passkey",
          "--policies", "full,h2o,local", "--budgets", "0.5,1.0")
    c = cells(out)
    assert c[("ppl", "full", 1.0)]["settings"]["docs"] == ["text-1", "text-2"]
    assert c[("passkey", "full", 1.0)]["settings"]["filler"] == "text"
    # a budget that holds the whole stream evicts nothing: identical to `full`
    assert c[("ppl", "h2o", 1.0)]["metrics"]["ppl"] == c[("ppl", "full", 1.0)]["metrics"]["ppl"]
    assert c[("ppl", "h2o", 0.5)]["metrics"]["ppl"] < c[("ppl", "local", 0.5)]["metrics"]["ppl"]


@pytest.mark.slow
def test_stream_nll_batch_equals_each_document_alone(engine_smollm2):
    from flexevict.runtime.generation import stream_nll
    from flexevict.evaluation.tasks import first_tokens, wikipedia_text
    docs = [first_tokens(engine_smollm2.tokenizer, wikipedia_text(20 + i), 64) for i in range(2)]
    spec = PolicySpec("h2o", budget=0.25)
    together, _ = stream_nll(engine_smollm2.engine, docs, spec.make())
    for doc, row in zip(docs, together):
        alone = stream_nll(engine_smollm2.engine, [doc], spec.make())[0][0]
        torch.testing.assert_close(row, alone, rtol=1e-5, atol=1e-5)
    assert float(together[0].double().mean()) == pytest.approx(
        engine_smollm2.score_ids(docs[0], spec)["nll"], rel=1e-5)


def test_stream_nll_is_the_same_with_the_head_per_step_or_over_many_steps(engine_smollm2):
    """Deferring the head (decode steps' hidden states through it together) changes only
    float rounding: per step, in groups that do not divide the steps, and all at the end."""
    from flexevict.runtime.generation import stream_nll
    from flexevict.evaluation.tasks import first_tokens, wikipedia_text
    docs = [first_tokens(engine_smollm2.tokenizer, wikipedia_text(30 + i), 40) for i in range(2)]
    spec = PolicySpec("h2o", budget=0.25)
    per_step, layout = stream_nll(engine_smollm2.engine, docs, spec.make(), head_rows=1)
    assert per_step.shape == (2, 39) and 39 - layout.slots > 10          # mostly decode steps
    for rows in (3, 10**6):
        got, _ = stream_nll(engine_smollm2.engine, docs, spec.make(), head_rows=rows)
        torch.testing.assert_close(got, per_step, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "ppl,summaries"], "unknown task 'summaries'"),
    (["--budgets", "0.2,1.5"], "--budgets: 1.5 is outside (0, 1]"),
    (["--budgets", "0,0.2"], "--budgets: 0.0 is outside (0, 1]"),
    (["--budgets", "half"], "--budgets: 'half' is not a number"),
    (["--text", "/nonexistent/doc.txt"], "/nonexistent/doc.txt: text file does not exist"),
    (["--policies", "h2o,lru"], "unknown policy 'lru'"),
    (["--policy", "h2o"], "sweep takes --policies and --budgets"),
    (["--policy-arg", "eager_fill=true"], "it must look like policy:name=value"),
    (["--policies", "h2o", "--policy-arg", "cascade:eager_fill=true"],
     "'cascade' is not in --policies (h2o)"),
    (["--policies", "cascade", "--policy-arg", "cascade:nope=1"], "unknown --policy-arg nope"),
    (["--policies", "cascade", "--policy-arg", "cascade:gamma=x"], "gamma=x: expected a float"),
    (["--policies", "h2o,h2o"], "names a label twice"),
    (["--policies", "h2o@"], "empty tag"),
    (["--policies", "lru@x"], "unknown policy 'lru'"),
    (["--tasks", "agreement", "--task-arg", "ppl:tokens=8192"], "'ppl' is not in --tasks"),
    (["--tasks", "ppl", "--task-arg", "ppl=8192"], "it must look like task:name=value"),
    (["--tasks", "ppl", "--task-arg", "ppl:length=8192"], "task 'ppl' has no size 'length'"),
    (["--tasks", "ppl", "--task-arg", "ppl:tokens=1,2"], "that size takes one value"),
])
def test_bad_input_is_one_line_error(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(["sweep", "--out", str(tmp_path / "o"), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flexevict.eval: error: ") and message in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert not os.path.exists(tmp_path / "o")                   # nothing loaded, nothing written


@pytest.mark.slow
def test_passkey_cli_retrieves_with_the_full_cache(capsys, smollm2_path):
    main(["passkey", "--length", "160", "--depths", "0.3,0.7", "--json"])
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["policy"] == "full" and r["accuracy"] == 1.0
    assert [p["answer"] for p in r["per_trial"]] == r["keys"]


def test_passkey_cli_rejects_bad_depths(capsys):
    with pytest.raises(SystemExit) as e:
        main(["passkey", "--depths", "0.5,2"])
    assert e.value.code == 2
    assert "passkey depths must be in [0, 1]" in capsys.readouterr().err


def test_a_sweep_run_records_the_shared_run_metadata(tmp_path):
    """The sweep's record of a run is runtime.machine.run_metadata (commit, device, versions),
    the one builder every benchmark result uses too."""
    from types import SimpleNamespace
    from flexevict.evaluation.sweep import run_sweep
    from flexevict.runtime.machine import run_metadata

    class Task:
        name, settings = "fake", {}

        def slots_check(self, spec):
            return None

        def run(self, llm, spec):
            return {"score": 1.0}
    llm = SimpleNamespace(device=torch.device("cpu"))
    data, ran, _ = run_sweep(llm, "m", [Task()], {"full": ()}, [0.5], str(tmp_path),
                              progress=False)
    assert ran == 1 and data["runs"][0]["machine"] == run_metadata("cpu")


def test_results_md_reports_the_summed_cell_time_of_this_sweeps_cells_only():
    """A sweep resumed over sessions records no single run's wall time; the note sums each
    matching cell's own seconds per task, leaving out other models' and settings' cells."""
    from types import SimpleNamespace
    from flexevict.eval import sweep_note
    tasks = [SimpleNamespace(name="ppl", settings={"tokens": 2048}),
             SimpleNamespace(name="passkey", settings={"repeats": 5})]
    cell = lambda model, task, settings, s: {"model": model, "task": task,  # noqa: E731
                                             "settings": settings, "seconds": s}
    data = {"runs": [], "cells": dict(enumerate([
        cell("m", "ppl", {"tokens": 2048}, 1000.5), cell("m", "ppl", {"tokens": 2048}, 2000.0),
        cell("m", "passkey", {"repeats": 5}, 94.0),
        cell("m", "ppl", {"tokens": 512}, 7.0),             # the earlier protocol's settings
        cell("other", "passkey", {"repeats": 5}, 50.0)]))}  # another model
    args = SimpleNamespace(text=None, quick=False)
    note = sweep_note("m", tasks, args, data)
    assert "Cell time: 3,094 s (ppl 3,000 s, passkey 94 s)" in note


class _FakeTask:
    """A task whose cells cost nothing; `during_run` stands in for another sweep's writes."""
    name, settings = "fake", {}

    def __init__(self, during_run=None):
        self.during_run = during_run

    def slots_check(self, spec):
        return None

    def run(self, llm, spec):
        if self.during_run:
            self.during_run()
        return {"score": spec.budget}


def test_two_sweeps_into_one_folder_merge_their_cells_and_skip_each_others(tmp_path):
    """While this sweep runs its first cell, another writes its own cell and the cell this
    sweep would run next: both survive in the file, and that cell is not run twice."""
    from types import SimpleNamespace
    from flexevict.evaluation.sweep import cell_key, load_results, record, run_sweep
    path = str(tmp_path / "results.json")
    other = _FakeTask()
    theirs = {cell_key("m", other, "h2o", (), b): {"metrics": {"by": "other"}}
              for b in (0.5, 0.9)}                  # 0.9: only the other sweep plans it

    def other_sweep_writes():
        if len(load_results(path)["cells"]) == 0:
            record(path, cells=theirs)
    llm = SimpleNamespace(device=torch.device("cpu"))
    data, ran, _ = run_sweep(llm, "m", [_FakeTask(other_sweep_writes)], {"h2o": ()},
                             [0.2, 0.5], str(tmp_path), progress=False)
    assert ran == 1 and data["runs"][-1]["cells"] == 1
    by_budget = {c.get("budget", "theirs"): c for c in load_results(path)["cells"].values()}
    assert len(load_results(path)["cells"]) == 3
    assert by_budget[0.2]["metrics"] == {"score": 0.2}
    assert list(tmp_path.iterdir()) == [tmp_path / "results.json"]     # no lock or temp file


def _record_many(path, tag, n):
    from flexevict.evaluation.sweep import record
    for i in range(n):
        record(path, cells={f"{tag}{i}": {}})


def test_concurrent_writers_lose_no_cell(tmp_path):
    """Two processes each add 40 cells one at a time; the lock makes every write see the
    other's, so all 80 are in the file."""
    import multiprocessing
    from flexevict.evaluation.sweep import load_results
    path = str(tmp_path / "results.json")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_record_many, args=(path, tag, 40)) for tag in "ab"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert len(load_results(path)["cells"]) == 80


@pytest.mark.slow
def test_a_policy_swept_again_under_a_label_with_its_own_arguments(quick, capsys):
    """`cascade@eager` is `cascade` with eager_fill: its own cells, keyed by label and
    arguments, next to the untagged policy's (already run, so not rerun)."""
    from flexevict.evaluation.sweep import parse_policies, policy_at
    policies = parse_policies("cascade,cascade@eager", ["cascade@eager:eager_fill=true"])
    assert policies == {"cascade": (), "cascade@eager": (("eager_fill", "true"),)}
    assert policy_at("cascade@eager", 0.2, policies["cascade@eager"]).make().eager_fill is True
    r = sweep(capsys, "--quick", "--out", quick, "--tasks", "ppl",
              "--policies", "cascade,cascade@eager",
              "--policy-arg", "cascade@eager:eager_fill=true")
    assert "2 cells, 1 already done, 1 to run" in r["stderr"] and r["cells_run"] == 1
    cell = cells(quick)[("ppl", "cascade@eager", 0.2)]
    assert cell["args"] == {"eager_fill": "true"} and cell["metrics"]["ppl"] > 0
    with open(os.path.join(quick, "results.md")) as f:
        assert "cascade@eager" in f.read()


def test_gemma3_preset_stands_for_its_arguments(capsys):
    """`--preset gemma3-270m` is issue 48's sweep; later flags override it; a bad name is one
    line and exit 2."""
    from flexevict.eval import parse_args
    from flexevict.evaluation.sweep import (expand_preset, parse_budgets, parse_policies,
                                            parse_task_args, parse_tasks)
    args = parse_args(expand_preset(["sweep", "--preset", "gemma3-270m", "--out", "x"]))
    names = parse_tasks(args.tasks)
    assert (args.model, names, list(parse_policies(args.policies)), parse_budgets(args.budgets)) \
        == ("gemma3-270m", ["retrieval", "ppl"], ["full", "recall", "h2o", "streaming"],
            [0.1, 0.2])
    assert parse_task_args(args.task_arg, names) == {
        "retrieval": {"lengths": (4096, 8192), "n": 8}, "ppl": {"tokens": 8192}}
    smoke = parse_args(expand_preset(["sweep", "--preset", "gemma3-270m", "--budgets", "0.2",
                                      "--task-arg", "ppl:tokens=512", "--out", "x"]))
    assert smoke.budgets == "0.2" and parse_task_args(smoke.task_arg, names)["ppl"] == {
        "tokens": 512}
    with pytest.raises(SystemExit) as e:
        main(["sweep", "--preset", "gemma9", "--out", "x"])
    assert e.value.code == 2 and "'gemma9' is not a preset" in capsys.readouterr().err
