"""Disk-tier dummy weights are kept from one run to the next (runtime/weight_cache.py): the
second run maps them instead of making and writing them, with the same tokens; the cache keeps
to its size cap, leaves no partial file behind and can be turned off."""
import os

import pytest
import torch
from tiny import CONFIGS, rand_prompts

from flexevict.bench.throughput import parse_args
from flexevict.cli import placement_from_args
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
