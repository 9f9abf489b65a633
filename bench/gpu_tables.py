"""The GPU plan's tables (bench/gpu_plan.py): one per group of steps, every ratio between steps
of one run on one machine.

    python bench/gpu_tables.py DIR     # the tables again from DIR/gpu/<step>_<device>.json
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics


def tables(rows: list[dict], meta: dict) -> str:
    head = (f"# GPU plan on {meta['device']} (driver {meta['driver']}, torch {meta['torch']}, "
            f"CUDA {meta['cuda']}, {meta['cpu_cores']} cores, {meta['host_memory_gib']} GiB "
            f"host memory, commit {meta['commit']})")
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["group"], []).append(r)
    parts = [head]
    for group, members in groups.items():
        if group in ("correctness", "calibration", "kernels"):
            parts.append(command_table(group, members))
        elif group == "hook-share":
            parts.append(hook_share_table(group, members))
        else:
            parts.append(run_table(group, members))
    return "\n\n".join(parts)


def command_table(group: str, rows: list[dict]) -> str:
    lines = [f"## {group}", "", "| step | seconds | exit | result |", "|---|---|---|---|"]
    for r in rows:
        res = r.get("result")
        if isinstance(res, dict) and "summary" in res:            # the kernels' JSON
            what = "; ".join(f"{k}: {v:.4g}" for k, v in res["summary"].items())
        elif isinstance(res, dict) and "rows" in res:             # bench/dummy_weights.py
            what = "; ".join(f"{row['shape']} {row['dtype']}: {row['gb_per_s']['after']:.1f} "
                             "GB/s" for row in res["rows"])
        elif isinstance(res, dict) and "tests" in res:            # JUnit counts
            what = ", ".join(f"{k} {v}" for k, v in res.items())
        else:
            what = "done" if res is None else "written"
        if "error" in r:
            what += f"; error: {r['error']}"
        lines.append(f"| {r['step']} | {r['seconds']} | {r['rc']} | {what} |")
    return "\n".join(lines)


def hook_share_table(group: str, rows: list[dict]) -> str:
    """bench/hook_share.py's own table of each step's result (its `report`), or its error."""
    from hook_share import report
    parts = []
    for r in rows:
        res = r.get("result")
        if isinstance(res, dict) and "results" in res and "error" not in r:
            parts.append(report(res, f"## {group} ({r['step']}, {r['seconds']} s)"))
        else:
            parts.append(f"## {group}\n\n{r['step']}: error: {r.get('error', 'no result')} "
                         f"({r['seconds']} s)")
    return "\n\n".join(parts)


def median_step_ms(e: dict) -> float | None:
    steps = e.get("step_seconds") or []
    return 1e3 * statistics.median(steps[1:] or steps) if steps else None


def placement_of(e: dict) -> str:
    p = e.get("placement")
    if not isinstance(p, dict):
        return ""
    percent = " ".join(str(p.get(k, "")) for k in ("w_gpu", "w_cpu", "cache_gpu", "cache_cpu",
                                                  "act_gpu", "act_cpu"))
    flags = [k for k in ("cpu_cache_compute", "compress_weight", "compress_cache") if p.get(k)]
    return f"{percent} {p.get('gpu_batch_size')}x{p.get('num_gpu_batches')} {' '.join(flags)}"


def run_table(group: str, rows: list[dict]) -> str:
    """Engine and FlexGen rows of one workload, each with its ratio to the group's baseline
    (FlexGen where it ran, else flexevict `full`) and its prediction."""
    base = next((r["result"]["total_throughput"] for r in rows
                 if r["kind"] == "flexgen" and r.get("result")), None)
    base_name = "FlexGen"
    if base is None:
        base = next((r["result"]["total_throughput"] for r in rows
                     if r.get("result") and r["step"].endswith("-full")), None)
        base_name = "full"
    fmt = lambda x, p=2: "" if x is None else f"{x:.{p}f}"  # noqa: E731
    lines = [f"## {group}", "", f"| step | placement | batch | prefill s | median step ms | "
             f"total tok/s | vs {base_name} | predicted tok/s | meas / pred | peak GPU GB | "
             "peak RSS GB | weights made s | graphs | wall s |", "|" + "---|" * 14]
    for r in rows:
        e = r.get("result")
        if e is None or "error" in r:
            lines.append(f"| {r['step']} | error: {r.get('error', '')} |" + " |" * 12)
            continue
        pred = (e.get("predicted") or {}).get("throughput")
        tput = e.get("total_throughput")
        batch = e.get("batch") or _flexgen_batch(r)
        lines.append(
            f"| {r['step']} | {placement_of(e) or 'as given'} | {batch} "
            f"| {fmt(e.get('prefill_latency_s'))} | {fmt(median_step_ms(e), 1)} | {fmt(tput)} "
            f"| {fmt(tput / base if tput and base else None)} | {fmt(pred)} "
            f"| {fmt(tput / pred if tput and pred else None)} | {fmt(e.get('peak_gpu_mem_gb'))} "
            f"| {fmt(e.get('peak_cpu_rss_gb'))} | {fmt(e.get('weights_load_s'), 1)} "
            f"| {e.get('graph_captures', '')} | {r['seconds']} |")
    return "\n".join(lines)


def _flexgen_batch(r: dict) -> int | None:
    words = r["command"].split()
    try:
        return (int(words[words.index("--gpu-batch-size") + 1])
                * int(words[words.index("--num-gpu-batches") + 1]))
    except (ValueError, IndexError):
        return None


def rebuild(out: str) -> str:
    """The tables of the plan's results under `out` (every step row in out/gpu, or in `out`
    itself as in a committed run's folder, in the plan's order)."""
    from gpu_plan import steps
    folder = os.path.join(out, "gpu") if os.path.isdir(os.path.join(out, "gpu")) else out
    rows = []
    for path in glob.glob(os.path.join(folder, "*.json")):
        if not path.endswith(".result.json"):
            with open(path) as f:
                row = json.load(f)
            if "step" in row:
                rows.append(row)
    if not rows:
        raise SystemExit(f"{out}: no GPU plan step results there (<step>_<device>.json)")
    order = {s.name: i for i, s in enumerate(steps())}
    rows.sort(key=lambda r: order.get(r["step"], len(order)))
    return tables(rows, rows[0])


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="a GPU plan's results folder (its gpu/ or a committed copy)")
    print(rebuild(ap.parse_args().out))
