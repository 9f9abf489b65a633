"""Offline batch jobs that survive crashes and scale out (`python -m flexevict.generate --input`).

    inputs.py   rows read lazily and checked; the validating pre-pass; look-ahead windows
    blocks.py   the blocking rule (generation.plan_batches within a window) and one block's run
    state.py    out.jsonl.state/: manifest, per-block commits, assembly in input order
    chat.py     --chat: the model's own Jinja2 chat template
    runner.py   the job from start to end, on this machine
    ray_job.py  the same job on Ray actors (--ray, --workers; Ray imported lazily)
"""
from flexevict.jobs.runner import run_job  # noqa: F401
from flexevict.jobs.spec import JobSpec  # noqa: F401
