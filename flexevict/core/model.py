"""White-box decoders in plain PyTorch: every family in `core/families/`, one model.

The model is four functions over explicit weights: `embed` (tokens -> hidden), a block's
`attention_half` (reading and writing that layer's `KVBuffer` through the policy) and
`mlp_half`, and `head` (hidden -> logits). What differs between families (weight names, norms,
embeddings, the MLP, a per-head transform of queries and keys) is the family's (`Family`);
attention, RoPE and the cache are here, once. The only caller is the engine (engine.py), which
streams one layer's weights at a time and reuses them over several GPU batches: there is no
second forward loop. Shapes: B batch, S sequence, H query heads,
Hk kv heads, d head dim, D hidden, R = B * Hk buffer rows.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flexevict.core import kernels
from flexevict.core.config import ModelConfig
from flexevict.core.ops import (LINEAR_WEIGHTS, PackedWeight, linear,  # noqa: F401 - re-exported
                                onednn_usable, prepack, rms_norm)
from flexevict.errors import UserError
from flexevict.core.kv import KVBuffer


# ------------------------------------------------------------------------------------ weights

def load_layer_weights(config: ModelConfig, source, j: int, device, dtype, only=None) -> dict:
    """Layer j's weights with q/k/v (and LLaMA's gate/up) fused into one matrix each; an absent
    bias is None. only: the keys to read (the others are None); default all."""
    weights = {}
    for key, names in layer_recipe(config, j).items():
        if names is None or (only is not None and key not in only):
            weights[key] = None
            continue
        parts = [source.load(n, device=device, dtype=dtype) for n in names]
        weights[key] = parts[0] if len(parts) == 1 else torch.cat(parts)
    return weights


def layer_recipe(config: ModelConfig, j: int) -> dict:
    """How each of layer j's weights is made: key -> the HF tensors concatenated along dim 0
    (q/k/v and gate/up fused), or None for an absent bias. Keys in the model's order; a fused
    bias that the model lacks (bqkv, bgu) has no key at all (`Family.layer_recipe`)."""
    return config.family.layer_recipe(config, j)


def load_outer_weights(config: ModelConfig, source, device, dtype) -> dict:
    """Embeddings, final norm and LM head (tied heads share the embedding tensor)."""
    raw = {n: source.load(n, device=device, dtype=dtype) for n in config.outer_param_shapes()}
    return config.family.outer_weights(config, raw)


# ------------------------------------------------------------------------------------ RoPE

def rope_inv_freq(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """Rotary inverse frequencies (d/2,), with linear or llama3 scaling when the config has it;
    local: the sliding layers' table (base `rope_local_theta`, never scaled: Gemma-3's)."""
    d = config.dim_head
    theta = config.rope_local_theta if local else config.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = config.rope_scaling
    if not sc or local:
        return inv
    kind = sc.get("rope_type", sc.get("type"))
    factor = float(sc["factor"])
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        old_ctx = sc["original_max_position_embeddings"]
        low_wl = old_ctx / sc["low_freq_factor"]
        high_wl = old_ctx / sc["high_freq_factor"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = ((old_ctx / wavelen - sc["low_freq_factor"])
                  / (sc["high_freq_factor"] - sc["low_freq_factor"]))
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        return torch.where(medium, smoothed, scaled)
    raise UserError(f"rope scaling '{kind}' is not supported (linear or llama3)")


def rope_cos_sin(inv_freq: torch.Tensor, pos: torch.Tensor, dtype):
    """cos, sin of shape pos.shape + (d,) for integer positions; inv_freq on pos's device."""
    freqs = pos.to(torch.float32).unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (..., d) rotated by the rotate-half convention (dims i and i + d/2 pair up); cos/sin
    (..., d) broadcast to x, their halves equal (`rope_cos_sin`)."""
    h = x.shape[-1] // 2
    return rotate_pairs(x, cos[..., :h], sin[..., :h])


def rotate_pairs(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """RoPE from the half-width cos/sin: x (..., d), c and s (..., d/2) broadcast to x's halves.

    x * cos + rotate_half(x) * sin, half by half: the same products and sums bit for bit
    (x1 c + (-x2) s is x1 c - x2 s in IEEE arithmetic) without building rotate_half(x) or
    concatenating the halves: each half is written in place into one output (in fp32 on a CPU
    this took a seventh, then under half, of the time). No fused multiply-add (addcmul), which
    rounds once and would differ."""
    h = x.shape[-1] // 2
    out = x.new_empty(torch.broadcast_shapes(x.shape, c.shape[:-1] + (x.shape[-1],)))
    _rotate_into(out[..., :h], out[..., h:], x[..., :h], x[..., h:], c, s)
    return out


def _rotate_into(lo, hi, x1, x2, c, s) -> None:
    """lo = x1 c - x2 s, hi = x2 c + x1 s: a pair's rotation, each product rounded apart."""
    torch.mul(x1, c, out=lo)
    lo.sub_(x2 * s)
    torch.mul(x2, c, out=hi)
    hi.add_(x1 * s)


# ------------------------------------------------------------------------------------ pieces

NO_CLOCK = contextlib.nullcontext()   # what `attention_half` times policy hooks with by default

@dataclass
class StepInput:
    """Per-call metadata shared by all layers.

    prefill: pos (B, S) absolute positions, valid (B, S) non-pad mask (pads first).
    decode:  pos (B,), valid None.
    """
    pos: torch.Tensor
    valid: torch.Tensor | None
    rope: tuple | None = None      # (cos, sin), computed once per call (RoPE families)
    local_rope: tuple | None = None    # the same from the sliding layers' own RoPE base, if any
    pads: torch.Tensor | None = None   # prefill: (B,) pads per row; None when no row has any
    pos_end: int | None = None     # every position so far is below it (host-known), or None


class Transformer:
    """A white-box decoder (any family of `core/families/`) over explicit weights."""

    def __init__(self, config: ModelConfig, layers: list[dict], outer: dict, device=None,
                 dtype=None):
        """layers/outer: resident weights (may be empty when an engine streams them and passes
        each call its loaded weights); device/dtype default to the embedding's."""
        self.config, self.layers, self.outer = config, layers, outer
        self.family = config.family
        rope = self.family.uses_rope
        self.inv_freq = rope_inv_freq(config) if rope else None
        # the sliding layers' own table (Gemma-3's local base), used by the layers `local`
        self.windows = [config.layer_window(j) for j in range(config.num_layers)]
        has_local = rope and config.rope_local_theta is not None and any(self.windows)
        self.local_inv_freq = rope_inv_freq(config, local=True) if has_local else None
        self.local = [has_local and w is not None for w in self.windows]
        self.scale = (config.query_pre_attn_scalar or config.dim_head) ** -0.5
        self._inv_freq_at = {}         # (device, local) -> inv_freq there, copied once
        self._rank_rope_at = {}        # (device, dtype, local) -> `rank_rope`'s table
        self._device, self._dtype = device, dtype

    @classmethod
    def load(cls, config: ModelConfig, source, device="cpu", dtype=torch.float32, progress=None,
             onednn: bool | None = None):
        """Load every weight onto `device`. onednn (default: when usable, i.e. fp32 on CPU and
        FLEXEVICT_ONEDNN is not 0) prepacks the linear weights for oneDNN."""
        pack = onednn_usable(device, dtype) if onednn is None else onednn
        layers = []
        for j in range(config.num_layers):
            layers.append(load_layer_weights(config, source, j, device, dtype))
            if pack:
                prepack(layers[-1])
            if progress:
                progress(j)
        outer = load_outer_weights(config, source, device, dtype)
        if pack:
            prepack(outer)       # a tied head gets its own packed copy; the embedding stays
        return cls(config, layers, outer)

    @property
    def dtype(self):
        return self._dtype or self.outer["embed"].dtype

    @property
    def device(self):
        return self._device or self.outer["embed"].device

    def rope_freq(self, device, local: bool = False) -> torch.Tensor:
        """inv_freq (local: the sliding layers' `local_inv_freq`) on `device`, copied there on
        first use: a copy per call would make every decode step wait for a host-to-device
        transfer."""
        key = (torch.device(device), local)
        if key not in self._inv_freq_at:
            self._inv_freq_at[key] = (self.local_inv_freq if local else self.inv_freq).to(key[0])
        return self._inv_freq_at[key]

    def rank_rope(self, n: int, device, dtype, local: bool = False) -> torch.Tensor:
        """`rank_table` for the ranks 0..m-1, m >= n, on (device, dtype): kept, and grown by
        doubling. StreamingLLM and Cascade rotate every cached key to its in-cache rank on
        every step; a lookup in the table saves recomputing the cosines and sines of the whole
        cache each step."""
        key = (torch.device(device), dtype, local)
        table = self._rank_rope_at.get(key)
        if table is None or table.shape[0] < n:
            size = 1 << max(n - 1, 1).bit_length()
            table = self._rank_rope_at[key] = rank_table(self.rope_freq(device, local), size,
                                                         dtype)
        return table

    # ------------------------------------------------------------------ embed / head
    def step_input(self, pos: torch.Tensor, valid: torch.Tensor | None,
                   pos_end: int | None = None) -> StepInput:
        rope = local = None
        if self.inv_freq is not None:
            rope = rope_cos_sin(self.rope_freq(pos.device), pos, self.dtype)
        if self.local_inv_freq is not None:
            local = rope_cos_sin(self.rope_freq(pos.device, local=True), pos, self.dtype)
        pads = None
        if valid is not None and not bool(valid.all()):   # prefill: one host read per call
            pads = (~valid).sum(dim=1)
        return StepInput(pos=pos, valid=valid, rope=rope, local_rope=local, pads=pads,
                         pos_end=pos_end)

    def embed(self, tokens: torch.Tensor, inp: StepInput, o: dict | None = None) -> torch.Tensor:
        """tokens (B, S) or (B,) -> hidden (B, S, D) or (B, D). o: outer weights (default
        resident)."""
        return self.family.embed(self.config, self.outer if o is None else o, tokens, inp)

    def head(self, h: torch.Tensor, o: dict | None = None) -> torch.Tensor:
        """hidden (..., D) -> fp32 logits (..., V). o: outer weights (default resident)."""
        return self.family.head(self.config, self.outer if o is None else o, h)

    # ------------------------------------------------------------------ one layer
    def attention_half(self, w: dict, h: torch.Tensor, inp: StepInput, buf: KVBuffer,
                       policy, clock=NO_CLOCK) -> torch.Tensor:
        """Norm, attention over `buf` (updated through `policy`), residual. The engine runs the
        two halves of a block as separate schedule layers with `sep_layer`. clock: a context
        manager entered around each policy hook (the engine times eviction bookkeeping)."""
        c, fam = self.config, self.family
        x = fam.attention_input(c, w, h)
        attn = linear(self.attention(x, w, inp, buf, policy, clock), w["wo"], w["bo"])
        return fam.attention_output(c, w, h, attn)

    def mlp_half(self, w: dict, h: torch.Tensor) -> torch.Tensor:
        """Norm, feed-forward, residual (`Family.mlp_half`)."""
        return self.family.mlp_half(self.config, w, h)

    def attention(self, x, w, inp: StepInput, buf: KVBuffer, policy, clock=NO_CLOCK
                  ) -> torch.Tensor:
        c = self.config
        nh, nk, d = c.num_heads, c.num_kv_heads, c.dim_head
        qkv = linear(x, w["wqkv"], w.get("bqkv"))
        q, k, v = qkv.split([nh * d, nk * d, nk * d], dim=-1)
        q, k = self.family.query_key(c, w, q, k)
        if buf.layer is not None and self.local[buf.layer]:    # the layer's own RoPE table
            inp = dataclasses.replace(inp, rope=inp.local_rope)
        if x.dim() == 3:
            return self._prefill_attention(q, k, v, inp, buf, policy, clock)
        return self._decode_attention(q, k, v, inp, buf, policy, clock)

    def _prefill_attention(self, q, k, v, inp, buf, policy, clock):
        c = self.config
        b, s, _ = q.shape
        nh, nk, d = c.num_heads, c.num_kv_heads, c.dim_head
        q = q.view(b, s, nh, d).transpose(1, 2)                   # (B, H, S, d)
        k = k.view(b, s, nk, d).transpose(1, 2)                   # (B, Hk, S, d)
        v = v.view(b, s, nk, d).transpose(1, 2)
        k_cached = k
        if inp.rope is not None:
            cos, sin = (t.unsqueeze(1) for t in inp.rope)          # (B, 1, S, d)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            # keys cached before RoPE, its pairs side by side (`rotate_in_cache`)
            k_cached = pairs_adjacent(k_cached) if buf.layout.rope_in_cache else k
        factor = policy.logit_scale(s)
        scale = self.scale * factor
        window = self.windows[buf.layer] if buf.layer is not None else None
        window = window if window is not None and window < s else None   # else it never binds
        scores = None
        if policy.wants_prompt_scores(buf.layout):   # the scores come with the output
            if window is not None:     # layers.py gives a binding window `local`, never this
                raise ValueError("a sliding layer's window ring ranks no prompt")
            fold = (None if policy.prompt_scores is None
                    else functools.partial(policy.prompt_scores, buf.layout))
            out, scores = kernels.prefill_attention_scores(q, k, v, inp.valid, scale, fold)
        else:
            default = factor == 1.0 and self.scale == d ** -0.5
            slide = {} if window is None else {"window": window}
            out = causal_attention(q, k, v, inp.pads, None if default else scale, **slide)
        # buffer rows are (b, kv-head): (B, Hk, S, ...) -> (S, B*Hk, ...)
        def rows(t):
            return t.permute(2, 0, 1, *range(3, t.dim())).reshape(s, b * nk, *t.shape[3:])
        pos = inp.pos.unsqueeze(1).expand(b, nk, s)
        valid = inp.valid.unsqueeze(1).expand(b, nk, s)
        extra = {}
        if policy.needs_prompt_queries and buf.layout.evicts:
            extra["q"] = (q.view(b, nk, nh // nk, s, d).permute(3, 0, 1, 2, 4)
                          .reshape(s, b * nk, nh // nk, d))
        with clock:
            policy.prefill(buf, rows(k_cached), rows(v), rows(pos).to(torch.int32), rows(valid),
                           None if scores is None else rows(scores), **extra)
        return out.reshape(b, s, nh * d)

    def _decode_attention(self, q, k, v, inp, buf, policy, clock):
        """Attention and eviction run where the buffer lives (FlexGen's cpu_cache_compute ships
        the new token's q, k, v to the CPU-resident cache and the output back)."""
        home = buf.k.device
        if q.device != home:
            rope = None if inp.rope is None else tuple(t.to(home) for t in inp.rope)
            inp = StepInput(pos=inp.pos.to(home), valid=None, rope=rope, pos_end=inp.pos_end)
            out = self._decode_attention(q.to(home), k.to(home), v.to(home), inp, buf, policy,
                                         clock)
            return out.to(q.device)
        c = self.config
        b = q.shape[0]
        nh, nk, d = c.num_heads, c.num_kv_heads, c.dim_head
        g = nh // nk
        q = q.reshape(b * nk, g, d)                                # rows = (b, kv-head)
        k = k.reshape(b * nk, d)
        in_cache = inp.rope is not None and buf.layout.rope_in_cache
        if inp.rope is not None and not in_cache:
            cos, sin = (t.repeat_interleave(nk, dim=0) for t in inp.rope)   # (R, d)
            q, k = apply_rope(q, cos.unsqueeze(1), sin.unsqueeze(1)), apply_rope(k, cos, sin)
        if in_cache:                          # cached before RoPE, its pairs side by side
            k = pairs_adjacent(k)
        slot = buf.incoming_slot()
        buf.write(slot, k, v.reshape(b * nk, d), inp.pos.repeat_interleave(nk).to(torch.int32))
        rotate = (functools.partial(self._rotate_in_cache, buf=buf, pos_end=inp.pos_end)
                  if in_cache else None)
        return cache_attention(q, buf, slot, policy, self.scale, rotate, clock).reshape(b, nh * d)

    def _rotate_in_cache(self, q, n: int, buf: KVBuffer, pos_end: int | None = None):
        """`rotate_in_cache` with the rank table of buf's layer."""
        local = buf.layer is not None and self.local[buf.layer]
        return rotate_in_cache(q, buf, n, self.rank_rope(n, q.device, q.dtype, local), pos_end)


def cache_attention(q, buf: KVBuffer, slot: int, policy, scale: float, rotate=None,
                    clock=NO_CLOCK) -> torch.Tensor:
    """A decode step's attention over a layer's cache, the new token's K/V already written at
    `slot`: the policy's hooks around attention over the slots it attends. The one copy of this
    sequence; the calibration prices a policy by timing it (`calibration.measure_policy`).

    q (R, g, d), rows (sequence, kv head); scale: the layer's, before the policy's logit scale.
    rotate(q, n) -> (q, keys (n, R, d)): for a buffer that keeps keys before RoPE
    (`Layout.rope_in_cache`), the query and the attended keys at their in-cache ranks. clock:
    entered around the policy's work, its hooks and that rotation (what eviction adds to
    attention) -> out (R, g, d)."""
    with clock:
        policy.before_attention(buf, slot, q)
    n = buf.attended(slot)
    keys = None
    if rotate is not None:
        with clock:
            q, keys = rotate(q, n)
    scale = scale * policy.logit_scale(min(n, buf.used + 1))
    scored = policy.accumulates_attention
    out, probs = attend(q, buf, n, scale, keys, scored)
    with clock:
        policy.after_attention(buf, slot, probs, scored=scored)
    return out


def rank_table(inv_freq: torch.Tensor, size: int, dtype) -> torch.Tensor:
    """RoPE's cos and sin side by side, (size, d/2, 2), for the positions 0..size-1 (inv_freq
    (d/2,) on the table's device): row p, frequency i holds (cos, sin) of p inv_freq[i],
    bit-identical to `rope_cos_sin` of p. In fp32 it is a complex table (cos + i sin): one
    gather fetches both, one complex product rotates (`rotate_adjacent`)."""
    cos, sin = rope_cos_sin(inv_freq, torch.arange(size, device=inv_freq.device), dtype)
    h = cos.shape[-1] // 2
    return torch.stack([cos[:, :h], sin[:, :h]], dim=-1)


def pairs_adjacent(x: torch.Tensor) -> torch.Tensor:
    """x (..., d) in the rotate-half order (dims i and i + d/2 pair up) -> a copy with each
    pair side by side, (x_0, x_h, x_1, x_h+1, ...): how keys cached before RoPE are stored, so
    that rotating them is one complex product (`rotate_adjacent`). Attention is a dot product
    over d, the same in any order of the dims that the query shares (up to its rounding)."""
    h = x.shape[-1] // 2
    return x.unflatten(-1, (2, h)).transpose(-1, -2).flatten(-2)


def rotate_adjacent(x: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
    """RoPE of x (..., d), its pairs side by side (`pairs_adjacent`), by cs (..., d/2, 2) from
    `rank_table` (broadcast to x's pairs) -> (..., d), pairs side by side.

    (x_a + i x_b)(cos + i sin): x_a cos - x_b sin and x_b cos + x_a sin, the products and sums
    of `rotate_pairs` bit for bit. In fp32 one complex product: a third of `rotate_pairs`'
    time on a CPU over a strided layer of a stack, which is what in-cache RoPE does to every
    cached key each step. 16-bit floats have no complex type: the same arithmetic by halves."""
    pairs = x.unflatten(-1, (-1, 2))
    if x.dtype in (torch.float32, torch.float64):
        out = torch.view_as_complex(pairs) * torch.view_as_complex(cs)
        return torch.view_as_real(out).flatten(-2)
    out = x.new_empty(torch.broadcast_shapes(pairs.shape, cs.shape))
    _rotate_into(out[..., 0], out[..., 1], pairs[..., 0], pairs[..., 1], cs[..., 0], cs[..., 1])
    return out.flatten(-2)


def rotate_in_cache(q, buf: KVBuffer, n: int, table: torch.Tensor, pos_end: int | None = None):
    """RoPE by in-cache rank (StreamingLLM/Cascade): keys cached before RoPE, their pairs side
    by side (`pairs_adjacent`), are rotated to their rank among the row's valid slots, the
    query to the last rank. q (R, g, d) in the rotate-half order; table (m, d/2, 2) from
    `rank_table`, m >= n; pos_end as in `cache_ranks` -> q, keys (n, R, d), both with their
    pairs side by side (attention reads them together)."""
    valid = buf.valid[:n]
    rank = cache_ranks(buf.pos[:n], valid, pos_end)                             # (n, R)
    both = table.index_select(0, rank.reshape(-1)).view(*rank.shape, *table.shape[1:])
    keys = rotate_adjacent(buf.k[:n], both)                                      # (n, R, d)
    at_q = table[valid.sum(dim=0) - 1].unsqueeze(1)                      # (R, 1, d/2, 2)
    return rotate_adjacent(pairs_adjacent(q), at_q), keys


def cache_ranks(pos: torch.Tensor, valid: torch.Tensor, pos_end: int | None = None):
    """Each valid slot's rank by position among its row's valid slots (positions are distinct
    within a row): pos (n, R) int, valid (n, R) bool, pos_end: every position is below it (known
    on the host), or None -> (n, R) int64; an invalid slot's rank is some value in [0, n) (its
    key is masked out of attention).

    A counting sort on a CPU given pos_end (6x faster than the sort at 460 slots x 24 rows);
    else a stable sort (on a GPU: no host read, the same shapes every step for CUDA graphs)."""
    if pos.is_cuda or pos_end is None:
        return _sorted_ranks(pos, valid)
    return _counted_ranks(pos, valid, pos_end)


def _sorted_ranks(pos, valid):
    """`cache_ranks` by a stable sort of the positions and its inverse permutation."""
    n, rows = pos.shape
    order = torch.where(valid, pos, torch.iinfo(pos.dtype).max).sort(dim=0, stable=True).indices
    ranks = torch.arange(n, device=pos.device).unsqueeze(1).expand(n, rows)
    return torch.empty_like(order).scatter_(0, order, ranks)


def _counted_ranks(pos, valid, pos_end: int):
    """`cache_ranks` by marking each row's valid positions in an (R, pos_end + 1) table and
    reading its running count at each slot; invalid slots are marked in a last column of their
    own. A position at or past pos_end fails the scatter (out of range), never silently."""
    n, rows = pos.shape
    spill = pos_end
    at = torch.where(valid, pos, spill).t().long()                            # (R, n)
    marks = torch.zeros(rows, spill + 1, dtype=torch.int32, device=pos.device)
    marks.scatter_(1, at, 1)
    below = marks.cumsum(1, dtype=torch.int32).gather(1, at) - 1              # (R, n)
    return below.clamp_(0, max(n - 1, 0)).t().long()


def causal_attention(q, k, v, pads: torch.Tensor | None, scale: float | None = None,
                     window: int | None = None):
    """Causal prefill attention of left-padded rows on SDPA's fused kernels (flash attention
    where the device has it). q (B, H, S, d), k/v (B, Hk, S, d), pads (B,) int pads at the start
    of each row, or None when no row has any; scale None = d^-0.5; window: each query sees only
    the last `window` tokens, itself included (a sliding-window layer: `windowed_attention`,
    banded) -> out (B, S, H, d), rows token-major for the output projection.

    Padding without a mask: SDPA cannot combine is_causal with a mask, and a (B, 1, S, S) mask
    rules out the flash kernel and makes the others read a B*S*S bias. Rolling each row left by
    its pad count moves its real tokens to the front, and there plain causal attention is exact:
    a real query sees exactly the real tokens up to itself. Pad queries, now at the end, see at
    least their row's first real token, so no row is fully masked and no NaN can arise (their
    outputs are finite and never read). The rolls are gathers of q, k, v and the output,
    O(B H S d) next to attention's O(B H S^2 d), and only a padded batch pays them.
    """
    gqa = q.shape[1] != k.shape[1]
    if window is not None:
        attention = functools.partial(windowed_attention, window=window, scale=scale, gqa=gqa)
    else:
        attention = functools.partial(F.scaled_dot_product_attention, is_causal=True,
                                      scale=scale, enable_gqa=gqa)
    if pads is None:
        return attention(q, k, v).transpose(1, 2)
    b, h, s, d = q.shape
    slots = torch.arange(s, device=q.device)
    src = (slots + pads[:, None]) % s            # (B, S): rolled slot i holds token src[b, i]

    def roll(t):
        return t.gather(2, src[:, None, :, None].expand(b, t.shape[1], s, d))

    out = attention(roll(q), roll(k), roll(v))
    back = (slots - pads[:, None]) % s           # token i sits at rolled slot back[b, i]
    return out.transpose(1, 2).gather(1, back[:, :, None, None].expand(b, s, h, d))


def windowed_attention(q, k, v, window: int, scale: float | None, gqa: bool) -> torch.Tensor:
    """Causal attention where query i sees keys i - window < j <= i (rolled rows: real tokens
    first, so slot distance is position distance; a pad query still sees itself). q (B, H, S,
    d), k/v (B, Hk, S, d) -> (B, H, S, d).

    In bands of `window` queries, each over the keys its queries can see (at most 2 window - 1):
    about 2 S window scores instead of the S^2 of one masked square (a mask rules out the fused
    causal kernels, so the square is computed whole; 8x the work at 8k tokens, window 512)."""
    s = q.shape[2]
    attend_band = functools.partial(F.scaled_dot_product_attention, scale=scale, enable_gqa=gqa)
    if s <= 2 * window:                        # one masked square costs about as much
        return attend_band(q, k, v, attn_mask=window_mask(0, s, 0, window, q.device))
    out = torch.empty_like(q)
    for a in range(0, s, window):
        e, k0 = min(a + window, s), max(a - window + 1, 0)
        out[:, :, a:e] = attend_band(q[:, :, a:e], k[:, :, k0:e], v[:, :, k0:e],
                                     attn_mask=window_mask(a, e, k0, window, q.device))
    return out


def window_mask(a: int, e: int, k0: int, window: int, device) -> torch.Tensor:
    """(e - a, e - k0) bool: which of the keys k0..e-1 the queries a..e-1 see."""
    gap = torch.arange(a, e, device=device)[:, None] - torch.arange(k0, e, device=device)
    return (gap >= 0) & (gap < window)


def attend(q: torch.Tensor, buf: KVBuffer, n: int, scale: float, keys=None,
           score: bool = False):
    """Decode attention over the buffer's first n slots (`kernels.split_decode_attention`: the
    split-slot kernel on a GPU, its torch reference elsewhere).

    q: (R, g, d); keys: (n, R, d) to use instead of the cached keys (in-cache RoPE)
    -> out (R, g, d), probs (R, g, n) fp32 (policies sum over g for a kv head).
    score: also add probs, summed over g, to buf.score[:n] in the same kernel (for a policy
    that `accumulates_attention`; it is then told `scored=True`).
    """
    return kernels.split_decode_attention(q, buf.k[:n] if keys is None else keys, buf.v[:n],
                                          buf.valid[:n], scale, buf.score if score else None)
