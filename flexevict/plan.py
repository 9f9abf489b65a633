"""`python -m flexevict.plan`: the placement the cost model predicts fastest, and why, without
loading any weights.

    python -m flexevict.plan --model opt-6.7b --prompt-len 2048 --gen-len 2048 \\
        --policy h2o --budget 0.2 --percent auto --gpu-batch-size auto --num-gpu-batches auto \\
        --device cuda --gpu-mem-limit 80 --calibration h100.json

Same model, length, policy and placement flags as `python -m flexevict.bench`; any placement
flag may be `auto` (`--percent auto`, `--gpu-batch-size auto`, `--num-gpu-batches auto`,
`--compress-weight auto`, `--compress-cache auto`, `--cpu-cache-compute auto`) and the others
stay as given. Prints the chosen placement with its predicted throughput and memory per tier,
what bounds it, the next best change, and the top alternatives; a request that cannot fit
prints one line naming the binding resource and the smallest change that fits, and exits 2.
"""
from __future__ import annotations

import argparse

import torch

from flexevict.errors import UserError, cli_errors
from flexevict.planner import search as S


def parse_args(argv=None):
    from flexevict.bench.throughput import add_run_args
    # --help: this docstring, then what the search does (flexevict.planner.search's docstring
    # after its first paragraph)
    description = __doc__ + "\n" + S.__doc__.split("\n\n", 1)[1]
    p = argparse.ArgumentParser(prog="python -m flexevict.plan", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p)
    p.add_argument("--top", type=int, default=5, help="alternatives to list (default 5)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    with cli_errors("flexevict.plan"):
        print("\n".join(run(args)))


def run(args) -> list[str]:
    from flexevict.api import resolve_model
    from flexevict.core.config import DTYPES, default_dtype
    from flexevict.cli import (choose_threads, cost_model_from_args, cpu_threads,
                               limits_from_args, note_unused_limits, policy_spec,
                               request_from_args)
    from flexevict.planner import advice
    if args.prompt_len < 1 or args.gen_len < 1:
        raise UserError("--prompt-len and --gen-len must be >= 1")
    config, _ = resolve_model(args.model, args.path)
    device = _plan_device(args.device)
    dtype = DTYPES[args.dtype or default_dtype(device)]
    with cpu_threads(args.threads):
        work = S.Workload(config, args.prompt_len, args.gen_len, policy_spec(args), device,
                          dtype)
        fixed = isinstance(args.gpu_batch_size, int) and isinstance(args.num_gpu_batches, int)
        choose_threads(args, work, args.gpu_batch_size * args.num_gpu_batches if fixed else 1)
        note_unused_limits(args, device)
        model = cost_model_from_args(args, work)
        request = request_from_args(args)
        limits = limits_from_args(args, device, model.cal)
        try:
            plan = S.search(model, request, limits, top=max(args.top, 1))
        except S.Infeasible as e:
            line = advice.does_not_fit(model, request, limits, S.infeasible_head(e))
            raise UserError(line or f"{S.infeasible_head(e)}; {S.no_fit_line(e)}") from None
        best = plan.best
        slow = advice.slow_line(model, best.total_s, best.n, limits, args.offload_dir)
        return [S.header(model, limits)] + S.report(plan, args.top) + ([slow] if slow else [])


def _plan_device(name: str) -> torch.device:
    """The device to plan for: it need not be present (a plan for a GPU from a CPU machine,
    with a calibration file made there or --synthetic)."""
    if name in (None, "auto"):
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name != "cpu" and not name.startswith("cuda"):
        raise UserError(f"unknown --device '{name}' (cpu, cuda or cuda:N)")
    return torch.device(name)


if __name__ == "__main__":
    main()
