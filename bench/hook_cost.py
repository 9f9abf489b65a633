"""What a policy's hooks cost, apart from the model: its prefill hook and its decode hooks
(before and after attention) on one layer's bare KV buffer at the eviction-cost case's shapes
(SmolLM2-135M: batch 8 x 3 kv heads = 24 rows, head dim 64, 3 query heads per kv head; 2048
prompt tokens + 32 at a 20% budget; --prompt-len and --budget change them), run by two source
trees side by side, in alternating fresh processes, so a change's effect on the hooks shows
where a whole run's noise (+-5% on this machine) would hide it.

    git worktree add /tmp/before <commit>
    python bench/hook_cost.py --before /tmp/before --policy hashevict --out OUT

Each process times the prefill hook 4 times (the best of the last 3) and the decode hooks over
--steps (200) steps after 50 warm-up steps (their mean; each step's query drifts from the last,
as a run's do), one torch thread per core as the bench's --threads 2, in the allocator state the
engine runs in. Reports each tree's median over the rounds and after / before. In a run the
hooks are slower than here (caches the model's weights have flushed): this compares trees, it
does not price a run (the calibration does).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

ROWS, HEAD_DIM, GROUP = 24, 64, 3
PROMPT, GEN, BUDGET = 2048, 32, 0.2
WARM_STEPS = 50


def measure(policy_name: str, prompt_len: int = PROMPT, steps: int = 200,
            budget: float = BUDGET) -> dict:
    """This process's tree: {prefill_ms, decode_us} of the policy's hooks (module docstring)."""
    import torch
    from flexevict.core.kv import KVBuffer
    from flexevict.core.model import attend
    from flexevict.planner.calibration import _prefill, _prompt, drifted   # calibration's
    from flexevict.policies import get_policy
    from flexevict.runtime.allocator import steady_host_allocator
    torch.set_num_threads(2)
    steady_host_allocator()
    torch.manual_seed(0)
    # the case's slots (floor(budget x (prompt + 32))), room in the layout for every step timed
    policy = get_policy(policy_name, budget_tokens=math.floor(budget * (prompt_len + GEN)))
    layout = policy.layout(prompt_len, WARM_STEPS + steps)
    buf = KVBuffer(layout, ROWS, HEAD_DIM, torch.float32, "cpu", fields=policy.fields(layout))
    buf.layer = 0
    s = prompt_len
    prompt = _prompt("cpu", torch.float32, s, ROWS, HEAD_DIM, GROUP)   # k, pos, valid, scores, q
    prefill = []
    for _ in range(4):
        start = time.perf_counter()
        _prefill(policy, buf, *prompt)
        prefill.append(time.perf_counter() - start)
    hooks, q = 0.0, torch.randn(ROWS, GROUP, HEAD_DIM)
    for step in range(WARM_STEPS + steps):
        new_k, q = torch.randn(ROWS, HEAD_DIM), drifted(q)        # as a run's, and calibration's
        slot = buf.incoming_slot()
        buf.write(slot, new_k, new_k, torch.full((ROWS,), s + step, dtype=torch.int32))
        start = time.perf_counter()
        policy.before_attention(buf, slot, q)
        spent = time.perf_counter() - start
        scored = policy.accumulates_attention
        _, probs = attend(q, buf, buf.attended(slot), HEAD_DIM ** -0.5, None, scored)
        start = time.perf_counter()
        policy.after_attention(buf, slot, probs, scored=scored)
        spent += time.perf_counter() - start
        hooks += spent if step >= WARM_STEPS else 0.0
    return {"prefill_ms": min(prefill[1:]) * 1e3, "decode_us": hooks / steps * 1e6}


def run_child(tree: str, policy: str, args) -> dict:
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", policy,
                           "--prompt-len", str(args.prompt_len), "--steps", str(args.steps),
                           "--budget", str(args.budget)],
                          cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(rows: list[dict], args) -> str:
    lines = [f"## Policy hooks, this tree (after) vs {args.before} (before)", "",
             f"One layer's bare buffer, {ROWS} rows, a {args.prompt_len}-token prompt at "
             f"{args.budget:.0%}; median of {args.rounds} alternating processes per tree.", "",
             "| policy | prefill hook ms, before / after | after / before | decode hooks us "
             "a step, before / after | after / before |", "|---|---|---|---|---|"]
    for r in rows:
        b, a = r["median"]["before"], r["median"]["after"]
        lines.append(f"| {r['policy']} | {b['prefill_ms']:.1f} / {a['prefill_ms']:.1f} | "
                     f"{a['prefill_ms'] / b['prefill_ms']:.2f} | {b['decode_us']:.1f} / "
                     f"{a['decode_us']:.1f} | {a['decode_us'] / b['decode_us']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", metavar="POLICY", help=argparse.SUPPRESS)
    ap.add_argument("--before", metavar="DIR", help="the other source tree")
    ap.add_argument("--policy", action="append", default=[], help="repeatable (default h2o)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=PROMPT)
    ap.add_argument("--steps", type=int, default=200, help="timed decode steps")
    ap.add_argument("--budget", type=float, default=BUDGET)
    ap.add_argument("--out", metavar="PREFIX", help="writes PREFIX.md and PREFIX.json")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args.prompt_len, args.steps, args.budget)))
        return
    from common import write_report
    from side_by_side import prepare
    from flexevict.errors import UserError, cli_errors
    with cli_errors("bench/hook_cost.py"):
        if not args.before or not args.out:
            raise UserError("--before DIR and --out PREFIX are required")
        if args.rounds < 1:
            raise UserError(f"--rounds must be >= 1 (got {args.rounds})")
        trees = {"before": prepare(args.before), "after": prepare(os.path.dirname(HERE))}
        rows = []
        for policy in args.policy or ["h2o"]:
            runs = {label: [] for label in trees}
            for r in range(args.rounds):
                for label, tree in (trees.items() if r % 2 == 0 else reversed(trees.items())):
                    runs[label].append(run_child(tree, policy, args))
                print(f"round {r + 1}/{args.rounds} {policy}: "
                      f"{ {k: v[-1] for k, v in runs.items()} }", file=sys.stderr)
            median = {label: {key: statistics.median(x[key] for x in v) for key in v[0]}
                      for label, v in runs.items()}
            rows.append({"policy": policy, "runs": runs, "median": median})
        write_report(args.out, report(rows, args),
                     {"before": args.before, "rounds": args.rounds, "prompt_len": args.prompt_len,
                      "steps": args.steps, "budget": args.budget, "results": rows})


if __name__ == "__main__":
    main()
