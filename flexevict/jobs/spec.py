"""What a batch job is: its input and output, the model and how it runs, as one picklable value
(the Ray workers get a copy), and the settings its outputs depend on (kept in the manifest)."""
from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass

from flexevict.runtime.generation import Sampling
from flexevict.runtime.placement import Placement
from flexevict.policies import PolicySpec

DEFAULT_WINDOW_BLOCKS = 16      # look-ahead window, in blocks, when --window is not given


@dataclass(frozen=True)
class JobSpec:
    input: str
    output: str
    model: str                   # as given: registry name, HF folder or .gguf
    path: str | None             # --path
    weights: str                 # the resolved weight path (or _DUMMY_)
    device: str
    dtype: str | None
    seed: int
    placement: Placement
    policy: PolicySpec
    sampling: Sampling
    max_new_tokens: int
    chat: bool = False
    window: int = 0              # rows; 0: DEFAULT_WINDOW_BLOCKS blocks
    on_error: str = "fail"
    threads: int | None = None
    created: int = 0             # an OpenAI output line's "created": the input file's mtime

    @property
    def block_size(self) -> int:
        """FlexGen's effective batch: gpu_batch_size x num_gpu_batches sequences."""
        p = self.placement
        return p.gpu_batch_size * p.num_gpu_batches

    @property
    def window_rows(self) -> int:
        return self.window or DEFAULT_WINDOW_BLOCKS * self.block_size

    def settings(self) -> dict:
        """Everything a completion depends on, by flag name: a resumed run must match. Where
        weights, cache and activations live (--percent), overlap, pinning and --offload-dir do
        not change a single output, so a rerun may change them."""
        p, s = self.placement, self.sampling
        model = os.path.abspath(self.model) if os.path.exists(self.model) else self.model
        weights = os.path.abspath(self.weights) if os.path.exists(self.weights) else self.weights
        return {
            "--model": model, "--path": weights, "--device": self.device, "--dtype": self.dtype,
            "--seed": self.seed, "--policy": self.policy.name, "--budget": self.policy.budget,
            "--budget-tokens": self.policy.budget_tokens,
            "--policy-arg": [f"{k}={v}" for k, v in self.policy.args],
            "--temperature": None if s.is_greedy else s.temperature,
            "--top-p": None if s.is_greedy else s.top_p,
            "--top-k": None if s.is_greedy else s.top_k,
            "--max-new-tokens": self.max_new_tokens, "--chat": self.chat,
            "--gpu-batch-size": p.gpu_batch_size, "--num-gpu-batches": p.num_gpu_batches,
            "--window": self.window_rows, "--compress-weight": p.compress_weight,
            "--compress-cache": p.compress_cache, "--cpu-cache-compute": p.cpu_cache_compute,
        }

    def llm(self, progress: bool = False):
        """Load the model as this job runs it."""
        from flexevict.api import LLM
        return LLM(self.model, path=self.path, device=self.device, dtype=self.dtype,
                   seed=self.seed, progress=progress, placement=self.placement)

    @property
    def defaults(self):
        """A row's settings where its line gives none (`inputs.Request`): the command line's."""
        from flexevict.jobs.inputs import Request
        return Request(self.max_new_tokens, self.sampling)

    def prompter(self):
        """Tokenizer, chat template and length check, without loading any weight."""
        return _prompter(self.model, self.path, self.defaults, self.chat, self.policy,
                         self.block_size)

    def choice_seeds(self, row) -> list[int]:
        """The sampling seed of each sequence a row runs (`Request.sequences`): from the
        request's own seed, else from --seed and the row's id; never from its block or
        position, so its tokens do not depend on where or beside what it runs."""
        req = row.request
        base = f"seed {req.seed}" if req.seed is not None else \
            f"{self.seed}\0{json.dumps(row.id, sort_keys=True)}"
        return [_seed(base if j == 0 else f"{base}\0choice {j}") for j in range(req.sequences)]


def _seed(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


@functools.lru_cache(maxsize=4)
def _prompter(model: str, path: str | None, defaults, chat: bool, policy, block_size: int):
    """Cached: a Ray worker process reads the tokenizer once for all its windows. The chat
    template is read when a row needs it (with --chat, now: a model without one is refused
    before anything runs)."""
    from flexevict.api import resolve_model
    from flexevict.io.tokenizer import load_tokenizer
    from flexevict.jobs.chat import load_chat_template
    from flexevict.jobs.inputs import Prompter
    config, weights = resolve_model(model, path)
    template = functools.cache(lambda: load_chat_template(weights, model))
    if chat:
        template()
    return Prompter(load_tokenizer(weights), config.max_positions, defaults, chat, template,
                    policy.make(), block_size)
