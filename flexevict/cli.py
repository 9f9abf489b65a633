"""Arguments and helpers shared by the command-line entry points."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys

from flexevict.core.config import known_names
from flexevict.errors import UserError
from flexevict.runtime.placement import DEFAULT_OFFLOAD_DIR


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
    default = default or os.environ.get("FLEXEVICT_THREADS") or AUTO
    p.add_argument("--threads", type=_int_or_auto, default=default,
                   help=f"torch CPU threads, or auto (default {default}; $FLEXEVICT_THREADS sets "
                        "it): the faster of one thread and one per core for this model here, by "
                        "the calibration, else a quick probe cached per machine, printed on "
                        "stderr (a small model's ops are overhead-bound: on a busy machine one "
                        "thread can be ten times faster); on a GPU, torch's default")


@contextlib.contextmanager
def cpu_threads(n: int | str | None):
    """Run with n torch CPU threads (None: leave as is; auto: as is until `choose_threads`
    picks them, once the model is known), restored after (a CLI's main() may run inside a
    bigger process, e.g. the tests)."""
    if n is not None and n != AUTO and n < 1:
        raise UserError(f"--threads must be >= 1 (got {n})")
    before = torch_threads()
    if n not in (None, AUTO):
        _torch().set_num_threads(n)
    try:
        yield
    finally:
        _torch().set_num_threads(before)


def choose_threads(args, work, n: int = 1, log=print) -> None:
    """--threads auto -> the faster of one thread and one per core for `work` (a
    planner.search.Workload) with n sequences under the flags' placement (everything on the
    compute device where a flag says auto): planner.advice.best_threads, from the calibration
    when one is cached, else the probe. Set now (cpu_threads restores it) and printed as the
    run's first line. Called before any auto placement is planned: the plan depends on it."""
    if getattr(args, "threads", None) != AUTO:
        return
    from flexevict.planner import advice
    from flexevict.runtime.placement import Placement
    _check_percent(args.percent)
    placement = Placement(gpu_batch_size=n) if has_auto(args) else _fixed_placement(args)
    cal = advice.here(work.device, getattr(args, "calibration", None))
    threads, why = advice.best_threads(work, cal, placement, n)
    _torch().set_num_threads(threads)
    args.threads = threads
    log(f"threads: {threads} ({why}; --threads N sets it)", file=sys.stderr)


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
    """FlexGen's placement flags (same names and defaults; `bench` fixes a GPU batch size),
    each of which may be `auto` (chosen by the cost model's search, planner/search.py), and the
    memory limits and calibration that search plans with."""
    g = p.add_argument_group("placement (FlexGen semantics; 'GPU' is the compute device; "
                             "`auto` asks the cost model, see python -m flexevict.plan)")
    g.add_argument("--percent", nargs="+", default=[100, 0, 100, 0, 100, 0],
                   metavar="PERCENT",
                   help="six integers W_GPU W_CPU CACHE_GPU CACHE_CPU ACT_GPU ACT_CPU: weights, KV "
                        "cache and activations on GPU and CPU, in percent, the rest of each on "
                        "disk (default 100 0 100 0 100 0); or auto")
    g.add_argument("--gpu-batch-size", type=_int_or_auto, default=gpu_batch_size or None,
                   help=f"sequences per GPU batch, or auto (default {gpu_batch_size})"
                   if gpu_batch_size else "sequences per GPU batch, or auto (default: the batch "
                   "split over the GPU batches; auto when any placement flag is auto)")
    g.add_argument("--num-gpu-batches", type=_int_or_auto, default=1,
                   help="GPU batches that share each loaded layer's weights, or auto (default 1)")
    for name, default, what in (("overlap", True, "overlap I/O with compute"),
                                ("sep-layer", True, "schedule attention and MLP as two layers"),
                                ("pin-weight", True, "pin CPU-resident weights (CUDA only)"),
                                ("cuda-graphs", True, "replay steady decode steps of an evicting "
                                 "run as CUDA graphs when everything is on the GPU; false: "
                                 "eager, like vLLM's enforce_eager")):
        g.add_argument(f"--{name}", type=str2bool, nargs="?", const=True, default=default,
                       help=f"{what} (default {default})")
    for name, what in (("cpu-cache-compute", "run decode attention on the CPU where a CPU/disk "
                                             "cache lives"),
                       ("compress-weight", "4-bit group-quantised weights"),
                       ("compress-cache", "4-bit group-quantised KV cache")):
        g.add_argument(f"--{name}", type=_bool_or_auto, nargs="?", const=True, default=False,
                       help=f"{what} (alone: on; or true, false, auto; default off)")
    g.add_argument("--offload-dir", default=DEFAULT_OFFLOAD_DIR,
                   help="directory for disk-resident weights and cache")
    g.add_argument("--no-weight-cache", dest="weight_cache", action="store_false",
                   help="do not keep disk-resident dummy weights for the next run (default: "
                        "kept in OFFLOAD_DIR/weights/, capped by FLEXEVICT_WEIGHT_CACHE_GIB, "
                        "default 100; a line at exit says how much is kept)")
    g.add_argument("--gpu-mem-limit", type=float, default=None, metavar="GB",
                   help="GPU memory the run may use, in GiB (bench caps the allocator at it, e.g. "
                        "16 for a T4's setting; auto plans within it; default: the GPU's)")
    g.add_argument("--cpu-mem-limit", type=float, default=None, metavar="GB",
                   help="host memory the process may hold, in GiB (anonymous memory: the "
                        "interpreter, the cpu tier, and on a CPU device the 'GPU' tier; mapped "
                        "disk-tier files do not count); checked before the run, and auto plans "
                        "within it (default: what is available now)")
    g.add_argument("--calibration", default=None, metavar="FILE",
                   help="machine calibration for auto and the predictions (default: this "
                        "machine's, measured on first use; see python -m flexevict.calibrate)")


def _int_or_auto(v: str):
    if v == "auto":
        return v
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or auto, got '{v}'") from None


def _bool_or_auto(v: str):
    return v if v == "auto" else str2bool(v)


AUTO = "auto"
PLACEMENT_FLAGS = ("percent", "gpu_batch_size", "num_gpu_batches", "compress_weight",
                   "compress_cache", "cpu_cache_compute")


def has_auto(args) -> bool:
    """Whether any placement flag says auto."""
    return any(getattr(args, f) == "auto" or getattr(args, f) == ["auto"]
               for f in PLACEMENT_FLAGS)


def placement_from_args(args, config=None, lengths: tuple | None = None, device=None,
                        dtype=None, max_batch: int | None = None):
    """The placement the flags describe; an unwritable --offload-dir is reported now, before
    any weight is read.

    Flags that say `auto` are chosen by the cost model's search (planner.search.resolve)
    for runs of lengths = (prompt_len, gen_len) tokens (generate: its prompts', `plan_job`). A
    caller that does not know its lengths yet (eval builds the model before reading its input)
    gets a plan for the longest run the model allows: the model's maximum positions, with
    --max-new-tokens of them generated (a conservative choice: a smaller batch or more
    offloading than shorter prompts need). With auto, --gpu-batch-size 0 (generate's "unset")
    is auto too."""
    from flexevict.runtime import rundir, weight_cache
    _check_percent(args.percent)
    if has_auto(args):
        placement = _resolve(args, config, lengths, device, dtype, max_batch)
    else:
        placement = _fixed_placement(args)
    placement = dataclasses.replace(placement, cuda_graphs=args.cuda_graphs,
                                    weight_cache=args.weight_cache)
    if placement.uses_disk:
        rundir.check_writable(placement.offload_dir)
        if placement.weight_cache:
            weight_cache.cap_bytes()        # a bad cap is one line now, not after calibration
    return placement


def _fixed_placement(args):
    """The placement of flags none of which says auto (checked: `Placement.from_percent`)."""
    from flexevict.runtime.placement import Placement
    return Placement.from_percent(
        [int(x) for x in args.percent], gpu_batch_size=_gpu_batch_size(args),
        num_gpu_batches=args.num_gpu_batches, overlap=args.overlap,
        sep_layer=args.sep_layer, pin_weight=args.pin_weight,
        cpu_cache_compute=args.cpu_cache_compute, compress_weight=args.compress_weight,
        compress_cache=args.compress_cache, offload_dir=args.offload_dir)


def check_gpu_batch_size(args) -> None:
    """An explicit --gpu-batch-size below 1 is refused (unset is None, auto is the planner's)."""
    gbs = args.gpu_batch_size
    if gbs is not None and gbs != AUTO and gbs < 1:
        raise UserError(f"--gpu-batch-size must be >= 1 (got {gbs}); leave it out for the "
                        "default")


def _gpu_batch_size(args) -> int:
    """--gpu-batch-size as given, 0 when unset."""
    check_gpu_batch_size(args)
    return args.gpu_batch_size or 0


def _check_percent(percent):
    if list(percent) == ["auto"]:
        return
    if len(percent) != 6:
        raise UserError(f"--percent takes six integers (weights, cache, activations on GPU "
                        f"and CPU) or auto, got {len(percent)} value(s)")
    for x in percent:
        try:
            int(x)
        except (TypeError, ValueError):
            raise UserError(f"--percent: '{x}' is not an integer; give six integers or "
                            "auto") from None


def _resolve(args, config, lengths, device, dtype, max_batch):
    """placement_from_args' auto path: fill in what the caller did not pass."""
    from flexevict.api import resolve_device, resolve_model
    from flexevict.core.config import DTYPES, default_dtype
    from flexevict.planner.search import Workload
    if config is None:
        config, _ = resolve_model(args.model, args.path)
    if device is None:
        device = resolve_device(getattr(args, "device", None))
    if dtype is None:
        dtype = DTYPES[getattr(args, "dtype", None) or default_dtype(device)]
    if lengths is None:
        gen = max(getattr(args, "max_new_tokens", None) or 1, 1)
        lengths = (max(config.max_positions - gen + 1, 1), gen)
    work = Workload(config, lengths[0], lengths[1], policy_spec(args), device, dtype)
    placement, _ = resolve_auto(args, work, max_batch)
    return placement


# ---------------------------------------------------------------------------- planner flags
# The planner takes typed inputs (flexevict/planner): these translate the placement flags.

def resolve_auto(args, work, max_batch: int | None = None, log=print):
    """The flags' placement with every `auto` chosen by the search for `work` (a
    planner.search.Workload), at most max_batch sequences a block -> (placement, plan)."""
    from flexevict.planner.search import resolve
    model = cost_model_from_args(args, work, log)
    return resolve(model, request_from_args(args, max_batch),
                   limits_from_args(args, work.device, model.cal), log)


def request_from_args(args, max_batch: int | None = None):
    """A PlacementRequest from the shared placement flags (`add_placement_args`); `auto` ->
    None (the search chooses)."""
    from flexevict.planner.search import PlacementRequest
    auto = list(args.percent) == [AUTO]
    get = lambda name: None if getattr(args, name) == AUTO else getattr(args, name)  # noqa: E731
    gbs = get("gpu_batch_size")
    return PlacementRequest(
        percent=None if auto else tuple(int(x) for x in args.percent),
        gpu_batch_size=gbs or None if gbs is not None else None,
        num_gpu_batches=get("num_gpu_batches"), compress_weight=get("compress_weight"),
        compress_cache=get("compress_cache"), cpu_cache_compute=get("cpu_cache_compute"),
        overlap=args.overlap, sep_layer=args.sep_layer, pin_weight=args.pin_weight,
        offload_dir=args.offload_dir, max_batch=max_batch)


def limits_from_args(args, device, calibration=None):
    """Limits from --gpu-mem-limit and --cpu-mem-limit (GiB; default: the machine's, or the
    calibrated machine's when planning for another) and the disk under --offload-dir."""
    from flexevict.planner.search import limits_for
    from flexevict.runtime.memory import GIB
    gib = lambda gb: None if gb is None else int(gb * GIB)  # noqa: E731
    return limits_for(device, args.offload_dir, gib(getattr(args, "gpu_mem_limit", None)),
                      gib(getattr(args, "cpu_mem_limit", None)), calibration)


def cost_model_from_args(args, work, log=print, cal=None):
    """The CostModel of `work` with calibration `cal`, else --calibration's, else this machine's
    cache (measured now when there is none), for --threads."""
    from flexevict.planner.search import cost_model_for, with_calibration
    if cal is not None:
        return with_calibration(work, cal)
    return cost_model_for(work, getattr(args, "calibration", None),
                          getattr(args, "threads", None), args.offload_dir, log)


# ---------------------------------------------------------------------------- before a run loads
# Every CLI, before it loads a weight: --threads auto chosen (choose_threads), limits that
# cannot apply said (note_unused_limits), and the run checked to fit and timed (check_run).

def note_unused_limits(args, device, log=print) -> None:
    """One line for a limit flag that cannot apply to a run or plan on `device`."""
    import torch
    gb = getattr(args, "gpu_mem_limit", None)
    if gb is not None and torch.device(device).type != "cuda":
        why = "this machine has no GPU" if not torch.cuda.is_available() else \
            "the run computes on the CPU"
        log(f"note: --gpu-mem-limit {gb:g} does not apply: {why}; this is for the CPU (a plan "
            "for a GPU: --device cuda with --calibration FILE made there)", file=sys.stderr)


def check_run(args, work, placement, n: int, runs: float = 1.0, steps: int | None = None,
              log=print):
    """Before any weight loads, a run of `runs` blocks of n sequences of `work` (a
    planner.search.Workload) under `placement` (steps: the decode steps it runs, bench's
    --cut-gen-len, when fewer than work.gen_len): it must fit memory, else a UserError that
    names `python -m flexevict.plan`'s answer (planner.advice.does_not_fit); predicted slower
    than advice.SLOW_S, a line on stderr says so and what runs here in reasonable time.
    -> (CostModel, Estimate) of one block, or None where nothing was worth estimating."""
    from flexevict.planner import advice
    from flexevict.runtime.memory import GIB, DoesNotFit, MemoryPlan
    from flexevict.runtime.layers import layer_slots, layer_specs
    policy = work.spec.make()
    layout = policy.layout(work.prompt_len, work.gen_len)
    slots = layer_slots(layer_specs(work.config, policy, work.prompt_len, work.gen_len, layout))
    plan = MemoryPlan(work.config, placement, work.dtype, n, work.prompt_len, work.gen_len,
                      slots, layout.home_tokens)
    cpu = getattr(args, "cpu_mem_limit", None)
    try:
        plan.check(work.device, limits_from_args(args, work.device).gpu,
                   None if cpu is None else int(cpu * GIB))
    except DoesNotFit as e:
        model = _estimator(args, work, None, n, runs, log)
        if model is None:
            raise UserError(e.message) from None
        request = request_from_args(args)
        if request.gpu_batch_size and request.gpu_batch_size > n:      # fewer prompts
            request = dataclasses.replace(request, gpu_batch_size=n)
        limits = limits_from_args(args, work.device, model.cal)    # as `plan` has them
        raise UserError(advice.does_not_fit(model, request, limits, e.head, runs)
                        or e.message) from None
    model = _estimator(args, work, placement, n, runs, log)
    if model is None:
        return None
    e = model.estimate(placement, n)
    seconds = (e.prefill_s + (steps - 1) * e.step_s if steps else e.total_s) * runs
    limits = limits_from_args(args, work.device, model.cal)
    advice.warn(advice.slow_line(model, seconds, n, limits, args.offload_dir, runs), log)
    return model, e


def _estimator(args, work, placement, n: int, runs: float, log=print):
    """The cost model check_run predicts with: where the command asks for predictions (bench's
    --predict, an auto flag, --calibration), its calibration, measured fully if needed; else the
    one cached here; else, for a run that does not fit (placement None) or one the probe's
    rough time puts over SLOW_S / ROUGH_MARGIN, a quick calibration made now; else None."""
    from flexevict.planner import advice
    from flexevict.planner.search import with_calibration
    if getattr(args, "predict", False) or has_auto(args) or getattr(args, "calibration", None):
        return cost_model_from_args(args, work, log)
    cal = advice.here(work.device, threads=torch_threads())
    if cal is None and placement is not None:
        rough = advice.rough_seconds(work, placement, n, torch_threads()) * runs
        if rough < advice.SLOW_S / advice.ROUGH_MARGIN:
            return None
    if cal is None:
        cal = advice.here_or_quick(work.device, torch_threads(), args.offload_dir, log=log)
    try:
        return with_calibration(work, cal)
    except UserError:          # a calibration file without this device or dtype: no estimate
        return None


def prompt_shape(args, config, weights: str) -> tuple[int, int]:
    """(the longest prompt in tokens, how many prompts) of generate's --prompt or --input,
    tokenized with the model's tokenizer: what its auto placement and checks plan for. What
    is wrong with a line (unreadable, too long for the model: clipped here) is the job's to
    say, its pre-pass or its --prompt check, as is a chat's formatting (here a message counts
    its contents' tokens)."""
    from flexevict.io.tokenizer import load_tokenizer
    tok = load_tokenizer(weights)
    longest = rows = 0
    if args.prompt is not None:
        longest, rows = len(tok.encode(args.prompt)), 1
    elif not os.path.isfile(args.input):
        raise UserError(f"{args.input}: input file does not exist")
    else:
        with open(args.input, encoding="utf-8", errors="replace") as f:    # a line at a time
            for text in filter(None, map(_prompt_text, f)):
                longest, rows = max(longest, len(tok.encode(text))), rows + 1
    most = max(config.max_positions - args.max_new_tokens + 1, 1)
    return min(max(longest, 1), most), max(rows, 1)


def _prompt_text(line: str) -> str | None:
    """A JSONL line's prompt: "prompt" or "messages", at the top or in an OpenAI request's
    "body"; None for a line without one."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(row, dict):
        return None
    row = row.get("body", row) if isinstance(row.get("body"), dict) else row
    prompt, messages = row.get("prompt"), row.get("messages")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(messages, list):
        return "\n".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
    return None


def plan_job(args):
    """generate's placement, after its pre-run checks: the prompts' longest length and count
    (`prompt_shape`) are what --threads auto, the auto placement flags (not the model's
    maximum) and `check_run`, for the job's blocks, plan with. With --ray the workers, not
    this machine, run it: only the flags' placement, and torch's default threads there."""
    import math
    from flexevict.api import resolve_device, resolve_model
    from flexevict.core.config import DTYPES, default_dtype
    from flexevict.planner.search import Workload
    if args.ray:
        args.threads = None if args.threads == AUTO else args.threads
        return placement_from_args(args)
    config, weights = resolve_model(args.model, args.path)
    device = resolve_device(args.device)
    dtype = DTYPES[args.dtype or default_dtype(device)]
    longest, rows = prompt_shape(args, config, weights)
    work = Workload(config, longest, args.max_new_tokens, policy_spec(args), device, dtype)
    fixed = not has_auto(args)           # else the plan picks the batch, after the threads
    choose_threads(args, work, min(rows, args.gpu_batch_size * args.num_gpu_batches)
                   if fixed else 1)
    note_unused_limits(args, device)
    placement = placement_from_args(args, config, (longest, args.max_new_tokens), device, dtype,
                                    max_batch=rows)
    block = max(placement.gpu_batch_size, 1) * placement.num_gpu_batches
    check_run(args, work, placement, min(rows, block), math.ceil(rows / block))
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
    from flexevict.policies import PolicySpec
    if args.budget is not None and args.budget_tokens is not None:
        raise UserError("give --budget or --budget-tokens, not both")
    return PolicySpec.parse(args.policy, args.budget, args.budget_tokens, args.policy_arg)


def distinct(items) -> list:
    """The items in order, each once (dicts too, which a set cannot hold)."""
    seen = []
    for x in items:
        if x not in seen:
            seen.append(x)
    return seen


def print_resolved(resolved: list[dict]):
    """Every CLI prints the policy's resolved slots (once per distinct resolution)."""
    for r in distinct(resolved):
        print("resolved budget: " + " ".join(f"{k}={v}" for k, v in r.items()), file=sys.stderr)


EVAL_LENGTHS = (512, 32)     # prompt and generated tokens --threads auto times eval's runs at


def load_llm(args, progress: bool = True):
    """eval's model: --threads auto chosen for a typical run of it (EVAL_LENGTHS), then
    loaded under the flags' placement."""
    from flexevict.api import LLM, resolve_device, resolve_model
    from flexevict.core.config import DTYPES, default_dtype
    from flexevict.planner.search import Workload
    from flexevict.policies import PolicySpec
    config, _ = resolve_model(args.model, args.path)
    device = resolve_device(args.device)
    prompt, gen = EVAL_LENGTHS
    # a sweep's --policy-arg belong to its labelled policies: it is timed as `full`
    spec = PolicySpec("full") if getattr(args, "task", None) == "sweep" else policy_spec(args)
    work = Workload(config, min(prompt, config.max_positions // 2), gen, spec, device,
                    DTYPES[args.dtype or default_dtype(device)])
    choose_threads(args, work)
    note_unused_limits(args, device)
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
    """Lines `{"id": ..., "prompt": "..."}` -> rows, each with its 1-based `_line` (all at
    once: eval's small prompt files; `generate --input` streams, see flexevict/jobs).

    Every problem names the file and line (and the id): malformed JSON, a missing, empty or
    whitespace-only prompt, and a duplicate id (with both lines). Rows without an id are
    numbered by their line."""
    from flexevict.jobs.inputs import read_all
    return read_all(path)


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
    from flexevict.api import resolve_model
    from flexevict.io.tokenizer import load_tokenizer
    config, weights = resolve_model(args.model, args.path)
    tok = load_tokenizer(weights)
    check_prompt_lengths(rows, [tok.encode(r["prompt"]) for r in rows], config, max_new_tokens,
                         path)


def _where(row: dict, path: str) -> str:
    if "_line" not in row:
        return path
    return f"{path}:{row['_line']} (id {json.dumps(row.get('id', row['_line']))})"
