"""Shared by the scripts in bench/: the package's run metadata and JSON writer, the seed policies,
running a command that writes its result as JSON (each benchmark case is its own process),
writing a comparison's tables and runs, and the models the peer comparisons run on.

    python bench/common.py      # the run metadata every result here records, for this machine
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

from flexevict.bench.report import write_json  # noqa: F401
from flexevict.runtime.machine import run_metadata

# the policies of the cost-of-eviction comparisons (bench/eviction_cost.py, the placement
# suite's 2048-token cases): the five papers' and TOVA
SEED_POLICIES = ("h2o", "buzz", "cascade", "hashevict", "vatp", "tova")


def run_engine(c: dict, out: str) -> dict:
    """`python -m flexevict.bench` with a case's argv (a suite case: {"name", "argv", "peer"})
    -> its JSON result, or the error record of `run_json`."""
    return run_json([sys.executable, "-m", "flexevict.bench", *c["argv"], "--json", out], out)


def run_json(argv: list[str], out: str) -> dict:
    """Run a command that writes its result as JSON to `out` -> that result, or {"error": its
    last stderr line, "stderr_tail": the last 40}. The stderr tail is echoed either way, so
    warnings and tracebacks land in the caller's log too."""
    proc = subprocess.run(argv, capture_output=True, text=True)
    lines = proc.stderr.strip().splitlines()
    if lines:
        print("\n".join(lines[-40:]), file=sys.stderr, flush=True)
    if proc.returncode != 0:
        return {"error": (lines or ["failed"])[-1], "stderr_tail": lines[-40:]}
    with open(out) as f:
        return json.load(f)


def write_report(prefix: str, text: str, data: dict) -> None:
    """A comparison's outputs: PREFIX.md (the tables, `text`), PREFIX.json (`data`, every run)
    and the tables printed."""
    with open(prefix + ".md", "w") as f:
        f.write(text + "\n")
    with open(prefix + ".json", "w") as f:
        json.dump(data, f, indent=1)
    print(text)


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(json.dumps(run_metadata("cpu"), indent=1))


def run_driver(python: str, driver: str, spec: dict, name: str, read):
    """Run a peer's driver script (text `driver`) with the peer's own interpreter `python`, on
    the inputs `spec` (JSON), in a fresh folder outside the tree, with this environment's
    PYTHONPATH and VIRTUAL_ENV removed (the peer imports only its own packages) -> read(spec),
    where spec also holds `tmp`, the folder, and `out`, the JSON file the driver writes; read
    runs before the folder goes. A failed driver is a UserError with its stderr's end."""
    from flexevict.errors import UserError
    with tempfile.TemporaryDirectory(prefix=f"{name}-peer-") as tmp:
        path, inputs = os.path.join(tmp, "driver.py"), os.path.join(tmp, "in.json")
        spec = dict(spec, out=os.path.join(tmp, "out.json"), tmp=tmp)
        with open(path, "w") as f:
            f.write(driver)
        with open(inputs, "w") as f:
            json.dump(spec, f)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        proc = subprocess.run([python, path, inputs], cwd=tmp, env=env, capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise UserError(f"the {name} driver failed:\n" + proc.stderr[-3000:])
        return read(spec)


def read_out(spec: dict) -> dict:
    """`run_driver`'s reader of the driver's JSON output alone."""
    with open(spec["out"]) as f:
        return json.load(f)


# A small Qwen3 (QK-norm per head, heads x head_dim != hidden, tied head) with SmolLM2's vocabulary,
# so Hamlet's SmolLM2 token ids are its input: no Qwen3 weights ship with the package, so the
# peer comparisons run it on flexevict's dummy weights, written as an HF folder both engines load
QWEN3_TINY = dict(arch="qwen3", name="qwen3-tiny", vocab_size=49152, hidden_size=512,
                  num_layers=8, num_heads=16, num_kv_heads=4, head_dim=128, ffn_size=1536,
                  max_positions=4096, norm_eps=1e-6, rope_theta=1e6, tie_embeddings=True,
                  bos_token_id=1, eos_token_ids=(2,))
PEER_MODELS = ("smollm2-135m", "qwen3-tiny")
# the drivers' lines that load `peer_model`'s model with transformers (spec: the driver's inputs)
LOAD_MODEL = """
if "folder" in spec:                       # an HF folder
    model = AutoModelForCausalLM.from_pretrained(spec["folder"], dtype=torch.float32).eval()
else:
    folder, name = os.path.split(spec["gguf"])
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
"""


def peer_model(name: str, tmp: str) -> tuple[dict, str, str]:
    """The model of a peer comparison -> (what the peer's driver loads: {"gguf": file} or
    {"folder": HF folder}, what flexevict's LLM loads, a line describing it). qwen3-tiny is
    written into tmp/qwen3-tiny (config.json, model.safetensors of seed 0, SmolLM2's
    tokenizer.json)."""
    from flexevict.io.packaged import smollm2_gguf
    if name == "smollm2-135m":
        return ({"gguf": smollm2_gguf()}, "smollm2-135m",
                "SmolLM2-135M (packaged Q4_1 GGUF, fp32)")
    import torch
    from safetensors.torch import save_file

    from flexevict.core.config import ModelConfig, to_hf_dict
    from flexevict.io.tokenizer import load_tokenizer
    from flexevict.io.weights import DummyWeights
    config = ModelConfig(**QWEN3_TINY)
    folder = os.path.join(tmp, config.name)
    os.makedirs(folder)
    load_tokenizer(smollm2_gguf()).save(folder)
    source = DummyWeights(config, seed=0)
    save_file({n: source.load(n, dtype=torch.float32).contiguous()
               for n in config.param_shapes()}, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**to_hf_dict(config), "torch_dtype": "float32"}, f)
    shape = ", ".join(f"{k}={QWEN3_TINY[k]}" for k in ("num_layers", "num_heads", "num_kv_heads",
                                                        "head_dim", "hidden_size"))
    line = f"a small Qwen3 ({shape}; flexevict's dummy weights, seed 0, as an HF folder; fp32)"
    return {"folder": folder}, folder, line
