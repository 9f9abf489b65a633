"""`python -m flexevict.calibrate`: measure this machine once for the placement cost model.

    python -m flexevict.calibrate [--device cuda] [--offload-dir DIR] [--recalibrate] [--quick]
    python -m flexevict.calibrate --synthetic h100 --out h100.json   # datasheet numbers, no run

What is measured, and where the result is kept: flexevict.planner.calibration.
"""
from __future__ import annotations

import argparse
import json

import torch

from flexevict.errors import UserError, cli_errors
from flexevict.planner import calibration as C
from flexevict.runtime.placement import DEFAULT_OFFLOAD_DIR

_SEE_LIBRARY = "What is measured, and where the result is kept: flexevict.planner.calibration.\n"


def summary(cal: C.Calibration, device: torch.device, dtype: torch.dtype) -> str:
    d = cal.device(device, dtype)
    gb, host, machine = 1e9, cal.data["host"], cal.data["machine"]
    measured = host.get("threads")
    scaling = d.get("thread_scaling") if device.type == "cpu" else None
    threads = (f"measured at {measured} threads, shown for {cal.threads}" if measured else
               f"{machine.get('threads', '?')} threads")
    lines = [f"calibration of {machine['device']} (torch {machine['torch']}, {threads})"
             f"{' [synthetic]' if cal.synthetic else ''}"
             f"{' [quick]' if cal.quick else ''}: {cal.path}",
             *([f"one thread vs {measured}, the time: " + ", ".join(
                 f"{kind} {ratio:.2f}x" for kind, ratio in scaling.items())] if scaling else []),
             "links GB/s: " + ", ".join(f"{k} {cal.link(k) / gb:.1f}" for k in cal.data["links"]),
             f"{device.type} {C.dtype_name(dtype)}: gemm {d['gemm_flops'] / 1e12:.2f} TFLOP/s, "
             f"gemv {d['gemv_bw'] / gb:.1f} GB/s, memory {d['mem_bw'] / gb:.1f} GB/s, "
             f"decode attention {d['attn_decode']['per_unit_s'] * 1e12:.2f} ps/unit",
             "prepare (oneDNN reorder) GB/s by layer MB: " + (", ".join(
                 f"{b / C.MB:.0f}: {r / gb:.2f}" for b, r in d["prepare"].get("layers", []))
                 or "none") + "; one large matrix: " + (", ".join(
                 f"{b / C.MB:.0f}: {r / gb:.2f}" for b, r in d["prepare"].get("big", [])) or "n/a"),
             f"disk: {cal.data['host']['disk_note']}"]
    return "\n".join(lines)


def main(argv=None):
    # --help: this docstring, then what is measured (flexevict.planner.calibration's docstring
    # after its first paragraph)
    description = __doc__.replace(_SEE_LIBRARY, C.__doc__.split("\n\n", 1)[1])
    p = argparse.ArgumentParser(prog="python -m flexevict.calibrate", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (default: cuda if any)")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="compute dtype to measure (default float16 on GPU, float32 on CPU)")
    p.add_argument("--offload-dir", default=DEFAULT_OFFLOAD_DIR,
                   help="where the disk tier lives (its disk is measured)")
    p.add_argument("--threads", type=int, default=None,
                   help="show the constants for this many torch CPU threads (default: torch's); "
                        "the measuring always runs one thread per core and serves every count")
    p.add_argument("--recalibrate", action="store_true", help="measure again even if cached")
    p.add_argument("--quick", action="store_true",
                   help="small sizes, few repeats: seconds, less accurate (tests)")
    p.add_argument("--synthetic", default=None, metavar="KIND",
                   help=f"write datasheet numbers instead of measuring ({', '.join(C.SYNTHETIC)})")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="also write the calibration to FILE (for --calibration elsewhere)")
    args = p.parse_args(argv)
    with cli_errors("flexevict.calibrate"):
        if args.synthetic:
            data = C.synthetic(args.synthetic)
            if not args.out:
                raise UserError("--synthetic needs --out FILE")
            _write(args.out, data)
            print(f"wrote synthetic {args.synthetic} calibration to {args.out}")
            return
        from flexevict.api import resolve_device
        from flexevict.cli import cpu_threads
        from flexevict.core.config import DTYPES, default_dtype
        device = resolve_device(args.device)
        if args.threads is not None and args.threads < 1:
            raise UserError(f"--threads must be >= 1 (got {args.threads})")
        cal = C.load(device, args.threads, args.offload_dir, recalibrate=args.recalibrate,
                     quick=args.quick)
        dtype = DTYPES[args.dtype or default_dtype(device)]
        with cpu_threads(args.threads):
            print(summary(cal, device, dtype))
        if args.out:
            _write(args.out, cal.data)


def _write(path: str, data: dict):
    try:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
    except OSError as e:
        raise UserError(f"--out {path}: cannot write it ({e.strerror})") from None


if __name__ == "__main__":
    main()
