"""kvpress 0.5.5 on the same model and prompts as the flexevict sweep (run with the Python of a
venv that holds kvpress, KVPRESS_VENV below).

    KVPRESS_VENV/bin/python bench/accuracy/kvpress_peer.py --inputs INPUTS.json --out OUT.json

INPUTS.json comes from `python bench/accuracy/peer.py export` (the sweep's passkey and agreement
prompts as token ids, the slot count flexevict gives each budget, and the GGUF path). This script
only generates: for every press and budget it prefills each prompt under the press (kvpress
compresses the prompt's KV once, at prefill), then decodes greedily with positions continuing
from the prompt length, as kvpress's own pipeline does. Scoring happens in `peer.py compare`, with
the same functions the sweep uses. It imports nothing from flexevict: kvpress needs
transformers < 5.3, so it lives in its own venv (see bench/results/accuracy/README.md).
"""
import argparse
import importlib.metadata
import json
import os
import platform
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402


def presses(ratio: float) -> dict:
    """kvpress's prompt-compression counterparts of flexevict's policies, at one ratio."""
    from kvpress import (KeyRerotationPress, ObservedAttentionPress, SnapKVPress,
                         StreamingLLMPress, TOVAPress)
    return {"streaming": StreamingLLMPress(compression_ratio=ratio, n_sink=4),
            "streaming-rerotate": KeyRerotationPress(StreamingLLMPress(compression_ratio=ratio,
                                                                       n_sink=4)),
            "observed-attention": ObservedAttentionPress(compression_ratio=ratio),
            "tova": TOVAPress(compression_ratio=ratio),
            "snapkv": SnapKVPress(compression_ratio=ratio, window_size=64, kernel_size=5)}


def load(gguf: str):
    from transformers import AutoModelForCausalLM
    folder, name = os.path.split(gguf)
    # eager attention: ObservedAttentionPress reads the attention matrix
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                 attn_implementation="eager")
    return model.eval()


@torch.inference_mode()
def greedy(model, ids: list[int], new_tokens: int, press=None) -> list[int]:
    """Prefill ids (compressed by `press`), then new_tokens greedy tokens (no stop token, as
    the sweep's agreement and passkey runs)."""
    from transformers import DynamicCache
    cache = DynamicCache()
    x = torch.tensor([ids])
    ctx = press(model) if press is not None else _nothing()
    with ctx:
        logits = model(input_ids=x, past_key_values=cache, logits_to_keep=1).logits
    out = [int(logits[0, -1].argmax())]
    # positions go on from the prompt length; with key rerotation, from the kept length
    start = cache.get_seq_length() if type(press).__name__ == "KeyRerotationPress" else len(ids)
    for i in range(new_tokens - 1):
        pos = torch.tensor([[start + i]])
        logits = model(input_ids=torch.tensor([[out[-1]]]), past_key_values=cache,
                       position_ids=pos).logits
        out.append(int(logits[0, -1].argmax()))
    return out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def run_task(model, task: dict, budgets: list[str]) -> list[dict]:
    """One row per (press, budget): the generated ids of every prompt."""
    rows = [{"press": "none", "budget": 1.0, "outputs": [
        greedy(model, ids, task["new_tokens"]) for ids in task["prompts"]]}]
    for b in budgets:
        slots = task["slots"][b]
        for name in presses(0.5):
            t0 = time.perf_counter()
            outs = []
            for ids in task["prompts"]:
                # keep exactly `slots` prompt tokens: kvpress keeps int(len * (1 - ratio))
                ratio = 1 - (slots + 0.5) / len(ids)
                outs.append(greedy(model, ids, task["new_tokens"], presses(ratio)[name]))
            rows.append({"press": name, "budget": float(b), "slots": slots, "outputs": outs,
                         "seconds": round(time.perf_counter() - t0, 2)})
            print(f"{task['name']} {name} {b}: {time.perf_counter() - t0:.1f}s", flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inputs", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with open(args.inputs) as f:
        inputs = json.load(f)
    import transformers
    t0 = time.perf_counter()
    model = load(inputs["gguf"])
    result = {"kvpress": importlib.metadata.version("kvpress"),
              "transformers": transformers.__version__, "torch": torch.__version__,
              "platform": platform.platform(), "threads": args.threads, "tasks": {}}
    for name, task in inputs["tasks"].items():
        budgets = sorted(task["slots"], key=float)
        result["tasks"][name] = run_task(model, {"name": name, **task}, budgets)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
