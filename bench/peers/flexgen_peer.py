"""Peer: FlexGen 0.1.8 (PyPI `flexgen`) at a flexevict.bench setting, run from its own
environment outside this tree. Takes the same flags as `python -m flexevict.bench`, runs
`python -m flexgen.flex_opt` with FlexGen's equivalents, parses its log and writes the same
throughput fields. FlexGen runs only on CUDA and uses all-ones dummy weights.

    FLEXGEN_PYTHON=/opt/flexgen-venv/bin/python python bench/peers/flexgen_peer.py \\
        --model opt-6.7b --percent 100 0 100 0 100 0 --gpu-batch-size 2 --json out.json

FlexGen 0.1.8 loads the tokenizer "facebook/opt-30b" for every OPT model
(`flex_opt.run_flexgen`). The peer runs FlexGen in its own working folder (--workdir, default
<tmp>/flexgen-peer) holding a byte-level stand-in at facebook/opt-30b, with HF_HUB_OFFLINE=1, so
it never asks the hub (prompts are dummy text anyway; throughput does not depend on the
tokenizer).
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

FLAGS = ("--prompt-len", "--gen-len", "--gpu-batch-size", "--num-gpu-batches", "--cut-gen-len")
SWITCHES = ("--cpu-cache-compute", "--compress-weight", "--compress-cache")
FIELDS = {"model size": "model_size_gb", "cache size": "cache_size_gb",
          "hidden size \\(p\\)": "hidden_size_gb", "peak gpu mem": "peak_gpu_mem_gb",
          "prefill latency": "prefill_latency_s", "prefill throughput": "prefill_throughput",
          "decode latency": "decode_latency_s", "decode throughput": "decode_throughput",
          "total latency": "total_latency_s", "total throughput": "total_throughput"}
TOKENIZER = "facebook/opt-30b"      # what FlexGen 0.1.8 loads, whatever the --model


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--percent", nargs=6, default=["100", "0", "100", "0", "100", "0"])
    p.add_argument("--pin-weight", default="1")
    p.add_argument("--offload-dir", default=os.path.join(tempfile.gettempdir(), "flexgen-offload"))
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "flexgen-peer"),
                   help="FlexGen's working folder (holds the stand-in tokenizer)")
    p.add_argument("--json", required=True)
    for f in FLAGS:
        p.add_argument(f, default=None)
    for s in SWITCHES:
        p.add_argument(s, action="store_true")
    return p.parse_known_args()[0]


def command(args, log: str) -> list[str]:
    python = os.environ.get("FLEXGEN_PYTHON")
    if not python:
        sys.exit("set FLEXGEN_PYTHON to the python of an environment with flexgen==0.1.8 "
                 "(bench/peers/README.md)")
    python = shutil.which(python) or python         # FlexGen runs in --workdir: no relative path
    cmd = [python, "-m", "flexgen.flex_opt", "--model", f"facebook/{args.model}",
           "--path", "_DUMMY_", "--percent", *args.percent, "--offload-dir", args.offload_dir,
           "--pin-weight", args.pin_weight, "--log-file", log]
    for f in FLAGS:
        value = getattr(args, f[2:].replace("-", "_"))
        if value is not None:
            cmd += [f, value]
    cmd += [s for s in SWITCHES if getattr(args, s[2:].replace("-", "_"))]
    return cmd


def prepare(workdir: str) -> dict:
    """Make `workdir` ready for an offline FlexGen run -> the environment to run it in.

    FlexGen runs with cwd=workdir, so its AutoTokenizer.from_pretrained("facebook/opt-30b")
    finds the stand-in written at workdir/facebook/opt-30b; HF_HUB_OFFLINE=1 keeps transformers
    from asking the hub first (the GPU machine has no network)."""
    stand_in_tokenizer(os.path.join(workdir, TOKENIZER))
    return dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def stand_in_tokenizer(folder: str) -> None:
    """A byte-level tokenizer in `folder` (one token per byte; pad, bos and eos are bytes 1-2)."""
    if os.path.exists(os.path.join(folder, "tokenizer.json")):
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    os.makedirs(folder, exist_ok=True)
    vocab = {chr(b) if 31 < b < 127 else f"<0x{b:02X}>": b for b in range(256)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0x00>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<0x01>",
                   "eos_token": "<0x02>", "bos_token": "<0x02>"}, f)


def parse_log(text: str) -> dict:
    out = {}
    for label, key in FIELDS.items():
        m = re.search(label + r":\s*([0-9.eE+-]+)", text)
        out[key] = float(m.group(1)) if m else None
    m = re.search(r"projected:\s*(\w+)", text)
    out["projected"] = m and m.group(1) == "True"
    return out


def main():
    args = parse()
    env = prepare(args.workdir)
    args.offload_dir = os.path.abspath(args.offload_dir)       # FlexGen runs in --workdir
    os.makedirs(args.offload_dir, exist_ok=True)
    log = os.path.abspath(args.json + ".log")
    proc = subprocess.run(command(args, log), capture_output=True, text=True, cwd=args.workdir,
                          env=env)
    if proc.returncode != 0 or not os.path.exists(log):
        sys.exit("flexgen failed: " + (proc.stderr.strip().splitlines() or ["no output"])[-1])
    with open(log) as f:
        result = {"peer": "flexgen 0.1.8 (all-ones dummy weights)", **parse_log(f.read())}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
