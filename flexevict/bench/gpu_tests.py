"""pytest plugin: run only the tests that skip without CUDA (the GPU plan's call 3).

    python -m pytest -p flexevict.bench.gpu_tests tests

A test counts as GPU-only when it (or its module or class) carries a
`pytest.mark.skipif(..., reason=...)` whose reason says it needs CUDA or a GPU, the project's
convention ("needs CUDA: ...", "needs a CUDA GPU"). The condition is not evaluated: on a GPU it
is false, and the mark still says what the test needs. Tests that skip from inside their body
(`pytest.skip`) cannot be told apart before they run and are left out.
"""
from __future__ import annotations

import re

GPU_ONLY = re.compile(r"\bneeds (a )?(CUDA|GPU)\b", re.IGNORECASE)


def is_gpu_only(item) -> bool:
    """Whether a collected test carries a skipif mark whose reason says it needs CUDA."""
    return any(GPU_ONLY.search(str(mark.kwargs.get("reason", "")))
               for mark in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config, items):
    keep = [item for item in items if is_gpu_only(item)]
    dropped = [item for item in items if not is_gpu_only(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep
