"""Install flexevict. `policies/` is installed as `flexevict.policies`.

torch is deliberately not an install requirement: on a CPU machine an unpinned `torch` would pull
a multi-GB CUDA build. Install torch first (`pip install torch==2.13.0` for CPU), then this.
The CUDA extension (`flexevict._C`, sources in cuda/) is built ahead of time here only when a
CUDA build of torch is importable; otherwise it is compiled on first GPU use.
"""
from setuptools import setup

setup(
    name="flexevict",
    version="0.1.0",
    description="Offloading throughput engine for LLM inference with KV-cache eviction",
    packages=["flexevict", "flexevict.bench", "flexevict.policies"],
    package_dir={"flexevict": "flexevict", "flexevict.policies": "policies"},
    python_requires=">=3.10",
    install_requires=["numpy", "tqdm", "tokenizers", "safetensors", "gguf", "nvidia-ml-py"],
    extras_require={"test": ["pytest", "transformers", "accelerate"]},
)
