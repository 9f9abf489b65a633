"""The same batch job as a Ray Data pipeline (`--ray auto|HEAD:6379 --workers N`).

    windows (driver) -> plan blocks (Ray tasks) -> EngineWorker actors (N) -> commit (driver)

The driver lists the look-ahead windows that still have blocks to run (from the pre-pass:
byte offsets, not rows). Ray tasks on the driver's node read each window from the file, form
its blocks by the same rule as the single-machine path (`blocks.plan_window`) and drop the
committed ones; a block travels as one Ray row, so a worker always runs a whole block.
`map_batches` runs them on a pool of N actors, each loading the model once (same model,
placement and policy flags; 1 CPU, plus 1 GPU with --device cuda). The readers reserve no CPU,
so they can always run next to the actors. The driver commits each block to the same state
folder as the local path as its result arrives, so a job can be stopped and continued with or
without Ray, and a block that arrives twice is committed once. A worker process that dies is
restarted by Ray and its block retried (Ray Data's actor pools: max_restarts=-1,
max_task_retries=-1).

Every node needs flexevict installed (and the weights at the same path); Ray is imported only
here (`pip install "flexevict[ray]"`).
"""
from __future__ import annotations

import json
import os

from flexevict.errors import UserError
from flexevict.jobs.blocks import plan_window, rows_from_wire, rows_to_wire, run_block
from flexevict.jobs.inputs import Window, read_window

INSTALL = 'pip install "flexevict[ray]"'
TEST_CRASH_FLAG = "FLEXEVICT_JOB_TEST_CRASH_FLAG"   # test hook: see EngineWorker


def _ray():
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise UserError(f"--ray needs Ray Data; install it with `{INSTALL}`") from None
    return ray


def run_on_ray(spec, found, state, commit, address: str, workers: int):
    """Run the job's missing blocks on a Ray cluster, committing each on arrival."""
    ray = _ray()
    started = not ray.is_initialized()
    if started:
        try:
            ray.init(address=None if address == "auto" else address, log_to_driver=False,
                     include_dashboard=False, logging_level="ERROR")
        except (ConnectionError, ValueError, RuntimeError) as e:
            raise UserError(f"--ray {address}: cannot connect ({e}); start the head with "
                            "`ray start --head` or give --ray auto") from None
    seen = {(w, b) for w, blocks in state.committed().items() for b in blocks}
    try:
        for w, b, n, record in _results(ray, spec, found, state, workers):
            if (w, b) not in seen:                    # a block that arrives twice counts once
                seen.add((w, b))
                commit(w, b, n, record)
    finally:
        if started:
            ray.shutdown()


def _results(ray, spec, found, state, workers: int):
    """Yield (window, block, blocks in window, record) as the workers finish blocks."""
    import logging
    import warnings

    from ray.data import DataContext
    logging.getLogger("ray.data").setLevel(logging.ERROR)    # its per-run INFO lines
    # a job of fewer windows than workers gives the pool fewer inputs than actors at first
    # (they still all run: each window becomes several blocks); not the user's concern
    warnings.filterwarnings("ignore", message="The minimum number of concurrent actors")
    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False                 # the driver shows the job's own progress
    done, complete = state.committed(), state.complete_windows()
    todo = [{"window": json.dumps({"w": w, "offset": win.offset, "first": win.first_line,
                                   "skip": list(win.skip), "done": sorted(done.get(w, ()))})}
            for w, win in enumerate(found.windows) if w not in complete]
    gpu = spec.device.startswith("cuda")
    _check_room(ray, workers, gpu)
    # the readers take no CPU, so they always run next to the actors (two 1-CPU actors on a
    # 2-CPU cluster with 1-CPU readers hang), and run on the driver's node: only it needs
    # the input file
    here = {"ray.io/node-id": ray.get_runtime_context().get_node_id()}
    ds = ray.data.from_items(todo, override_num_blocks=max(1, min(len(todo), 4 * workers)))
    ds = ds.flat_map(_plan, fn_kwargs={"spec": spec}, num_cpus=0, label_selector=here)
    # Ray Data restarts a dead actor and retries its block (its actor pools default to
    # max_restarts=-1, max_task_retries=-1; passing them again is deprecated in Ray 2.60)
    ds = ds.map_batches(EngineWorker, batch_size=1, batch_format="pandas",
                        fn_constructor_kwargs={"spec": spec,
                                               "crash_flag": os.environ.get(TEST_CRASH_FLAG)},
                        compute=ray.data.ActorPoolStrategy(size=workers),
                        num_gpus=1 if gpu else 0, num_cpus=1)
    for row in ds.iter_rows():
        r = json.loads(row["result"])
        yield r["w"], r["b"], r["n"], r["record"]


def _check_room(ray, workers: int, gpu: bool):
    """N workers need N CPUs (and N GPUs with --device cuda): else they would wait forever."""
    have = ray.cluster_resources()
    for kind, need in (("CPU", workers), ("GPU", workers if gpu else 0)):
        if have.get(kind, 0) < need:
            raise UserError(f"--workers {workers} needs {need} {kind}s on the Ray cluster, which "
                            f"has {have.get(kind, 0):g}; give fewer --workers")


def _plan(item: dict, spec) -> list[dict]:
    """A window descriptor -> its blocks not yet committed, one Ray row each."""
    d = json.loads(item["window"])
    win = Window(d["offset"], d["first"], tuple(d["skip"]))
    blocks = plan_window(read_window(spec.input, win, spec.window_rows, spec.prompter(),
                                     spec.chat), spec)
    return [{"block": json.dumps({"w": d["w"], "b": b, "n": len(blocks),
                                  "rows": rows_to_wire(rows)}, ensure_ascii=False)}
            for b, rows in enumerate(blocks) if b not in d["done"]]


class EngineWorker:
    """A Ray actor holding one loaded model; each call generates one block.

    Test hook: crash_flag (from FLEXEVICT_JOB_TEST_CRASH_FLAG on the driver) names a file;
    the first worker to find it there on its first block deletes it and exits the process,
    so exactly one worker dies mid-job."""

    def __init__(self, spec, crash_flag: str | None = None):
        import torch
        if spec.threads:
            torch.set_num_threads(spec.threads)
        self.spec, self.crash_flag, self.calls = spec, crash_flag, 0
        self.llm = spec.llm(progress=False)

    def __call__(self, batch):
        import pandas as pd
        self.calls += 1
        if self.crash_flag and self.calls == 1:
            try:
                os.remove(self.crash_flag)
                os._exit(1)
            except FileNotFoundError:
                pass
        results = []
        for text in batch["block"]:
            d = json.loads(text)
            record = run_block(self.llm, self.spec, rows_from_wire(d["rows"]))
            results.append(json.dumps({"w": d["w"], "b": d["b"], "n": d["n"],
                                       "record": record}, ensure_ascii=False))
        return pd.DataFrame({"result": results})
