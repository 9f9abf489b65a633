"""Run `python -m flexevict.generate` with a signal sent to itself around a block commit: the
batch-job tests' crash and Ctrl-C injection, done here by patching the committer instead of a
hook in the library.

    python tests/fault_job.py SIGNAL WHERE K [generate args...]

SIGNAL: KILL, INT, TERM...; WHERE: before-commit or after-commit; K: the commit it happens at
(1-based: before the K-th commit, or after it).
"""
import os
import signal
import sys
import time

from flexevict.generate import main
from flexevict.jobs import runner


def send_at(name: str, where: str, k: int) -> None:
    """Patch the committer so that the process gets SIG`name` at `where` of commit `k`."""
    commit = runner.Committer.__call__

    def patched(self, *args):
        if where == "before-commit" and len(self.seconds) + 1 == k:
            _signal(name)
        commit(self, *args)
        if where == "after-commit" and len(self.seconds) == k:
            _signal(name)
    runner.Committer.__call__ = patched


def _signal(name: str) -> None:
    os.kill(os.getpid(), getattr(signal, "SIG" + name))
    time.sleep(1)                 # the handler runs here (SIGKILL never returns)


if __name__ == "__main__":
    sig, where, k, *argv = sys.argv[1:]
    send_at(sig, where, int(k))
    main(argv)
