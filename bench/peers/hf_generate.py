"""Peer: HF transformers `generate` (optionally with accelerate offload) at a flexevict.bench
setting. Takes the same flags as `python -m flexevict.bench` (extra ones are ignored) and
writes the same throughput fields, so bench/suites.py can put the two side by side.

    python bench/peers/hf_generate.py --model opt-125m --prompt-len 128 --gen-len 32 \\
        --gpu-batch-size 4 --num-gpu-batches 2 --json out.json
    ... --max-memory 0:16GiB,cpu:100GiB     # accelerate offload (device_map="auto")

Dummy weights are HF's own random init (throughput does not depend on the values); a .gguf
--path loads real weights. One HF batch holds gpu_batch_size x num_gpu_batches sequences.
"""
import argparse
import json
import os
import resource
import tempfile
import time

import torch

from flexevict.bench.throughput import WARMUP_PROMPT, WARMUP_TOKENS


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--path", default=None)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--gpu-batch-size", type=int, default=4)
    p.add_argument("--num-gpu-batches", type=int, default=1)
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-memory", default=None, help="accelerate offload, e.g. 0:16GiB,cpu:100GiB")
    p.add_argument("--json", required=True)
    return p.parse_known_args()[0]


def load(args, device, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM
    if args.path and args.path.endswith(".gguf"):
        folder, name = os.path.split(args.path)
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype).to(device)
    from flexevict.core.config import registry_config, to_hf_dict
    hf = to_hf_dict(registry_config(args.model))
    cfg = AutoConfig.for_model(**hf)
    if not args.max_memory:
        with torch.device(device):
            return AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    folder = tempfile.mkdtemp(prefix="hf-peer-")        # accelerate offloads from a checkpoint
    AutoModelForCausalLM.from_config(cfg, dtype=dtype).save_pretrained(folder)
    limits = dict(kv.split(":") for kv in args.max_memory.split(","))
    limits = {int(k) if k.isdigit() else k: v for k, v in limits.items()}
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map="auto",
                                                max_memory=limits,
                                                offload_folder=os.path.join(folder, "offload"))


def timed_generate(model, ids, new_tokens):
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                   max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    sync()
    return time.perf_counter() - t0


@torch.inference_mode()
def main():
    args = parse()
    cuda = torch.cuda.is_available() and args.device != "cpu"
    device = "cuda" if cuda else "cpu"
    dtype = torch.float16 if cuda else torch.float32
    model = load(args, device, dtype).eval()
    model.generation_config.eos_token_id = None          # always generate gen_len tokens
    n = args.gpu_batch_size * args.num_gpu_batches
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(4, model.config.vocab_size, (n, args.prompt_len), generator=g)
    ids = ids.to(model.device)
    # the same warm-up as flexevict.bench's (its length, not its policy: HF keeps every token)
    timed_generate(model, ids[:, :min(WARMUP_PROMPT, args.prompt_len)],
                   min(WARMUP_TOKENS, args.gen_len))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    prefill = timed_generate(model, ids, 1)
    total = timed_generate(model, ids, args.gen_len)
    decode = max(total - prefill, 1e-9)
    result = {"peer": "transformers" + (" + accelerate offload" if args.max_memory else ""),
              "transformers": __import__("transformers").__version__, "batch": n,
              "prefill_latency_s": prefill, "prefill_throughput": n * args.prompt_len / prefill,
              "decode_latency_s": decode, "decode_throughput": n * (args.gen_len - 1) / decode,
              "total_latency_s": total, "total_throughput": n * args.gen_len / total,
              "peak_gpu_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
              "peak_cpu_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
              "max_memory": args.max_memory, "threads": torch.get_num_threads()}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
