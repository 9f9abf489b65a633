"""`hashevict`: HashEvict, LSH-based pre-attention KV cache eviction (Liu et al. 2024, "HashEvict:
A Pre-Attention KV Cache Eviction Strategy using Locality-Sensitive Hashing", arXiv 2412.16187;
Sec. 2 Eq. 2-3, Sec. 3 Eq. 5-6 and Algorithm 1, Sec. 4 "Configuration").

Rule:
- Hash: a fixed Gaussian projection R (c x d, N(0, 1) entries); h(x) = Heaviside(R x), bit j = 1
  iff (R x)_j >= 0 (Sec. 2). Keys are hashed once when written, queries each step.
- Each decode step, BEFORE attention (Algorithm 1): among the candidates, evict the cached key
  with the largest Hamming distance popcount(h(q_t) XOR h(k_j)) from the current query; the new
  token takes its place and attends over the kept set only. Memoryless: no accumulation, no decay.
- Always kept (Sec. 4): the first `sinks`=4 tokens and the `recent`=10 most recent cached tokens
  (positions >= t - 10 for the token t being decoded, as in the authors' code), inside the budget.
  Empty slots are filled before anything is evicted.

Decisions where the paper is silent or ambiguous:
- Query hash (the paper); `hash_source=key` compares the new key's hash (the authors' code).
- q_t (Algorithm 1; available before attention), not Eq. 6's q_{t-1}.
- Keys and queries are hashed post-RoPE (what attention sees; the authors' code, App. E).
- GQA: one decision per kv head; distance = the SUM of the group's query heads' distances.
- Ties: the oldest (smallest position) of the farthest candidates; layout independent.
- R: one per layer, shared by its heads, seeded from (`seed`, `buf.layer`); never changes mid-run.
  It is a per-layer constant, `buf.constant("hash_proj", ...)`.
- Prefill `replay` (default): plain SDPA prefill (no column sums), then Algorithm 1's decisions
  replayed over prompt tokens C .. N-1 with their hashes (Sec. 3 "Prompt Encoding Stage"). The
  model passes the prompt queries (`q=`) because `needs_prompt_queries` is set; a caller that
  does not makes the replay use each key's hash as its query hash. `prompt_pool=recent_global` keeps
  the first `sinks` and the last C - sinks prompt tokens (the authors' code's default).
- Storage: codes of c <= 24 bits sit in the fp32 `buf.state` of the key's slot; wider codes (the
  c = 32 / 64 ablation) in the declared field `hash` (`buf.policy_state["hash"]`), as is each
  row's pre-attention victim (`victims`). Both are declared by `fields()` (`kv.Field`).
- With a budget >= prompt + gen nothing is hashed and nothing moves.

Notes: policies/README.md#hashevict
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flexevict.core import kernels
from flexevict.errors import UserError, setting
from flexevict.core.kernels import (FP32_CODE_BITS, WORD_BITS, hash_bits, hash_codes,
                                    hash_replay, pack_codes)
from flexevict.core.kv import Field, KVBuffer, gather_prompt, left_aligned

from flexevict.policies.registry import register
from flexevict.policies.base import RingPolicy

KEY_CHUNK_VALUES = 1 << 20   # replay keys made at once: steps x rows x S fp32, 4 MiB (in cache)
KEY_CHUNK_VALUES_GPU = 1 << 25   # on a GPU, 128 MiB (twice: the kernel's contiguous copy)


# ------------------------------------------------------------------------------ hashing

def projection(bits: int, head_dim: int, seed: int, layer: int = 0) -> torch.Tensor:
    """The Gaussian LSH matrix R (bits, head_dim) fp32 on CPU, fixed by the `seed` and the layer."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + layer)
    return torch.randn(bits, head_dim, generator=gen)


def _signs(bits: torch.Tensor) -> torch.Tensor:
    """Hash bits (..., c) bool as +-1 fp32 vectors: bit j -> 1.0 if set."""
    return bits.to(torch.float32).mul_(2).sub_(1)


def _replay_keys(ks: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """HashEvict's replay keys for a chunk of c steps over tokens [0, n): key[t, r, x] = n - x
    - (n + 1) / 2 * (q_t . k_x) over +-1 codes, which orders like distance * (n + 1) + n - x
    (the farthest goes, ties: the oldest), since popcount(a ^ b) = (bits - a.b) / 2; exact in
    fp32 (integers and halves far below 2**24), whatever order the GEMM sums in. ks (rows, bits,
    n) key signs, qs (rows, c, bits) query signs summed over the group -> (c, rows, n), a view
    of one (rows, c, n) GEMM output: a step's keys are strided, which a CPU's gather reads as
    fast, and one pass writes them (no scaling or transposing passes)."""
    n = ks.shape[2]
    tie = (n - torch.arange(n, device=ks.device)).to(torch.float32)
    return torch.baddbmm(tie, qs, ks, alpha=-(n + 1) / 2).transpose(0, 1)


# ------------------------------------------------------------------------------ policy

@register
@dataclass(frozen=True)
class HashEvict(RingPolicy):
    sinks: int = 4
    recent: int = 10
    hash_bits: int = 16
    seed: int = 0
    hash_source: str = "query"
    prompt_pool: str = "replay"       # not `prefill`: that is the hook
    name = "hashevict"
    graph_safe = True
    needs_prompt_scores = False        # attention-free: plain SDPA prefill
    needs_prompt_queries = True        # the replay prefill wants the prompt queries (q=)

    def __post_init__(self):
        super().__post_init__()
        if self.sinks < 0 or self.recent < 0:
            raise UserError(f"{setting('policy_args')} sinks/recent must be >= 0 (got "
                            f"sinks={self.sinks}, recent={self.recent})")
        if not 1 <= self.hash_bits <= 1024:
            raise UserError(f"{setting('policy_args')} hash_bits must be in [1, 1024] (got "
                            f"{self.hash_bits})")
        if self.hash_source not in ("query", "key"):
            raise UserError(f"{setting('policy_args')} hash_source must be 'query' or 'key' "
                            f"(got {self.hash_source!r})")
        if self.prompt_pool not in ("replay", "recent_global"):
            raise UserError(f"{setting('policy_args')} prompt_pool must be 'replay' or "
                            f"'recent_global' (got {self.prompt_pool!r})")

    @property
    def words(self) -> int:
        """int64 words per hash code."""
        return -(-self.hash_bits // WORD_BITS)

    @property
    def in_state(self) -> bool:
        """The codes fit `buf.state` (else the declared field `hash` holds them)."""
        return self.hash_bits <= FP32_CODE_BITS

    # ------------------------------------------------------------------ sizing
    def minimum_slots(self) -> int:
        # sinks + one prefix candidate + ring (recent + the oldest, a candidate) + scratch
        return self.sinks + self.recent + 3

    def prefix_slots(self, capacity: int) -> int:
        # >= sinks + 1 whenever the run evicts (minimum_slots); a budget that holds the whole
        # run may be smaller than the minimum and never reaches the ring commit
        return max(capacity - (self.recent + 1), 0)

    def describe(self, layout=None) -> dict:
        return {**super().describe(layout), "hash_storage": "state" if self.in_state else "hash"}

    def fields(self, layout):
        # each row's victim, chosen before attention and committed after it; the codes when
        # they do not fit `buf.state`
        victims = Field("victims", ("rows",), torch.int64)
        if self.in_state:
            return (victims,)
        return (victims, Field("hash", ("slots", "rows", self.words), torch.int64))

    # ------------------------------------------------------------------ per-slot codes
    def _proj(self, buf: KVBuffer) -> torch.Tensor:
        """R for the buffer's layer on its device (a constant: made once, never moved)."""
        return buf.constant("hash_proj", lambda dev: projection(
            self.hash_bits, buf.head_dim, self.seed, buf.layer).to(dev))

    def _put(self, buf: KVBuffer, index, codes: torch.Tensor) -> None:
        """Store codes (..., rows, words) at slot(s) `index`."""
        if self.in_state:
            buf.state[index] = codes[..., 0].to(torch.float32)
            return
        buf.policy_state["hash"][index] = codes

    def _get(self, buf: KVBuffer, index) -> torch.Tensor:
        """Codes (..., rows, words) of slot(s) `index`."""
        if self.in_state:
            return buf.state[index].to(torch.int64).unsqueeze(-1)
        return buf.policy_state["hash"][index]

    # ------------------------------------------------------------------ prefill
    def prefill(self, buf, k, v, pos, valid, scores=None, q=None):
        """k, v (S, rows, d); pos, valid (S, rows); q (S, rows, group, d) post-RoPE prompt
        queries when the engine passes them."""
        lay = buf.layout
        buf.ring_start = buf.cursor = lay.prefix
        if not lay.evicts:
            return buf.store_prompt(k, v, pos, valid)
        s = k.shape[0]
        order = left_aligned(valid)
        k, v, pos, valid, _ = gather_prompt(order, k, v, pos, valid)
        proj = self._proj(buf)
        kb = hash_bits(k, proj)                 # (S, rows, bits), packed for the kept only
        n_real = valid.sum(dim=0)                                  # (rows,)
        sinks, ring = self.sinks, lay.ring
        npool = lay.prefix - sinks
        dev = k.device
        j = torch.arange(npool, device=dev).unsqueeze(1)
        mid_end = n_real - ring                                    # middle tokens: [sinks, mid_end)
        if self.prompt_pool == "recent_global":
            idx = mid_end - npool + j
            pool = torch.where(idx >= sinks, idx, -1)
        else:
            idx = sinks + j
            pool = torch.where(idx < mid_end, idx, -1)
            if s > buf.capacity:
                ks = _signs(kb)                                     # (S, rows, bits)
                if self.hash_source == "query" and q is not None:
                    qs = _signs(hash_bits(q, proj)).sum(dim=2)      # summed over the group
                    qs = qs.gather(0, order.unsqueeze(-1).expand_as(qs))   # as k, left-aligned
                else:
                    qs = ks
                pool = self._replay(pool, ks, qs, n_real, buf.capacity, ring)
        self._store(buf, k, v, pos, valid, kb, pool, n_real)

    def _replay(self, pool, ks, qs, n_real, capacity, ring):
        """Algorithm 1 over prompt tokens t = capacity .. S-1 on token indices only.

        At step t the candidates are the pool (non-sink prefix; -1: empty, which competes as
        token 0 one step older) and the token leaving the ring, a = t - ring; the one with the
        largest (distance, -index) goes. Rows are independent; a row takes part while t < its
        length. ks (S, rows, bits): the keys' codes as +-1; qs (S, rows, bits): the queries',
        summed over the group. Every distance comes from one batched GEMM per chunk of steps
        (`_replay_keys`); what stays a loop is Algorithm 1's own dependency, each step's pool
        being the last one's after its eviction (`kernels.hash_replay`: on a GPU one launch
        per chunk). -> the final pool (P, rows)."""
        s, rows = ks.shape[:2]
        npool = pool.shape[0]
        # (rows, P + 1): a row that evicts its arrival writes it to the spare last column
        pool = torch.cat([pool.t(), pool.new_zeros(rows, 1)], dim=1)
        empty = bool((pool[:, :npool] < 0).any())        # prefill only: one host read
        all_live = int(n_real.min())
        ks, qs = ks.permute(1, 2, 0), qs.transpose(0, 1)          # (rows, bits, S), (rows, S, bits)
        chunk = KEY_CHUNK_VALUES_GPU if ks.is_cuda else KEY_CHUNK_VALUES
        span = max(1, chunk // (rows * s))
        for c0 in range(capacity, s, span):
            c1 = min(c0 + span, s)
            keys = _replay_keys(ks[..., :c1 - ring], qs[:, c0:c1])   # (c, rows, c1 - ring)
            hash_replay(keys, pool, n_real, c0, ring, all_live, empty)
        return pool[:, :npool].t()

    def _store(self, buf, k, v, pos, valid, kb, pool, n_real):
        """Lay the kept tokens out: sinks, the pool in position order, then the last `ring`
        tokens right-aligned in the ring (a short row's holes sit at the ring's oldest end, so
        the ring stays a FIFO of the most recent tokens). Holes are invalid."""
        dev = k.device
        sinks, ring = self.sinks, buf.layout.ring
        sink = torch.arange(sinks, device=dev).unsqueeze(1).expand(-1, n_real.shape[0])
        far = torch.iinfo(torch.int64).max
        pool = torch.where(pool >= 0, pool, far).sort(dim=0).values
        recent = n_real - ring + torch.arange(ring, device=dev).unsqueeze(1)
        keep = torch.cat([sink, pool, recent])                            # (capacity, rows)
        ok = torch.cat([sink < n_real, pool != far, recent >= max(sinks, 0)])
        keep = torch.where(ok, keep, 0)
        buf.store_prompt(k, v, pos, valid, keep=keep)
        c = buf.capacity
        buf.valid[:c] &= ok
        buf.pos[:c].masked_fill_(~ok, -1)
        kept = kb.gather(0, keep.unsqueeze(-1).expand(-1, -1, kb.shape[-1]))  # (capacity, rows, c)
        self._put(buf, slice(0, c), pack_codes(kept))

    # ------------------------------------------------------------------ decode
    def before_attention(self, buf, slot, q):
        """Hash the new key; when the buffer is full, pick each row's victim from the current
        query's hash and mask it out of this step's attention (Algorithm 1 lines 1-2, 6)."""
        if not buf.layout.evicts:
            return
        proj = self._proj(buf)
        if slot != buf.scratch or self.hash_source == "key":
            hk = hash_codes(buf.k[slot], proj)                      # (rows, W)
            hq = hk.unsqueeze(1)
        else:                                 # the key and the group's queries in one call
            codes = hash_codes(torch.cat([buf.k[slot].unsqueeze(1), q], dim=1), proj)
            hk, hq = codes[:, 0], codes[:, 1:]                      # (rows, W), (rows, g, W)
        self._put(buf, slot, hk)
        if slot != buf.scratch:
            return
        # empty first, else the farthest; ties: the oldest; valid sinks stay (one launch)
        codes = None if self.in_state else buf.policy_state["hash"]
        bits = min(self.hash_bits, WORD_BITS)
        buf.policy_state["victims"].copy_(kernels.hash_victims(buf, hq, self.sinks, codes, bits))

    def commit(self, buf, slot):
        if slot != buf.scratch:
            return buf.commit_appended(slot)
        victims = buf.policy_state["victims"]
        if not self.in_state:                       # mirror ring_commit's moves on the codes
            h, rows = buf.policy_state["hash"], buf.rows_index
            cursor = buf.ring_cursor()           # an int, or the (1,) index kept on the device
            h[victims, rows] = h[cursor, rows]
            h[cursor] = h[buf.scratch].clone()   # an indexed write refuses a view of h itself
        kernels.ring_commit(buf, victims)
