"""`python -m flexevict.bench`: FlexGen's throughput benchmark, with KV eviction policies.

    python -m flexevict.bench --model opt-30b --policy h2o --budget 0.2 \\
        --percent 20 80 0 100 0 100 --gpu-batch-size 48 --num-gpu-batches 3 --cpu-cache-compute

Dummy weights (random, seeded) by default; gpu_batch_size x num_gpu_batches random prompts of
--prompt-len tokens, --gen-len tokens each, greedy. Prints FlexGen's result block (sizes, peak
memory, prefill/decode/total latency and throughput, total = generated tokens / (prefill +
decode)) plus the policy's resolved slots, the time in eviction bookkeeping and the bytes moved
per link; `--json FILE` writes all of it with the device, versions and commit. Before the
clock starts, the CUDA extension is loaded (its build/load time is reported apart, as
kernel_build_s) and a short warm-up runs the policy under test (WARMUP_PROMPT below).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import sys
import time

import numpy as np
import torch

from flexevict.core import kernels
from flexevict.api import resolve_device, resolve_model
from flexevict.core.config import DTYPES, default_dtype
from flexevict.cli import (add_placement_args, add_policy_args, add_threads_arg, check_run,
                           choose_threads, cpu_threads, has_auto, placement_from_args,
                           policy_spec)
from flexevict.runtime.engine import Engine, RunResult, check_length
from flexevict.runtime.layers import describe_layers, layer_slots, layer_specs
from flexevict.errors import UserError, cli_errors
from flexevict.runtime.memory import MemoryPlan, GIB, out_of_memory
from flexevict.policies import Policy, PolicySpec
from flexevict.io.weights import DUMMY, open_weights
from flexevict.runtime.progress import Progress
from flexevict.bench.report import write_json
from flexevict.runtime.machine import run_metadata

# The warm-up before the timed run (one place): every sequence of the batch gets a prompt of
# WARMUP_PROMPT tokens and WARMUP_TOKENS generated tokens, under a budget of a quarter of the
# prompt (at least the policy's minimum), so an evicting policy compacts the prompt and then
# evicts at every decode step: its prefill and decode hooks, and every kernel they launch, have
# run once before the clock starts. Short, so that offloaded weights stream only a few times.
WARMUP_PROMPT, WARMUP_TOKENS = 64, 8


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m flexevict.bench", description=__doc__,
                                formatter_class=_HelpFormatter)
    add_run_args(p)
    p.add_argument("--ignore-max-positions", action="store_true",
                   help="timing only: let runs exceed the model's position limit (positions "
                        "wrap; the generated text is meaningless)")
    p.add_argument("--no-warmup", action="store_true",
                   help=f"skip the warm-up ({WARMUP_PROMPT} + {WARMUP_TOKENS} tokens with the "
                        "policy under test) before the timed run")
    p.add_argument("--predict", action="store_true",
                   help="print the cost model's prediction, calibrating this machine first if "
                        "it never was (default: from a cached calibration; without one, a quick "
                        "calibration where the run does not fit or may be slow)")
    p.add_argument("--yes", action="store_true",
                   help="run even when it is predicted to take over an hour (without it a "
                        "terminal asks, anything else refuses)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the result as JSON")
    return p.parse_args(argv)


def add_run_args(p: argparse.ArgumentParser):
    """What a benchmark run is (model, lengths, device, policy, placement and limits): shared
    with `python -m flexevict.plan`, which plans the same run without running it."""
    p.add_argument("--model", default="opt-6.7b", help="registry name, HF folder or .gguf")
    p.add_argument("--path", default=DUMMY, help=f"weights (default {DUMMY}: seeded random)")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per sequence")
    p.add_argument("--gen-len", type=int, default=32, help="generated tokens per sequence")
    p.add_argument("--cut-gen-len", type=int, default=None,
                   help="run this many decode steps and project the rest (output says projected)")
    p.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (default: cuda if any)")
    p.add_argument("--dtype", default=None, choices=list(DTYPES),
                   help="default float16 on GPU, float32 on CPU")
    p.add_argument("--seed", type=int, default=0, help="seed for dummy weights and prompts")
    add_threads_arg(p)
    add_policy_args(p)
    add_placement_args(p, gpu_batch_size=4)          # FlexGen's default


def main(argv=None):
    args = parse_args(argv)
    with cli_errors("flexevict.bench"), cpu_threads(args.threads):
        result = run(args)
        print(format_block(result))
        write_json(args.json, result, result["device"])


def run(args) -> dict:
    s = prepare(args)
    with out_of_memory(s.plan, s.device, s.limit):
        engine, weights_load_s = load_engine(s, args.seed)
        try:
            prompts = random_prompts(s.config, s.n, args.prompt_len, args.seed)
            if not args.no_warmup:
                warm_up(engine, s.spec, s.n, args.prompt_len, args.gen_len, args.seed)
            _reset_peaks(s.device)
            timed = _timed_run(engine, prompts, s.steps, args.gen_len, s.policy,
                               args.ignore_max_positions)
        finally:
            engine.close()
    result = _result(args, s.plan, s.policy, timed, s.device, s.steps)
    result["kernel_build_s"] = s.build_s
    result["weights_load_s"] = weights_load_s
    result["predicted"] = s.predicted
    return result


@dataclasses.dataclass
class Setup:
    """A bench run resolved from its flags before any weight loads (`prepare`)."""
    config: object                  # the model's ModelConfig
    path: str                       # its weights, or DUMMY (seeded random)
    device: torch.device
    dtype: torch.dtype
    limit: int | None               # the GPU allocator's cap in bytes (None on a CPU)
    placement: object               # Placement
    n: int                          # sequences: gpu_batch_size x num_gpu_batches
    steps: int                      # token steps run: the prefill, then steps - 1 decode steps
    spec: PolicySpec
    policy: Policy                  # a fresh one of `spec`, bound to the model
    plan: MemoryPlan
    predicted: dict | None          # the cost model's prediction (`describe`), if any
    build_s: float | None           # `load_kernels`' seconds


def prepare(args) -> Setup:
    """Everything `run` does before the weights load: the flags checked, threads and placement
    chosen, the memory estimate checked (a setting that cannot fit is one line now), the
    prediction made and the CUDA extension loaded. Shared with bench/hook_share.py, which runs
    one engine for several policies."""
    if args.prompt_len < 1 or args.gen_len < 1:
        raise UserError("--prompt-len and --gen-len must be >= 1")
    config, path = resolve_model(args.model, args.path)
    device = resolve_device(args.device)
    dtype = DTYPES[args.dtype or default_dtype(device)]
    limit = _set_gpu_limit(device, args.gpu_mem_limit)
    work = _workload(args, config, device, dtype)
    fixed = isinstance(args.gpu_batch_size, int) and isinstance(args.num_gpu_batches, int)
    choose_threads(args, work, args.gpu_batch_size * args.num_gpu_batches if fixed else 1)
    placement = placement_from_args(args, config, (args.prompt_len, args.gen_len), device, dtype)
    if placement.gpu_batch_size < 1:
        raise UserError(f"--gpu-batch-size must be >= 1 (got {placement.gpu_batch_size})")
    n = placement.gpu_batch_size * placement.num_gpu_batches
    if args.cut_gen_len is not None and args.cut_gen_len < 2:
        raise UserError(f"--cut-gen-len must be >= 2: the prefill and at least one decode step "
                        f"to project from (got {args.cut_gen_len})")
    steps = min(args.cut_gen_len or args.gen_len, args.gen_len)
    if not args.ignore_max_positions:          # before the weights load, not after
        check_length(config, args.prompt_len, steps)
    spec = policy_spec(args)
    policy = spec.make().for_model(config)
    layout = policy.layout(args.prompt_len, args.gen_len)
    slots = layer_slots(layer_specs(config, policy, args.prompt_len, args.gen_len, layout))
    plan = MemoryPlan(config, placement, dtype, n, args.prompt_len, args.gen_len, slots,
                      layout.home_tokens)
    predicted = describe(check_run(args, work, placement, n, steps=steps))
    confirm_long_run(predicted, steps, args.yes)
    build_s = load_kernels(device)
    return Setup(config, path, device, dtype, limit, placement, n, steps, spec, policy, plan,
                 predicted, build_s)


def load_engine(s: Setup, seed: int) -> tuple[Engine, float]:
    """The engine of a prepared run: its weights made (DUMMY, from `seed`) or loaded under its
    placement, with a progress bar -> (engine, seconds it took)."""
    what = "making dummy weights" if s.path == DUMMY else "loading weights"
    t0 = time.perf_counter()
    with Progress(s.config.num_layers, what, "layer", "MB") as bar:
        engine = Engine.load(s.config, open_weights(s.path, s.config, seed), s.placement,
                             s.device, s.dtype, progress=lambda b: bar.update(1, b / 1e6))
    return engine, time.perf_counter() - t0


def warm_up(engine: Engine, spec: PolicySpec, n: int, prompt_len: int, gen_len: int,
            seed: int, adapt=None) -> None:
    """The warm-up before a timed run of n sequences of prompt_len + gen_len tokens: a fresh
    policy of `spec` under the budget `warmup_policy` picks (adapt(policy) instead, when given:
    bench/hook_share.py's hook-free variant), on random prompts from seed + 1."""
    tokens = min(WARMUP_TOKENS, gen_len)
    warm, length = warmup_policy(spec, prompt_len, tokens)
    engine.run(random_prompts(engine.config, n, length, seed + 1), tokens,
               adapt(warm) if adapt else warm, greedy)


def describe(checked) -> dict | None:
    """`check_run`'s (cost model, estimate) as the result's `predicted`: per phase and total,
    what bounds each phase, and the calibration it rests on; None without one."""
    from flexevict.planner.advice import source
    from flexevict.planner.search import bound_line
    if checked is None:
        return None
    model, e = checked
    cal = model.cal
    return {**e.describe(), "bound": bound_line(e),
            "calibration": {"path": cal.path, "machine": cal.data.get("machine"),
                            "synthetic": cal.synthetic, "quick": cal.quick,
                            "source": source(cal)}}


LONG_RUN_S = 3600.0


def confirm_long_run(predicted: dict | None, steps: int, yes: bool) -> None:
    """A run predicted to take over an hour (its prefill and the `steps` - 1 decode steps it
    times) goes ahead only with --yes or a yes typed on a terminal: found before the weights
    load, not hours in. An estimate from a quick or synthetic calibration alone only warns
    (`check_run` said it): it does not stop a run."""
    if predicted is None or yes:
        return
    seconds = predicted["prefill_s"] + (steps - 1) * predicted["decode_step_s"]
    cal = predicted.get("calibration", {})
    if seconds < LONG_RUN_S or cal.get("quick") or cal.get("synthetic"):
        return
    from flexevict.planner.search import wall_time
    what = (f"this run is predicted to take {wall_time(seconds)} "
            f"({predicted['throughput']:.3f} token/s, from {cal.get('source', 'the cost model')})")
    if sys.stdin.isatty() and sys.stderr.isatty():
        print(f"{what}; run it? [y/N] ", end="", file=sys.stderr, flush=True)
        if sys.stdin.readline().strip().lower() in ("y", "yes"):
            return
        raise UserError(f"{what}: not run (answer y, or add --yes)")
    raise UserError(f"{what}; add --yes to run it, or --cut-gen-len N to time N decode steps "
                    "and project the rest")


def _workload(args, config, device, dtype):
    from flexevict.planner.search import Workload
    return Workload(config, args.prompt_len, args.gen_len, policy_spec(args), device, dtype)


def load_kernels(device) -> float | None:
    """Load the CUDA extension now (import the ahead-of-time build, or build it just in time)
    so that neither lands in a timed step -> the seconds it took, or None where the PyTorch
    reference runs anyway (a CPU device, or FLEXEVICT_KERNELS=0). First use of each kernel
    (module loading) is left to the warm-up."""
    if device.type != "cuda" or not kernels.ext.enabled():
        return None
    t0 = time.perf_counter()
    kernels.ext.load()
    return time.perf_counter() - t0


def warmup_policy(spec: PolicySpec, max_prompt: int, steps: int) -> tuple[Policy, int]:
    """A fresh policy from `spec` for the warm-up of `steps` decode steps, with a budget that
    makes it evict at the warm-up's length -> (policy, prompt length <= max_prompt, the timed
    run's, so the warm-up fits wherever the run does). A spec without a budget (`full`, or any
    policy holding every token) is kept as is: the timed run does not evict either. The budget
    is a quarter of the warm-up, or the least above it that the policy's layout accepts
    (recall's page summaries need room that grows with the run)."""
    length = min(WARMUP_PROMPT, max_prompt)
    if spec.budget is None and spec.budget_tokens is None:
        return spec.make(), length
    minimum = spec.make().minimum_slots()
    length = min(max(length, 2 * minimum), max_prompt)      # the prompt overflows the budget
    slots = max(minimum, length // 4)
    while True:
        policy = dataclasses.replace(spec, budget=None, budget_tokens=slots).make()
        try:
            if policy.layout(length, steps).evicts:
                return policy, length
        except UserError:
            pass
        if slots >= length + steps:
            return policy, length                 # none evicts here: warm up without evicting
        slots += 1


def _timed_run(engine, prompts, steps, gen_len, policy, wrap_positions: bool):
    bar = Progress(steps, "bench", "step", "processed tokens")   # prompt + generated
    nvml, host = _NvmlPeak(engine.tiers.compute), HostMemoryPeak()
    host.sample()

    def tick():
        bar.update(1, len(prompts) * (len(prompts[0]) if bar.done == 0 else 1))
        nvml.sample()
        host.sample()
        return False
    try:
        run = engine.run(prompts, steps, policy, greedy, until=tick, plan_steps=gen_len,
                         wrap_positions=wrap_positions)
    finally:
        bar.close()
    return Timed(run, nvml.peak, host)


@dataclasses.dataclass
class Timed:
    """The timed run and the memory peaks sampled during it."""
    run: RunResult
    nvml_peak: int | None           # GPU bytes by NVML (None without a GPU)
    host_peak: object               # HostMemoryPeak


def greedy(i, k, h, head):
    """The bench's `Consumer`: each sequence's most likely next token, (b,) int64."""
    return head(h[:, -1] if h.dim() == 3 else h).argmax(dim=-1)


def random_prompts(config, n: int, length: int, seed: int) -> list[list[int]]:
    """n prompts of `length` random token ids in [4, vocab_size), from `seed`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, config.vocab_size, (n, length), generator=g).tolist()


# ---------------------------------------------------------------------------- results

def project_decode(step_seconds: list[float], gen_len: int,
                   attended: list[int] | None = None) -> tuple[float, bool]:
    """Decode latency for gen_len - 1 steps from the measured ones -> (seconds, projected).

    attended: the tokens each decode step 1 .. gen_len - 1 attends (`Layout.held`), which its
    time grows with; None: the step's index (recall, which scores its growing history). The
    missing steps are priced by a line through the measured ones after the first, time against
    tokens: a full cache's steps grow, a full buffer's stay (every measured step attends the
    same tokens, so they cost the measured mean, whatever noise rises among them), and BUZZ's
    follow its middle, which fills and is sampled down again. A falling line is noise (no step
    gets cheaper by attending more): the missing steps cost the mean. Both kinds of noise were
    seen on H200 runs: a -19 us/step fit over 63 flat 18 ms steps projected a quarter of the
    real decode time, a +80 us/step fit over 63 flat 34 ms steps nearly twice it."""
    decode = step_seconds[1:]
    missing = gen_len - 1 - len(decode)
    if missing <= 0:
        return float(sum(decode)), False
    x = np.asarray(attended if attended is not None else range(1, gen_len), dtype=float)
    steady = np.asarray(decode[1:] or decode)         # the first decode step warms up
    x_run, x_missing = x[len(decode) - len(steady):len(decode)], x[len(decode):]
    slope, mean = 0.0, float(steady.mean()) if steady.size else 0.0
    if steady.size >= 3 and np.ptp(x_run) > 0:
        slope = max(float(np.polyfit(x_run, steady, 1)[0]), 0.0)
    # the line through the measured steps' centre with that slope
    extra = float((mean + slope * (x_missing - x_run.mean())).sum())
    return float(sum(decode)) + extra, True


def _result(args, plan, policy, timed, device, steps) -> dict:
    """The run's JSON: `plan` (MemoryPlan) holds the config, the placement and the batch n."""
    stats, layout = timed.run.stats, timed.run.layout
    config, placement, n = plan.config, plan.placement, plan.n
    prefill = stats.step_seconds[0]
    # what a step's time grows with: the tokens it attends, unless the cache keeps a growing
    # history besides (recall), which it scores every step
    attended = None if layout.home_tokens else layout.attended_per_step(args.gen_len - 1)
    decode, projected = project_decode(stats.step_seconds, args.gen_len, attended)
    total = prefill + decode
    return {
        "model": config.name, "path": args.path, "dtype": str(plan.dtype).replace("torch.", ""),
        "prompt_len": args.prompt_len, "gen_len": args.gen_len, "batch": n,
        "decode_steps_run": steps - 1, "projected": projected,
        "placement": placement.describe(),
        "policy": {**policy.describe(layout), **describe_layers(timed.run.layers)},
        "budget": args.budget,
        "budget_tokens": args.budget_tokens,
        "model_size_gb": config.weight_bytes(_dtype_name(plan.dtype)) / GIB,
        "cache_size_gb": config.cache_bytes(n, args.prompt_len + args.gen_len,
                                            _dtype_name(plan.dtype)) / GIB,
        "budget_cache_size_gb": plan.cache_bytes() / GIB,
        "hidden_size_gb": config.hidden_bytes(n, args.prompt_len, _dtype_name(plan.dtype)) / GIB,
        "estimated_gb": {k: v / GIB for k, v in plan.needs().items()},
        "peak_gpu_mem_gb": (torch.cuda.max_memory_allocated(device) / GIB
                            if device.type == "cuda" else None),
        "peak_gpu_mem_nvml_gb": None if timed.nvml_peak is None else timed.nvml_peak / GIB,
        "peak_cpu_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
        "peak_cpu_anon_gb": _gib(timed.host_peak.anon),
        "peak_cpu_file_mapped_gb": _gib(timed.host_peak.file),
        "prefill_latency_s": prefill, "prefill_throughput": n * args.prompt_len / prefill,
        "decode_latency_s": decode,
        "decode_throughput": n * (args.gen_len - 1) / decode if decode > 0 else None,
        "total_latency_s": total, "total_throughput": n * args.gen_len / total,
        "prefill_eviction_s": stats.prefill_eviction_seconds,
        "eviction_s": stats.eviction_seconds,
        "eviction_share_of_decode": eviction_share(stats),
        "graphed_decode_steps": sum(stats.graphed[1:]), "graph_captures": stats.graph_captures,
        "evicts": layout.evicts,
        "bytes_moved": stats.traffic,
        "positions_wrapped": args.ignore_max_positions,
        "placement_auto": has_auto(args),
        "device": str(device), "step_seconds": stats.step_seconds,
        "run_info": run_metadata(device),
    }


def eviction_share(stats) -> float | None:
    """The policy hooks' share of the eager decode steps (graphed steps run them untimed)."""
    eager = [s for s, g in zip(stats.step_seconds[1:], stats.graphed[1:]) if not g]
    return stats.eviction_seconds / sum(eager) if eager else None


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def eviction_line(r: dict) -> str:
    """The policy hooks' time, prefill (prompt selection) and decode apart; the share is of
    the decode steps' time, decode-time work only."""
    if not r["evicts"]:
        return "eviction time: none (the cache holds every token)"
    share, graphed = r["eviction_share_of_decode"], r.get("graphed_decode_steps", 0)
    of_decode = "" if share is None else f" ({100 * share:.1f}% of the eager decode steps)"
    untimed = (f"; {graphed} decode steps ran as CUDA graphs ({r['graph_captures']} "
               "captured), their eviction untimed (--cuda-graphs false times every step)"
               if graphed else "")
    return (f"eviction time: prefill {r['prefill_eviction_s']:.3f} s, decode "
            f"{r['eviction_s']:.3f} s{of_decode}{untimed}")


def format_block(r: dict) -> str:
    """FlexGen's benchmark log block, then flexevict's additions."""
    gb = lambda x: "n/a" if x is None else f"{x:.3f} GB"  # noqa: E731
    tput = lambda x: "n/a" if x is None else f"{x:.3f} token/s"  # noqa: E731
    lines = [
        f"model size: {gb(r['model_size_gb'])}\tcache size: {gb(r['cache_size_gb'])}\t"
        f"hidden size (p): {gb(r['hidden_size_gb'])}",
        f"peak gpu mem: {gb(r['peak_gpu_mem_gb'])} (nvml {gb(r['peak_gpu_mem_nvml_gb'])})\t"
        f"peak cpu rss: {gb(r['peak_cpu_rss_gb'])} (anonymous {gb(r['peak_cpu_anon_gb'])}, "
        f"mapped files {gb(r['peak_cpu_file_mapped_gb'])})\tprojected: {r['projected']}",
        f"prefill latency: {r['prefill_latency_s']:.3f} s\tprefill throughput: "
        f"{tput(r['prefill_throughput'])}",
        f"decode latency: {r['decode_latency_s']:.3f} s\tdecode throughput: "
        f"{tput(r['decode_throughput'])}",
        f"total latency: {r['total_latency_s']:.3f} s\ttotal throughput: "
        f"{tput(r['total_throughput'])}",
        "policy: " + " ".join(f"{k}={v}" for k, v in r["policy"].items())
        + f"\tbudget cache size: {gb(r['budget_cache_size_gb'])}",
        eviction_line(r),
        "bytes moved: " + (json.dumps({k: f"{v / GIB:.3f} GB" for k, v in r["bytes_moved"].items()})
                           if r["bytes_moved"] else "none"),
        f"device: {r['run_info']['device']}\ttorch {r['run_info']['torch']}\tcuda "
        f"{r['run_info']['cuda']}\tkernels {r['run_info']['kernels']}\tcommit "
        f"{r['run_info']['commit'][:12]}\tkernel build/load: "
        + ("n/a" if r.get("kernel_build_s") is None else f"{r['kernel_build_s']:.2f} s"),
    ]
    if r.get("predicted"):
        lines += predicted_lines(r)
    else:
        lines.append(NO_PREDICTION)
    if r["positions_wrapped"]:
        lines.append("positions wrapped past the model's limit: timing only, output meaningless")
    return "\n".join(lines)


NO_PREDICTION = ("predicted: none (no calibration of this machine is cached: `python -m "
                 "flexevict.calibrate` measures one once, or add --predict)")


def predicted_lines(r: dict) -> list[str]:
    """The cost model's prediction next to the measurement, per phase."""
    p = r["predicted"]
    step = r["decode_latency_s"] / max(r["gen_len"] - 1, 1)
    cal = p["calibration"]
    tag = " synthetic" if cal["synthetic"] else " quick" if cal["quick"] else ""
    return [f"predicted: prefill {p['prefill_s']:.3f} s (measured {r['prefill_latency_s']:.3f}), "
            f"decode step {p['decode_step_s']:.4f} s (measured {step:.4f}), total "
            f"{p['total_s']:.3f} s (measured {r['total_latency_s']:.3f}), total throughput "
            f"{p['throughput']:.3f} token/s (measured / predicted "
            f"{r['total_throughput'] / p['throughput']:.2f})",
            f"predicted bound: {p['bound']}\tcalibration:{tag} {cal['path']}"]


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
    # torch wants the device's index: a bare "cuda" (the --device default) is refused
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(gb * GIB / total, index)
    return int(gb * GIB)


def _reset_peaks(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


class HostMemoryPeak:
    """Peak host memory of this process, sampled once per token step, in two parts: anonymous
    memory (what the process really holds: heap, pinned buffers, tensors) and pages of mapped
    files (disk-tier weights and cache, read through the page cache and droppable by the
    kernel). getrusage's peak RSS counts both. Linux only (/proc/self/status); None elsewhere."""

    def __init__(self):
        self.anon = self.file = None

    def sample(self):
        now = _proc_status(("RssAnon", "RssFile", "RssShmem"))
        if now:
            anon, file = now["RssAnon"], now["RssFile"] + now["RssShmem"]
            self.anon, self.file = max(self.anon or 0, anon), max(self.file or 0, file)


def _proc_status(keys) -> dict | None:
    """Fields of /proc/self/status in bytes, or None without /proc."""
    try:
        with open("/proc/self/status") as f:
            found = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f
                     if ln.split(":")[0] in keys}
    except OSError:
        return None
    return found if len(found) == len(keys) else None


def _gib(nbytes):
    return None if nbytes is None else nbytes / GIB


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, and each flag's default in --help (unless its help
    already states it, or there is none to state)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, [], argparse.SUPPRESS) \
                or not action.option_strings:
            return text
        value = " ".join(map(str, action.default)) if isinstance(action.default, list) \
            else action.default
        return f"{text} (default {value})".strip()


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
