#!/bin/sh
# Fill .peers/wheels (ignored) with what FlexGen 0.1.8 needs beyond a CUDA machine's torch,
# transformers, numpy, tqdm and attrs, for `python bench/suites.py gpu` on a machine without
# network (bench/gpu_plan.py installs them into .peers/site there). FlexGen's `flex_opt` does
# not import pulp (only its cost model does), so the wheel alone is enough.
set -e
cd "$(dirname "$0")/../.."
python3 -m pip download --no-deps --only-binary=:all: -d .peers/wheels flexgen==0.1.8
