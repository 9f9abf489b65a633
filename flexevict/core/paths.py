"""Where flexevict keeps files between runs (calibrations, joined packaged models, policy
statistics): one rule for every layer, so this lives at the bottom."""
from __future__ import annotations

import os


def cache_dir() -> str:
    """$FLEXEVICT_CACHE_DIR, else $XDG_CACHE_HOME/flexevict, else ~/.cache/flexevict."""
    if os.environ.get("FLEXEVICT_CACHE_DIR"):
        return os.path.expanduser(os.environ["FLEXEVICT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "flexevict")
