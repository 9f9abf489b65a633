"""Where a decode step's GPU time goes: torch.profiler over a few eager decode steps of the
bench's setting (dummy weights, all on the GPU), the kernels grouped by name, slowest first,
next to the step's wall time and the bytes it must read (weights + the attended cache).

    python bench/profile_decode.py --model opt-6.7b --batch 24 --prompt-len 2048 \\
        --policy h2o --budget 0.2 --steps 5 --json out.json

Eager on purpose (`cuda_graphs` off): a graph replay shows as one launch, its kernels the same.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flexevict.core.config import registry_config  # noqa: E402
from flexevict.io.weights import DummyWeights  # noqa: E402
from flexevict.policies import get_policy  # noqa: E402
from flexevict.runtime.engine import Engine  # noqa: E402
from flexevict.runtime.placement import Placement  # noqa: E402

WARM_STEPS = 3          # decode steps before the profiled ones (allocator, cuBLAS, kernels)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="opt-6.7b")
    p.add_argument("--batch", type=int, default=24)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--gen-len", type=int, default=2048, help="sizes the budget (not run)")
    p.add_argument("--policy", default="h2o")
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda", help="cpu: a smoke test (no kernel table)")
    args = p.parse_args(argv)
    config = registry_config(args.model)
    policy = get_policy(args.policy, **({} if args.policy == "full" else {"budget": args.budget}))
    engine = Engine.load(config, DummyWeights(config, seed=0),
                         Placement(gpu_batch_size=args.batch, cuda_graphs=False), args.device,
                         torch.float16 if args.device == "cuda" else torch.float32)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(4, config.vocab_size, (args.batch, args.prompt_len),
                            generator=g).tolist()
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    walls, step = [], [0]

    def consume(i, k, h, head):
        return head(h[:, -1] if h.dim() == 3 else h).argmax(dim=-1)

    def until():
        step[0] += 1
        if step[0] == 1 + WARM_STEPS:      # the engine synchronizes after every step
            prof.start()
            walls.append(time.perf_counter())
        return step[0] >= 1 + WARM_STEPS + args.steps
    run = engine.run(prompts, 1 + WARM_STEPS + args.steps + 1, policy, consume,
                     until=until, plan_steps=args.gen_len, wrap_positions=True)
    prof.stop()
    result = summarize(prof, args, config, run)
    print(result["table"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def summarize(prof, args, config, run) -> dict:
    """Kernels by total GPU time per step; the step's wall time and bytes to read."""
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    per_step = lambda us: us / args.steps / 1e3  # noqa: E731  (us over the steps -> ms/step)
    kernels = sorted(({"name": e.key, "ms_per_step": per_step(e.self_device_time_total),
                       "calls_per_step": e.count / args.steps} for e in events),
                     key=lambda k: -k["ms_per_step"])
    gpu_ms = sum(k["ms_per_step"] for k in kernels) or float("nan")
    steps = run.stats.step_seconds[-args.steps:]
    slots = run.layout.slots
    cache = 2 * config.num_layers * args.batch * config.num_kv_heads * config.dim_head * 2 * slots
    weights = config.weight_bytes("float16")
    lines = [f"{args.model} batch {args.batch}, {args.policy} ({slots} slots): "
             f"wall {1e3 * sum(steps) / len(steps):.2f} ms/step, GPU kernels "
             f"{gpu_ms:.2f} ms/step, must read {(weights + cache) / 1e9:.1f} GB/step "
             f"(weights {weights / 1e9:.1f}, cache {cache / 1e9:.1f})",
             "| kernel | ms/step | share of GPU | calls/step |", "|---|---|---|---|"]
    for k in kernels[:args.top]:
        lines.append(f"| {k['name'][:90]} | {k['ms_per_step']:.3f} | "
                     f"{100 * k['ms_per_step'] / gpu_ms:.1f}% | {k['calls_per_step']:.0f} |")
    cpu = sorted((e for e in prof.key_averages() if e.device_type.name == "CPU"),
                 key=lambda e: -e.self_cpu_time_total)
    lines += ["", "| host op | self ms/step | calls/step |", "|---|---|---|"]
    lines += [f"| {e.key[:90]} | {per_step(e.self_cpu_time_total):.3f} | "
              f"{e.count / args.steps:.0f} |" for e in cpu[:args.top]]
    host = host_syncs(prof, args.steps)
    lines.append("host scalar reads and synchronizes per step: " + (", ".join(
        f"{name} {n:g}" for name, n in host.items()) or "none"))
    return {"args": vars(args), "slots": slots, "host_syncs_per_step": host,
            "wall_ms_per_step": 1e3 * sum(steps) / len(steps),
            "gpu_kernel_ms_per_step": gpu_ms, "weight_bytes": weights, "cache_bytes": cache,
            "kernels": kernels, "table": "\n".join(lines),
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "torch": torch.__version__}


# host-side calls that can make the host wait for the GPU (a scalar read: of a GPU tensor it
# waits, of a CPU one it does not; a synchronize; a blocking copy): one wait per layer would
# serialise the step's host dispatch and GPU work
SYNC_CALLS = ("aten::_local_scalar_dense", "aten::nonzero", "cudaStreamSynchronize",
              "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def host_syncs(prof, steps: int) -> dict:
    """Calls per step of each `SYNC_CALLS` name seen on the host side of the profile."""
    counts = {}
    for e in prof.key_averages():
        if e.device_type.name == "CPU" and e.key in SYNC_CALLS:
            counts[e.key] = counts.get(e.key, 0) + e.count / steps
    return counts


if __name__ == "__main__":
    main()
