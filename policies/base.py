"""The interface every eviction policy implements."""
from __future__ import annotations

import torch

from flexevict.kv import KVBuffer


class Policy:
    name = "base"

    def capacity(self, prompt_len: int, gen_len: int) -> int:
        """Committed slots per (sequence, kv-head) for a run of prompt_len + gen_len tokens.

        The last generated token is never fed back, so a full cache needs prompt + gen - 1.
        """
        return prompt_len + gen_len - 1

    def prefill(self, buf: KVBuffer, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                valid: torch.Tensor) -> None:
        """Keep the prompt. k, v: (S, rows, d); pos, valid: (S, rows)."""
        buf.store_prompt(k, v, pos, valid)

    def before_attention(self, buf: KVBuffer, slot: int, q: torch.Tensor) -> None:
        """Hook before decode attention; q: (rows, group, d). Default: nothing."""

    def after_attention(self, buf: KVBuffer, slot: int, probs: torch.Tensor) -> None:
        """Commit the decoded token written in `slot`; probs: (rows, group, attended) fp32, the
        attention just used by each query head of a kv head."""
        buf.commit_appended(slot)
