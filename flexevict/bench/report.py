"""What every benchmark result records (flexevict.runtime.machine.run_metadata), and JSON
output."""
from __future__ import annotations

import json
import os

import torch

from flexevict.runtime.machine import run_metadata


def write_json(path: str | None, result: dict, device: torch.device | str | None = None) -> None:
    """`result` with the run's metadata under "run"; device (default: this machine's GPU if it
    has one, else its CPU) is the one the metadata names."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump({**result, "run": run_metadata(device)}, f, indent=1)
