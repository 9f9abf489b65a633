"""A batch job from start to end: check the input, resume from the state folder, run the
missing blocks (here, or on Ray workers), assemble the output in input order, summarize.
"""
from __future__ import annotations

import json
import os
import sys
import time

from flexevict.errors import Terminated, UserError, setting
from flexevict.runtime.progress import Progress
from flexevict.jobs.blocks import run_block, window_todo
from flexevict.jobs.inputs import scan
from flexevict.jobs.spec import JobSpec
from flexevict.jobs.state import VERSION, JobState, paths_for, write_atomic


def run_job(spec: JobSpec, restart: bool = False, ray: str | None = None,
            workers: int = 1) -> dict | None:
    """Run (or continue) the job -> its summary (also written to out.summary.json); None when
    the output is already complete."""
    start = time.monotonic()
    paths = paths_for(spec.output)
    check_paths(spec.input, spec.output)
    found = _check_input(spec, paths)
    manifest = {"version": VERSION, "input": found.identity, "settings": spec.settings()}
    if not restart and _already_complete(spec.output, paths, manifest):
        print(f"{spec.output} is complete (same input and settings); nothing to do. Add "
              "--restart to generate it again", file=sys.stderr)
        return None
    state = JobState(spec.output)
    llm = None
    try:
        resumed = state.open(manifest, restart)
        if resumed:
            print(f"resuming {spec.output}: {resumed} of {found.rows} rows were committed "
                  "earlier", file=sys.stderr)
        if resumed < found.rows and ray is None:
            llm = spec.llm(progress=True)
        with Progress(found.rows - resumed, "generating", "prompt", "generated tokens") as bar:
            commit = Committer(state, bar)
            try:
                if llm is not None:
                    _run_here(spec, found, state, commit, llm)
                elif resumed < found.rows:
                    from flexevict.jobs.ray_job import run_on_ray
                    run_on_ray(spec, found, state, commit, ray, workers)
            except (KeyboardInterrupt, Terminated):
                print(f"stopped: {resumed + commit.rows} of {found.rows} rows are committed in "
                      f"{state.folder}; rerun the same command to continue", file=sys.stderr)
                raise
        totals = state.assemble(found.rows)
        this_run = {"resumed": resumed, "wall": time.monotonic() - start,
                    "ray": None if ray is None else {"address": ray, "workers": workers}}
        summary = _summary(spec, paths, manifest, found, totals, commit, this_run)
        write_atomic(paths["summary"], json.dumps(summary, indent=1) + "\n")
        state.remove()
    finally:
        if llm is not None:
            llm.close()
        state.close()
    return summary


def check_paths(input_path: str, output: str):
    """Refuse, before anything is read or written, an input that is not a readable regular
    file and an output (or a file the job writes beside it) that is a directory or the input
    itself, through any symlink or hard link."""
    if os.path.isdir(input_path):
        raise UserError(f"{input_path}: {setting('input')} is a directory; give a JSONL file")
    if os.path.exists(input_path) and not os.path.isfile(input_path):
        raise UserError(f"{input_path}: {setting('input')} is not a regular file (a FIFO or "
                        "device); give a JSONL file")
    if os.path.isfile(input_path) and not os.access(input_path, os.R_OK):
        raise UserError(f"{input_path}: {setting('input')} is not readable (permissions)")
    if os.path.isdir(output):
        raise UserError(f"{output}: {setting('output')} is a directory; give a file name, e.g. "
                        f"{os.path.join(output, 'out.jsonl')}")
    written = [output, output + ".partial", *paths_for(output).values()]
    for path in written:
        if os.path.exists(path) and os.path.exists(input_path) and \
                os.path.samefile(path, input_path):
            raise UserError(f"{path} is the input file itself; the job would overwrite its "
                            f"input: give another {setting('output')}")


def _check_input(spec: JobSpec, paths: dict):
    """The validating pre-pass: every row checked before the model loads. With --on-error
    skip, rows that cannot run go to out.errors.jsonl (id, line, reason) instead."""
    prompter = spec.prompter()
    if spec.on_error == "fail":
        found = scan(spec.input, prompter, spec.window_rows)
        if os.path.exists(paths["errors"]):       # a stale list from an earlier skip run
            os.remove(paths["errors"])
        return found
    tmp = paths["errors"] + ".partial"
    try:
        with open(tmp, "w", encoding="utf-8") as errors:
            found = scan(spec.input, prompter, spec.window_rows, on_error=lambda e:
                         errors.write(json.dumps(e.as_record(), ensure_ascii=False) + "\n"))
        os.replace(tmp, paths["errors"])
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    if not found.rows:
        raise UserError(f"{spec.input}: every row failed ({found.failed}); see {paths['errors']}")
    return found


def _already_complete(output: str, paths: dict, manifest: dict) -> bool:
    """The output exists, no run of the job is under way, and the summary says it was made
    from this input with these settings."""
    if os.path.exists(paths["state"]) or not os.path.isfile(output):
        return False
    try:
        with open(paths["summary"], encoding="utf-8") as f:
            return json.load(f).get("manifest") == manifest
    except (OSError, ValueError):
        return False


class Committer:
    """Commits finished blocks to the state folder, timing each commit and moving the bar (by
    the decode step while a block runs here: `step`)."""

    def __init__(self, state: JobState, bar: Progress):
        self.state, self.bar = state, bar
        self.seconds: list[float] = []
        self.rows = self.tokens = 0
        self.shown = 0                   # tokens of the block in flight the bar has counted

    def step(self, rows: int):
        """-> the on_step of a block of `rows` rows run here: the bar moves every step."""
        def on_step(tokens: int, step: int, steps: int):
            self.shown += tokens
            self.bar.update(0, tokens, partial=rows * step / steps)
        return on_step

    def __call__(self, w: int, b: int, n: int, record: dict):
        self.seconds.append(self.state.commit(w, b, n, record))
        tokens = sum(r["tokens"] for r in record["rows"])
        self.rows += len(record["rows"])
        self.tokens += tokens
        self.bar.update(len(record["rows"]), tokens - self.shown)
        self.shown = 0


def _run_here(spec: JobSpec, found, state: JobState, commit: Committer, llm):
    """The single-machine path: windows in input order, their missing blocks one by one."""
    prompter, done, complete = spec.prompter(), state.committed(), state.complete_windows()
    for w, win in enumerate(found.windows):
        if w not in complete:
            _run_window(spec, w, win, prompter, done.get(w, set()), commit, llm)


def _run_window(spec: JobSpec, w: int, win, prompter, done: set, commit: Committer, llm):
    """One window's missing blocks, run and committed (its rows are freed on return)."""
    for b, n, rows in window_todo(spec, win, prompter, done):
        commit(w, b, n, run_block(llm, spec, rows, commit.step(len(rows))))


def _summary(spec, paths, manifest, found, totals, commit, this_run: dict) -> dict:
    """The job's summary; this_run: rows resumed, wall seconds and the Ray address and
    workers (None without Ray)."""
    gen_s, times = totals["generate_seconds"], commit.seconds
    resumed, wall = this_run["resumed"], this_run["wall"]
    return {
        "output": spec.output, "input": spec.input, "model": spec.model,
        "errors": paths["errors"] if found.failed else None,
        "rows": found.rows + found.failed, "completed_rows": found.rows,
        "failed_rows": found.failed, "rows_resumed": resumed,
        "prompt_tokens": totals["prompt_tokens"], "generated_tokens": totals["generated_tokens"],
        "blocks": totals["blocks"],
        "generate_seconds": gen_s,
        "generated_tokens_per_second": totals["generated_tokens"] / gen_s if gen_s else None,
        "this_run": {"rows": commit.rows, "generated_tokens": commit.tokens,
                     "wall_seconds": wall,
                     "generated_tokens_per_second": commit.tokens / wall if wall else None},
        "commit_seconds": {"blocks": len(times), "total": sum(times),
                           "mean": sum(times) / len(times) if times else None,
                           "max": max(times, default=None)},
        "policy": {"name": spec.policy.name, "budget": spec.policy.budget,
                   "budget_tokens": spec.policy.budget_tokens, "args": dict(spec.policy.args)},
        "resolved": totals["resolved"], "placement": spec.placement.describe(),
        "device": spec.device, "ray": this_run["ray"],
        "manifest": manifest,
    }
