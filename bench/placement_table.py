"""The placement suite's tables (`python bench/suites.py placement-cpu`): the cost model's
predictions against measured runs, `--percent auto` against the best hand-written setting, and
what a KV budget does to the largest feasible batch and the predicted throughput.

    python bench/placement_table.py [RESULTS.json]   # the tables again, from a suite's results

With `--compare-calibration FILE` (suites.py placement-cpu) every case is also predicted with
that calibration, for the run's placement: two calibrations judged on the same measured runs.

Every case runs --repeat times (rounds over all cases, so a disturbance of the shared machine
hits different cases in different rounds) and its median run is compared (the calibration, too,
keeps the median of its rounds: both describe the machine as it typically is). Results go to
bench/results/placement/: predicted_vs_measured_cpu.md/.json and cases/<case>.json (the median
run's bench JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

from common import run_engine

# --cpu-mem-limit (GiB) of the placement suite's tight cases: below what the all-in-memory setting
# of the CPU suite holds (about 1.0 GiB for both models), above what weights on disk hold
PLACEMENT_LIMIT_GB = 0.8

WITHIN = 0.20              # predicted vs measured total throughput: the goal
AUTO_VS_HAND = 0.95        # auto's measured throughput vs the best hand-written setting's


def run_placement_suite(cases: list[dict], out: str, repeats: int = 5,
                        compare: str | None = None, quiet_load: float | None = None
                        ) -> list[dict]:
    """Run the cases (module docstring); compare: another calibration file to predict every
    case with, side by side with the one the runs used; quiet_load: start each run only once
    the 1-minute load average is below it (a shared machine), and record it before and after."""
    if repeats < 1:
        raise SystemExit("--repeat must be >= 1")
    folder = os.path.join(out, "cases")
    scratch = os.path.join(out, "cases", "runs")
    os.makedirs(scratch, exist_ok=True)
    runs = {c["name"]: [] for c in cases}
    for r in range(repeats):
        for c in cases:
            path = os.path.join(scratch, f"{c['name']}.{r}.json")
            before = wait_quiet(quiet_load)
            res = run_engine(c, path)
            res["load_average"] = [before, os.getloadavg()[0]]
            runs[c["name"]].append((res, path))
            tput = res.get("total_throughput")
            print(f"[placement round {r + 1}/{repeats}] {c['name']}: "
                  + (f"{tput:.2f} token/s" if tput else res.get("error", "?"))
                  + f" (load {before:.2f} -> {os.getloadavg()[0]:.2f})",
                  file=sys.stderr, flush=True)
    rows = []
    for c in cases:
        ok = sorted(((res, p) for res, p in runs[c["name"]] if "error" not in res),
                    key=lambda rp: rp[0]["total_throughput"])
        if ok:
            median, path = ok[(len(ok) - 1) // 2]          # the lower median of an even count
            shutil.copy(path, os.path.join(folder, f"{c['name']}.json"))
        else:
            median = runs[c["name"]][0][0]
        rows.append(row(c, median, [res.get("total_throughput") for res, _ in runs[c["name"]]],
                        compare))
        rows[-1]["load_average"] = [res.get("load_average") for res, _ in runs[c["name"]]]
    shutil.rmtree(scratch)
    budget = budget_rows()
    text = tables(rows, budget, repeats)
    with open(os.path.join(out, "predicted_vs_measured_cpu.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out, "predicted_vs_measured_cpu.json"), "w") as f:
        json.dump({"repeats": repeats, "within": WITHIN, "limit_gb": PLACEMENT_LIMIT_GB,
                   "cases": rows, "budget": budget, "table": text}, f, indent=1)
    print(text)
    return rows


def wait_quiet(below: float | None, poll_s: float = 10.0) -> float:
    """Wait until the 1-minute load average is below `below` (None: no wait) -> the load
    average when the run starts."""
    while below is not None and os.getloadavg()[0] >= below:
        time.sleep(poll_s)
    return os.getloadavg()[0]


def row(c: dict, r: dict, totals: list, compare: str | None = None) -> dict:
    """One case's comparison from its median run r (a bench result JSON), and with
    `compare` (a calibration file) its prediction for the same run under that calibration."""
    argv = c["argv"]
    limit = float(argv[argv.index("--cpu-mem-limit") + 1]) if "--cpu-mem-limit" in argv else None
    out = {"case": c["name"], "command": "python -m flexevict.bench " + " ".join(argv),
           "auto": "auto" in argv, "limit_gb": limit, "totals": totals}
    if "error" in r:
        return {**out, "error": r["error"]}
    p = r["predicted"]
    step = r["decode_latency_s"] / max(r["gen_len"] - 1, 1)
    p_ = r["placement"]
    flags = [f"--percent {' '.join(map(str, p_['percent']))}"] + [
        f"--{k.replace('_', '-')}" for k in ("compress_weight", "compress_cache",
                                             "cpu_cache_compute") if p_[k]]
    ratio = r["total_throughput"] / p["throughput"]
    return {**out, "model": r["model"], "policy": r["policy"]["policy"],
            "slots": r["policy"]["slots"], "batch": r["batch"], "placement": " ".join(flags),
            "predicted": {"prefill_s": p["prefill_s"], "decode_step_s": p["decode_step_s"],
                          "total_s": p["total_s"], "throughput": p["throughput"],
                          "bound": p["bound"]},
            "measured": {"prefill_s": r["prefill_latency_s"], "decode_step_s": step,
                         "total_s": r["total_latency_s"], "throughput": r["total_throughput"]},
            "measured_over_predicted": ratio, "within": abs(ratio - 1) <= WITHIN,
            "peak_cpu_anon_gb": r["peak_cpu_anon_gb"], "peak_cpu_rss_gb": r["peak_cpu_rss_gb"],
            "calibration": p["calibration"],
            **({"compared": predicted_with(r, c, compare)} if compare else {})}


def predicted_with(r: dict, c: dict, path: str) -> dict:
    """The prediction of run r (a bench result JSON of case c) under the calibration file at
    `path`, for the placement and batch the run used -> {"calibration", "throughput",
    "measured_over_predicted", "within"}."""
    import torch
    from flexevict.api import resolve_model
    from flexevict.planner import calibration
    from flexevict.planner.costmodel import CostModel
    from flexevict.policies import PolicySpec
    from flexevict.runtime.placement import Placement
    argv = c["argv"]
    threads = int(argv[argv.index("--threads") + 1]) if "--threads" in argv else None
    config, _ = resolve_model(r["model"], r["path"])
    spec = PolicySpec.parse(r["policy"]["policy"], r["budget"], r["budget_tokens"])
    fields = {k: v for k, v in r["placement"].items() if k != "percent"}
    model = CostModel(config, calibration.read_file(path, threads), r["device"],
                      getattr(torch, r["dtype"]), r["prompt_len"], r["gen_len"], spec)
    tput = model.estimate(Placement(**fields), r["batch"]).throughput
    ratio = r["total_throughput"] / tput
    return {"calibration": path, "throughput": tput, "measured_over_predicted": ratio,
            "within": abs(ratio - 1) <= WITHIN}


def budget_rows() -> list[dict]:
    """Predictions only: under one memory limit, the largest batch that fits with every
    weight and the cache in memory, and the best plan the search finds, for full and a 20%
    budget. OPT-6.7B 2048 + 2048 on an 80 GB GPU is H2O's setting (synthetic H100)."""
    import torch
    from flexevict.planner import calibration, search as P
    from flexevict.api import resolve_model
    from flexevict.core.config import DTYPES, default_dtype
    from flexevict.planner.costmodel import CostModel
    from flexevict.runtime.memory import GIB
    from flexevict.runtime.placement import Placement
    from flexevict.policies import PolicySpec
    h100 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "placement",
                        "calibration_h100_synthetic.json")
    here = calibration.load(torch.device("cpu"), 1)
    settings = [("smollm2-135m", 128, 32, "cpu", here, P.Limits(cpu=2 * GIB), "CPU 2 GiB"),
                ("smollm2-135m", 1024, 1024, "cpu", here, P.Limits(cpu=2 * GIB), "CPU 2 GiB"),
                ("opt-6.7b", 2048, 2048, "cuda", calibration.read_file(h100),
                 P.Limits(gpu=80 * GIB, cpu=128 * GIB), "GPU 80 GiB (synthetic H100)")]
    rows = []
    for model, prompt, gen, device, cal, limits, what in settings:
        config, _ = resolve_model(model, "_DUMMY_")
        dtype = DTYPES[default_dtype(device)]
        for pol in (("full", None), ("h2o", 0.2)):
            m = CostModel(config, cal, device, dtype, prompt, gen, PolicySpec.parse(*pol))
            fits = [g for g in P.GPU_BATCH_SIZES
                    if m.memory_plan(Placement(gpu_batch_size=g), g).overflow(
                        device, limits.gpu, limits.cpu) is None]
            best = P.search(m, P.PlacementRequest(percent=None, gpu_batch_size=None,
                                         num_gpu_batches=None), limits, top=1).best
            rows.append({"model": model, "prompt_len": prompt, "gen_len": gen, "limit": what,
                         "policy": pol[0] if pol[1] is None else f"{pol[0]} {pol[1]}",
                         "slots": m.slots, "largest_batch_in_memory": max(fits, default=0),
                         "best_plan": P.flags(best.placement), "best_batch": best.n,
                         "best_throughput": best.throughput})
    return rows


def tables(rows: list[dict], budget: list[dict], repeats: int) -> str:
    fmt = lambda x, p=3: "n/a" if x is None else f"{x:.{p}f}"  # noqa: E731
    good = [r for r in rows if "error" not in r and not r["auto"]]
    lines = ["## Predicted vs measured, CPU suite at --threads 1", "",
             f"Median of {repeats} runs per case (rounds over all cases); the prediction is the "
             "cost model's for the case's placement with this machine's calibration. Goal: "
             f"measured total throughput within {100 * WITHIN:.0f}% of the prediction.", "",
             "| case | policy (slots) | batch | placement | prefill s pred / meas | decode step "
             "ms pred / meas | total tok/s pred | total tok/s meas (all runs) | meas / pred | "
             "within | bound (predicted) |", "|" + "---|" * 11]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | | | | | | | error: {r['error']} | | | |")
            continue
        p, m = r["predicted"], r["measured"]
        lines.append(
            f"| {r['case']} | {r['policy']} ({r['slots']}) | {r['batch']} | {r['placement']} "
            f"| {fmt(p['prefill_s'], 2)} / {fmt(m['prefill_s'], 2)} | "
            f"{fmt(1e3 * p['decode_step_s'], 1)} / {fmt(1e3 * m['decode_step_s'], 1)} | "
            f"{fmt(p['throughput'], 1)} | {fmt(m['throughput'], 1)} ("
            + ", ".join(fmt(t, 1) for t in r["totals"])
            + f") | {fmt(r['measured_over_predicted'], 2)} | {'yes' if r['within'] else 'NO'} "
            f"| {p['bound']} |")
    hits = sum(r["within"] for r in good)
    lines += ["", f"Hand-written cases within {100 * WITHIN:.0f}%: {hits} of {len(good)}; "
              f"auto cases: {sum(r['within'] for r in rows if 'error' not in r and r['auto'])} "
              f"of {sum(1 for r in rows if 'error' not in r and r['auto'])}.", ""]
    lines += compare_table(rows) + auto_table(rows) + [""] + budget_table(budget)
    return "\n".join(lines)


def compare_table(rows: list[dict]) -> list[str]:
    """The same runs predicted with the compared calibration (none: no lines)."""
    both = [r for r in rows if "compared" in r]
    if not both:
        return []
    lines = ["## The same runs, predicted with another calibration", "",
             f"Calibration of the runs: {both[0]['calibration']['path']}; compared: "
             f"{both[0]['compared']['calibration']}.", "",
             "| case | total tok/s meas | pred (runs') | meas / pred | pred (compared) | "
             "meas / pred | within |", "|---|---|---|---|---|---|---|"]
    for r in both:
        c = r["compared"]
        lines.append(f"| {r['case']} | {r['measured']['throughput']:.1f} | "
                     f"{r['predicted']['throughput']:.1f} | {r['measured_over_predicted']:.2f} | "
                     f"{c['throughput']:.1f} | {c['measured_over_predicted']:.2f} | "
                     f"{'yes' if c['within'] else 'NO'} |")
    for auto in (False, True):
        group = [r for r in both if r["auto"] == auto]
        lines.append(f"\n{'Auto' if auto else 'Hand-written'} cases within {100 * WITHIN:.0f}%: "
                     f"{sum(r['within'] for r in group)} of {len(group)} with the runs' "
                     f"calibration, {sum(r['compared']['within'] for r in group)} of "
                     f"{len(group)} with the compared one.")
    return lines + [""]


def auto_table(rows: list[dict]) -> list[str]:
    """--percent auto against the best hand-written setting of the same model and policy that
    fits the same memory limit (its measured peak anonymous memory under it)."""
    lines = ["## --percent auto vs the best hand-written setting", "",
             f"Same model, policy and batch (4 x 2); 'limit' cases add --cpu-mem-limit "
             f"{PLACEMENT_LIMIT_GB} GiB, and a hand-written setting qualifies there if its "
             "measured peak anonymous memory stayed under it. Goal: auto at least "
             f"{AUTO_VS_HAND:.2f}x the best hand-written setting.", "",
             "| auto case | auto placement | auto tok/s | peak anon GB | best hand-written | "
             "its tok/s | auto / hand |", "|---|---|---|---|---|---|---|"]
    for a in [r for r in rows if r["auto"]]:
        if "error" in a:
            lines.append(f"| {a['case']} | error: {a['error']} | | | | | |")
            continue
        hand = [r for r in rows if not r["auto"] and "error" not in r
                and r["model"] == a["model"] and r["policy"] == a["policy"]
                and r["batch"] == a["batch"]
                and (a["limit_gb"] is None or r["peak_cpu_anon_gb"] <= a["limit_gb"])]
        best = max(hand, key=lambda r: r["measured"]["throughput"], default=None)
        ratio = a["measured"]["throughput"] / best["measured"]["throughput"] if best else None
        lines.append(
            f"| {a['case']} | {a['placement']} | {a['measured']['throughput']:.1f} | "
            f"{a['peak_cpu_anon_gb']:.2f} | {best['case'] if best else 'none fits'} | "
            + (f"{best['measured']['throughput']:.1f} | {ratio:.2f}"
               + ("" if ratio >= AUTO_VS_HAND else " (below goal)") if best else "n/a | n/a")
            + " |")
    return lines


def budget_table(budget: list[dict]) -> list[str]:
    lines = ["## A 20% KV budget vs full under the same memory limit (predictions)", "",
             "Largest batch with weights and cache all in memory (one GPU batch), and the best "
             "plan of the search (placement and batch auto).", "",
             "| model | prompt + gen | limit | policy (slots) | largest batch in memory | "
             "best plan | its batch | predicted tok/s |", "|---|---|---|---|---|---|---|---|"]
    for b in budget:
        lines.append(f"| {b['model']} | {b['prompt_len']} + {b['gen_len']} | {b['limit']} | "
                     f"{b['policy']} ({b['slots']}) | {b['largest_batch_in_memory']} | "
                     f"{b['best_plan']} | {b['best_batch']} | {b['best_throughput']:.1f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    """Print the tables of a finished suite run (default: the committed CPU results)."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="?",
                    default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                         "results", "placement", "predicted_vs_measured_cpu.json"),
                    help="a placement suite's predicted_vs_measured_*.json "
                         "(default: the committed CPU results)")
    args = ap.parse_args(argv)
    with open(args.results) as f:
        data = json.load(f)
    print(tables(data["cases"], data["budget"], data["repeats"]))


if __name__ == "__main__":
    main()
