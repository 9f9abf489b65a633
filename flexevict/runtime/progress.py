"""Progress a person can watch: a tqdm bar on a terminal; under a scheduler, `nohup` or a pipe
(stderr not a terminal), one line every FLEXEVICT_PROGRESS_SECONDS seconds (default 30) with
units done/total, the rate of the tracked quantity and the ETA, and a last line at the end."""
from __future__ import annotations

import os
import sys
import time

DEFAULT_SECONDS = 30.0


class Progress:
    """update(n, tokens) after each unit of work (a layer, a batch of prompts, a token step)."""

    def __init__(self, total: int, desc: str, unit: str, rate_unit: str | None = None,
                 file=None, enabled: bool = True):
        """rate_unit: what the rate counts (e.g. "tokens", passed to update); default `unit`."""
        self.total, self.desc, self.unit = total, desc, unit
        self.rate_unit = rate_unit or unit
        self.file = file or sys.stderr
        self.done = self.counted = 0
        self.start = self.last = time.monotonic()
        self.interval = float(os.environ.get("FLEXEVICT_PROGRESS_SECONDS", DEFAULT_SECONDS))
        self.bar = None
        self.enabled = enabled
        if enabled and _is_terminal(self.file):
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, unit=unit, file=self.file)

    def update(self, n: int = 1, counted: int | None = None) -> None:
        self.done += n
        self.counted += n if counted is None else counted
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and time.monotonic() - self.last >= self.interval:
            self._line()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self.done:
            self._line()
        self.enabled = False

    def _line(self) -> None:
        now = time.monotonic()
        self.last = now
        elapsed = max(now - self.start, 1e-9)
        left = (self.total - self.done) * elapsed / self.done if self.done else float("nan")
        print(f"{self.desc}: {self.done}/{self.total} {self.unit}s, "
              f"{self.counted / elapsed:.1f} {self.rate_unit}/s, elapsed {_clock(elapsed)}, "
              f"ETA {_clock(left)}", file=self.file, flush=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is not None and self.bar is None:
            self.enabled = False        # the error is the one line to show, not a progress line
        self.close()


def _is_terminal(f) -> bool:
    try:
        return f.isatty()
    except (AttributeError, ValueError):
        return False


def _clock(seconds: float) -> str:
    if seconds != seconds:                       # nan: nothing done yet
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
