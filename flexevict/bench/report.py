"""What every benchmark result records (machine, versions, commit, kernel path), and JSON output."""
from __future__ import annotations

import json
import os
import platform
import subprocess

import torch


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def kernel_backend(device: torch.device) -> str:
    """Which implementation the eviction hot path uses on `device`."""
    try:
        from flexevict import kernels
    except ImportError:
        return "torch-reference"
    return kernels.backend(device) if hasattr(kernels, "backend") else "torch-reference"


def git_commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def run_metadata(device: torch.device | str = "cpu") -> dict:
    device = torch.device(device)
    return {"device": device_name(device), "device_type": device.type,
            "platform": platform.platform(), "cpu_threads": torch.get_num_threads(),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "kernels": kernel_backend(device), "commit": git_commit()}


def write_json(path: str | None, result: dict, device: torch.device | str = "cpu") -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump({**result, "run": run_metadata(device)}, f, indent=1)
