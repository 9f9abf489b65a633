"""The Python API the CLIs use: load a model with a placement, generate, score a text.

    from flexevict import LLM
    llm = LLM("smollm2-135m")                      # packaged real weights, fp32 on CPU
    outs = llm.generate(["The capital of France is"], max_new_tokens=16)
    print(outs[0]["completion"], llm.score(open("doc.txt").read(), max_tokens=512)["ppl"])
"""
from __future__ import annotations

import math
import os

import torch

from flexevict.core.config import (DTYPES, ModelConfig, default_dtype, registry_config,
                                   with_overrides)
from flexevict.errors import UserError, setting
from flexevict.runtime.engine import Engine, resolved_layout
from flexevict.runtime.layers import describe_run
from flexevict.runtime.generation import Sampling, Watch, generate, plan_batches, stream_nll
from flexevict.io.packaged import PACKAGED_MODELS
from flexevict.runtime.placement import Placement
from flexevict.policies import PolicySpec
from flexevict.runtime.progress import Progress
from flexevict.io.tokenizer import load_tokenizer
from flexevict.io.weights import DUMMY, config_for_path, open_weights


def resolve_model(model: str, path: str | None = None) -> tuple[ModelConfig, str]:
    """(config, weight path) for a registry name, an HF folder or a .gguf file.

    A registry name without --path uses its packaged weights if a package ships them, else
    seeded random weights (FlexGen's `_DUMMY_`).
    """
    if os.path.isdir(model) or model.endswith(".gguf"):
        if not os.path.exists(model):
            raise UserError(f"{model}: file does not exist")
        return config_for_path(model), model
    config = registry_config(model)
    if path is None:
        path = PACKAGED_MODELS[config.name]() if config.name in PACKAGED_MODELS else DUMMY
    if path != DUMMY:
        if not os.path.exists(path):
            raise UserError(f"{path}: weight path does not exist (give an HF folder, a .gguf "
                            f"file, or {DUMMY} for random weights)")
        file_config = config_for_path(path)
        config = with_overrides(file_config, name=config.name)
    return config, path


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"{setting('device')} {device} asked for, but this torch has no usable "
                        f"CUDA; use {setting('device')} cpu")
    if device != "cpu" and not device.startswith("cuda"):
        raise UserError(f"unknown {setting('device')} '{device}' (cpu, cuda or cuda:N)")
    return torch.device(device)




class LLM:
    """A model loaded under a placement (default: everything on the device), with its
    tokenizer. Generation and scoring both run on the offloading engine."""

    def __init__(self, model: str = "smollm2-135m", path: str | None = None,
                 device: str | None = "cpu", dtype: str | None = None, seed: int = 0,
                 progress: bool = False, placement: Placement | None = None):
        self.config, self.path = resolve_model(model, path)
        self.device = resolve_device(device)
        if dtype is None:
            dtype = default_dtype(self.device)
        if dtype not in DTYPES:
            raise UserError(f"unknown {setting('dtype')} '{dtype}' ({', '.join(DTYPES)})")
        self.tokenizer = load_tokenizer(self.path)
        source = open_weights(self.path, self.config, seed)
        self.placement = placement or Placement()
        self.progress = progress       # the default of generate's and score's progress
        try:
            with Progress(self.config.num_layers, "loading", "layer", "MB",
                          enabled=progress) as bar:
                self.engine = Engine.load(self.config, source, self.placement, self.device,
                                          DTYPES[dtype], progress=lambda b: bar.update(1, b / 1e6))
        finally:
            source.close()

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: list[str], max_new_tokens: int = 32,
                 sampling: Sampling = Sampling(), policy: PolicySpec | str = "full",
                 batch_size: int = 8, stop_ids=None, progress: bool | None = None) -> list[dict]:
        """-> one dict per prompt, in order: {"completion", "tokens", "ids", "resolved"}
        ("resolved": the policy's budget as its batch resolved it, `Policy.describe`).

        Prompts are grouped by length into batches of `batch_size` (with --gpu-batch-size:
        gpu_batch_size x num_gpu_batches) to limit padding; with an evicting policy only prompts
        whose budget resolves alike share a batch (`generation.plan_batches`), so a prompt's
        greedy tokens never depend on the other prompts. (`flexevict.generate --input` runs
        files of any size through `generate_block`, block by block: see flexevict/jobs.)
        progress: a line every few seconds (a bar on a terminal), per decode step; default:
        the LLM's `progress`.
        """
        p = self.placement
        if p.gpu_batch_size:
            batch_size = p.gpu_batch_size * p.num_gpu_batches
        if batch_size < 1:
            raise UserError(f"{setting('batch_size')} must be >= 1 (got {batch_size})")
        spec = as_spec(policy)
        encoded = [self.tokenizer.encode(p) for p in prompts]
        results: list[dict | None] = [None] * len(prompts)
        batches = plan_batches([len(e) for e in encoded], max_new_tokens, spec.make(), batch_size)
        with Progress(len(prompts), "generating", "prompt", "generated tokens",
                      enabled=self.progress if progress is None else progress) as bar:
            for batch in batches:
                def on_step(tokens, step, steps, k=len(batch)):
                    bar.update(0, tokens, partial=k * step / steps)
                outs, resolved = self.generate_block([encoded[i] for i in batch], max_new_tokens,
                                                     sampling, spec, stop_ids, Watch(None, on_step))
                for i, ids in zip(batch, outs):
                    results[i] = {"completion": self.tokenizer.decode(ids), "tokens": len(ids),
                                  "ids": ids, "resolved": resolved}
                bar.update(len(batch), 0)
        return results

    def generate_block(self, encoded: list[list[int]], max_new_tokens: int | list[int],
                       sampling: Sampling | list[Sampling], policy: PolicySpec | str,
                       stop_ids=None, watch: Watch = Watch()) -> tuple[list[list[int]], dict]:
        """One engine run over token-id prompts that may share a batch (one batch of
        `generation.plan_batches`; at most gpu_batch_size x num_gpu_batches of them with
        --gpu-batch-size) -> (generated ids per prompt, the policy's resolved budget).
        max_new_tokens, sampling: one for all prompts or one per prompt (each then sampling
        with a generator of its own, from its seed); watch: see `generation.generate`."""
        pol = as_spec(policy).make().for_model(self.config)
        stop = tuple(self.config.eos_token_ids) if stop_ids is None else tuple(stop_ids)
        outs = generate(self.engine, encoded, max_new_tokens, pol, sampling, stop, self.pad_id,
                        watch)
        steps = max(max_new_tokens) if isinstance(max_new_tokens, list) else max_new_tokens
        return outs, describe_run(self.config, pol, resolved_layout(pol, encoded, steps))

    @property
    def pad_id(self) -> int:
        c = self.config
        return c.pad_token_id if c.pad_token_id is not None else (c.eos_token_ids or (0,))[0]

    # ------------------------------------------------------------------ scoring
    def close(self):
        """Stop the copy threads and delete this run's offload files."""
        self.engine.close()

    def score_ids(self, ids: list[int], policy: PolicySpec | str = "full",
                  prefill_tokens: int | None = None, progress: bool | None = None) -> dict:
        """Perplexity of ids; with eviction, tokens after the prefill go one at a time through
        the decode path. -> {"tokens", "nll", "ppl", "slots", "resolved"} (the policy's
        budget as resolved, `Policy.describe`)."""
        if len(ids) < 2:
            raise UserError(f"text has {len(ids)} token(s); perplexity needs at least 2")
        pol = as_spec(policy).make().for_model(self.config)
        show = self.progress if progress is None else progress
        nll, layout = stream_nll(self.engine, [ids], pol, prefill_tokens, progress=show)
        mean = float(nll.double().mean())
        return {"tokens": len(ids), "nll": mean, "ppl": math.exp(mean), "slots": layout.slots,
                "resolved": describe_run(self.config, pol, layout)}

    def score(self, text: str, max_tokens: int | None = None, policy: PolicySpec | str = "full",
              prefill_tokens: int | None = None, progress: bool | None = None) -> dict:
        """Perplexity of the text's first max_tokens tokens, tokenized as a prompt is: with the
        BOS the model's tokenizer adds (Gemma's, which the model needs; SmolLM2 adds none),
        which counts as the first token and is never predicted."""
        ids = self.tokenizer.encode(text)
        return self.score_ids(ids[:max_tokens] if max_tokens else ids, policy, prefill_tokens,
                              progress)


def as_spec(policy: PolicySpec | str) -> PolicySpec:
    return PolicySpec(policy) if isinstance(policy, str) else policy
