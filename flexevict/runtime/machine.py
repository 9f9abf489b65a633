"""Where a result comes from: the device's name, the versions, the kernel path and the
commit, built in one place (`run_metadata`) for every benchmark, sweep and calibration record."""
from __future__ import annotations

import functools
import os
import platform
import re
from pathlib import Path

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
        from flexevict.core import kernels
    except ImportError:
        return "torch-reference"
    return kernels.backend(device) if hasattr(kernels, "backend") else "torch-reference"


@functools.cache
def git_commit() -> str:
    """$FLEXEVICT_COMMIT when set (a working tree copied to a GPU machine: the GPU plan passes
    it, and a .git found there can be a stale one, as on the first H200 run), else the
    checkout's HEAD commit read from the .git folder (no `git` program needed), else
    "unknown". Computed once per process."""
    return (os.environ.get("FLEXEVICT_COMMIT") or commit_from_tree(Path(__file__).parent)
            or "unknown")


def commit_from_tree(start: Path) -> str | None:
    """HEAD's commit of the first repository found walking up from `start`, or None.

    Reads .git/HEAD, then the branch's loose ref file or its line in packed-refs. A .git that is
    a file (worktree, submodule) points to the real folder; a worktree's refs live in the
    folder its `commondir` names."""
    for folder in [start.resolve(), *start.resolve().parents]:
        dot = folder / ".git"
        if dot.is_dir() or dot.is_file():
            try:
                return _resolve_head(_git_dir(dot))
            except (OSError, ValueError):
                return None
    return None


def _git_dir(dot: Path) -> Path:
    if dot.is_dir():
        return dot
    text = dot.read_text().strip()                  # "gitdir: <path>"
    if not text.startswith("gitdir:"):
        raise ValueError(f"{dot}: not a gitdir link")
    return (dot.parent / text.split(":", 1)[1].strip()).resolve()


def _resolve_head(gitdir: Path) -> str | None:
    head = (gitdir / "HEAD").read_text().strip()
    common = gitdir
    if (gitdir / "commondir").is_file():
        common = (gitdir / (gitdir / "commondir").read_text().strip()).resolve()
    for _ in range(10):                             # symbolic refs may chain; never loop forever
        if not head.startswith("ref:"):
            return head if re.fullmatch(r"[0-9a-f]{40}([0-9a-f]{24})?", head) else None
        ref = head.split(":", 1)[1].strip()
        loose = [d / ref for d in (gitdir, common) if (d / ref).is_file()]
        if loose:
            head = loose[0].read_text().strip()
            continue
        return _packed_ref(common, ref)
    return None


def _packed_ref(common: Path, ref: str) -> str | None:
    packed = common / "packed-refs"
    if not packed.is_file():
        return None
    for line in packed.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1] == ref and not line.startswith(("#", "^")):
            return parts[0]
    return None


def run_metadata(device: torch.device | str = "cpu") -> dict:
    device = torch.device(device)
    return {"device": device_name(device), "device_type": device.type,
            "platform": platform.platform(), "cpu_threads": torch.get_num_threads(),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "kernels": kernel_backend(device), "commit": git_commit()}
