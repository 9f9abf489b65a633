"""Finding the compiled kernels (`flexevict._C`).

`setup.py` builds the extension ahead of time when a CUDA build of torch and nvcc are present.
Otherwise it is compiled just in time, the first time a kernel is asked for on a GPU, by the
same commands (`build.py`), for the GPU's own architecture, into a folder keyed by the sources
(~/.cache/flexevict or $FLEXEVICT_BUILD_DIR). A failed build warns once and every op falls back
to its PyTorch reference. The loaded module is cached: it is
the only module-level state of `flexevict.core.kernels`, with `use_kernels`' switch.

What each kernel accepts (head dims, prompt lengths, slots, ...) is the extension's own
`limits()`, compiled from cuda/flexevict_kernels.h: `within` and `decode_attention_fits` read
it, so the header is the one place those numbers are written.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import warnings
from pathlib import Path

import torch

from flexevict.core.kernels import build

KERNELS, REFERENCE = "cuda-kernels", "torch-reference"
NAME = "flexevict_C"


_forced: bool | None = None          # use_kernels' setting; None: FLEXEVICT_KERNELS decides


def enabled() -> bool:
    """Kernels are on unless FLEXEVICT_KERNELS=0 (read at every call, so tests can flip it), or
    as `use_kernels` says inside its block."""
    if _forced is not None:
        return _forced
    return os.environ.get("FLEXEVICT_KERNELS", "1") != "0"


@contextlib.contextmanager
def use_kernels(on: bool):
    """Within the block the kernels are on (True: where built and the shape fits, whatever
    FLEXEVICT_KERNELS says) or off (False: every op runs its PyTorch reference); the setting
    before is restored after. One switch for the whole process, as the variable is: the kernel
    benchmark times both paths of an op in turn."""
    global _forced
    before, _forced = _forced, bool(on)
    try:
        yield
    finally:
        _forced = before


@functools.lru_cache(maxsize=None)
def load():
    """The extension module, or None when there is no GPU or it cannot be built (warned once)."""
    if not torch.cuda.is_available():
        return None
    try:
        from flexevict import _C                     # built ahead of time by setup.py
        return _current(_C)
    except ImportError:
        pass
    files = build.sources()
    if len(files) < 2 or not files[-1].is_file():
        warnings.warn(f"flexevict: CUDA kernel sources not found in {build.SOURCE_DIR}; using "
                      "the PyTorch reference (reinstall flexevict: they are its package data)")
        return None
    try:
        return _current(_build_and_import(files))
    except Exception as e:                           # noqa: BLE001 - any build failure
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        warnings.warn(f"flexevict: building the CUDA kernels failed ({reason}); using the "
                      "PyTorch reference")
        return None


def _current(module):
    """module, or None (warned) when it was built from older sources, without `limits()`."""
    if hasattr(module, "limits"):
        return module
    warnings.warn("flexevict: the compiled kernels predate their limits() (an old build); "
                  "using the PyTorch reference: reinstall (pip install -e .) to rebuild them")
    return None


@functools.lru_cache(maxsize=None)
def limits(module) -> dict[str, int]:
    """What the kernels of `module` (the loaded extension) accept, by name: shared_bytes,
    decode_max_dim, prefill_max_dim, prefill_max_batch_heads, compact_max_seq, buzz_max_slots,
    buzz_max_dim, lsh_max_bits, lsh_max_dim, cascade_max_levels, cascade_max_kv_heads,
    page_max_pages, page_max_dim."""
    return dict(module.limits())


def within(module, **sizes: int) -> bool:
    """Every size at most `module`'s limit of the same name, e.g.
    `within(module, compact_max_seq=s)`: the kernel takes the input."""
    have = limits(module)
    return all(size <= have[name] for name, size in sizes.items())


@functools.lru_cache(maxsize=4096)
def decode_attention_fits(module, group: int, dim: int) -> bool:
    """Decode attention's kernel takes `group` query heads of `dim`: the head dim, and the
    shared memory the two need (the kernel's own formula)."""
    return within(module, decode_max_dim=dim) and \
        module.decode_attention_shared_bytes(group, dim) <= limits(module)["shared_bytes"]


def _build_and_import(files):
    """Build with nvcc + c++ for this GPU's architecture into a folder keyed by the sources,
    torch and the architecture (reused when it exists), and import the result."""
    major, minor = torch.cuda.get_device_capability()
    key = hashlib.sha1(f"{torch.__version__} sm_{major}{minor}".encode())
    for f in files:
        key.update(f.read_bytes())
    root = Path(os.environ.get("FLEXEVICT_BUILD_DIR", Path.home() / ".cache" / "flexevict"))
    out = root / f"kernels-{key.hexdigest()[:16]}"
    so = build.link_command(out, NAME)[1]
    if not so.is_file():
        so = build.build(out, NAME, [f"{major}{minor}"])
    spec = importlib.util.spec_from_file_location(NAME, so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def module_for(t: torch.Tensor):
    """The extension when `t` is on a GPU and kernels are enabled and built, else None."""
    if t.is_cuda and enabled():
        return load()
    return None


def backend(device: torch.device | str | None = None) -> str:
    """"cuda-kernels" or "torch-reference": what the eviction hot path runs on `device`
    (default: the GPU when there is one). Benchmarks record it in every result."""
    device = torch.device(device if device is not None else
                          "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and enabled() and load() is not None:
        return KERNELS
    return REFERENCE


def stream(t: torch.Tensor) -> int:
    """The current CUDA stream of t's device, as the integer the binding expects."""
    return torch.cuda.current_stream(t.device).cuda_stream
