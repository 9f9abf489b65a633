"""A quick probe of this CPU (a fraction of a second), cached per machine beside the calibration:
what `--threads auto` and a first run's rough time estimate rest on when no calibration exists.

It times, on one torch thread and on one per core, a decode step's worth of one layer of the
model (its linear weights streamed from memory on the engine's path, and one element-wise op
per norm or bias), per model shape, and a prefill-shaped matrix product. A small model's decode
step is a few hundred tiny ops, each forking and joining every thread, where one thread can
win; a large one's streams weights, where all cores do. Where other work keeps cores busy at
run time, advice.best_threads does not use the cached times (a thread that waits for a busy
core stalls every op). Layers over LAYER_CAP bytes are probed at a scaled-down shape, their
time scaled back up by bytes (weight streaming is bandwidth-bound at that size).
"""
from __future__ import annotations

import json
import math
import os
import time

import torch

from flexevict.planner import calibration
from flexevict.planner.calibration import _linear_op, _threads

VERSION = 1
LAYER_CAP = 32 << 20      # a probed layer's weights at most (bytes)
STREAM = 64 << 20         # distinct layers streamed per timing: more than a last-level cache
ROUNDS = 5                # one thread and all alternate, the median of each


def path() -> str:
    return calibration.cache_path(calibration.machine_key(torch.device("cpu")), "probe")


def probe(config) -> dict:
    """{"cores", "gemm_flops": {threads: flop/s}, "layer_s": {threads: seconds of one decode
    layer}} for `config`'s layer shape, threads "1" and str(cores); measured once per machine
    and shape, then read from the cache file (`path`)."""
    data = _read()
    key = _shape_key(config)
    if "gemm_flops" not in data or key not in data["layers"]:
        with torch.inference_mode():
            if "gemm_flops" not in data:
                data["gemm_flops"] = _gemm()
            data["layers"][key] = _layer_seconds(config)
        _write(data)
    return {"cores": data["cores"], "gemm_flops": data["gemm_flops"],
            "layer_s": data["layers"][key]}


def rough_seconds(config, prompt_len: int, gen_len: int, n: int, threads: int,
                  num_gpu_batches: int = 1) -> float:
    """A run's time from the probe alone, weights in memory: the prefill's matrix products at
    the probed rate, and each decode step streaming every layer once per GPU batch."""
    p = probe(config)
    t = "1" if threads == 1 else str(p["cores"])
    prefill = 2 * config.num_params() * prompt_len * n / p["gemm_flops"][t]
    step = config.num_layers * p["layer_s"][t] * num_gpu_batches
    return prefill + max(gen_len - 1, 0) * step


def _read() -> dict:
    try:
        with open(path()) as f:
            data = json.load(f)
        if data.get("version") == VERSION and data.get("cores") == calibration._cores():
            return data
    except (OSError, json.JSONDecodeError):
        pass
    return {"version": VERSION, "machine": calibration.machine_key(torch.device("cpu")),
            "cores": calibration._cores(), "layers": {}}


def _write(data: dict) -> None:
    try:
        os.makedirs(os.path.dirname(path()), exist_ok=True)
        with open(path() + ".partial", "w") as f:
            json.dump(data, f, indent=1)
        os.replace(path() + ".partial", path())
    except OSError:
        pass                      # an unwritable cache: probed again next time, still correct


def _shape_key(config) -> str:
    return f"{config.arch}:{config.hidden_size}:{config.ffn_size}:{config.num_kv_heads}"


def _both(fn) -> dict:
    """{threads: the median seconds of ROUNDS calls of fn()}, on one thread and on every core,
    alternating, so that a busy moment on a shared machine hits both alike (the median: what a
    run of many steps meets, not the luckiest moment)."""
    cores = calibration._cores()
    times = {str(t): [] for t in dict.fromkeys([1, cores])}
    for r in range(ROUNDS + 1):
        for t, seen in times.items():
            with _threads(int(t)):
                t0 = time.perf_counter()
                fn()
                if r:                                   # round 0 warms up
                    seen.append(time.perf_counter() - t0)
    return {t: sorted(seen)[len(seen) // 2] for t, seen in times.items()}


def _gemm() -> dict:
    """{threads: flop/s} of a prefill-shaped product on the engine's path."""
    prep, apply = _linear_op(torch.device("cpu"), torch.float32, _packs())
    x, w = torch.full((256, 1024), 0.01), prep(torch.full((1024, 1024), 0.01))
    times = _both(lambda: apply(x, w))
    return {t: 2 * 256 * 1024 * 1024 / s for t, s in times.items()}


def _layer_seconds(config) -> dict:
    """{threads: seconds of one layer's decode step}, timed over STREAM bytes of distinct
    layers (a model's weights come from memory, not from a cache)."""
    shapes = _layer_shapes(config)
    nbytes = 4 * sum(math.prod(s) for s in shapes)
    scale = min(1.0, math.sqrt(LAYER_CAP / nbytes))
    shapes = [tuple(max(1, round(d * scale)) for d in s) if len(s) == 2 else s for s in shapes]
    probed = 4 * sum(math.prod(s) for s in shapes)
    count = max(1, min(config.num_layers, STREAM // probed))
    prep, apply = _linear_op(torch.device("cpu"), torch.float32, _packs())
    ops = [[(torch.full((1, s[-1]), 0.01), prep(torch.full(s, 0.01)) if len(s) == 2
             else torch.full(s, 0.01), len(s) == 2) for s in shapes] for _ in range(count)]

    def step():
        for layer in ops:
            for x, w, is_linear in layer:
                apply(x, w) if is_linear else x.mul(w)
    times = _both(step)
    return {t: s / count * nbytes / probed for t, s in times.items()}


def _layer_shapes(config) -> list[tuple]:
    """The shapes of one layer's weights (both halves), as the engine holds them."""
    from flexevict.runtime.memory import stage_weights
    stages = stage_weights(config, True)
    return [shape for stage in stages[1:3] for _, shape in stage]


def _packs() -> bool:
    from flexevict.core.model import onednn_usable
    return onednn_usable(torch.device("cpu"), torch.float32)
