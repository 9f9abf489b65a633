"""flexevict: an offloading throughput engine for LLM inference with KV-cache eviction."""
import os

# Transparent huge pages for torch's large CPU allocations (weights, KV homes, staging buffers):
# a fresh 2 MB page faults in once instead of 512 times (zeroing a fresh 64 MB tensor: 1.3 ->
# 4.1 GB/s; OPT-1.3B's dummy weights made in 11 s instead of 14-17, the same peak memory). torch
# reads the variable once, at the process's first allocation, so it is set before torch is
# imported: it takes effect for the CLIs and wherever flexevict is imported first; a user's own
# setting wins. On a system whose THP mode is "never" it changes nothing.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

try:
    import torch  # noqa: F401
except ImportError as e:  # torch is not an install requirement: see README "Install"
    raise ImportError("flexevict needs PyTorch: `pip install torch==2.13.0` (CPU) or a CUDA "
                      "build of torch for GPUs") from e

from flexevict.errors import UserError  # noqa: E402

__all__ = ["LLM", "UserError"]


def __getattr__(name):       # keep `import flexevict` light: LLM pulls in the model code
    if name == "LLM":
        from flexevict.api import LLM
        return LLM
    raise AttributeError(name)
