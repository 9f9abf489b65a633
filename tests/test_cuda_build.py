"""The CUDA extension builds without a GPU: every cuda/*.cu compiles with nvcc for sm_75, sm_80
and sm_90 (one nvcc call per file with one -gencode per arch; the calls run in parallel, one
per core), the C++ binding compiles against the installed torch (a CPU build is fine: it
includes no CUDA header), and the objects link into an extension that imports and rejects bad
arguments with one-line errors. The commands are `flexevict.core.kernels.build`'s, the same ones a
GPU machine without ninja builds with, here with warnings as errors. nvcc is looked up on PATH,
CUDA_HOME and /usr/local/cuda; without it the nvcc tests skip and say so."""
import importlib.util
import subprocess

import pytest
import torch

from flexevict.core.kernels import build

NVCC, CXX = build.find_nvcc(), build.find_cxx()
UNITS = sorted(p.name for p in build.SOURCE_DIR.glob("*.cu"))
MODULE = "flexevict_cpu_check"                  # the test build's extension name
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (PATH, CUDA_HOME, "
                                "/usr/local/cuda): the CUDA sources cannot be compiled here")
needs_cxx = pytest.mark.skipif(CXX is None, reason="no C++ compiler (c++ or $CXX) on PATH")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """Compile every unit in parallel -> {"dir": folder, unit: {rc, log, cmd}}."""
    if NVCC is None or CXX is None:
        pytest.skip("nvcc and a C++ compiler are both needed")
    out = tmp_path_factory.mktemp("cuda_build")
    cmds = build.compile_commands(out, MODULE, build.CI_ARCHS, strict=True)
    order = ["binding.cpp"] + sorted((u for u in cmds if u != "binding.cpp"),
                                     key=lambda u: -(build.SOURCE_DIR / u).stat().st_size)
    return {"dir": out, **build.run_all({u: cmds[u] for u in order})}   # slowest first


def test_kernel_sources_include_cuda_headers_only():
    """A CPU torch's CUDA headers are incomplete: kernels must not include torch at all."""
    assert {"attention.cu", "evict.cu", "compact.cu", "quant.cu"} <= set(UNITS)
    for src in [*build.SOURCE_DIR.glob("*.cu"), *build.SOURCE_DIR.glob("*.cuh"),
                build.SOURCE_DIR / "flexevict_kernels.h"]:
        text = src.read_text()
        assert not any(h in text for h in ("torch/", "ATen/", "c10/")), src.name


@needs_nvcc
@needs_cxx
@pytest.mark.parametrize("unit", UNITS)
def test_cuda_unit_compiles_for_sm75_sm80_sm90(built, unit):
    r = built[unit]
    assert all(f"-gencode=arch=compute_{a},code=sm_{a}" in r["cmd"] for a in build.CI_ARCHS)
    assert r["rc"] == 0, f"{r['cmd']}\n{r['log']}"


@needs_nvcc
@needs_cxx
def test_binding_compiles_against_the_installed_torch(built):
    r = built["binding.cpp"]
    assert r["rc"] == 0, f"{r['cmd']}\n{r['log']}"


@needs_nvcc
@needs_cxx
def test_extension_links_imports_and_rejects_bad_arguments(built):
    """Link the objects, import the result (no GPU needed) and check that the binding's checks
    answer with one-line ValueErrors naming the argument."""
    assert all(built[u]["rc"] == 0 for u in [*UNITS, "binding.cpp"]), "a unit did not compile"
    if build.cudart_dir(NVCC) is None:
        pytest.skip("libcudart.so not found next to nvcc or in CUDA_HOME: cannot link")
    argv, so = build.link_command(built["dir"], MODULE)
    done = subprocess.run(argv, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    spec = importlib.util.spec_from_file_location(MODULE, so)
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)

    q, k = torch.zeros(2, 1, 4), torch.zeros(3, 2, 4)
    valid = torch.ones(3, 2, dtype=torch.bool)
    calls = {
        "q must be a CUDA tensor": lambda: ext.decode_attention(
            q, k, k, valid, torch.zeros(2, 1, 4), torch.zeros(2, 1, 3), None, 1.0, 0),
        "buffer k must be a CUDA tensor": lambda: ext.select_commit(
            k, k, valid.float(), valid.float(), valid.int(), valid, 1, -1, None, 0, None, None,
            3, 0, None, 0),
        "x must be a CUDA tensor": lambda: ext.quantize_4bit(
            k, 1, 24, 1, 64, torch.zeros(32, dtype=torch.uint8), k, k, 0),
    }
    for expected, call in calls.items():
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert expected in message and "\n" not in message.strip(), message
