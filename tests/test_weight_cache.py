"""Disk-tier dummy weights are kept from one run to the next (runtime/weight_cache.py): the
second run maps them instead of making and writing them, with the same tokens; the cache keeps
to its size cap, leaves no partial file behind and can be turned off."""
import os
import shutil
import subprocess
import sys

import pytest
import torch
from tiny import CONFIGS, rand_prompts

from flexevict.bench.throughput import parse_args
from flexevict.cli import placement_from_args
from flexevict.errors import UserError
from flexevict.io.weights import DummyWeights
from flexevict.policies import get_policy
from flexevict.runtime import weight_cache
from flexevict.runtime.engine import Engine
from flexevict.runtime.generation import generate
from flexevict.runtime.placement import Placement

MIXED = (30, 20, 100, 0, 100, 0)          # half of each layer's weights on disk


class Counting(DummyWeights):
    """Dummy weights that count the tensors made."""
    made: list

    def __init__(self, config, seed=0, generate_on=None, made=None):
        super().__init__(config, seed, generate_on)
        self.made = [] if made is None else made

    def generating_on(self, device):
        return Counting(self.config, self.seed, device, self.made)

    def load(self, name, device="cpu", dtype=torch.float32):
        self.made.append(name)
        return super().load(name, device, dtype)


def run(cfg, placement, source=None, prompts=None):
    """Tokens of a short h2o run, and the source (its `made` list)."""
    source = source or Counting(cfg, seed=3)
    engine = Engine.load(cfg, source, placement, "cpu", torch.float32)
    try:
        return generate(engine, prompts or rand_prompts([9, 6], seed=1), 6,
                        get_policy("h2o", budget=0.5)), source
    finally:
        engine.close()


def cache_files(offload) -> list[str]:
    root = os.path.join(offload, weight_cache.FOLDER)
    return sorted(f for _, _, fs in os.walk(root) for f in fs) if os.path.isdir(root) else []


@pytest.mark.parametrize("compress", [False, True])
def test_second_run_maps_the_kept_weights_and_makes_the_same_tokens(tmp_path, compress):
    cfg = CONFIGS["opt"]
    p = Placement.from_percent(MIXED, offload_dir=str(tmp_path), compress_weight=compress)
    first, src1 = run(cfg, p)
    kept = cache_files(tmp_path)
    assert kept and not any(f.endswith(".part") for f in kept)
    second, src2 = run(cfg, p)
    assert second == first
    assert cache_files(tmp_path) == kept                          # nothing written again
    assert len(src2.made) < len(src1.made)                        # kept weights were not made
    # every layer tensor that only feeds a kept weight was skipped
    layer_names = [n for n in cfg.param_shapes() if ".layers." in n]
    assert set(layer_names) - set(src2.made)
    off = Placement.from_percent(MIXED, offload_dir=str(tmp_path / "off"),
                                 compress_weight=compress, weight_cache=False)
    uncached, _ = run(cfg, off)
    assert uncached == first and cache_files(tmp_path / "off") == []


def test_all_on_disk_makes_no_layer_weight_the_second_time(tmp_path):
    cfg = CONFIGS["llama-gqa"]
    p = Placement.from_percent((0, 0, 100, 0, 100, 0), offload_dir=str(tmp_path))
    first, _ = run(cfg, p)
    second, src = run(cfg, p)
    assert second == first
    assert not [n for n in src.made if ".layers." in n]


def test_models_seeds_and_dtypes_get_their_own_folders(tmp_path):
    p = Placement.from_percent((0, 0, 100, 0, 100, 0), offload_dir=str(tmp_path))
    a = weight_cache.WeightCache.for_run(DummyWeights(CONFIGS["opt"], 0), p, torch.float32)
    b = weight_cache.WeightCache.for_run(DummyWeights(CONFIGS["opt"], 1), p, torch.float32)
    c = weight_cache.WeightCache.for_run(DummyWeights(CONFIGS["opt"], 0), p, torch.float16)
    d = weight_cache.WeightCache.for_run(DummyWeights(CONFIGS["llama-gqa"], 0), p, torch.float32)
    assert len({x.folder for x in (a, b, c, d)}) == 4
    on_gpu = Placement.from_percent((100, 0, 100, 0, 100, 0), offload_dir=str(tmp_path))
    assert weight_cache.WeightCache.for_run(DummyWeights(CONFIGS["opt"], 0), on_gpu,
                                            torch.float32) is None


def test_the_cap_removes_the_least_recently_used_folder_first(tmp_path, monkeypatch):
    cfg = CONFIGS["opt"]
    p = Placement.from_percent((0, 0, 100, 0, 100, 0), offload_dir=str(tmp_path))
    run(cfg, p, Counting(cfg, seed=1))
    one = weight_cache.folder_bytes(os.path.join(tmp_path, weight_cache.FOLDER))
    monkeypatch.setenv(weight_cache.CAP_ENV, str(1.5 * one / 2 ** 30))
    run(cfg, p, Counting(cfg, seed=2))                 # seed 1's folder goes to make room
    folders = sorted(os.listdir(os.path.join(tmp_path, weight_cache.FOLDER)))
    assert len(folders) == 1 and folders[0].endswith("seed2-float32")
    # a cap below one model: the weights go to the run folder and the tokens stay the same
    monkeypatch.setenv(weight_cache.CAP_ENV, str(0.2 * one / 2 ** 30))
    tokens, _ = run(cfg, p, Counting(cfg, seed=5))
    ref, _ = run(cfg, Placement.from_percent((100, 0, 100, 0, 100, 0)), Counting(cfg, seed=5))
    assert tokens == ref
    assert weight_cache.folder_bytes(os.path.join(tmp_path, weight_cache.FOLDER)) <= 0.2 * one


def test_parts_of_a_killed_run_are_removed(tmp_path):
    p = Placement.from_percent((0, 0, 100, 0, 100, 0), offload_dir=str(tmp_path))
    kept = weight_cache.WeightCache.for_run(DummyWeights(CONFIGS["opt"], 0), p, torch.float32)
    dead = os.path.join(kept.folder, f"0.wqkv.bin.{2 ** 22 + 12345}.part")   # no such pid
    live = os.path.join(kept.folder, f"0.wo.bin.{os.getpid()}.part")
    for path in (dead, live):
        open(path, "wb").close()
    weight_cache.WeightCache.for_run(DummyWeights(CONFIGS["opt"], 0), p, torch.float32)
    assert not os.path.exists(dead) and os.path.exists(live)


def test_no_weight_cache_flag():
    assert placement_from_args(parse_args(["--model", "opt-125m"])).weight_cache
    off = parse_args(["--model", "opt-125m", "--no-weight-cache"])
    assert not placement_from_args(off).weight_cache


# ------------------------------------------------------------------ what the cache says

def test_a_line_at_exit_says_what_is_kept_where_and_how_to_turn_it_off(tmp_path, capsys):
    cfg = CONFIGS["opt"]
    run(cfg, Placement.from_percent(MIXED, offload_dir=str(tmp_path)))
    root = os.path.join(tmp_path, weight_cache.FOLDER)
    capsys.readouterr()
    weight_cache._say_kept()                       # what atexit runs
    lines = [ln for ln in capsys.readouterr().err.splitlines() if root in ln]
    assert lines == [weight_cache.kept_line(root, 100 * 2 ** 30)]
    size = weight_cache.folder_bytes(root)                         # under 1 MiB here
    assert lines[0].startswith(f"flexevict: {size / 2 ** 10:.1f} KiB of dummy weights kept in "
                               f"{root} for the next run")
    assert "--no-weight-cache" in lines[0] and f"{weight_cache.CAP_ENV}=100 " in lines[0]
    weight_cache._say_kept()                       # said once
    assert root not in capsys.readouterr().err


def test_nothing_is_said_when_nothing_is_kept(tmp_path, capsys):
    cfg = CONFIGS["opt"]
    run(cfg, Placement.from_percent(MIXED, offload_dir=str(tmp_path), weight_cache=False))
    run(cfg, Placement.from_percent(MIXED, offload_dir=str(tmp_path / "removed")))
    shutil.rmtree(tmp_path / "removed")            # the user deleted it, as the line allows
    capsys.readouterr()
    weight_cache._say_kept()
    assert str(tmp_path) not in capsys.readouterr().err


KEEP_SCRIPT = """
import sys, torch
from tiny import CONFIGS
from flexevict.errors import cli_errors
from flexevict.io.weights import DummyWeights
from flexevict.runtime.engine import Engine
from flexevict.runtime.placement import Placement

class Interrupted(DummyWeights):
    def generating_on(self, device):
        return Interrupted(self.config, self.seed, device)

    def load(self, name, device="cpu", dtype=torch.float32):
        if ".layers.1." in name:
            raise KeyboardInterrupt                # Ctrl-C while the weights are made
        return super().load(name, device, dtype)

cfg = CONFIGS["opt"]
source = (Interrupted if sys.argv[2] == "interrupt" else DummyWeights)(cfg, 0)
p = Placement.from_percent((0, 0, 100, 0, 100, 0), offload_dir=sys.argv[1])
with cli_errors("keep"):
    Engine.load(cfg, source, p, "cpu", torch.float32).close()
"""


@pytest.mark.parametrize("how, code", [("finish", 0), ("interrupt", 130)])
def test_the_line_comes_at_the_end_of_a_process_and_after_ctrl_c(tmp_path, how, code):
    tests = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", KEEP_SCRIPT, str(tmp_path), how],
                          capture_output=True, text=True, cwd=tests, timeout=120)
    assert proc.returncode == code, proc.stderr
    root = os.path.join(tmp_path, weight_cache.FOLDER)
    kept = [ln for ln in proc.stderr.splitlines() if "of dummy weights kept in" in ln]
    assert kept == [weight_cache.kept_line(root, weight_cache.cap_bytes())]
    assert proc.stderr.splitlines()[-1] == kept[0]                 # the last word of the run
    assert cache_files(tmp_path) and not any(f.endswith(".part") for f in cache_files(tmp_path))


def test_a_tiny_cap_keeps_nothing_says_so_once_and_keeps_the_tokens(tmp_path, monkeypatch,
                                                                    capsys):
    cfg = CONFIGS["opt"]
    monkeypatch.setenv(weight_cache.CAP_ENV, "0.000001")           # about 1 KiB
    on_disk = Placement.from_percent((0, 0, 100, 0, 100, 0), offload_dir=str(tmp_path))
    tokens, _ = run(cfg, on_disk, Counting(cfg, seed=4))
    said = [ln for ln in capsys.readouterr().err.splitlines() if "is reached" in ln]
    assert len(said) == 1 and f"{weight_cache.CAP_ENV}=1e-06 is reached" in said[0]
    assert weight_cache.folder_bytes(os.path.join(tmp_path, weight_cache.FOLDER)) <= 2 ** 10
    ref, _ = run(cfg, Placement.from_percent((100, 0, 100, 0, 100, 0)), Counting(cfg, seed=4))
    assert tokens == ref


def test_removing_a_folder_for_the_cap_is_said(tmp_path, monkeypatch, capsys):
    cfg = CONFIGS["opt"]
    p = Placement.from_percent((0, 0, 100, 0, 100, 0), offload_dir=str(tmp_path))
    run(cfg, p, Counting(cfg, seed=1))
    one = weight_cache.folder_bytes(os.path.join(tmp_path, weight_cache.FOLDER))
    monkeypatch.setenv(weight_cache.CAP_ENV, str(1.5 * one / 2 ** 30))
    capsys.readouterr()
    run(cfg, p, Counting(cfg, seed=2))
    removed = [ln for ln in capsys.readouterr().err.splitlines() if "removed kept" in ln]
    assert len(removed) == 1 and "seed1-float32" in removed[0]
    assert "least recently used" in removed[0] and weight_cache.CAP_ENV in removed[0]


@pytest.mark.parametrize("value", ["abc", "-1", "nan", "10GB"])
def test_a_bad_cap_is_one_line_naming_the_fix(monkeypatch, value):
    monkeypatch.setenv(weight_cache.CAP_ENV, value)
    with pytest.raises(UserError) as e:
        weight_cache.cap_bytes()
    assert str(e.value).startswith(f"{weight_cache.CAP_ENV}={value!r} is not a size in GiB")
    assert "unset it" in str(e.value) and "\n" not in str(e.value)
    # the command line says so before anything is made or calibrated
    args = parse_args(["--model", "opt-125m", "--percent", "0", "0", "100", "0", "100", "0"])
    with pytest.raises(UserError):
        placement_from_args(args)


def test_the_cap_reads_gib_inf_and_refuses_the_gb_spelling(monkeypatch):
    monkeypatch.setenv(weight_cache.CAP_ENV, " 2.5 ")
    assert weight_cache.cap_bytes() == int(2.5 * 2 ** 30)
    monkeypatch.setenv(weight_cache.CAP_ENV, "inf")
    assert weight_cache.cap_bytes() >= 2 ** 62
    monkeypatch.delenv(weight_cache.CAP_ENV)
    assert weight_cache.cap_bytes() == 100 * 2 ** 30
    monkeypatch.setenv(weight_cache.MISSPELT, "50")
    with pytest.raises(UserError, match=f"set {weight_cache.CAP_ENV}=50 instead"):
        weight_cache.cap_bytes()
