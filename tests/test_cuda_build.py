"""The CUDA extension builds without a GPU: every cuda/*.cu compiles with nvcc for sm_75, sm_80
and sm_90 (one nvcc call per file with one -gencode per arch; the calls run in parallel, one
per core), the C++ binding compiles against the installed torch (a CPU build is fine: it
includes no CUDA header), and the objects link into an extension that imports and rejects bad
arguments with one-line errors. The commands are `flexevict.core.kernels.build`'s, the same ones a
GPU machine without ninja builds with, here with warnings as errors. nvcc is looked up on PATH,
CUDA_HOME and /usr/local/cuda; without it the nvcc tests skip and say so."""
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch

from flexevict.core.kernels import CascadeRule, build
from flexevict.core.kv import KVBuffer, Layout

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


@pytest.mark.slow
@needs_nvcc
@needs_cxx
@pytest.mark.parametrize("unit", UNITS)
def test_cuda_unit_compiles_for_sm75_sm80_sm90(built, unit):
    r = built[unit]
    assert all(f"-gencode=arch=compute_{a},code=sm_{a}" in r["cmd"] for a in build.CI_ARCHS)
    assert r["rc"] == 0, f"{r['cmd']}\n{r['log']}"


@pytest.mark.slow
@needs_nvcc
@needs_cxx
def test_binding_compiles_against_the_installed_torch(built):
    r = built["binding.cpp"]
    assert r["rc"] == 0, f"{r['cmd']}\n{r['log']}"


@pytest.mark.slow
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
    buf = KVBuffer(Layout(3, prefix=1, ring=1), 2, 4, torch.float32, "cpu")   # a CPU buffer
    rule = CascadeRule(sinks=1, gamma=0.5, reduce="mean", window=1)
    index = torch.zeros(2, dtype=torch.long)
    calls = [   # every binding, called as flexevict.core.kernels calls it (one CPU input each)
        ("q must be a CUDA tensor", lambda: ext.decode_attention(q, k, k, valid, None, 1.0, 0)),
        ("q must be a CUDA tensor", lambda: ext.split_decode_attention(
            q, k, k, valid, None, 1.0, 0, True, 0)),
        ("q must be a CUDA tensor", lambda: ext.prefill_attention(
            k[None], k[None], k[None], torch.ones(1, 1, 2, 2, dtype=torch.bool),
            torch.ones(1, 2, dtype=torch.bool), 1.0, 0)),
        ("buffer k must be a CUDA tensor",
         lambda: ext.select_commit(buf, 1, -1, None, 3, 0, None, 0)),
        ("buffer k must be a CUDA tensor", lambda: ext.hash_select(
            buf, 1, 1, 0, torch.zeros(2, 1, 1, dtype=torch.long), None, 0)),
        ("buffer k must be a CUDA tensor", lambda: ext.compact_prompt(
            k, k, valid.int(), valid, None, valid.float(), buf, 0)),
        ("buffer k must be a CUDA tensor", lambda: ext.buzz_pass(buf, 2, 1, 1, 1, 1, 0)),
        ("buffer k must be a CUDA tensor", lambda: ext.cascade_update(
            buf, torch.zeros(2, 1, 3), index[None], index[None], index[:1], rule, 0)),
        ("x must be a CUDA tensor", lambda: ext.quantize_4bit(k, 1, 24, 1, 64, 0)),
        ("mins must be a CUDA tensor", lambda: ext.dequantize_4bit(
            torch.zeros(12, dtype=torch.uint8), k, k, 1, 24, 1, 64, 0)),
        ("rows must be a CUDA tensor", lambda: ext.copy_rows(k, k, index, False, 0)),
    ]
    for expected, call in calls:
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert expected in message and "\n" not in message.strip(), message
    # every limit the header defines, exported under its name (Python reads nothing else)
    assert ext.limits() == header_limits()
    for g, d in ((1, 64), (8, 128), (32, 256)):     # the launcher's own shared memory count
        assert ext.decode_attention_shared_bytes(g, d) == ((g + 4) * d + 2 * g + 32) * 4
    # split decode attention's split count: from the sizes alone, enough blocks, <= 1024 slots
    # per split and >= 64 unless that leaves a single split
    for rows, n in ((1, 1), (8, 32768), (256, 2048), (768, 819), (1344, 32768), (4, 0)):
        splits = ext.split_decode_splits(rows, n)
        assert 1 <= splits <= max(n, 1) and -(-n // splits) <= 1024
        assert rows * splits >= 2048 or -(-n // splits) <= 64


def header_limits() -> dict:
    """The FE_* limits #defined in cuda/flexevict_kernels.h, evaluated -> {lowercase name
    without FE_: value}."""
    defined = {}
    text = (build.SOURCE_DIR / "flexevict_kernels.h").read_text()
    for name, rest in re.findall(r"^#define FE_([A-Z_]+) (.*)$", text, re.M):
        if not name.startswith("STR"):
            expr = rest.split("//")[0]                                 # less the comment
            expr = re.sub(r"FE_([A-Z_]+)", lambda m: str(defined[m.group(1).lower()]), expr)
            defined[name.lower()] = eval(expr.replace("/", "//"))      # integer arithmetic
    return defined


def test_header_limits_are_the_ones_the_kernels_were_written_for():
    """The parse above reads what the header says (no nvcc needed)."""
    limits = header_limits()
    assert limits["decode_max_dim"] == 256 and limits["shared_bytes"] == 48 * 1024
    assert limits["lsh_max_dim"] == 48 * 1024 // 4 and len(limits) == 16
    assert limits["split_decode_max_dim"] == 256 and limits["split_decode_max_group"] == 8
    assert limits["split_decode_dim_multiple"] == 8
    assert limits["page_max_pages"] == 4096 and limits["page_max_dim"] == 256


class _FakeExtension:
    """A stand-in for the compiled module with small limits: records which ops it was asked to
    run (each then raises, so a test sees the dispatch, not a result)."""

    def __init__(self, **limits):
        self.table = {**header_limits(), **limits}
        self.called = []

    def limits(self):
        return dict(self.table)

    def decode_attention_shared_bytes(self, group, dim):
        return ((group + 4) * dim + 2 * group + 32) * 4

    def __getattr__(self, op):
        def launch(*args):
            self.called.append(op)
            raise RuntimeError(f"fake {op}")
        return launch


def install_fake(monkeypatch, limits: dict) -> _FakeExtension:
    """Dispatch every op to a fake extension with `limits` (the header's, overridden)."""
    from flexevict.core.kernels import ext
    fake = _FakeExtension(**limits)
    monkeypatch.setattr(ext, "module_for", lambda t: fake)
    monkeypatch.setattr(ext, "stream", lambda t: 0)
    return fake


@pytest.mark.parametrize("limits,kernel", [({}, True), ({"decode_max_dim": 8}, False),
                                           ({"shared_bytes": 512}, False)])
def test_decode_attention_takes_its_limits_from_the_module(monkeypatch, limits, kernel):
    from flexevict.core import kernels
    fake = install_fake(monkeypatch, limits)
    q, k = torch.randn(2, 4, 16), torch.randn(5, 2, 16)
    valid = torch.ones(5, 2, dtype=torch.bool)
    if kernel:
        with pytest.raises(RuntimeError, match="fake decode_attention"):
            kernels.decode_attention_kernel(q, k, k, valid, 0.25)
    else:                                  # over the module's limit: the reference answers
        out, probs = kernels.decode_attention_kernel(q, k, k, valid, 0.25)
        assert out.shape == (2, 4, 16) and fake.called == []


@pytest.mark.parametrize("limits,kernel", [({}, True), ({"lsh_max_bits": 32}, False),
                                           ({"lsh_max_dim": 8}, False)])
def test_hash_codes_takes_its_limits_from_the_module(monkeypatch, limits, kernel):
    from flexevict.core import kernels
    fake = install_fake(monkeypatch, limits)
    x, proj = torch.randn(3, 16), torch.randn(64, 16)
    if kernel:
        with pytest.raises(RuntimeError, match="fake lsh_hash"):
            kernels.hash_codes(x, proj)
    else:
        assert kernels.hash_codes(x, proj).shape == (3, 2) and fake.called == []


@pytest.mark.slow
def test_an_installed_package_finds_its_cuda_sources(tmp_path):
    """A non-editable install (no checkout next to it) carries cuda/ as the package data of
    flexevict.cuda_sources, and the just-in-time build finds every source there."""
    root = pathlib.Path(__file__).resolve().parents[1]
    src = tmp_path / "src"                     # a copy: pip builds in-tree (build/, egg-info)
    for name in ("flexevict", "policies", "cuda"):
        shutil.copytree(root / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(root / "setup.py", src)
    site = tmp_path / "site"
    env = dict(os.environ, FLEXEVICT_KERNELS="0")         # never compile the extension here
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                           "--no-build-isolation", "--target", str(site), str(src)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    shutil.rmtree(src)                         # nothing of the tree is left to fall back on
    probe = ("from flexevict.core.kernels import build; print(build.SOURCE_DIR); "
             "print(*[f.name for f in build.sources() if f.is_file()])")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(site)), timeout=120)
    assert done.returncode == 0, done.stderr
    folder, names = done.stdout.splitlines()
    assert folder == str(site / "flexevict" / "cuda_sources")
    assert names.split() == UNITS + ["binding.cpp"]
    for header in ("common.cuh", "flexevict_kernels.h"):        # what the units include
        assert (site / "flexevict" / "cuda_sources" / header).is_file()


def test_setup_builds_with_the_same_commands(tmp_path, monkeypatch):
    """setup.py's build_ext runs `build.build` for sm_75/80/90 (the just-in-time build's
    commands: one build path) and puts the library where setuptools installs flexevict._C."""
    from setuptools import Distribution, Extension
    calls = []

    def fake_build(out, name, archs):
        calls.append((name, tuple(archs)))
        out.mkdir(parents=True, exist_ok=True)
        (out / "lib.so").write_bytes(b"built")
        return out / "lib.so"
    monkeypatch.setattr(build, "build", fake_build)
    extension = Extension("flexevict._C", sources=[])
    command = build.setup_command()(Distribution({"name": "flexevict",
                                                  "ext_modules": [extension]}))
    command.build_temp, command.build_lib = str(tmp_path / "temp"), str(tmp_path / "lib")
    command.ensure_finalized()
    command.build_extension(extension)
    assert calls == [("_C", build.CI_ARCHS)]
    assert pathlib.Path(command.get_ext_fullpath("flexevict._C")).read_bytes() == b"built"
    assert "setup_command()" in (pathlib.Path(__file__).parents[1] / "setup.py").read_text()
