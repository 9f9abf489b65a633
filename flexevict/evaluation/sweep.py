"""The accuracy sweep: policies x budgets x tasks in one run, resumable, with tables and plots.

    python -m flexevict.eval sweep --model smollm2-135m --out bench/results/accuracy
    python -m flexevict.eval sweep --tasks ppl --policies h2o,local --budgets 0.1,0.2 --out DIR
    python -m flexevict.eval sweep --preset gemma3-270m --out DIR     # a named sweep (PRESETS)

Every finished cell (model, task, policy, budget, task settings) is saved to `DIR/results.json`
at once, so an interrupted sweep resumes where it stopped and a rerun skips finished cells.
After the cells run, `results.md` (tables), `claims.md` (the papers' claims checked) and one PNG
per metric (metric against budget, one line per policy) are written from every cell in the file
that matches this run's model and task settings.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import sys
import time

from flexevict.errors import UserError, setting
from flexevict.evaluation.retrieval import Retrieval
from flexevict.evaluation.tasks import Agreement, AttentionLoss, Passkey, Ppl
from flexevict.policies import POLICIES, PolicySpec
from flexevict.runtime.machine import run_metadata
from flexevict.runtime.progress import Progress

DEFAULT_BUDGETS = (0.05, 0.1, 0.2, 0.4, 0.6, 1.0)
TASKS = {t.name: t for t in (Ppl, Agreement, Passkey, AttentionLoss, Retrieval)}
QUICK_BUDGETS = (0.2,)           # `full`, the reference, always runs (at 1.0)

# Named sweeps, as the arguments each stands for: `sweep --preset NAME` is `sweep ARGS`, and
# flags given after it override its values (--task-arg and --policy-arg add to its own).
PRESETS = {
    # Gemma-3-270M (32k context; the policy runs on its 3 global layers, the 15 sliding ones
    # keep their 512-token window): RULER-style retrieval at 4k and 8k tokens, 8 samples per
    # kind and length, and perplexity on 8k-token streams; full, recall, h2o and streaming at
    # 10% and 20%, each against full with paired intervals (sweep_report)
    "gemma3-270m": ("--model", "gemma3-270m", "--tasks", "retrieval,ppl",
                    "--policies", "full,recall,h2o,streaming", "--budgets", "0.1,0.2",
                    "--task-arg", "retrieval:lengths=4096,8192", "--task-arg", "retrieval:n=8",
                    "--task-arg", "ppl:tokens=8192"),
}


def expand_preset(argv: list[str]) -> list[str]:
    """['sweep', '--preset', NAME, *rest] -> ['sweep', *PRESETS[NAME], *rest]; other argument
    lists unchanged."""
    if argv[:1] != ["sweep"] or "--preset" not in argv:
        return argv
    i = argv.index("--preset")
    name = argv[i + 1] if i + 1 < len(argv) else ""
    if name not in PRESETS:
        raise UserError(f"{setting('preset')} '{name}' is not a preset ({', '.join(PRESETS)})")
    return ["sweep", *PRESETS[name], *argv[1:i], *argv[i + 2:]]


def parse_budgets(spec: str) -> list[float]:
    """'0.05,0.2,1' -> sorted unique fractions in (0, 1]."""
    out = []
    for item in spec.split(","):
        try:
            b = float(item)
        except ValueError:
            raise UserError(f"{setting('budgets')}: '{item}' is not a number (give fractions in "
                            "(0, 1], e.g. 0.05,0.2,1.0)") from None
        if not 0 < b <= 1:
            raise UserError(f"{setting('budgets')}: {b} is outside (0, 1]")
        out.append(b)
    return sorted(set(out))


def parse_tasks(spec: str) -> list[str]:
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in TASKS]
    if unknown or not names:
        raise UserError(f"unknown task '{','.join(unknown) or spec}'; known tasks: "
                        f"{', '.join(TASKS)}")
    return names


def parse_task_args(items, names: list[str]) -> dict[str, dict]:
    """['ppl:tokens=8192', 'retrieval:lengths=1024,2048'] -> {task: {size: value}}: a task's
    input sizes (its `sizes`), numbers or comma lists; checked before the model loads."""
    out: dict[str, dict] = {}
    for item in items or ():
        task, colon, pair = item.partition(":")
        name, eq, text = pair.partition("=")
        if not colon or not eq or not text:
            raise UserError(f"{setting('task_args')} '{item}': it must look like task:name=value "
                            "(e.g. ppl:tokens=8192)")
        if task not in names:
            raise UserError(f"{setting('task_args')} '{item}': '{task}' is not in "
                            f"{setting('tasks')} ({', '.join(names)})")
        known = TASKS[task].sizes
        if name not in known:
            raise UserError(f"{setting('task_args')} '{item}': task '{task}' has no size '{name}'; "
                            f"known: {', '.join(known)}")
        values = tuple(_number(v) for v in text.split(","))
        if isinstance(known[name][0], tuple):      # a list size (depths, lengths, kinds)
            out.setdefault(task, {})[name] = values
        elif len(values) == 1:
            out.setdefault(task, {})[name] = values[0]
        else:
            raise UserError(f"{setting('task_args')} '{item}': that size takes one value")
    return out


def _number(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()                        # retrieval kinds are names


def build_tasks(names: list[str], llm, text: str | None, quick: bool, task_args: dict) -> list:
    return [TASKS[n](llm, text=text, quick=quick, **task_args.get(n, {})) for n in names]


def policy_name(label: str) -> str:
    """'h2o@T+w' -> 'h2o': a label is a registered policy, optionally '@' a tag, so one policy
    can be swept more than once with different arguments."""
    return label.partition("@")[0]


def parse_policies(spec: str | None, policy_args=()) -> dict[str, tuple]:
    """'h2o,cascade,cascade@eager' and ['cascade@eager:eager_fill=true', ...] -> {label:
    ((name, value), ...)}, in order; every policy and argument checked now (one-line errors)."""
    labels = list(POLICIES) if spec is None else [s.strip() for s in spec.split(",") if s.strip()]
    if len(set(labels)) != len(labels):
        raise UserError(f"{setting('policies')} names a label twice; tag repeats, e.g. "
                        "h2o,h2o@ablation")
    given: dict[str, list] = {label: [] for label in labels}
    for item in policy_args or ():
        label, colon, pair = item.partition(":")
        if not colon or "=" not in pair:
            raise UserError(f"{setting('policy_args')} '{item}': in a sweep it must look like "
                            "policy:name=value (e.g. cascade:eager_fill=true)")
        if label not in given:
            raise UserError(f"{setting('policy_args')} '{item}': '{label}' is not in "
                            f"{setting('policies')} ({', '.join(labels)})")
        given[label].append(pair)
    out = {}
    for label, pairs in given.items():
        if "@" in label and not label.partition("@")[2]:
            raise UserError(f"{setting('policies')}: '{label}' has an empty tag after '@'")
        out[label] = PolicySpec.parse(policy_name(label), policy_args=pairs).args
    return out


def policy_at(label: str, budget: float, args: tuple = ()) -> PolicySpec:
    """The spec of one cell; `full` refuses a budget (it runs at 1.0 only)."""
    name = policy_name(label)
    return PolicySpec(name, None if name == "full" else budget, args=args)


def plan(tasks: list, policies: dict[str, tuple], budgets: list[float]) -> list[tuple]:
    """[(task, label, args, budget)]: every policy at every budget; `full`, the reference every
    table and claim compares with, once at 1.0 whatever the budgets."""
    return [(t, label, args, b) for t in tasks for label, args in policies.items()
            for b in ([1.0] if policy_name(label) == "full" else budgets)]


def cell_key(model: str, task, policy: str, args: tuple, budget: float) -> str:
    key = {"model": model, "task": task.name, "policy": policy, "budget": budget,
           "settings": task.settings}
    if args:                                  # cells without arguments keep their old keys
        key["args"] = [list(a) for a in args]
    return json.dumps(key, sort_keys=True)


# ------------------------------------------------------------------------------ results file

def load_results(path: str) -> dict:
    if not os.path.exists(path):
        return {"cells": {}, "runs": []}
    try:
        with open(path) as f:
            data = json.load(f)
        assert isinstance(data.get("cells"), dict)
    except (ValueError, AssertionError, AttributeError):
        raise UserError(f"{path}: not a sweep results file; use another {setting('out')}") from None
    data.setdefault("runs", [])
    return data


def save_results(path: str, data: dict) -> None:
    """Write-then-rename: a crash mid-write never loses the cells already saved."""
    tmp = path + ".partial"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


@contextlib.contextmanager
def _locked(directory: str):
    """Hold an exclusive lock on the results directory (released when the process dies, and no
    lock file is left behind): sweeps sharing one --out take turns at reading and writing."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def record(path: str, cells: dict | None = None, run: dict | None = None) -> dict:
    """Add cells ({key: cell}) and/or one run record to the results file, merged with what other
    sweeps into the same directory wrote meanwhile; -> the file's contents after the write."""
    with _locked(os.path.dirname(path)):
        data = load_results(path)
        data["cells"].update(cells or {})
        if run:
            data["runs"].append(run)
        save_results(path, data)
    return data


# ------------------------------------------------------------------------------ running

def run_sweep(llm, model: str, tasks: list, policies: dict[str, tuple], budgets: list[float],
              out: str, progress: bool = True) -> tuple[dict, int, float]:
    """Run every missing cell, saving after each; -> (the results file's contents, cells run,
    wall seconds spent on them). Sweeps may share one `out` (say, one per device, each with its
    own --policies or --tasks): each merges its cells into the file and skips any another ran.

    tasks: built `tasks.Task` objects (their inputs fixed); model: the name cells are keyed by;
    policies: {label: arguments} (`parse_policies`).
    """
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "results.json")
    data = load_results(path)
    cells = plan(tasks, policies, budgets)
    todo = [c for c in cells if cell_key(model, *c) not in data["cells"]]
    print(f"sweep: {len(cells)} cells, {len(cells) - len(todo)} already done, {len(todo)} to run"
          f" -> {path}", file=sys.stderr)
    bar = Progress(len(todo), "sweep", "cell", enabled=progress)
    t_start, ran = time.perf_counter(), 0
    for task, label, args, budget in todo:
        key = cell_key(model, task, label, args, budget)
        if key in load_results(path)["cells"]:     # another sweep into this --out ran it
            bar.update(1)
            continue
        t0 = time.perf_counter()
        spec = policy_at(label, budget, args)
        why = task.slots_check(spec)      # a budget below the policy's minimum: a skipped cell
        metrics = {"skipped": why} if why else task.run(llm, spec)
        data = record(path, cells={key: {
            "model": model, "task": task.name, "policy": label, "args": dict(args),
            "budget": budget,
            "settings": task.settings, "metrics": metrics,
            "seconds": round(time.perf_counter() - t0, 2),
            "finished": datetime.datetime.now().isoformat(timespec="seconds")}})
        ran += 1
        bar.update(1)
    bar.close()
    seconds = round(time.perf_counter() - t_start, 1)
    if ran:
        data = record(path, run={"cells": ran, "seconds": seconds,
                                 "tasks": [t.name for t in tasks],
                                 "policies": {k: dict(v) for k, v in policies.items()},
                                 "budgets": budgets,
                                 "machine": run_metadata(llm.device)})
    return data, ran, seconds


def matching(data: dict, model: str, tasks: list) -> list[dict]:
    """The cells of this model and these task settings (any policy and budget: a later run that
    adds budgets shows up in the same tables)."""
    settings = {t.name: t.settings for t in tasks}
    return [c for c in data["cells"].values()
            if c["model"] == model and settings.get(c["task"]) == c["settings"]]


def select(data: dict, model: str, tasks: list) -> dict:
    """{(task, policy, budget): metrics} of the matching cells."""
    return {(c["task"], c["policy"], c["budget"]): c["metrics"]
            for c in matching(data, model, tasks)}


def cell_seconds(data: dict, model: str, tasks: list) -> dict[str, float]:
    """{task: the summed wall seconds of its matching cells}. Each cell times itself, so the sum
    is right for a sweep interrupted and resumed across sessions, or split over processes."""
    seconds = {t.name: 0.0 for t in tasks}
    for c in matching(data, model, tasks):
        seconds[c["task"]] += c["seconds"]
    return seconds
