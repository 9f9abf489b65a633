"""The host allocator's thresholds (runtime/allocator.py): set once per process by the engine
and the calibration, and left alone when the user tunes glibc's malloc. Their effect on a step
is a timing, shown in bench/README.md, not here."""
import os
import subprocess
import sys

import pytest

GLIBC = sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION") is not None
pytestmark = pytest.mark.skipif(not GLIBC, reason="glibc's mallopt: Linux with glibc only")

SET = """
import ctypes, sys
from flexevict.runtime import allocator
calls = []
real = ctypes.CDLL
class Spy:
    def __init__(self, name):
        self.lib = real(name)
    @property
    def mallopt(self):
        f = self.lib.mallopt
        def call(param, value):
            calls.append((param, value))
            return f(param, value)
        call.argtypes = call.restype = None
        return call
ctypes.CDLL = Spy
print(allocator.steady_host_allocator(), allocator.steady_host_allocator(), calls)
"""


def run(env=None) -> str:
    return subprocess.run([sys.executable, "-c", SET], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, check=True).stdout.strip()


def test_thresholds_set_once_per_process():
    from flexevict.runtime.allocator import M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    want = [(M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 1 << 30)]
    assert run() == f"True True {want}"


@pytest.mark.parametrize("name", ["MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_"])
def test_user_malloc_settings_are_left_alone(name):
    assert run({name: str(1 << 20)}) == "False False []"
