"""User-facing errors: one line that names the problem and the fix.

Every mistake a user can make (unknown model, bad budget, missing weight file, over-long prompt,
malformed input) raises `UserError`. The CLIs turn it into one line on stderr and exit code 2,
without a traceback; library callers can catch it like any exception.
"""
import sys
from contextlib import contextmanager


class UserError(Exception):
    """A problem with the user's input or environment, with the fix in the message."""


@contextmanager
def cli_errors(prog: str):
    """Run a CLI body; print `prog: error: ...` and exit 2 on a UserError."""
    try:
        yield
    except UserError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)
