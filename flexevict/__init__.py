"""flexevict: an offloading throughput engine for LLM inference with KV-cache eviction."""
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
