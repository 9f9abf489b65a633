"""Arguments and helpers shared by the command-line entry points."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from .config import known_names
from .errors import UserError


def add_model_args(p: argparse.ArgumentParser, threads: int | None = None):
    p.add_argument("--model", default="smollm2-135m",
                   help=f"registry name ({known_names()}), an HF folder, or a .gguf file")
    p.add_argument("--path", default=None,
                   help="weights for a registry name: HF folder, .gguf, or _DUMMY_ for seeded "
                        "random weights (default: the packaged weights, else _DUMMY_)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="default: float32 on CPU, float16 on GPU")
    p.add_argument("--seed", type=int, default=0, help="seed for dummy weights and sampling")
    add_threads_arg(p, threads)
    add_policy_args(p)
    add_placement_args(p)


def add_threads_arg(p: argparse.ArgumentParser, default: int | None = None):
    what = "torch's default, one per core" if default is None else str(default)
    p.add_argument("--threads", type=int, default=default,
                   help=f"torch CPU threads (default {what}); on a shared machine, or with a small "
                        "model whose ops are overhead-bound, 1 is often much faster")


@contextlib.contextmanager
def cpu_threads(n: int | None):
    """Run with n torch CPU threads (None: leave as is), restored after (a CLI's main() may run
    inside a bigger process, e.g. the tests)."""
    if n is not None and n < 1:
        raise UserError(f"--threads must be >= 1 (got {n})")
    before = torch_threads()
    if n is not None:
        _torch().set_num_threads(n)
    try:
        yield
    finally:
        _torch().set_num_threads(before)


def _torch():
    import torch
    return torch


def torch_threads() -> int:
    return _torch().get_num_threads()


def str2bool(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got '{v}'")


def add_placement_args(p: argparse.ArgumentParser, gpu_batch_size: int = 0):
    """FlexGen's placement flags (same names and defaults; `bench` fixes a GPU batch size)."""
    g = p.add_argument_group("placement (FlexGen semantics; 'GPU' is the compute device)")
    g.add_argument("--percent", nargs=6, type=int, default=[100, 0, 100, 0, 100, 0],
                   metavar=("W_GPU", "W_CPU", "CACHE_GPU", "CACHE_CPU", "ACT_GPU", "ACT_CPU"),
                   help="weights, KV cache and activations on GPU and CPU, in percent; the "
                        "rest of each is on disk (default 100 0 100 0 100 0)")
    g.add_argument("--gpu-batch-size", type=int, default=gpu_batch_size,
                   help=f"sequences per GPU batch (default {gpu_batch_size})" if gpu_batch_size
                   else "sequences per GPU batch (default: the batch split over the GPU batches)")
    g.add_argument("--num-gpu-batches", type=int, default=1,
                   help="GPU batches that share each loaded layer's weights (default 1)")
    for name, default, what in (("overlap", True, "overlap I/O with compute"),
                                ("sep-layer", True, "schedule attention and MLP as two layers"),
                                ("pin-weight", True, "pin CPU-resident weights (CUDA only)")):
        g.add_argument(f"--{name}", type=str2bool, nargs="?", const=True, default=default,
                       help=f"{what} (default {default})")
    g.add_argument("--cpu-cache-compute", action="store_true",
                   help="run decode attention on the CPU where a CPU/disk cache lives")
    g.add_argument("--compress-weight", action="store_true", help="4-bit group-quantised weights")
    g.add_argument("--compress-cache", action="store_true", help="4-bit group-quantised KV cache")
    g.add_argument("--offload-dir", default="~/flexevict_offload_dir",
                   help="directory for disk-resident weights and cache")


def placement_from_args(args):
    """The placement the flags describe; an unwritable --offload-dir is reported now, before
    any weight is read."""
    from . import rundir
    from .placement import Placement
    placement = Placement.from_percent(
        args.percent, gpu_batch_size=args.gpu_batch_size, num_gpu_batches=args.num_gpu_batches,
        overlap=args.overlap, sep_layer=args.sep_layer, pin_weight=args.pin_weight,
        cpu_cache_compute=args.cpu_cache_compute, compress_weight=args.compress_weight,
        compress_cache=args.compress_cache, offload_dir=args.offload_dir)
    if placement.uses_disk:
        rundir.check_writable(placement.offload_dir)
    return placement


def add_policy_args(p: argparse.ArgumentParser):
    p.add_argument("--policy", default="full", help="KV eviction policy (default full)")
    p.add_argument("--budget", type=float, default=None,
                   help="KV slots per (sequence, layer, kv-head) as a fraction of prompt + "
                        "generated tokens, in (0, 1]")
    p.add_argument("--budget-tokens", type=int, default=None, help="KV slots, absolute")
    p.add_argument("--policy-arg", action="append", default=[], metavar="NAME=VALUE",
                   help="override a policy parameter (repeatable)")


def policy_spec(args):
    from .policies import PolicySpec
    if args.budget is not None and args.budget_tokens is not None:
        raise UserError("give --budget or --budget-tokens, not both")
    return PolicySpec.parse(args.policy, args.budget, args.budget_tokens, args.policy_arg)


def print_resolved(resolved: list[dict]):
    """Every CLI prints the policy's resolved slots (once per distinct resolution)."""
    seen = []
    for r in resolved:
        if r not in seen:
            seen.append(r)
            print("resolved budget: " + " ".join(f"{k}={v}" for k, v in r.items()), file=sys.stderr)


def load_llm(args, progress: bool = True):
    from .api import LLM
    return LLM(args.model, path=args.path, device=args.device, dtype=args.dtype,
               seed=args.seed, progress=progress, placement=placement_from_args(args))


def read_text(path: str) -> str:
    if not os.path.isfile(path):
        raise UserError(f"{path}: text file does not exist")
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if not text.strip():
        raise UserError(f"{path}: text file is empty")
    return text


def read_jsonl_prompts(path: str) -> list[dict]:
    """Lines `{"id": ..., "prompt": "..."}` -> rows, each with its 1-based `_line`.

    Every problem names the file and line (and the id): malformed JSON, a missing, empty or
    whitespace-only prompt, and a duplicate id (with both lines). Rows without an id are
    numbered by their line."""
    if not os.path.isfile(path):
        raise UserError(f"{path}: input file does not exist")
    rows, seen = [], {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{n}: malformed JSON line ({e.msg}); expected "
                                '{"id": ..., "prompt": "..."}') from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise UserError(f'{path}:{n}: line needs a string "prompt" field')
            rid = row.get("id", n)
            where = f"{path}:{n} (id {json.dumps(rid)})"
            if not row["prompt"].strip():
                what = "empty" if not row["prompt"] else "whitespace-only"
                raise UserError(f"{where}: {what} prompt; give every line some text")
            key = json.dumps(rid, sort_keys=True)
            if key in seen:
                raise UserError(f"{where}: duplicate id, first used on line {seen[key]}; give "
                                "every line its own id")
            seen[key] = n
            rows.append({**row, "_line": n})
    if not rows:
        raise UserError(f"{path}: input file has no prompts")
    return rows


def check_prompt_lengths(rows: list[dict], encoded: list[list[int]], config,
                         max_new_tokens: int, path: str = "--prompt") -> None:
    """Every prompt fits the model's positions with max_new_tokens more; else the first one
    that does not is named (file, line, id) before any generation starts."""
    limit = config.max_positions
    for row, ids in zip(rows, encoded):
        if not ids:
            raise UserError(f"{_where(row, path)}: prompt encodes to no tokens; give it some text")
        if len(ids) + max_new_tokens - 1 > limit:
            raise UserError(f"{_where(row, path)}: prompt of {len(ids)} tokens + {max_new_tokens} "
                            f"new tokens exceeds the model's maximum of {limit} positions; "
                            "shorten the prompt or --max-new-tokens")


def check_prompts(args, rows: list[dict], max_new_tokens: int, path: str = "--prompt") -> None:
    """Tokenize every prompt with the model's tokenizer and check its length, before any
    weight is loaded (a bad last line must not fail a job after hours of work)."""
    from .api import resolve_model
    from .tokenizer import load_tokenizer
    config, weights = resolve_model(args.model, args.path)
    tok = load_tokenizer(weights)
    check_prompt_lengths(rows, [tok.encode(r["prompt"]) for r in rows], config, max_new_tokens,
                         path)


def without_line(row: dict) -> dict:
    """An input row as the user wrote it (read_jsonl_prompts adds `_line`)."""
    return {k: v for k, v in row.items() if k != "_line"}


def _where(row: dict, path: str) -> str:
    if "_line" not in row:
        return path
    return f"{path}:{row['_line']} (id {json.dumps(row.get('id', row['_line']))})"


def write_jsonl_atomic(path: str, rows: list[dict]):
    """Write to `path.partial` and rename when complete, so a crash leaves no complete-looking file."""
    tmp = path + ".partial"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        raise UserError(f"{path}: cannot write output ({e.strerror})") from None
