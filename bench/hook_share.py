"""Each policy's share of a decode step, measured differentially: the same engine run with a
policy P and with "P without hooks", side by side in one process (issue "Decode attention at
the memory bound", item 3: each seed policy's hooks at most 5% of a replayed step).

    python bench/hook_share.py --cuda-graphs --out bench/results/hook_share_h200    # a GPU
    python bench/hook_share.py --model opt-125m --prompt-len 256 --gen-len 64 \\
        --gpu-batch-size 4 --policy h2o --device cpu --out /tmp/hook_share_cpu

Why differential. The engine times the hooks with a pair of CUDA events around each eager hook
call (`EvictionClock`, flexevict/runtime/engine.py). A replayed CUDA graph is one launch of the
whole step's kernels: no event can sit between them, so a replay's hooks cannot be timed
apart. The whole replayed step can be timed; so every policy P runs twice on one engine (its
weights made once), as itself and as `without_hooks(P)`, and

    share = 1 - median(step without hooks) / median(step with hooks)

over the decode steps that ran graphed, after the first SETTLE of every run (first use of a
kernel, graph captures). Where no step ran graphed (a CPU, which never graphs; a policy that is
not graph-safe; --cuda-graphs false) every decode step after the first SETTLE counts, the
output says the steps were eager, and the goal is not checked. The two runs alternate for
--rounds rounds (P first in odd rounds, the variant first in even ones) so that a drift of the
machine hits both alike; each median pools the counted steps of every round.

A run is `python -m flexevict.bench`'s (flexevict/bench/throughput.py `prepare`, `load_engine`,
`warm_up`): dummy weights, everything on the compute device (--percent 100 0 100 0 100 0, one
GPU batch), random prompts, its warm-up with a fresh policy of the kind under test, --cut-gen-len
token steps run under the budget of --gen-len, positions wrapping past the model's limit
(--ignore-max-positions: timing only).

"P without hooks" is a subclass of P's class made here, not in the library, with P's dataclass
fields: its layout, fields, prefill, logit scale, name and its graph_safe, graph_safe_filling
and stacks flags are P's. It changes (DISABLED):
- before_attention and after_attention (observe, and commit for a layer's own buffer) do
  nothing, and accumulates_attention is False, so attention writes no scores;
- commit does nothing: the engine calls it once per decode step for a stacked cache
  (`Engine._commit_stacks`, the CPU reference path's kv.LayerRows);
- replay_host does nothing: the host part BUZZ runs after each replayed step
  (`KVBuffer.replay_host`, flexevict/runtime/graphs.py), which moves its counts as commit would.

Limits. It measures what removing the hooks saves, not the hooks' own kernel time: what they
overlapped with (host work of an eager step hidden under the GPU's, kernels sharing the GPU)
is lost with them, and what they disturbed (caches, the allocator) is spared. Without commits
a buffer stays as the prefill left it: a buffer still filling (BUZZ's middle, which fills and
is sampled down again) attends fewer slots than P's does, so that share also counts attention
over the extra slots; the table gives the slots each attends by the layout's rule
(`Layout.held`, before a GPU rounds a filling span up to FILL_SPAN). Keys cached before RoPE
(`rope_in_cache`) are rotated to their ranks in both runs: the layout's, not a hook (OPT has
learned positions: none here). A model's sliding-window layers keep their own window ring.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import SEED_POLICIES, write_report  # noqa: E402

from flexevict.cli import str2bool  # noqa: E402
from flexevict.errors import UserError, cli_errors  # noqa: E402

POLICIES = SEED_POLICIES + ("recall",)
GOAL = 0.05                 # hooks at most 5% of a replayed step
SETTLE = 2                  # decode steps of every run left out: kernels' first use, captures
SEED = 0                    # dummy weights and prompts, as the bench's default
DISABLED = ("before_attention", "after_attention", "commit", "replay_host")
LABELS = ("with", "without")


def _nothing(self, *args, **kwargs) -> None:
    """A disabled hook (`without_hooks`)."""


def without_hooks(policy):
    """`policy` without its decode-step hooks: an instance of a subclass of its class, made
    here, from its dataclass fields, whose DISABLED members do nothing and whose attention
    writes no scores (accumulates_attention False); all else is the policy's (docstring)."""
    cls = type(policy)
    members = {name: _nothing for name in DISABLED}
    bare = type(f"{cls.__name__}WithoutHooks", (cls,),
                {**members, "accumulates_attention": False, "__module__": __name__,
                 "__doc__": f"{cls.__name__} without its decode hooks (bench/hook_share.py)."})
    return bare(**{f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)
                   if f.init})


def bench_args(args, policy: str):
    """The flags of `python -m flexevict.bench` for a run of `policy` (its parsed Namespace)."""
    from flexevict.bench.throughput import parse_args
    return parse_args(["--model", args.model, "--prompt-len", str(args.prompt_len),
                       "--gen-len", str(args.gen_len), "--cut-gen-len", str(args.cut_gen_len),
                       "--gpu-batch-size", str(args.gpu_batch_size), "--device", args.device,
                       "--cuda-graphs", str(args.cuda_graphs), "--policy", policy,
                       "--budget", str(args.budget), "--seed", str(SEED),
                       "--ignore-max-positions", "--yes"])


def timed_run(engine, s, args, bare: bool) -> dict:
    """One run on the loaded engine of a fresh policy of the prepared run `s` (throughput's
    `Setup`), without its hooks when `bare`: the bench's warm-up, then the prefill and
    s.steps - 1 decode steps -> every token step's seconds (prefill first) and whether it ran
    graphed, the engine's own clock of the eager steps' hooks (seconds, share), and the
    slots a counted step attends (`attended`)."""
    from flexevict.bench.throughput import eviction_share, greedy, random_prompts, warm_up
    adapt = without_hooks if bare else None
    warm_up(engine, s.spec, s.n, args.prompt_len, args.gen_len, SEED, adapt)
    policy = s.spec.make()
    run = engine.run(random_prompts(s.config, s.n, args.prompt_len, SEED), s.steps,
                     without_hooks(policy) if bare else policy, greedy,
                     plan_steps=args.gen_len, wrap_positions=True)
    st = run.stats
    out = {"step_seconds": st.step_seconds, "graphed": st.graphed,
           "graph_captures": st.graph_captures, "clock_eviction_s": st.eviction_seconds,
           "clock_share": eviction_share(st), "attended": attended(run.layout, s.steps - 1, bare)}
    out["median_ms"] = 1e3 * statistics.median(t for t, _ in counted(out))
    return out


def attended(layout, decode_steps: int, bare: bool) -> float:
    """Mean slots a counted decode step attends, by the layout's rule (`Layout.held`): P's
    buffer grows or saws with its commits; without them it stays as the prefill left it."""
    if bare:
        return float(layout.held(0)[0] + 1)
    return statistics.fmean(layout.attended_per_step(decode_steps)[SETTLE:])


def counted(run: dict) -> list[tuple[float, bool]]:
    """A run's decode steps the share is taken over, (seconds, graphed) each: after the first
    SETTLE, the graphed ones where any ran graphed, else all of them."""
    decode = list(zip(run["step_seconds"][1:], run["graphed"][1:]))[SETTLE:]
    if any(g for _, g in decode):
        return [(t, g) for t, g in decode if g]
    return decode


def summarise(name: str, slots: int, runs: dict) -> dict:
    """One policy's row from its runs {"with": [timed_run, ...], "without": [...]}: medians
    in ms, the share, counted and graphed steps, and the goal (None where not replayed)."""
    steps = {label: [x for r in runs[label] for x in counted(r)] for label in LABELS}
    median_ms = {label: 1e3 * statistics.median(t for t, _ in steps[label]) for label in LABELS}
    graphed = {label: sum(g for _, g in steps[label]) for label in LABELS}
    replayed = all(graphed[label] == len(steps[label]) > 0 for label in LABELS)
    share = 1 - median_ms["without"] / median_ms["with"]
    clock = [r["clock_share"] for r in runs["with"] if r["clock_share"] is not None]
    return {"policy": name, "slots": slots, "median_step_ms": median_ms, "share": share,
            "steps_counted": {label: len(steps[label]) for label in LABELS},
            "graphed_steps": graphed, "replayed": replayed,
            "goal_met": share <= GOAL if replayed else None,
            "clock_share_eager": statistics.fmean(clock) if clock else None,
            "attended_slots": {label: runs[label][0]["attended"] for label in LABELS},
            "runs": runs}


def policy_row(engine, name: str, s, args) -> dict:
    """`summarise` of --rounds alternating pairs of runs of policy `name` (`timed_run`)."""
    from flexevict.runtime.memory import out_of_memory
    runs = {label: [] for label in LABELS}
    for r in range(args.rounds):
        for label in (LABELS if r % 2 == 0 else LABELS[::-1]):
            with out_of_memory(s.plan, s.device, s.limit):
                runs[label].append(timed_run(engine, s, args, bare=label == "without"))
            last = runs[label][-1]
            print(f"{name} round {r + 1}/{args.rounds}, {label} hooks: median "
                  f"{last['median_ms']:.2f} ms over {len(counted(last))} steps "
                  f"({sum(last['graphed'][1:])} graphed)", file=sys.stderr, flush=True)
    return summarise(name, s.policy.layout(args.prompt_len, args.gen_len).slots, runs)


def measure(args) -> dict:
    """Every policy's row on one engine -> the JSON: the machine at the top level (device,
    torch, CUDA, kernels, commit), the settings and the rows. Every policy's run is checked
    (memory, budget) before the weights are made."""
    from flexevict.bench.throughput import load_engine, prepare
    from flexevict.cli import cpu_threads
    from flexevict.runtime.machine import run_metadata
    from flexevict.runtime.memory import out_of_memory
    flags = {p: bench_args(args, p) for p in args.policy or POLICIES}
    with cpu_threads(next(iter(flags.values())).threads):
        setups = {p: prepare(f) for p, f in flags.items()}
        first = next(iter(setups.values()))
        with out_of_memory(first.plan, first.device, first.limit):
            engine, load_s = load_engine(first, SEED)
        try:
            rows = [policy_row(engine, p, s, args) for p, s in setups.items()]
        finally:
            engine.close()
    settings = {"model": args.model, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
                "steps": first.steps, "batch": first.n, "budget": args.budget,
                "rounds": args.rounds, "cuda_graphs": args.cuda_graphs, "settle": SETTLE,
                "goal": GOAL, "dtype": str(first.dtype).replace("torch.", ""),
                "weights_load_s": load_s, "disabled": list(DISABLED)}
    return {**run_metadata(first.device), "settings": settings, "results": rows}


def report(data: dict, heading: str = "## Policy hooks' share of a decode step") -> str:
    """The table (PREFIX.md, and the GPU plan's hook-share table) from `measure`'s JSON."""
    s, rows = data["settings"], data["results"]
    pct = lambda x: "n/a" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    goal = {True: "yes", False: "**no**", None: "n/a (eager)"}
    if all(r["replayed"] for r in rows):
        how = (f"over the replayed (CUDA graph) decode steps after the first {s['settle']} of "
               f"each of {s['rounds']} round(s)")
    else:
        how = (f"over the decode steps after the first {s['settle']} of each of {s['rounds']} "
               "round(s), the graphed ones where a run replayed any, else all; where none ran "
               "graphed (a CPU never graphs) the steps were eager, and the goal, about replayed "
               "steps, is not checked")
    lines = [f"{heading}: {s['model']}, {s['prompt_len']} + "
             f"{s['gen_len']} ({s['steps']} token steps run), batch {s['batch']}, budget "
             f"{s['budget']}, {s['dtype']}, {data['device']}", "",
             f"share = 1 - median step without hooks / median step with hooks, {how}. Clock "
             "share: the engine's own clock around the eager steps' hooks (`EvictionClock`).",
             "",
             "| policy | slots | step ms, hooks | step ms, no hooks | hook share | steps counted "
             "| graphed | clock share (eager) | attended slots, hooks / none | goal <= "
             f"{100 * s['goal']:.0f}% |", "|" + "---|" * 10]
    for r in rows:
        ms, n, g, a = (r["median_step_ms"], r["steps_counted"], r["graphed_steps"],
                       r["attended_slots"])
        lines.append(f"| {r['policy']} | {r['slots']} | {ms['with']:.2f} | {ms['without']:.2f} "
                     f"| {pct(r['share'])} | {n['with']} / {n['without']} | {g['with']} / "
                     f"{g['without']} | {pct(r['clock_share_eager'])} | {a['with']:.0f} / "
                     f"{a['without']:.0f} | {goal[r['goal_met']]} |")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="opt-6.7b", help="registry name, as the bench's")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--gen-len", type=int, default=2048, help="the budget's generated tokens")
    ap.add_argument("--cut-gen-len", type=int, default=64, help="token steps run")
    ap.add_argument("--gpu-batch-size", type=int, default=24)
    ap.add_argument("--policy", action="append", default=[],
                    help=f"repeatable (default: {', '.join(POLICIES)})")
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--rounds", type=int, default=3, help="alternating pairs of runs")
    ap.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (default: cuda if any)")
    ap.add_argument("--cuda-graphs", type=str2bool, nargs="?", const=True, default=True,
                    help="replay the steady decode steps as CUDA graphs (default true)")
    ap.add_argument("--out", metavar="PREFIX", help="writes PREFIX.md and PREFIX.json")
    ap.add_argument("--json", metavar="FILE", help="also the JSON there (the GPU plan's)")
    return ap.parse_args(argv)


def check(args) -> None:
    """Bad flags as one line before anything is prepared or loaded."""
    from flexevict.policies import PolicySpec
    if not 0 < args.budget <= 1:
        raise UserError(f"--budget must be in (0, 1] (got {args.budget})")
    for name in args.policy:
        PolicySpec.parse(name, args.budget)            # an unknown name is one line
    if args.rounds < 1:
        raise UserError(f"--rounds must be >= 1 (got {args.rounds})")
    if min(args.prompt_len, args.gpu_batch_size) < 1:
        raise UserError("--prompt-len and --gpu-batch-size must be >= 1")
    if min(args.cut_gen_len, args.gen_len) < SETTLE + 2:
        raise UserError(f"--cut-gen-len and --gen-len must be >= {SETTLE + 2}: the prefill, "
                        f"{SETTLE} decode steps left out and at least one counted")


def main(argv=None):
    args = parse_args(argv)
    with cli_errors("bench/hook_share.py"):
        check(args)
        data = measure(args)
        text = report(data)
        if args.out:
            write_report(args.out, text, data)
        else:
            print(text)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()
