"""Benchmark suites, one command each; every case runs in its own process (so peak memory is
the case's own), peers side by side in the same run.

    python bench/suites.py cpu              # runs on a CPU machine (CI-sized), vs transformers
    python bench/suites.py flexgen          # FlexGen's table on a GPU, vs FlexGen 0.1.8
    python bench/suites.py h2o              # H2O's table on a GPU (h2o 20% vs full)
    python bench/suites.py h2o-policies     # buzz, cascade, hashevict, vatp at 20%, OPT-6.7B 2048+2048
    python bench/suites.py bound            # weights streamed from CPU vs the PCIe bound
    python bench/suites.py --list

Results: bench/results/<suite>/<case>_<device>.json and a summary <suite>_<device>.md/.json.
FlexGen runs from its own environment outside this tree: set FLEXGEN_PYTHON to its python
(see bench/peers/README.md). Cases whose setting cannot fit this machine record the engine's
one-line memory error instead of numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")

# FlexGen's README table (T4 16 GB, prompt 512, gen 32): percents and batch sizes as published
FLEXGEN = {
    "opt-6.7b": ("100 0 100 0 100 0", 2, 1, []),
    "opt-6.7b-compressed": ("100 0 100 0 100 0", 72, 1, ["--compress-weight", "--compress-cache"]),
    "opt-30b": ("20 80 0 100 0 100", 48, 3, ["--cpu-cache-compute"]),
    "opt-30b-compressed": ("0 100 0 100 0 100", 64, 8, ["--compress-cache"]),
    "opt-175b": ("0 50 0 0 0 100", 32, 8, ["--cpu-cache-compute", "--pin-weight", "0"]),
    "opt-175b-compressed": ("0 100 0 100 0 100", 48, 3, ["--compress-weight", "--compress-cache"]),
}
# H2O's committed T4 logs for OPT-30B (prompt 512, budget 20%), and its A100 6.7B 2048+2048 runs
H2O_30B = {32: [("0 100 0 100 0 100", 52, 14), ("20 80 0 100 0 100", 48, 16)],
           512: [("0 100 0 100 0 100", 52, 8), ("20 80 0 100 0 100", 40, 10)],
           1024: [("0 100 0 100 0 100", 44, 6), ("20 80 0 100 0 100", 40, 7)]}


def case(name, model, prompt, gen, percent, gbs, nb, extra=(), policy=("full",), peer=None,
         cut=None):
    argv = ["--model", model, "--prompt-len", str(prompt), "--gen-len", str(gen),
            "--percent", *percent.split(), "--gpu-batch-size", str(gbs),
            "--num-gpu-batches", str(nb), "--policy", policy[0], *extra]
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
            cases.append(case(f"{model}-{label}-full", model, 128, 32, percent, 4, 2, extra,
                              peer=hf if label == "memory" else None))
        cases.append(case(f"{model}-memory-h2o-0.2", model, 128, 32, "100 0 100 0 100 0", 4, 2,
                          extra, policy=("h2o", 0.2)))
        cases.append(case(f"{model}-cache-cpu-compute-h2o-0.2", model, 128, 32,
                          "100 0 0 100 100 0", 4, 2, extra + ["--cpu-cache-compute"],
                          policy=("h2o", 0.2)))
    return cases


def suite_flexgen():
    """FlexGen's table; OPT-6.7B under a T4's 16 GB (--gpu-mem-limit 16)."""
    cases = []
    for name, (percent, gbs, nb, extra) in FLEXGEN.items():
        model = "-".join(name.split("-")[:2])
        limit = ["--gpu-mem-limit", "16"]
        cut = None if model == "opt-6.7b" else 8            # FlexGen's suite projects these too
        cases.append(case(name, model, 512, 32, percent, gbs, nb, limit + extra, cut=cut,
                          peer={"kind": "flexgen"}))
    return cases


def suite_h2o():
    cases = []
    for gen, settings in H2O_30B.items():
        for percent, gbs, nb in settings:
            tag = f"opt-30b-512+{gen}-{percent.replace(' ', '-')}-bs{gbs * nb}"
            extra = ["--cpu-cache-compute", "--gpu-mem-limit", "16"]
            for pol in (("full",), ("h2o", 0.2)):
                cases.append(case(f"{tag}-{pol[0]}", "opt-30b", 512, gen, percent, gbs, nb, extra,
                                  policy=pol, cut=8))
    long = ["--ignore-max-positions"]
    for bs, pols in ((24, (("full",), ("h2o", 0.2))), (64, (("full",), ("h2o", 0.2)))):
        for pol in pols:
            cases.append(case(f"opt-6.7b-2048+2048-bs{bs}-{pol[0]}", "opt-6.7b", 2048, 2048,
                              "100 0 100 0 100 0", bs, 1, long, policy=pol, cut=64))
    return cases


def suite_h2o_policies():
    return [case(f"opt-6.7b-2048+2048-bs24-{p}", "opt-6.7b", 2048, 2048, "100 0 100 0 100 0", 24,
                 1, ["--ignore-max-positions"], policy=(p, 0.2), cut=64)
            for p in ("h2o", "buzz", "cascade", "hashevict", "vatp")]


def suite_bound():
    """Decode with every weight streamed from pinned CPU memory: the step cannot beat
    bytes per step / host-to-device bandwidth (measured in the same run); goal >= 80%."""
    return [case(f"{m}-weights-cpu-bs{b}", m, 512, 32, "0 100 100 0 100 0", b, 1, cut=16)
            for m in ("opt-6.7b", "opt-13b") for b in (8, 32)]


SUITES = {"cpu": suite_cpu, "flexgen": suite_flexgen, "h2o": suite_h2o,
          "h2o-policies": suite_h2o_policies, "bound": suite_bound}


# ---------------------------------------------------------------------------- running

def device_label() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")


def run_engine(c: dict, out: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "flexevict.bench", *c["argv"], "--json", out],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    with open(out) as f:
        return json.load(f)


def run_peer(c: dict, out: str) -> dict | None:
    peer = c["peer"]
    if not peer:
        return None
    script = {"hf": "hf_generate.py", "flexgen": "flexgen_peer.py"}[peer["kind"]]
    argv = [sys.executable, os.path.join(HERE, "peers", script), *c["argv"], "--json", out]
    if peer.get("path"):
        argv += ["--path", peer["path"]]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    with open(out) as f:
        return json.load(f)


def summarize(name: str, rows: list[dict]) -> str:
    head = ("| case | policy | batch | total tok/s | prefill tok/s | decode tok/s | peak GPU GB "
            "| peak RSS GB | eviction % | peer | peer total tok/s | ratio |")
    lines = [f"## {name}", "", head, "|" + "---|" * 12]
    fmt = lambda x, p=2: "n/a" if x is None else f"{x:.{p}f}"  # noqa: E731
    for r in rows:
        e, p = r["engine"], r.get("peer") or {}
        if "error" in e:
            lines.append(f"| {r['case']} | | | error: {e['error']} | | | | | | | | |")
            continue
        share = e.get("eviction_share_of_decode")
        ratio = (e["total_throughput"] / p["total_throughput"]
                 if p.get("total_throughput") else None)
        lines.append(
            f"| {r['case']} | {e['policy']['policy']} ({e['policy']['slots']} slots) | {e['batch']} "
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
    lines = [f"host-to-device bandwidth (pinned): "
             + ("n/a (no CUDA)" if bandwidth is None else f"{bandwidth / 1e9:.2f} GB/s"), "",
             "| case | GB per decode step | bound ms | measured ms (median step) | bound / measured |",
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
    ap.add_argument("suite", nargs="?", choices=list(SUITES))
    ap.add_argument("--list", action="store_true", help="print the cases and their commands")
    ap.add_argument("--only", default=None, help="run the cases whose name contains this")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    names = [args.suite] if args.suite else list(SUITES)
    if args.list or not args.suite:
        for n in names:
            for c in SUITES[n]():
                print(f"{n}/{c['name']}: python -m flexevict.bench {' '.join(c['argv'])}"
                      + (f"   [peer: {c['peer']['kind']}]" if c["peer"] else ""))
        return
    dev = device_label()
    folder = os.path.join(args.out, args.suite)
    os.makedirs(folder, exist_ok=True)
    rows = []
    for c in SUITES[args.suite]():
        if args.only and args.only not in c["name"]:
            continue
        print(f"[{args.suite}] {c['name']}", file=sys.stderr, flush=True)
        base = os.path.join(folder, f"{c['name']}_{dev}")
        rows.append({"case": c["name"], "command": "python -m flexevict.bench " + " ".join(c["argv"]),
                     "engine": run_engine(c, base + ".json"),
                     "peer": run_peer(c, base + ".peer.json")})
        print(summarize(args.suite, rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    table = summarize(f"{args.suite} on {dev}", rows)
    if args.suite == "bound":
        table += "\n\n" + bound_table(rows, h2d_bandwidth())
    with open(os.path.join(args.out, f"{args.suite}_{dev}.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(args.out, f"{args.suite}_{dev}.json"), "w") as f:
        json.dump({"suite": args.suite, "device": dev, "cases": rows}, f, indent=1)
    print(table)


def _packaged_smollm2():
    from flexevict.packaged import smollm2_gguf
    return smollm2_gguf()


if __name__ == "__main__":
    main()
