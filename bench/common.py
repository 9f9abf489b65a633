"""What every benchmark result records: the machine, versions and commit, written as JSON."""
import json
import platform
import subprocess

import torch


def run_metadata() -> dict:
    return {"platform": platform.platform(), "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                     text=True).stdout.strip()}


def write_json(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({**result, "run": run_metadata()}, f, indent=1)
