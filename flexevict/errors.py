"""User-facing errors: one line that names the problem and the fix.

Every mistake a user can make (unknown model, bad budget, missing weight file, over-long prompt,
malformed input) raises `UserError`. The CLIs turn it into one line on stderr and exit code 2,
without a traceback; library callers can catch it like any exception.
"""
import signal
import sys
import threading
from contextlib import contextmanager


class UserError(Exception):
    """A problem with the user's input or environment, with the fix in the message."""


class Terminated(BaseException):
    """SIGTERM arrived: unwinds like Ctrl-C, so every `finally` and exit handler runs (and the
    run's offload files are removed) before the process exits."""


@contextmanager
def cli_errors(prog: str):
    """Run a CLI body; print `prog: error: ...` and exit 2 on a UserError; exit 130 on Ctrl-C
    and 143 on SIGTERM, after cleaning up."""
    previous = _on_sigterm()
    try:
        yield
    except UserError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)
    except Terminated:
        print(f"{prog}: terminated", file=sys.stderr)
        sys.exit(143)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _on_sigterm():
    """Raise Terminated on SIGTERM (main thread only) -> the previous handler, or None."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def terminate(signum, frame):
        raise Terminated()
    return signal.signal(signal.SIGTERM, terminate)
