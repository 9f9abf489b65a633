"""`python -m flexevict.bench`: FlexGen's throughput benchmark, with KV eviction policies.

    python -m flexevict.bench --model opt-30b --policy h2o --budget 0.2 \\
        --percent 20 80 0 100 0 100 --gpu-batch-size 48 --num-gpu-batches 3 --cpu-cache-compute

Dummy (seeded random) weights by default; gpu_batch_size x num_gpu_batches random prompts of
--prompt-len tokens, --gen-len tokens each, greedy. Prints FlexGen's result block (sizes, peak
memory, prefill/decode/total latency and throughput, total = generated tokens / (prefill +
decode)) plus the policy's resolved slots, the time in eviction bookkeeping and the bytes moved
per link; `--json FILE` writes all of it with the device, versions and commit.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys

import numpy as np
import torch

from ..api import DTYPES, resolve_device, resolve_model
from ..cli import add_placement_args, add_policy_args, placement_from_args, policy_spec
from ..engine import Engine
from ..errors import UserError, cli_errors
from ..memory import MemoryPlan, GIB, out_of_memory
from ..policies import PolicySpec
from ..weights import DUMMY, open_weights
from .report import run_metadata, write_json


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m flexevict.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="opt-6.7b", help="registry name, HF folder or .gguf")
    p.add_argument("--path", default=DUMMY, help=f"weights (default {DUMMY}: seeded random)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--cut-gen-len", type=int, default=None,
                   help="run this many decode steps and project the rest (output says projected)")
    p.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (default: cuda if any)")
    p.add_argument("--dtype", default=None, choices=list(DTYPES),
                   help="default float16 on GPU, float32 on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpu-mem-limit", type=float, default=None, metavar="GB",
                   help="cap the GPU memory the engine may use (e.g. 16 for a T4's setting)")
    p.add_argument("--ignore-max-positions", action="store_true",
                   help="timing only: let runs exceed the model's position limit (positions "
                        "wrap; the generated text is meaningless)")
    p.add_argument("--no-warmup", action="store_true", help="skip the 1-token warmup run")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the result as JSON")
    add_policy_args(p)
    add_placement_args(p)
    args = p.parse_args(argv)
    if args.gpu_batch_size == 0:
        args.gpu_batch_size = 4                      # FlexGen's default
    return args


def main(argv=None):
    args = parse_args(argv)
    with cli_errors("flexevict.bench"):
        result = run(args)
        print(format_block(result))
        write_json(args.json, result, result["device"])


def run(args) -> dict:
    if args.prompt_len < 1 or args.gen_len < 1:
        raise UserError("--prompt-len and --gen-len must be >= 1")
    config, path = resolve_model(args.model, args.path)
    device = resolve_device(args.device)
    dtype = DTYPES[args.dtype or ("float32" if device.type == "cpu" else "float16")]
    placement = placement_from_args(args)
    n = placement.gpu_batch_size * placement.num_gpu_batches
    steps = min(args.cut_gen_len or args.gen_len, args.gen_len)
    policy = policy_spec(args).make()
    slots = policy.capacity(args.prompt_len, args.gen_len) + 1
    plan = MemoryPlan(config, placement, dtype, n, args.prompt_len, args.gen_len, slots)
    limit = _set_gpu_limit(device, args.gpu_mem_limit)
    plan.check(device, limit)
    with out_of_memory(plan, device, limit):
        engine = Engine.load(config, open_weights(path, config, args.seed), placement, device,
                             dtype)
        engine.wrap_positions = args.ignore_max_positions
        try:
            prompts = _random_prompts(config, n, args.prompt_len, args.seed)
            if not args.no_warmup:
                engine.run([p[:32] for p in prompts], 1, PolicySpec("full").make(), _greedy)
            _reset_peaks(device)
            stats = _timed_run(engine, prompts, steps, args.gen_len, policy)
        finally:
            engine.close()
    return _result(args, config, placement, plan, policy, stats, device, n, steps)


def _timed_run(engine, prompts, steps, gen_len, policy):
    from tqdm import tqdm
    bar = tqdm(total=steps, desc="bench", unit="step", file=sys.stderr, disable=None)
    nvml = _NvmlPeak(engine.tiers.compute)

    def tick():
        bar.update(1)
        nvml.sample()
        return False
    try:
        stats = engine.run(prompts, steps, policy, _greedy, until=tick, plan_steps=gen_len)
    finally:
        bar.close()
    stats.nvml_peak = nvml.peak
    return stats


def _greedy(i, k, h, head):
    return head(h[:, -1] if h.dim() == 3 else h).argmax(dim=-1)


def _random_prompts(config, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, config.vocab_size, (n, length), generator=g).tolist()


# ---------------------------------------------------------------------------- results

def project_decode(step_seconds: list[float], gen_len: int) -> tuple[float, bool]:
    """Decode latency for gen_len - 1 steps from the measured ones -> (seconds, projected).

    Missing steps are extrapolated with a line fitted to the measured decode steps after the
    first (a full cache's step grows with context; a fixed-budget buffer's stays flat)."""
    decode = step_seconds[1:]
    missing = gen_len - 1 - len(decode)
    if missing <= 0:
        return float(sum(decode)), False
    steady = decode[1:] or decode
    if len(steady) >= 3:
        slope, intercept = np.polyfit(np.arange(len(steady)), steady, 1)
        at = np.arange(len(steady), len(steady) + missing)
        extra = float(np.maximum(intercept + slope * at, 0).sum())
    else:
        extra = float(np.mean(steady)) * missing if steady else 0.0
    return float(sum(decode)) + extra, True


def _result(args, config, placement, plan, policy, stats, device, n, steps) -> dict:
    prefill = stats.step_seconds[0]
    decode, projected = project_decode(stats.step_seconds, args.gen_len)
    total = prefill + decode
    return {
        "model": config.name, "path": args.path, "dtype": str(plan.dtype).replace("torch.", ""),
        "prompt_len": args.prompt_len, "gen_len": args.gen_len, "batch": n,
        "decode_steps_run": steps - 1, "projected": projected,
        "placement": placement.describe(),
        "policy": policy.describe(), "budget": args.budget, "budget_tokens": args.budget_tokens,
        "model_size_gb": config.weight_bytes(_dtype_name(plan.dtype)) / GIB,
        "cache_size_gb": config.cache_bytes(n, args.prompt_len + args.gen_len,
                                            _dtype_name(plan.dtype)) / GIB,
        "budget_cache_size_gb": plan.cache_bytes() / GIB,
        "hidden_size_gb": config.hidden_bytes(n, args.prompt_len, _dtype_name(plan.dtype)) / GIB,
        "estimated_gb": {k: v / GIB for k, v in plan.needs().items()},
        "peak_gpu_mem_gb": (torch.cuda.max_memory_allocated(device) / GIB
                            if device.type == "cuda" else None),
        "peak_gpu_mem_nvml_gb": None if stats.nvml_peak is None else stats.nvml_peak / GIB,
        "peak_cpu_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
        "prefill_latency_s": prefill, "prefill_throughput": n * args.prompt_len / prefill,
        "decode_latency_s": decode,
        "decode_throughput": n * (args.gen_len - 1) / decode if decode > 0 else None,
        "total_latency_s": total, "total_throughput": n * args.gen_len / total,
        "eviction_s": stats.eviction_seconds,
        "eviction_share_of_decode": (stats.eviction_seconds / sum(stats.step_seconds[1:])
                                     if len(stats.step_seconds) > 1 else None),
        "bytes_moved": stats.traffic,
        "positions_wrapped": args.ignore_max_positions,
        "device": str(device), "step_seconds": stats.step_seconds,
        "run_info": run_metadata(device),
    }


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def format_block(r: dict) -> str:
    """FlexGen's benchmark log block, then flexevict's additions."""
    gb = lambda x: "n/a" if x is None else f"{x:.3f} GB"  # noqa: E731
    tput = lambda x: "n/a" if x is None else f"{x:.3f} token/s"  # noqa: E731
    lines = [
        f"model size: {gb(r['model_size_gb'])}\tcache size: {gb(r['cache_size_gb'])}\t"
        f"hidden size (p): {gb(r['hidden_size_gb'])}",
        f"peak gpu mem: {gb(r['peak_gpu_mem_gb'])} (nvml {gb(r['peak_gpu_mem_nvml_gb'])})\t"
        f"peak cpu rss: {gb(r['peak_cpu_rss_gb'])}\tprojected: {r['projected']}",
        f"prefill latency: {r['prefill_latency_s']:.3f} s\tprefill throughput: "
        f"{tput(r['prefill_throughput'])}",
        f"decode latency: {r['decode_latency_s']:.3f} s\tdecode throughput: "
        f"{tput(r['decode_throughput'])}",
        f"total latency: {r['total_latency_s']:.3f} s\ttotal throughput: "
        f"{tput(r['total_throughput'])}",
        "policy: " + " ".join(f"{k}={v}" for k, v in r["policy"].items())
        + f"\tbudget cache size: {gb(r['budget_cache_size_gb'])}",
        f"eviction time: {r['eviction_s']:.3f} s"
        + ("" if r["eviction_share_of_decode"] is None
           else f" ({100 * r['eviction_share_of_decode']:.1f}% of decode)"),
        "bytes moved: " + (json.dumps({k: f"{v / GIB:.3f} GB" for k, v in r["bytes_moved"].items()})
                           if r["bytes_moved"] else "none"),
        f"device: {r['run_info']['device']}\ttorch {r['run_info']['torch']}\tcuda "
        f"{r['run_info']['cuda']}\tkernels {r['run_info']['kernels']}\tcommit "
        f"{r['run_info']['commit'][:12]}",
    ]
    if r["positions_wrapped"]:
        lines.append("positions wrapped past the model's limit: timing only, output meaningless")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- memory

def _set_gpu_limit(device, gb: float | None) -> int | None:
    """Cap the caching allocator at gb GiB (a T4's 16 GB on a larger card) -> limit bytes."""
    if device.type != "cuda":
        if gb is not None:
            raise UserError("--gpu-mem-limit needs a CUDA device (--device cuda)")
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    if gb is None:
        return total
    if not 0 < gb * GIB <= total:
        raise UserError(f"--gpu-mem-limit {gb} GB: must be in (0, {total / GIB:.1f}] on this GPU")
    torch.cuda.set_per_process_memory_fraction(gb * GIB / total, device)
    return int(gb * GIB)


def _reset_peaks(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


class _NvmlPeak:
    """Peak device memory in use as NVML reports it, sampled once per token step."""

    def __init__(self, device):
        self.peak, self.handle = None, None
        if device.type != "cuda":
            return
        try:
            import pynvml
            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            self._nvml = pynvml
        except Exception:             # NVML missing or unusable: report n/a, not a guess
            self.handle = None

    def sample(self):
        if self.handle is not None:
            used = self._nvml.nvmlDeviceGetMemoryInfo(self.handle).used
            self.peak = max(self.peak or 0, used)


if __name__ == "__main__":
    main()
