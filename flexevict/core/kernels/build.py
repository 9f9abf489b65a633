"""The one way the CUDA extension is built: nvcc and the C++ compiler, run directly.

Every cuda/*.cu with nvcc (one call per file, the calls in parallel), the binding against the
installed torch (a CPU build is fine: it includes no CUDA header), and the link. Three callers,
one set of commands: `setup.py` ahead of time (`flexevict._C`, for sm_75, sm_80 and sm_90, by
`SetupCommand`), `ext.load` just in time on first GPU use (for the GPU's own architecture), and
tests/test_cuda_build.py on CPU machines (warnings as errors). Sources: a source checkout's
cuda/ folder when this file sits in one (an editable install, or setup.py building), else the
installed package `flexevict.cuda_sources` (setup.py ships cuda/ as it).
"""
from __future__ import annotations

import concurrent.futures
import importlib.resources
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import torch


def source_dir() -> Path:
    """The folder of the CUDA sources: the cuda/ folder of the checkout this file is in (the
    sources being edited, and the ones setup.py builds), else the package
    flexevict.cuda_sources installed with flexevict."""
    checkout = Path(__file__).resolve().parents[3]
    if (checkout / "setup.py").is_file() and (checkout / "cuda" / "binding.cpp").is_file():
        return checkout / "cuda"
    return Path(str(importlib.resources.files("flexevict.cuda_sources")))


SOURCE_DIR = source_dir()
CI_ARCHS = ("75", "80", "90")
STRICT = ["-Wall", "-Wextra", "-Werror"]       # the binding's own code (torch headers excluded)


def sources() -> list[Path]:
    """Every cuda/*.cu, then the binding (what setup.py builds too)."""
    return sorted(SOURCE_DIR.glob("*.cu")) + [SOURCE_DIR / "binding.cpp"]


def cpp_extension():
    """torch.utils.cpp_extension, imported on first use (it pulls in setuptools: slow)."""
    from torch.utils import cpp_extension as module
    return module


def find_nvcc() -> str | None:
    """nvcc from PATH, CUDA_HOME / CUDA_PATH, torch's idea of CUDA_HOME, or /usr/local/cuda."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), cpp_extension().CUDA_HOME,
             "/usr/local/cuda"]
    for cand in [shutil.which("nvcc")] + [os.path.join(h, "bin", "nvcc") for h in homes if h]:
        if cand and os.path.isfile(cand):
            return cand
    return None


def find_cxx() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++"))


def cudart_dir(nvcc: str) -> str | None:
    """The folder holding libcudart.so: under CUDA_HOME, next to nvcc, or /usr/local/cuda."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), cpp_extension().CUDA_HOME,
             os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "/usr/local/cuda"]
    for home in filter(None, homes):
        for sub in ("lib64", "lib"):
            if any(Path(home, sub).glob("libcudart.so*")):
                return os.path.join(home, sub)
    return None


def object_of(out: Path, src: Path) -> Path:
    return out / (src.stem + ".o")


def compile_commands(out: Path, name: str, archs, strict: bool = False) -> dict[str, list[str]]:
    """{source file name: argv} compiling every source into `out` for the extension `name`."""
    nvcc, cxx = find_nvcc(), find_cxx()
    if nvcc is None or cxx is None:
        raise RuntimeError("nvcc and a C++ compiler are needed to build the CUDA kernels "
                           f"(nvcc: {nvcc}, c++: {cxx}); set CUDA_HOME or PATH")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    includes = [f"-isystem{p}" for p in cpp_extension().include_paths()]
    includes.append(f"-isystem{sysconfig.get_paths()['include']}")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmds = {}
    for src in sources():
        obj = str(object_of(out, src))
        if src.suffix == ".cu":
            cmds[src.name] = [nvcc, "-c", str(src), "-o", obj, "-std=c++20", "-O3",
                              "-Xcompiler", "-fPIC", *gencode,
                              *(["--Werror", "all-warnings"] if strict else [])]
        else:
            cmds[src.name] = [cxx, "-c", str(src), "-o", obj, "-std=c++20", "-O2", "-fPIC",
                              f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-DTORCH_EXTENSION_NAME={name}",
                              *includes, *(STRICT if strict else [])]
    return cmds


def link_command(out: Path, name: str) -> tuple[list[str], Path]:
    """(argv, path of the shared library) linking the objects of `compile_commands`."""
    nvcc, cxx = find_nvcc(), find_cxx()
    lib = cudart_dir(nvcc) if nvcc else None
    if lib is None or cxx is None:
        raise RuntimeError("libcudart.so and a C++ compiler are needed to link the kernels")
    so = out / (name + sysconfig.get_config_var("EXT_SUFFIX"))
    torch_libs = cpp_extension().library_paths()
    argv = [cxx, "-shared", "-o", str(so), *[str(object_of(out, s)) for s in sources()],
            *[f"-L{p}" for p in torch_libs], "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python",
            f"-L{lib}", "-lcudart", *[f"-Wl,-rpath,{p}" for p in [*torch_libs, lib]]]
    return argv, so


def run_all(cmds: dict[str, list[str]], jobs: int | None = None) -> dict[str, dict]:
    """Run the commands in parallel (one per core) -> {name: {rc, log}}."""
    def run(argv):
        done = subprocess.run(argv, capture_output=True, text=True)
        return {"rc": done.returncode, "log": (done.stdout + done.stderr).strip(),
                "cmd": " ".join(argv)}
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 2) as pool:
        return dict(zip(cmds, pool.map(run, cmds.values())))


def build(out: Path, name: str, archs) -> Path:
    """Compile and link the extension `name` into `out` -> the shared library's path."""
    out.mkdir(parents=True, exist_ok=True)
    results = run_all(compile_commands(out, name, archs))
    failed = [r for r in results.values() if r["rc"]]
    if failed:
        raise RuntimeError(f"{failed[0]['cmd']} failed: {failed[0]['log'][-2000:]}")
    argv, so = link_command(out, name)
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"linking the kernels failed: {(done.stdout + done.stderr)[-2000:]}")
    return so


def setup_command():
    """setup.py's `build_ext` command: builds each extension (`flexevict._C`) with `build` for
    CI_ARCHS and copies the library to where setuptools installs the module."""
    from setuptools.command.build_ext import build_ext

    class SetupCommand(build_ext):
        def build_extension(self, extension):
            name = extension.name.rpartition(".")[2]
            so = build(Path(self.build_temp) / "flexevict_kernels", name, CI_ARCHS)
            target = Path(self.get_ext_fullpath(extension.name))
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(so, target)
    return SetupCommand
