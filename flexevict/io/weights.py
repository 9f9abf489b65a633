"""Weight sources: seeded dummy weights, HF folders (safetensors or .bin), GGUF, and the engine's
own one-file-per-tensor layout.

Every source answers `load(name) -> torch.Tensor` for a parameter named as in HF transformers
(`config.param_shapes()`), one tensor at a time, so the model is built layer by layer and host
memory never holds more than one shard (or one tensor) beyond the model itself.
"""
from __future__ import annotations

import glob
import json
import math
import os
import zlib

import numpy as np
import torch

from flexevict.core.config import ModelConfig, load_hf_config, to_hf_dict
from flexevict.errors import UserError
from flexevict.io.seeded import SCHEME, seeded_normal

DUMMY = "_DUMMY_"   # FlexGen's spelling for "no weights, random numbers"


class DummyWeights:
    """Seeded random weights with a realistic scale, generated per tensor on demand.

    Linear weights ~ N(0, 1/fan_in) (activations keep unit scale, so attention is far from
    uniform and score-based eviction has something to rank); embeddings ~ N(0, 1) (learned
    positions N(0, 0.02)); norm weights 1 + N(0, 0.1); biases N(0, 0.02). Each tensor's seed is
    derived from its name, so the result does not depend on load order and no full copy of the
    model is ever needed; the numbers (`seeded_normal`, scheme in io/seeded.py: approximately
    normal, Irwin-Hall n = 8) do not depend on the device that makes them, so `generating_on`
    can make them on the compute device for a CPU or disk tier. Tensor `name`'s key is
    seed * 1_000_003 + crc32(name).
    """

    def __init__(self, config: ModelConfig, seed: int = 0, generate_on=None):
        self.config, self.seed, self.generate_on = config, seed, generate_on
        self.shapes = config.param_shapes_cached()

    @property
    def cache_key(self) -> str:
        """What decides every number (model shapes, seed and the generator's scheme): the weight
        cache's folder name (runtime/weight_cache.py). The name alone is not enough: test
        configs share names; the scheme is hashed in so no run maps an older scheme's files."""
        shapes = zlib.crc32(repr((SCHEME, sorted(self.shapes.items()))).encode())
        return f"{self.config.name}-{shapes:08x}-seed{self.seed}"

    def generating_on(self, device) -> "DummyWeights":
        """The same weights, made on `device` (fast: the compute device) and then moved to
        where each `load` asks for them."""
        return DummyWeights(self.config, self.seed, generate_on=device)

    def scale_and_base(self, name: str) -> tuple[float, float]:
        shape = self.shapes[name]
        if "embed" in name or name == "lm_head.weight":
            return (0.02 if "positions" in name else 1.0), 0.0
        if name.endswith(".bias"):
            return 0.02, 0.0
        if len(shape) == 1:            # LayerNorm / RMSNorm weights
            return 0.1, 1.0
        return shape[1] ** -0.5, 0.0

    def load(self, name: str, device="cpu", dtype=torch.float32) -> torch.Tensor:
        shape = self.shapes[name]
        key = self.seed * 1_000_003 + zlib.crc32(name.encode())
        scale, base = self.scale_and_base(name)
        t = seeded_normal(key, math.prod(shape), self.generate_on or device, scale, base,
                          dtype=dtype)
        return t.view(shape).to(device)

    def close(self):
        pass


class MetaWeights:
    """Weights with shapes and no data (on the meta device): for rules that need only sizes,
    like the placement's, run exactly as on real weights."""

    def __init__(self, config: ModelConfig):
        self.shapes = config.param_shapes_cached()

    def load(self, name: str, device="meta", dtype=torch.float16) -> torch.Tensor:
        return torch.empty(self.shapes[name], device="meta", dtype=dtype)


def _file_keys(name: str) -> list[str]:
    """Candidate file names for an HF parameter name (older OPT checkpoints lack `model.`)."""
    return [name, name[len("model."):]] if name.startswith("model.") else [name]


class HFFolderWeights:
    """An HF-layout folder: `*.safetensors` (preferred, memory-mapped) or `*.bin` shards."""

    def __init__(self, folder: str, config: ModelConfig):
        self.folder, self.config = folder, config
        self.files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
        self.kind = "safetensors"
        if not self.files:
            bins = sorted(glob.glob(os.path.join(folder, "*.bin")))
            named = [f for f in bins if os.path.basename(f).startswith("pytorch_model")]
            self.files = named or [f for f in bins if os.path.basename(f) != "training_args.bin"]
            self.kind = "bin"
        if not self.files:
            raise UserError(f"{folder}: no *.safetensors or *.bin weight files; "
                            "download the model's weights into this folder")
        self.index = {}          # tensor name -> file
        self._open = {}          # file -> open handle (safetensors) or state dict (one .bin)
        for path in self.files:
            for key in self._handle(path).keys():
                self.index[key] = path

    def _handle(self, path):
        if path not in self._open:
            try:
                if self.kind == "safetensors":
                    from safetensors import safe_open
                    self._open[path] = safe_open(path, framework="pt")
                else:
                    for p in list(self._open):       # keep at most one .bin shard in memory
                        del self._open[p]
                    self._open[path] = _load_bin(path)
            except Exception as e:  # corrupt or truncated file
                first_line = (str(e).splitlines() or [""])[0]
                raise UserError(f"{path}: cannot read weight file ({type(e).__name__}: "
                                f"{first_line}); re-download it") from None
        return self._open[path]

    def load(self, name: str, device="cpu", dtype=torch.float32) -> torch.Tensor:
        for key in _file_keys(name):
            if key in self.index:
                path = self.index[key]
                handle = self._handle(path)
                try:
                    t = handle.get_tensor(key) if self.kind == "safetensors" else handle[key]
                except Exception as e:
                    raise UserError(f"{path}: cannot read tensor {key} ({e}); "
                                    "re-download it") from None
                return _checked(t, name, self.config, path).to(device=device, dtype=dtype)
        raise UserError(f"{self.folder}: weight '{name}' is missing from the weight files")

    def close(self):
        self._open.clear()


def _load_bin(path: str) -> dict:
    """A `.bin` state dict, memory-mapped when the file is in torch's zip format."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
        return torch.load(path, map_location="cpu", weights_only=True)   # legacy format


def _checked(t: torch.Tensor, name: str, config: ModelConfig, path: str) -> torch.Tensor:
    want = config.param_shapes_cached().get(name)
    if want is not None and tuple(t.shape) != tuple(want):
        raise UserError(f"{path}: tensor {name} has shape {tuple(t.shape)}, expected {want}; "
                        "the weights do not match the config")
    return t


class NativeWeights:
    """The engine's own layout: `config.json` plus one memory-mappable `.npy` file per tensor.

    Made by `convert()`; the offloading engine reads disk-homed tensors straight from here.
    """

    def __init__(self, folder: str, config: ModelConfig):
        self.folder, self.config = folder, config

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name + ".npy")

    def load(self, name: str, device="cpu", dtype=torch.float32) -> torch.Tensor:
        path = self.path(name)
        if not os.path.isfile(path):
            raise UserError(f"{path}: weight file is missing; re-run `python -m flexevict.convert`")
        try:
            arr = np.load(path, mmap_mode="r")
        except Exception as e:
            raise UserError(f"{path}: corrupt weight file ({e}); "
                            "re-run `python -m flexevict.convert`") from None
        return _checked(torch.from_numpy(np.array(arr)), name, self.config, path).to(
            device=device, dtype=dtype)

    def close(self):
        pass


def native_info(folder: str) -> dict | None:
    """The engine layout's `flexevict.json`, or None for any other folder."""
    path = os.path.join(folder, "flexevict.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def convert(source, config: ModelConfig, out_dir: str, dtype: str = "float16",
            tokenizer: str = "tokenizer.json") -> None:
    """Write `source`'s weights into the engine's layout (one `.npy` per tensor) under out_dir.

    One tensor is in memory at a time. bfloat16 is stored as float32 (numpy has no bf16).
    """
    os.makedirs(out_dir, exist_ok=True)
    np_dtype = {"float16": np.float16, "float32": np.float32, "bfloat16": np.float32}[dtype]
    for name in config.param_shapes():
        arr = source.load(name).numpy().astype(np_dtype)
        tmp = os.path.join(out_dir, name + ".npy.tmp")
        with open(tmp, "wb") as f:
            np.save(f, arr)
        os.replace(tmp, os.path.join(out_dir, name + ".npy"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(to_hf_dict(config), f, indent=1)
    with open(os.path.join(out_dir, "flexevict.json"), "w") as f:
        json.dump({"format": "flexevict-npy-v1", "dtype": dtype, "tokenizer": tokenizer}, f)


def open_weights(path: str | None, config: ModelConfig, seed: int = 0):
    """The weight source for a model path: None / `_DUMMY_` -> dummy; folder -> HF or native;
    `.gguf` -> GGUF."""
    if path is None or path == DUMMY:
        return DummyWeights(config, seed)
    if path.endswith(".gguf"):
        from flexevict.io.gguf_io import GGUFWeights
        return GGUFWeights(path, config)
    if os.path.isdir(path):
        return NativeWeights(path, config) if native_info(path) else HFFolderWeights(path, config)
    raise UserError(f"{path}: weight path does not exist (give an HF folder, a .gguf file, "
                    f"or {DUMMY} for random weights)")


def config_for_path(path: str) -> ModelConfig:
    if path.endswith(".gguf"):
        from flexevict.io.gguf_io import gguf_config
        return gguf_config(path)
    return load_hf_config(path)
