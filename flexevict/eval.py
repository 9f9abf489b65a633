"""`python -m flexevict.eval`: accuracy on the same engine path as generation.

    python -m flexevict.eval ppl --model smollm2-135m --text FILE --max-tokens 1024 --json
    python -m flexevict.eval ppl --model smollm2-135m --text FILE --policy h2o --budget 0.2 --json
    python -m flexevict.eval agreement --model smollm2-135m --policy h2o --budget 0.2 \\
        --input prompts.jsonl --max-new-tokens 64 --json
    python -m flexevict.eval passkey --model smollm2-135m --policy h2o --budget 0.2 --json
    python -m flexevict.eval sweep --model smollm2-135m --out DIR [--tasks ppl,agreement,...] \\
        [--policies h2o,local,...] [--budgets 0.05,0.2,1.0] [--text FILE] [--quick]
    python -m flexevict.eval sweep --preset gemma3-270m --out DIR

With eviction, `ppl` prefills `--prefill-tokens` tokens (default: the slot count) and feeds the
rest one token at a time through the decode path, evicting exactly as generation does.
`agreement` compares greedy continuations with the full cache's. `passkey` hides a 5-digit key
at several depths of filler text and checks the greedy answer. `sweep` runs policies x budgets x
tasks (ppl, agreement, passkey, attention-loss; see flexevict/evaluation/tasks.py) on packaged
real text, resumably, and writes a results JSON, markdown tables, the papers' claims and PNG
plots.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from flexevict.cli import (add_model_args, check_prompts, cpu_threads, distinct, load_llm,
                  policy_spec, print_resolved, read_jsonl_prompts, read_text)
from flexevict.errors import UserError, cli_errors
from flexevict.io.packaged import SWEEP_INSTALL, missing_sweep_needs
from flexevict.policies import PolicySpec
from flexevict.evaluation.tasks import compare


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m flexevict.eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="task", required=True)
    ppl = sub.add_parser("ppl", help="perplexity of a text file's first N tokens")
    add_model_args(ppl)
    ppl.add_argument("--text", required=True, help="UTF-8 text file")
    ppl.add_argument("--max-tokens", type=int, default=None, help="keep the first N tokens")
    ppl.add_argument("--prefill-tokens", type=int, default=None,
                     help="with eviction: tokens prefilled before decoding (default: slots)")
    agree = sub.add_parser("agreement", help="greedy continuations vs the full cache")
    add_model_args(agree)
    agree.add_argument("--input", required=True, help='JSONL of {"id": ..., "prompt": ...}')
    agree.add_argument("--max-new-tokens", type=int, default=64)
    agree.add_argument("--batch-size", type=int, default=8)
    passkey = sub.add_parser("passkey", help="retrieve a key hidden in long filler text")
    add_model_args(passkey)
    passkey.add_argument("--text", default=None,
                         help="filler text file (default: Mohtashami & Jaggi's repeated sentences)")
    passkey.add_argument("--length", type=int, default=512, help="prompt tokens (about)")
    passkey.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9",
                         help="where the key sits, as fractions of the filler (one prompt each)")
    sweep = sub.add_parser("sweep", help="policies x budgets x tasks, tables and plots")
    add_model_args(sweep, threads=1)   # a small model's decode step is per-op-overhead bound
    add_sweep_args(sweep)
    for sp in (ppl, agree, passkey, sweep):
        sp.add_argument("--json", action="store_true",
                        help="print one JSON object on stdout (progress stays on stderr)")
    return p.parse_args(argv)


def add_sweep_args(p):
    from flexevict.evaluation.sweep import DEFAULT_BUDGETS, PRESETS, QUICK_BUDGETS, TASKS
    p.add_argument("--out", required=True, help="folder for results.json, tables and plots")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma list of {', '.join(TASKS)}")
    p.add_argument("--policies", default=None,
                   help="comma list of policies, each optionally tagged NAME@TAG to sweep it "
                        "again with other --policy-arg LABEL:name=value (default: every "
                        "registered policy)")
    p.add_argument("--budgets", default=None,
                   help="comma list of fractions in (0, 1] (default "
                        f"{','.join(map(str, DEFAULT_BUDGETS))}; with --quick "
                        f"{','.join(map(str, QUICK_BUDGETS))})")
    p.add_argument("--text", default=None,
                   help="UTF-8 text file that replaces the packaged texts in every task")
    p.add_argument("--task-arg", action="append", default=[], metavar="TASK:NAME=VALUE",
                   help="a task's input size, e.g. ppl:tokens=8192, ppl:docs=2, "
                        "retrieval:lengths=1024,2048 (repeatable)")
    p.add_argument("--quick", action="store_true", help="small inputs (CI: minutes, not an hour)")
    p.add_argument("--preset", choices=PRESETS,
                   help="a named sweep: stands for its arguments (flexevict/evaluation/sweep.py, "
                        "PRESETS), placed first so later flags override them")
    p.add_argument("--report", action="store_true",
                   help="run no cell: write the tables, claims and plots from the cells saved")


def budget_label(args):
    if args.budget_tokens is not None:
        return None
    return args.budget if args.budget is not None else 1.0


def run_ppl(args) -> dict:
    text = read_text(args.text)
    if args.max_tokens is not None and args.max_tokens < 2:
        raise UserError(f"--max-tokens must be >= 2 (got {args.max_tokens})")
    spec = policy_spec(args)
    llm = load_llm(args, progress=True)
    result = llm.score(text, max_tokens=args.max_tokens, policy=spec,
                       prefill_tokens=args.prefill_tokens, progress=True)
    if args.max_tokens is not None and result["tokens"] < args.max_tokens:
        print(f"note: {args.text} has {result['tokens']} tokens, fewer than --max-tokens "
              f"{args.max_tokens}: scored all {result['tokens']}", file=sys.stderr)
    print_resolved([result.pop("resolved")])
    return {"model": llm.config.name, "policy": args.policy, "budget": budget_label(args), **result}


def run_agreement(args) -> dict:
    rows = read_jsonl_prompts(args.input)
    spec = policy_spec(args)
    check_prompts(args, rows, args.max_new_tokens, args.input)
    llm = load_llm(args, progress=True)
    prompts = [r["prompt"] for r in rows]
    # exactly max_new_tokens each (no stop tokens) so both runs are compared step for step
    ref = llm.generate(prompts, args.max_new_tokens, policy=PolicySpec("full"),
                       batch_size=args.batch_size, stop_ids=(), progress=True)
    out = llm.generate(prompts, args.max_new_tokens, policy=spec, batch_size=args.batch_size,
                       stop_ids=(), progress=True)
    resolved = distinct(o["resolved"] for o in out)
    print_resolved(resolved)
    scores = compare(out, ref)
    for row, per in zip(rows, scores["per_prompt"]):
        per["id"] = row.get("id")
    return {"model": llm.config.name, "policy": args.policy, "budget": budget_label(args),
            "slots": [r["slots"] for r in resolved], "prompts": len(rows),
            "max_new_tokens": args.max_new_tokens, **scores}


def parse_fractions(spec: str, what: str) -> list[float]:
    try:
        return [float(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{what} must be a comma list of numbers (got '{spec}')") from None


def run_passkey(args) -> dict:
    from flexevict.evaluation.tasks import Passkey
    depths = parse_fractions(args.depths, "--depths")
    text = read_text(args.text) if args.text else None
    spec = policy_spec(args)
    llm = load_llm(args, progress=True)
    task = Passkey(llm, text, length=args.length, depths=depths, repeats=1, seed=args.seed)
    result = task.run(llm, spec)
    print_resolved([{"slots": result["slots"]}])
    return {"model": llm.config.name, "policy": args.policy, "budget": budget_label(args),
            "keys": task.keys, **task.settings, **result}


def model_key(args, llm) -> str:
    """What a sweep cell's model is: the name, plus the weights and dtype when not default."""
    key = llm.config.name + (f"@{args.path}" if args.path else "")
    return key + (f":{args.dtype}" if args.dtype else "")


def sweep_inputs(args) -> tuple:
    """Check every sweep argument before the model loads -> (tasks, task sizes, policies,
    budgets, text)."""
    from flexevict.evaluation.sweep import (DEFAULT_BUDGETS, QUICK_BUDGETS, parse_budgets,
                                            parse_policies, parse_task_args, parse_tasks)
    if args.policy != "full" or args.budget is not None or args.budget_tokens is not None:
        raise UserError("sweep takes --policies and --budgets (lists), not --policy, --budget "
                        "or --budget-tokens")
    names = parse_tasks(args.tasks)
    task_args = parse_task_args(args.task_arg, names)
    policies = parse_policies(args.policies, args.policy_arg)
    budgets = parse_budgets(args.budgets) if args.budgets else \
        list(QUICK_BUDGETS if args.quick else DEFAULT_BUDGETS)
    text = read_text(args.text) if args.text else None
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UserError(f"--out {args.out}: exists and is not a folder")
    missing = [m for m in missing_sweep_needs()     # all of it now, not after an hour of cells
               if text is None or m == "matplotlib"]     # --text replaces the packaged texts
    if missing:
        raise UserError(f"eval sweep needs {', '.join(missing)}, not installed; run: "
                        f"{SWEEP_INSTALL}")
    return names, task_args, policies, budgets, text


def run_sweep_cli(args) -> dict:
    from flexevict.evaluation import sweep_report as report
    from flexevict.evaluation.sweep import build_tasks, load_results, run_sweep, select
    names, task_args, policies, budgets, text = sweep_inputs(args)
    llm = load_llm(args, progress=True)
    tasks = build_tasks(names, llm, text, args.quick, task_args)
    model = model_key(args, llm)
    if args.report:
        data, ran, seconds = load_results(os.path.join(args.out, "results.json")), 0, 0.0
    else:
        data, ran, seconds = run_sweep(llm, model, tasks, policies, budgets, args.out)
    sel = select(data, model, tasks)
    write(os.path.join(args.out, "results.md"),
          report.tables(sel, tasks, sweep_note(model, tasks, args, data)))
    write(os.path.join(args.out, "claims.md"), report.claims_markdown(report.claims(sel)))
    plots = report.plots(sel, tasks, model, args.out)
    return {"model": model, "out": args.out, "cells": len(sel), "cells_run": ran,
            "seconds_this_run": seconds, "files": ["results.json", "results.md", "claims.md",
                                                   *[os.path.basename(p) for p in plots]]}


def sweep_note(model: str, tasks: list, args, data: dict) -> str:
    from flexevict.evaluation.sweep import cell_seconds
    lines = [f"Model `{model}`; text: {'`' + args.text + '`' if args.text else 'packaged'}"
             f"{' (--quick)' if args.quick else ''}. Task settings:", ""]
    lines += [f"- `{t.name}`: " + ", ".join(f"{k}={v}" for k, v in t.settings.items())
              for t in tasks]
    seconds = cell_seconds(data, model, tasks)
    lines += ["", f"Cell time: {sum(seconds.values()):,.0f} s (" +
              ", ".join(f"{name} {s:,.0f} s" for name, s in seconds.items()) +
              "): the sum of each cell's own wall seconds, whichever run or process ran it."]
    return "\n".join(lines)


def write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


RUNNERS = {"ppl": run_ppl, "agreement": run_agreement, "passkey": run_passkey,
           "sweep": run_sweep_cli}


def main(argv=None):
    from flexevict.evaluation.sweep import expand_preset
    with cli_errors("flexevict.eval"):
        argv = expand_preset(sys.argv[1:] if argv is None else list(argv))
    args = parse_args(argv)
    with cli_errors("flexevict.eval"), cpu_threads(args.threads):
        result = RUNNERS[args.task](args)
        if args.json:
            print(json.dumps(result))
        else:
            print(summary_line(args.task, result))


def summary_line(task: str, r: dict) -> str:
    if task == "ppl":
        return (f"{r['model']} policy={r['policy']} slots={r['slots']} tokens={r['tokens']} "
                f"nll={r['nll']:.4f} ppl={r['ppl']:.4f}")
    if task == "agreement":
        return (f"{r['model']} policy={r['policy']} token_agreement={r['token_agreement']:.3f} "
                f"first_divergence={r['first_divergence']:.1f} rouge_l={r['rouge_l']:.3f}")
    if task == "passkey":
        return (f"{r['model']} policy={r['policy']} slots={r['slots']} accuracy="
                f"{r['accuracy']:.3f} digit_accuracy={r['digit_accuracy']:.3f} answers="
                + ",".join(p["answer"] or "-" for p in r["per_trial"]))
    return f"{r['model']}: {r['cells']} cells in {r['out']}: " + ", ".join(r["files"])


if __name__ == "__main__":
    main()
