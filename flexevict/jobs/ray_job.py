"""The same batch job on a Ray cluster (`--ray auto|HEAD:6379 --workers N`).

    windows (driver) -> blocks (driver) -> EngineWorker actors (N) -> commit (driver)

The driver reads the look-ahead windows that still have blocks to run, one at a time, and forms
their uncommitted blocks by the same rule and in the same order as the single-machine path
(`blocks.window_todo`); it keeps two blocks per worker in flight and commits each result to
the same state folder as the local path as it arrives, so a job can be stopped and continued
with or without Ray, and a block that arrives twice is committed once. Each worker is a Ray
actor holding one loaded model (same model, placement and policy flags; 1 CPU, plus 1 GPU with
--device cuda). A worker process that dies is restarted by Ray and its block retried
(max_restarts=-1, max_task_retries=-1); the actor's constructor takes only the job's small
settings, by value, so a restart never needs an object that may be gone (Ray Data's actor pools
pass theirs through the object store and log an error line about it on every run).

Only the driver reads the input, so only its node needs the file; every node needs flexevict
installed (and the weights at the same path). Workers keep the user's scheduling priority (Ray
would lower it). Ray is imported only here (`pip install "flexevict[ray]"`).
"""
from __future__ import annotations

import os

from flexevict.errors import UserError, setting
from flexevict.jobs.blocks import rows_from_wire, rows_to_wire, run_block, window_todo

INSTALL = 'pip install "flexevict[ray]"'


def _ray():
    try:
        import ray
    except ImportError:
        raise UserError(f"{setting('ray')} needs Ray; install it with `{INSTALL}`") from None
    return ray


def run_on_ray(spec, found, state, commit, address: str, workers: int):
    """Run the job's missing blocks on a Ray cluster, committing each on arrival."""
    ray = _ray()
    started = connect(ray, address)
    seen = {(w, b) for w, blocks in state.committed().items() for b in blocks}
    try:
        for w, b, n, record in _results(ray, spec, found, state, workers):
            if (w, b) not in seen:                    # a block that arrives twice counts once
                seen.add((w, b))
                commit(w, b, n, record)
    finally:
        if started:
            ray.shutdown()


def connect(ray, address: str) -> bool:
    """Join the cluster at `address` ("auto": start one here, or the one RAY_ADDRESS names)
    unless this process already is connected -> whether it connected (and so disconnects).
    A cluster started here keeps its workers at the user's niceness (Ray's default lowers
    it to 15)."""
    if ray.is_initialized():
        return False
    starts = address == "auto" and not os.environ.get("RAY_ADDRESS")
    try:
        ray.init(address=None if address == "auto" else address, log_to_driver=False,
                 include_dashboard=False, logging_level="ERROR",
                 _system_config={"worker_niceness": 0} if starts else None)
    except (ConnectionError, ValueError, RuntimeError) as e:
        raise UserError(f"{setting('ray')} {address}: cannot connect ({e}); start the head with "
                        f"`ray start --head` or give {setting('ray')} auto") from None
    return True


def _results(ray, spec, found, state, workers: int):
    """Yield (window, block, blocks in window, record) as the workers finish blocks, with at
    most two blocks per worker in flight (one running, one waiting)."""
    gpu = spec.device.startswith("cuda")
    _check_room(ray, workers, gpu)
    actor = ray.remote(EngineWorker).options(num_cpus=1, num_gpus=1 if gpu else 0,
                                             max_restarts=-1, max_task_retries=-1)
    pool = [actor.remote(spec) for _ in range(workers)]
    todo = _blocks(spec, found, state)
    running = {}                                  # object ref -> its actor
    idle = pool * 2                               # each actor takes two blocks at a time
    try:
        while True:
            while idle and (block := next(todo, None)) is not None:
                a = idle.pop()
                running[a.run.remote(block)] = a
            if not running:
                return
            [ref], _ = ray.wait(list(running), num_returns=1)
            idle.append(running.pop(ref))
            yield ray.get(ref)
    finally:
        for a in pool:
            ray.kill(a)


def _blocks(spec, found, state):
    """The job's missing blocks as the workers take them, window by window (`window_todo`,
    the local path's rule) -> (window, block, blocks in window, rows on the wire)."""
    prompter, done, complete = spec.prompter(), state.committed(), state.complete_windows()
    for w, win in enumerate(found.windows):
        if w not in complete:
            for b, n, rows in window_todo(spec, win, prompter, done.get(w, ())):
                yield w, b, n, rows_to_wire(rows)


def _check_room(ray, workers: int, gpu: bool):
    """N workers need N CPUs (and N GPUs with --device cuda): else they would wait forever."""
    have = ray.cluster_resources()
    for kind, need in (("CPU", workers), ("GPU", workers if gpu else 0)):
        if have.get(kind, 0) < need:
            raise UserError(f"{setting('workers')} {workers} needs {need} {kind}s on the Ray "
                            f"cluster, which has {have.get(kind, 0):g}; give fewer "
                            f"{setting('workers')}")


class EngineWorker:
    """A Ray actor holding one loaded model; each call generates one block."""

    def __init__(self, spec):
        import torch
        if spec.threads:
            torch.set_num_threads(spec.threads)
        self.spec = spec
        self.llm = spec.llm(progress=False)

    def run(self, block: tuple) -> tuple:
        """(window, block, blocks in window, rows on the wire) -> (window, block, blocks in
        window, the block's record)."""
        w, b, n, rows = block
        return w, b, n, run_block(self.llm, self.spec, rows_from_wire(rows))

    def niceness(self) -> int:
        """This worker process's niceness (tests: the user's, not lowered)."""
        return os.nice(0)
