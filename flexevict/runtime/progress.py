"""Progress a person can watch: a tqdm bar on a terminal; under a scheduler, `nohup` or a pipe
(stderr not a terminal), one line every FLEXEVICT_PROGRESS_SECONDS seconds (default 5) with
units done/total, the rate of the tracked quantity and the ETA, and a last line at the end
(unless the line before it already said the same).

A unit may run for longer than the interval (a long prompt's prefill, a sweep cell of many
prompts): the innermost open bar then prints its line on a timer all the same, so that a
working process never reads as a hung one."""
from __future__ import annotations

import os
import sys
import threading
import time

DEFAULT_SECONDS = 5.0


class Progress:
    """update(n, tokens) after each unit of work (a layer, a batch of prompts, a token step);
    update(0, tokens, partial) while a long unit runs (a batch's decode steps), so that its
    lines keep coming and its ETA counts the part of the unit already done."""

    # the process's open bars, innermost last: they share its stderr, and only the innermost
    # prints on the timer (`_beat`)
    _open: list["Progress"] = []
    _lock = threading.Lock()

    def __init__(self, total: int, desc: str, unit: str, rate_unit: str | None = None,
                 file=None, enabled: bool = True):
        """rate_unit: what the rate counts (e.g. "tokens", passed to update); default `unit`."""
        self.total, self.desc, self.unit = total, desc, unit
        self.rate_unit = rate_unit or unit
        self.file = file or sys.stderr
        self.done = self.counted = 0
        self.partial = 0.0                  # units of the work in flight already done
        self.shown = None                   # (done, counted) of the last line printed
        self.start = self.last = time.monotonic()
        self.interval = float(os.environ.get("FLEXEVICT_PROGRESS_SECONDS", DEFAULT_SECONDS))
        self.bar = None
        self.enabled = enabled
        if enabled and _is_terminal(self.file):
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, unit=unit, file=self.file)
        self._stop = threading.Event()
        if enabled:
            Progress._open.append(self)
            if self.interval > 0:
                threading.Thread(target=self._beat, daemon=True).start()

    def update(self, n: int = 1, counted: int | None = None, partial: float = 0.0) -> None:
        """n units finished and `counted` more of the rate's quantity (default n); partial: the
        units of the work now in flight already done (for the ETA only)."""
        self.done += n
        self.counted += n if counted is None else counted
        self.partial = partial
        with Progress._lock:
            if self.bar is not None:
                self.bar.update(n)
            elif self.enabled and time.monotonic() - self.last >= self.interval:
                self._line()

    def close(self) -> None:
        self._stop.set()
        with Progress._lock:
            if self in Progress._open:
                Progress._open.remove(self)
            if self.bar is not None:
                self.bar.close()
            elif self.enabled and self.done and self.shown != (self.done, self.counted):
                self._line()
            self.enabled = False

    def _beat(self) -> None:
        """Every interval without a line while this is the innermost open bar: a line (on a
        terminal, the bar redrawn with its elapsed time)."""
        while not self._stop.wait(self.interval):
            with Progress._lock:
                innermost = Progress._open and Progress._open[-1] is self
                if not self.enabled or not innermost:
                    continue
                if self.bar is not None:
                    self.bar.refresh()
                elif time.monotonic() - self.last >= self.interval:
                    self._line()

    def _line(self) -> None:
        now = time.monotonic()
        self.last, self.shown = now, (self.done, self.counted)
        elapsed = max(now - self.start, 1e-9)
        done = self.done + self.partial
        left = (self.total - done) * elapsed / done if done else float("nan")
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
