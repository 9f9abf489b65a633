"""Per-run offload folders that never outlive their run.

Each run that puts anything on disk gets `run-<pid>-<random>/` under `--offload-dir`, with an
`owner` file naming its process (pid and start time, so a reused pid is not mistaken for the
owner). The folder is removed when the run closes, at interpreter exit, on an error, on Ctrl-C
and on SIGTERM (`errors.cli_errors` turns SIGTERM into a normal exit). Nothing can run after
`kill -9`, so every new run first removes the folders whose owner is gone.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

from flexevict.errors import UserError, setting

PREFIX = "run-"
OWNER = "owner"
_open: set[str] = set()          # folders of this process, removed at exit if still there


def create(offload_dir: str) -> str:
    """A fresh run folder under offload_dir (created if needed), after removing stale ones."""
    offload_dir = os.path.expanduser(offload_dir)
    try:
        os.makedirs(offload_dir, exist_ok=True)
        remove_stale(offload_dir)
        path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=offload_dir)
        with open(os.path.join(path, OWNER), "w") as f:
            f.write(f"{os.getpid()} {_start_time(os.getpid())}\n")
    except OSError as e:
        raise UserError(f"{setting('offload_dir')} {offload_dir}: cannot create a folder there "
                        f"({e.strerror}); give a writable directory") from None
    _open.add(path)
    return path


def remove(path: str | None) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)
        _open.discard(path)


def check_writable(offload_dir: str) -> None:
    """Fail early, with the reason, if offload_dir cannot be created or written (a full or
    read-only disk, /proc, a file in the way), instead of a misleading free-space figure."""
    path = os.path.expanduser(offload_dir)
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise UserError(f"{setting('offload_dir')} {offload_dir}: not a writable directory "
                        f"({e.strerror}); give a writable directory") from None


def remove_stale(offload_dir: str) -> list[str]:
    """Remove run folders whose owner process is gone -> the folders removed."""
    removed = []
    for name in os.listdir(offload_dir):
        path = os.path.join(offload_dir, name)
        if name.startswith(PREFIX) and os.path.isdir(path) and not _owner_alive(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _owner_alive(path: str) -> bool:
    try:
        with open(os.path.join(path, OWNER)) as f:
            pid, start = f.read().split()
    except (OSError, ValueError):
        # no owner file yet: a run between mkdtemp and writing it, or a pre-owner-file folder;
        # only a folder older than a minute is taken to be abandoned
        try:
            return os.path.getmtime(path) > _now() - 60
        except OSError:
            return False
    return _start_time(int(pid)) == start


def alive(pid: int) -> bool:
    """Whether a process with this pid runs."""
    return _start_time(pid) != "gone"


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot ("gone" if there is no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)               # no /proc (macOS): alive or not, without a start time
        return "alive"
    except ProcessLookupError:
        return "gone"
    except PermissionError:
        return "alive"


def _now() -> float:
    import time
    return time.time()


@atexit.register
def _remove_all() -> None:
    for path in list(_open):
        remove(path)
