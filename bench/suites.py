"""Benchmark suites, one command each; every case runs in its own process (so peak memory is
the case's own), peers side by side in the same run.

    python bench/suites.py cpu              # runs on a CPU machine (CI-sized), vs transformers
    python bench/suites.py flexgen          # FlexGen's table on a GPU, vs FlexGen 0.1.8
    python bench/suites.py h2o              # H2O's table on a GPU (h2o 20% vs full)
    python bench/suites.py h2o-policies     # buzz, cascade, hashevict, vatp at 20%, OPT-6.7B
    python bench/suites.py bound            # weights streamed from CPU vs the PCIe bound
    python bench/suites.py recall           # recall 10% vs full at 32k, cache on the CPU
    python bench/suites.py placement-cpu    # the cost model: predicted vs measured, auto placement
    python bench/suites.py gpu --out DIR --max-minutes M   # every GPU table (bench/gpu_plan.py)
    python bench/suites.py --list

Results: DIR/<suite>/<case>_<device>.json per case and a summary DIR/<suite>_<device>.md/.json
(DIR: --out, default bench/results). A suite resumes: a case whose result is already in DIR is
read back, not run again, so a suite can run in as many pieces as a time-limited machine
allows; `--max-minutes M` starts no case after M minutes (the summary covers the cases done, and
the exit code is 3 while cases remain). FlexGen runs from its own environment outside this
tree: set FLEXGEN_PYTHON to its python (see bench/peers/README.md). Cases whose setting cannot
fit this machine record the engine's one-line memory error instead of numbers, and their peer
is not run (it would only meet the same wall, as a 150+ GB host allocation and an OOM kill).
`--case NAME` (repeatable) runs those cases, `--cut-gen-len N` overrides their cut, `--json
FILE` writes the summary there too.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
PLACEMENT_RESULTS = os.path.join(RESULTS, "placement")
sys.path.insert(0, HERE)            # bench/'s own modules, also when imported from elsewhere

from common import SEED_POLICIES, run_engine, run_json  # noqa: E402
from placement_table import PLACEMENT_LIMIT_GB, run_placement_suite  # noqa: E402

from flexevict.bench.report import write_json  # noqa: E402
from flexevict.errors import UserError, cli_errors  # noqa: E402
from flexevict.runtime.machine import device_name  # noqa: E402

# FlexGen's README table (T4 16 GB, prompt 512, gen 32): percents and batch sizes as published
FLEXGEN = {
    "opt-6.7b": ("100 0 100 0 100 0", 2, 1, []),
    "opt-6.7b-compressed": ("100 0 100 0 100 0", 72, 1, ["--compress-weight", "--compress-cache"]),
    # not in FlexGen's table: half the weights streamed from the CPU (issue: weights partly there)
    "opt-6.7b-weights-half-cpu": ("50 50 100 0 100 0", 8, 1, []),
    "opt-30b": ("20 80 0 100 0 100", 48, 3, ["--cpu-cache-compute"]),
    "opt-30b-compressed": ("0 100 0 100 0 100", 64, 8, ["--compress-cache"]),
    "opt-175b": ("0 50 0 0 0 100", 32, 8, ["--cpu-cache-compute", "--pin-weight", "0"]),
    "opt-175b-compressed": ("0 100 0 100 0 100", 48, 3, ["--compress-weight", "--compress-cache"]),
}
# H2O's committed T4 logs for OPT-30B (prompt 512, budget 20%), and its A100 6.7B 2048+2048 runs
H2O_30B = {32: [("0 100 0 100 0 100", 52, 14), ("20 80 0 100 0 100", 48, 16)],
           512: [("0 100 0 100 0 100", 52, 8), ("20 80 0 100 0 100", 40, 10)],
           1024: [("0 100 0 100 0 100", 44, 6), ("20 80 0 100 0 100", 40, 7)]}


EAGER = ["--cuda-graphs", "false"]


def case(name, model, lengths, setting, extra=(), policy=("full",), peer=None, cut=None):
    """One bench run: lengths (prompt, gen); setting (percent "w_gpu w_cpu ...", gpu batch size,
    GPU batches); policy (name,) or (name, budget); peer: what to run side by side."""
    (prompt, gen), (percent, gbs, nb) = lengths, setting
    argv = ["--model", model, "--prompt-len", str(prompt), "--gen-len", str(gen),
            "--percent", *percent.split(), "--gpu-batch-size", str(gbs),
            "--num-gpu-batches", str(nb), "--policy", policy[0], "--yes", *extra]
    if len(policy) > 1:
        argv += ["--budget", str(policy[1])]
    if cut:
        argv += ["--cut-gen-len", str(cut)]
    return {"name": name, "argv": argv, "peer": peer}


def suite_cpu():
    """CPU-sized: what runs here in minutes. SmolLM2 (real weights) in memory vs on disk; OPT
    placements; h2o vs full; each paired with transformers' generate at the same setting."""
    smol = _packaged_smollm2()
    cases = []
    for model, path in (("smollm2-135m", smol), ("opt-125m", None)):
        extra = ["--device", "cpu"] + (["--path", path] if path else [])
        hf = {"kind": "hf", "model": model, "path": path}
        for label, percent in (("memory", "100 0 100 0 100 0"), ("weights-disk", "0 0 100 0 100 0"),
                               ("weights-cpu-cache-cpu", "0 100 0 100 100 0")):
            cases.append(case(f"{model}-{label}-full", model, (128, 32), (percent, 4, 2), extra,
                              peer=hf if label == "memory" else None))
        cases.append(case(f"{model}-memory-h2o-0.2", model, (128, 32),
                          ("100 0 100 0 100 0", 4, 2), extra, policy=("h2o", 0.2)))
        cases.append(case(f"{model}-cache-cpu-compute-h2o-0.2", model, (128, 32),
                          ("100 0 0 100 100 0", 4, 2), extra + ["--cpu-cache-compute"],
                          policy=("h2o", 0.2)))
    return cases


def suite_flexgen():
    """FlexGen's table; OPT-6.7B under a T4's 16 GB (--gpu-mem-limit 16)."""
    cases = []
    for name, (percent, gbs, nb, extra) in FLEXGEN.items():
        model = "-".join(name.split("-")[:2])
        limit = ["--gpu-mem-limit", "16"]
        cut = None if model == "opt-6.7b" else 8            # FlexGen's suite projects these too
        cases.append(case(name, model, (512, 32), (percent, gbs, nb), limit + extra, cut=cut,
                          peer={"kind": "flexgen"}))
    return cases


def suite_h2o():
    cases = []
    for gen, settings in H2O_30B.items():
        for percent, gbs, nb in settings:
            tag = f"opt-30b-512+{gen}-{percent.replace(' ', '-')}-bs{gbs * nb}"
            extra = ["--cpu-cache-compute", "--gpu-mem-limit", "16"]
            for pol in (("full",), ("h2o", 0.2)):
                cases.append(case(f"{tag}-{pol[0]}", "opt-30b", (512, gen), (percent, gbs, nb),
                                  extra, policy=pol, cut=8))
    long, lengths = ["--ignore-max-positions"], (2048, 2048)
    for bs in (24, 64):
        for pol in (("full",), ("h2o", 0.2)):
            # uncut: full's step grows with the context (a projection misses the curve), and
            # h2o's one capture is paid back over the whole run
            cases.append(case(f"opt-6.7b-2048+2048-bs{bs}-{pol[0]}", "opt-6.7b", lengths,
                              ("100 0 100 0 100 0", bs, 1), long, policy=pol))
    # h2o with every step eager: its eviction share and what the graphs save, side by side
    cases.append(case("opt-6.7b-2048+2048-bs24-h2o-eager", "opt-6.7b", lengths,
                      ("100 0 100 0 100 0", 24, 1), long + EAGER, policy=("h2o", 0.2), cut=256))
    return cases


def suite_h2o_policies():
    """The seed policies at 20%, every step eager so that each one's eviction share is timed
    (graphed steps run the hooks untimed)."""
    return [case(f"opt-6.7b-2048+2048-bs24-{p}", "opt-6.7b", (2048, 2048),
                 ("100 0 100 0 100 0", 24, 1), ["--ignore-max-positions"] + EAGER,
                 policy=(p, 0.2), cut=64)
            for p in ("h2o", "buzz", "cascade", "hashevict", "vatp")]


def suite_bound():
    """Decode with every weight streamed from pinned CPU memory: the step cannot beat
    bytes per step / host-to-device bandwidth (measured in the same run); goal >= 80%."""
    return [case(f"{m}-weights-cpu-bs{b}", m, (512, 32), ("0 100 100 0 100 0", b, 1), cut=16)
            for m in ("opt-6.7b", "opt-13b") for b in (8, 32)]


AUTO_FLAGS = ["--compress-weight", "auto", "--compress-cache", "auto", "--cpu-cache-compute",
              "auto"]


def suite_placement_cpu():
    """The CPU suite at --threads 1, each result with the cost model's prediction; then per
    model and policy --percent auto (every switch auto) at the suite's batch, with no memory
    limit and under --cpu-mem-limit PLACEMENT_LIMIT_GB (bench/results/placement/)."""
    smol = _packaged_smollm2()
    cases = [{**c, "argv": c["argv"] + ["--threads", "1"], "peer": None} for c in suite_cpu()]
    for model, path in (("smollm2-135m", smol), ("opt-125m", None)):
        extra = ["--device", "cpu", "--threads", "1"] + (["--path", path] if path else [])
        cases.append(case(f"{model}-weights-disk-h2o-0.2", model, (128, 32),   # hand-written,
                          ("0 0 100 0 100 0", 4, 2), extra, policy=("h2o", 0.2)))  # fits the limit
        for pol in (("full",), ("h2o", 0.2)):
            tag = "-".join(map(str, pol))
            cases.append(case(f"{model}-auto-{tag}", model, (128, 32), ("auto", 4, 2),
                              extra + AUTO_FLAGS, policy=pol))
            cases.append(case(f"{model}-auto-{tag}-limit", model, (128, 32), ("auto", 4, 2),
                              extra + AUTO_FLAGS + ["--cpu-mem-limit", str(PLACEMENT_LIMIT_GB)],
                              policy=pol))
    # what eviction costs at a long prompt (score collection, replay, in-cache RoPE): every
    # seed policy at 20% on the eviction-cost case (bench/eviction_cost.py), and recall at its
    # 10%, one thread
    extra = ["--device", "cpu", "--threads", "1", "--path", smol]
    cases += [case(f"smollm2-135m-2048-{'-'.join(map(str, pol))}", "smollm2-135m", (2048, 32),
                   ("100 0 100 0 100 0", 8, 1), extra + ["--predict"], policy=pol)
              for pol in [("full",)] + [(name, 0.2) for name in SEED_POLICIES]
              + [("recall", 0.1)]]
    # long prompts, where prefill attention (S^2) is most of the run and a decode step attends
    # thousands of slots: full, h2o at 20% and recall at 10% at 4k tokens (batch 4) and at the
    # model's 8192 positions (batch 2: the same tokens)
    cases += [case(f"smollm2-135m-{prompt}-{'-'.join(map(str, pol))}", "smollm2-135m",
                   (prompt, gen), ("100 0 100 0 100 0", batch, 1), extra + ["--predict"],
                   policy=pol)
              for prompt, gen, batch in LONG_PROMPTS
              for pol in (("full",), ("h2o", 0.2), ("recall", 0.1))]
    return cases


# (prompt, gen, batch) of the placement suite's long-prompt cases
LONG_PROMPTS = ((4096, 32, 4), (8176, 16, 2))


def suite_recall():
    """Recall at long context with the cache on the CPU (LLaMA-3-8B shapes, 32k prompt, batch
    4): recall 10% (history on the CPU, pages fetched each step) against full attending on the
    CPU (--cpu-cache-compute) and full streaming the whole cache to the GPU every step."""
    long = ["--ignore-max-positions"]
    cache_cpu = "100 0 0 100 100 0"
    return [case(f"llama-3-8b-32768+32-bs4-{tag}", "llama-3-8b", (32768, 32), (cache_cpu, 4, 1),
                 long + extra, policy=pol, cut=16)
            for tag, pol, extra in (("recall", ("recall", 0.1), []),
                                    ("full-cpu-compute", ("full",), ["--cpu-cache-compute"]),
                                    ("full-stream", ("full",), []))]


SUITES = {"cpu": suite_cpu, "placement-cpu": suite_placement_cpu, "flexgen": suite_flexgen,
          "h2o": suite_h2o,
          "h2o-policies": suite_h2o_policies, "bound": suite_bound, "recall": suite_recall}


# ---------------------------------------------------------------------------- running

def device_label() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    name = device_name(torch.device("cuda"))
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


PEER_SKIPPED = "peer skipped: engine case does not fit"
MEMORY_ERRORS = ("out of GPU memory", "out of CPU memory", "not enough disk")   # memory.py's


def does_not_fit(engine: dict) -> bool:
    """The engine's case failed its memory preflight (or ran out of memory)."""
    return any(m in engine.get("error", "") for m in MEMORY_ERRORS)


def run_case(c: dict, base: str) -> dict:
    """The engine, then its peer at the same setting unless the engine's case cannot fit."""
    engine = run_engine(c, base + ".json")
    if c["peer"] and does_not_fit(engine):
        peer = {"skipped": PEER_SKIPPED}
    else:
        peer = run_peer(c, base + ".peer.json")
    return {"case": c["name"], "command": command_of(c), "engine": engine, "peer": peer}


def prediction_table(rows: list[dict]) -> str:
    """The cost model's prediction next to the measurement for every case that ran (each bench
    result carries its `predicted`; README "Every bench run checks the model")."""
    lines = ["### Predicted vs measured (cost model)", "",
             "| case | prefill s pred / meas | decode step ms pred / meas | total tok/s pred / "
             "meas | meas / pred | calibration | bound (predicted) |", "|" + "---|" * 7]
    for r in rows:
        e = r["engine"]
        p = e.get("predicted")
        if not p:
            continue
        step = e["decode_latency_s"] / max(e["gen_len"] - 1, 1)
        cal = p["calibration"]
        tag = "synthetic" if cal["synthetic"] else "quick" if cal["quick"] else "measured"
        lines.append(f"| {r['case']} | {p['prefill_s']:.2f} / {e['prefill_latency_s']:.2f} | "
                     f"{1e3 * p['decode_step_s']:.1f} / {1e3 * step:.1f} | "
                     f"{p['throughput']:.1f} / {e['total_throughput']:.1f} | "
                     f"{e['total_throughput'] / p['throughput']:.2f} | {tag} | {p['bound']} |")
    return "\n".join(lines)


def run_peer(c: dict, out: str) -> dict | None:
    peer = c["peer"]
    if not peer:
        return None
    script = {"hf": "hf_generate.py", "flexgen": "flexgen_peer.py"}[peer["kind"]]
    argv = [sys.executable, os.path.join(HERE, "peers", script), *c["argv"], "--json", out]
    if peer.get("path"):
        argv += ["--path", peer["path"]]
    return run_json(argv, out)


def summarize(name: str, rows: list[dict]) -> str:
    head = ("| case | policy | batch | total tok/s | prefill tok/s | decode tok/s | peak GPU GB "
            "| peak RSS GB | eviction % | peer | peer total tok/s | ratio |")
    lines = [f"## {name}", "", head, "|" + "---|" * 12]
    fmt = lambda x, p=2: "n/a" if x is None else f"{x:.{p}f}"  # noqa: E731
    for r in rows:
        e, p = r["engine"], r.get("peer") or {}
        if "error" in e:
            note = p.get("skipped", p.get("error", ""))
            lines.append(f"| {r['case']} | | | error: {e['error']} | | | | | | {note} | | |")
            continue
        share = e.get("eviction_share_of_decode")
        ratio = (e["total_throughput"] / p["total_throughput"]
                 if p.get("total_throughput") else None)
        lines.append(
            f"| {r['case']} | {e['policy']['policy']} ({e['policy']['slots']} slots) "
            f"| {e['batch']} "
            f"| {fmt(e['total_throughput'])} | {fmt(e['prefill_throughput'], 1)} "
            f"| {fmt(e['decode_throughput'])} | {fmt(e['peak_gpu_mem_gb'])} "
            f"| {fmt(e['peak_cpu_rss_gb'])} | {fmt(None if share is None else 100 * share, 1)} "
            f"| {p.get('peer', p.get('error', ''))} | {fmt(p.get('total_throughput'))} "
            f"| {fmt(ratio)} |")
    return "\n".join(lines)


def h2d_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float | None:
    """Pinned host-to-device copy bandwidth in bytes/s (best of `repeats`), or None on CPU."""
    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    return nbytes / best


def bound_table(rows: list[dict], bandwidth: float | None) -> str:
    """Per decode step: bytes moved host-to-device / bandwidth vs the measured step time."""
    lines = ["host-to-device bandwidth (pinned): "
             + ("n/a (no CUDA)" if bandwidth is None else f"{bandwidth / 1e9:.2f} GB/s"), "",
             "| case | GB per decode step | bound ms | measured ms (median step) "
             "| bound / measured |",
             "|---|---|---|---|---|"]
    for r in rows:
        e = r["engine"]
        if "error" in e or bandwidth is None:
            continue
        steps = len(e["step_seconds"])
        per_step = sum(v for k, v in e["bytes_moved"].items() if k.endswith("->gpu")) / steps
        measured = sorted(e["step_seconds"][1:])[len(e["step_seconds"][1:]) // 2]
        bound = per_step / bandwidth
        lines.append(f"| {r['case']} | {per_step / 1e9:.2f} | {1e3 * bound:.1f} | "
                     f"{1e3 * measured:.1f} | {bound / measured:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("suite", nargs="?", choices=[*SUITES, "gpu"])
    ap.add_argument("--list", action="store_true", help="print the cases and their commands")
    ap.add_argument("--only", default=None, help="run the cases whose name contains this")
    ap.add_argument("--case", action="append", default=[], metavar="NAME",
                    help="run this case (exact name; repeatable)")
    ap.add_argument("--cut-gen-len", type=int, default=None, metavar="N",
                    help="run N decode steps of every selected case and project the rest")
    ap.add_argument("--out", default=None, help=f"results folder (default {RESULTS})")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the summary here")
    ap.add_argument("--max-minutes", type=float, default=None, metavar="M",
                    help="start no case after M minutes; exit code 3 while cases remain")
    ap.add_argument("--repeat", type=int, default=5, metavar="N",
                    help="placement-cpu: run every case N times, rounds over all cases, and "
                         "compare the median run of each (default 5)")
    ap.add_argument("--compare-calibration", default=None, metavar="FILE",
                    help="placement-cpu: also predict every case with this calibration file, "
                         "side by side with the one the runs used")
    ap.add_argument("--quiet-load", type=float, default=None, metavar="L",
                    help="placement-cpu: start each run once the 1-minute load average is "
                         "below L (a shared machine); the load before and after is recorded")
    args = ap.parse_args(argv)
    with cli_errors("bench/suites.py"):
        if args.max_minutes is not None and args.max_minutes <= 0:
            raise UserError(f"--max-minutes {args.max_minutes}: must be > 0")
        if args.suite == "gpu" and args.list:
            from gpu_plan import list_plan
            return list_plan()
        if args.list or not args.suite:
            for n in ([args.suite] if args.suite else list(SUITES)):
                for c in SUITES[n]():
                    print(f"{n}/{c['name']}: python -m flexevict.bench {' '.join(c['argv'])}"
                          + (f"   [peer: {c['peer']['kind']}]" if c["peer"] else ""))
            return
        if args.suite == "gpu":
            from gpu_plan import run_plan
            sys.exit(run_plan(args.out or RESULTS, args.max_minutes, args.only))
        if args.suite == "placement-cpu":
            return run_placement_suite(select(args), args.out or PLACEMENT_RESULTS, args.repeat,
                                       args.compare_calibration, args.quiet_load)
        rows, left = run_suite(args.suite, select(args), args.out or RESULTS, args.json,
                               args.max_minutes)
    if left:
        print(f"[{args.suite}] stopped after {args.max_minutes:g} minutes with {len(left)} "
              f"case(s) left: {', '.join(left)}; run the same command again to go on",
              file=sys.stderr)
        sys.exit(3)


def select(args) -> list[dict]:
    """The suite's cases that --only / --case pick, with --cut-gen-len applied."""
    cases = SUITES[args.suite]()
    unknown = set(args.case) - {c["name"] for c in cases}
    if unknown:
        raise UserError(f"--case {', '.join(sorted(unknown))}: not in suite '{args.suite}' "
                        f"(see `python bench/suites.py {args.suite} --list`)")
    cases = [c for c in cases if (not args.only or args.only in c["name"])
             and (not args.case or c["name"] in args.case)]
    if args.cut_gen_len is not None:
        if args.cut_gen_len < 1:
            raise UserError(f"--cut-gen-len {args.cut_gen_len}: must be >= 1")
        for c in cases:
            argv = c["argv"]
            if "--cut-gen-len" in argv:
                i = argv.index("--cut-gen-len")
                del argv[i:i + 2]
            argv += ["--cut-gen-len", str(args.cut_gen_len)]
    return cases


def run_suite(suite: str, cases: list[dict], out: str, summary_json: str | None = None,
              max_minutes: float | None = None) -> tuple[list[dict], list[str]]:
    """Run the cases one process each, reading back those whose result is already in `out`
    -> (rows done, names of the cases left when `max_minutes` ran out). Writes each case's
    row as out/suite/<case>_<device>.json, the table out/suite_device.md and the summary
    out/suite_device.json (and summary_json)."""
    dev = device_label()
    folder = os.path.join(out, suite)
    os.makedirs(folder, exist_ok=True)
    start, rows, left = time.monotonic(), [], []
    for c in cases:
        base = os.path.join(folder, f"{c['name']}_{dev}")
        done = read_row(base + ".row.json", c)
        if done is not None:
            print(f"[{suite}] {c['name']}: already in {folder}", file=sys.stderr, flush=True)
            rows.append(done)
            continue
        if max_minutes is not None and time.monotonic() - start >= 60 * max_minutes:
            left.append(c["name"])
            continue
        print(f"[{suite}] {c['name']}", file=sys.stderr, flush=True)
        rows.append(run_case(c, base))
        write_json(base + ".row.json", rows[-1])
        print(summarize(suite, rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    table = summarize(f"{suite} on {dev}", rows) + "\n\n" + prediction_table(rows)
    summary = {"suite": suite, "device": dev, "cases": rows, "cases_left": left}
    if suite == "bound":
        bandwidth = h2d_bandwidth()
        table += "\n\n" + bound_table(rows, bandwidth)
        summary["h2d_bandwidth"] = bandwidth
    summary["table"] = table
    with open(os.path.join(out, f"{suite}_{dev}.md"), "w") as f:
        f.write(table + "\n")
    for path in filter(None, (os.path.join(out, f"{suite}_{dev}.json"), summary_json)):
        write_json(path, summary)
    print(table)
    return rows, left


def read_row(path: str, c: dict) -> dict | None:
    """The row of a case run before with the same command, or None (none, another command,
    or a file cut short)."""
    try:
        with open(path) as f:
            row = json.load(f)
    except (OSError, ValueError):
        return None
    return row if row.get("command") == command_of(c) else None


def command_of(c: dict) -> str:
    return "python -m flexevict.bench " + " ".join(c["argv"])


def _packaged_smollm2():
    from flexevict.io.packaged import smollm2_gguf
    return smollm2_gguf()


if __name__ == "__main__":
    main()
