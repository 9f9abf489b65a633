"""User-facing errors: one line that names the problem and the fix.

Every mistake a user can make (unknown model, bad budget, missing weight file, over-long prompt,
malformed input) raises `UserError`. The CLIs turn it into one line on stderr and exit code 2,
without a traceback; library callers can catch it like any exception.

A message names a setting through `setting("budget_tokens")`, never as a flag: a library caller
reads the parameter's name (`budget_tokens`), a command-line user the flag (`--budget-tokens`),
as `cli_errors` renders it. One message, two readers, and no CLI words below the CLI.
"""
import re
import signal
import sys
import threading
from contextlib import contextmanager


_SETTING = re.compile("\u27e8([a-z0-9_]+)\u27e9")    # setting("x") -> "\u27e8x\u27e9"
# settings whose flag is not the parameter's name with dashes: {parameter: flag}
FLAGS = {"policy_args": "--policy-arg", "task_args": "--task-arg",
         "weight_cache": "--no-weight-cache"}


def setting(name: str) -> str:
    """A setting's name inside a UserError message (`name`: the library's parameter name), shown
    as that name, or as its flag under `cli_errors`."""
    return f"\u27e8{name}\u27e9"


def as_flag(name: str) -> str:
    return FLAGS.get(name, "--" + name.replace("_", "-"))


def for_cli(text: str) -> str:
    """A message as a command-line user reads it: its settings as their flags."""
    return _SETTING.sub(lambda m: as_flag(m.group(1)), text)


class UserError(Exception):
    """A problem with the user's input or environment, with the fix in the message (settings
    named by `setting`)."""

    @property
    def message(self) -> str:
        """The message with its settings unrendered: to put inside another message, which
        renders them for its own reader."""
        return super().__str__()

    def __str__(self) -> str:
        return _SETTING.sub(lambda m: m.group(1), self.message)

    def for_cli(self) -> str:
        return for_cli(self.message)


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
        print(f"{prog}: error: {e.for_cli()}", file=sys.stderr)
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
