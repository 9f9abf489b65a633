"""`triattention`: TriAttention (Mao, Lin, Huang, Xie, Fu, Zhuang, Han, Chen, "TriAttention:
Efficient Long Reasoning with Trigonometric KV Compression", arXiv 2604.04921, 2026; the Q/K
concentration of pre-RoPE queries and keys, the trigonometric-series score with its norm term,
and the offline calibration of the query statistics, in its method section - section pointers
unchecked against a copy of the paper).

Rule: no attention weights. Offline, per model, each query head's pre-RoPE queries are
summarised per RoPE frequency f (dims f and f + d/2 as one complex number q_f): the mean
q̄_f and the mean modulus E|q_f| (the calibration: `python -m flexevict.calibrate_policy
triattention --model M`). A cached key k (pre-RoPE k_f, at position p) is scored by the
trigonometric series a query at the centre q̄ would give it at distance D,
    S_trig(D) = sum_f |q̄_f| |k_f| cos(D w_f + arg q̄_f - arg k_f),
averaged over the future distances D = t - p + o, o in 1, 2, 4, ..., `horizon` (t: the next
query's position), plus the norm term S_norm = sum_f (E|q_f| - |q̄_f|) |k_f| (the part of the
queries the centre misses). The keys with the lowest scores go.

Decisions where the paper is silent or the engine differs (policies/README.md#triattention):
- The score is computed from the cached (post-RoPE) key directly: with k_rot = k e^{i p w},
  the series' mean over the offsets is Re sum_f conj(k_rot,f) q̄_f e^{i t w_f} m_f with
  m_f = mean_o e^{i o w_f}, i.e. a dot product of the key with one effective query per head
  and step (`effective_query`): the cost of attention's own q.k, with no RoPE inversion and
  no per-key trigonometry. The same numbers as inverting RoPE first, up to rounding (tested
  against a float64 computation of the formula as written).
- Per (layer, kv head) selection, as every policy here: each query head's scores are
  z-normalised over the candidates and a kv head takes the max over its query heads (the
  authors' code's per-layer, per-head mode with its default normalisation and max). Their
  experiments' default shares one selection per kv head across all layers (mean over layers),
  which a layer-by-layer decode cannot do: layer j commits before layer j + 1 has its keys.
- Decode, fixed buffer: once full, every step scores all `slots` keys (the new one included)
  and evicts the lowest (ties: the oldest; empty slots first); the authors' code prunes a
  growing cache every 128 steps. The prompt, when longer than the buffer, is selected by the
  same score with t = its length (the authors' "allow prefill compression" variant; their
  default pins the prompt, which a buffer smaller than the prompt cannot).
- `window=W` protects the W newest tokens (0 by default, as the authors' HF code; their vLLM
  server protects 128).
- Offsets: powers of two up to `horizon` (65536, the authors' default), mean aggregation only
  (the max over offsets is not linear, so it would need per-key trigonometry).
- Models without RoPE (OPT): w = 0, so S_trig = q̄ . k at every distance, plus the norm term.
- Statistics (`stats`): `auto` uses the run's model's calibration (one made by the command and
  cached, else the one shipped for a packaged model); a model with none, or `stats=none`,
  scores by the norm term alone with unit query moduli (sum_f |k_f|): named in the result
  (`describe`, "calibration"). `stats=PATH` reads a calibration file.
- RoPE's attention scaling (YaRN) is taken as 1: no model here uses one.

Notes: policies/README.md#triattention
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import sys
from dataclasses import dataclass

import torch

from flexevict.core import kernels
from flexevict.core.kv import gather_prompt, left_aligned
from flexevict.core.model import rope_inv_freq
from flexevict.core.paths import cache_dir
from flexevict.errors import UserError, setting

from flexevict.policies.base import Policy
from flexevict.policies.keydiff import top_rows
from flexevict.policies.registry import register

FORMAT = "flexevict-triattention-1"
SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration")
COMMAND = "python -m flexevict.calibrate_policy triattention --model {}"


# ------------------------------------------------------------------ calibration files

@dataclass(frozen=True)
class Calibration:
    """A model's query statistics: q_mean (L, H, F, 2) fp32 (real, imaginary parts of each query
    head's mean pre-RoPE query per frequency), q_abs (L, H, F) fp32 (its mean modulus),
    inv_freq (F,) (the model's RoPE frequencies; zeros without RoPE), kv_heads, and where it
    came from: model, text, tokens."""
    q_mean: torch.Tensor
    q_abs: torch.Tensor
    inv_freq: torch.Tensor
    kv_heads: int
    model: str
    text: str
    tokens: int

    def check(self, config) -> None:
        """Refuse a calibration made for other shapes or RoPE frequencies than `config`'s."""
        want = (config.num_layers, config.num_heads, config.dim_head // 2)
        got = (*self.q_mean.shape[:2], self.q_mean.shape[2])
        same_rope = torch.allclose(self.inv_freq.double(), model_inv_freq(config).double(),
                                   rtol=1e-6, atol=0)
        if got != want or self.kv_heads != config.num_kv_heads or not same_rope:
            raise UserError(f"the TriAttention calibration of '{self.model}' (layers, heads, "
                            f"frequencies {got}) does not fit model '{config.name}' {want}; "
                            f"make one: {COMMAND.format(config.name)}")

    def describe(self) -> str:
        return f"{self.model}: {self.tokens} tokens of {self.text}"


def save_calibration(path: str, cal: Calibration) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.save({"format": FORMAT, "q_mean": cal.q_mean, "q_abs": cal.q_abs,
                "inv_freq": cal.inv_freq, "kv_heads": cal.kv_heads, "model": cal.model,
                "text": cal.text, "tokens": cal.tokens}, path)


def load_calibration(path: str) -> Calibration:
    """The calibration in `path` (read once per file version)."""
    try:
        return _load(path, os.stat(path).st_mtime_ns)
    except OSError as e:
        raise UserError(f"cannot read the TriAttention calibration {path}: {e}") from None


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime: int) -> Calibration:
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError) as e:
        raise UserError(f"cannot read the TriAttention calibration {path}: {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UserError(f"{path} is not a TriAttention calibration ({FORMAT})")
    return Calibration(**{k: v for k, v in data.items() if k != "format"})


def file_name(model: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", model.strip("/")) + ".pt"


def cache_path(model: str) -> str:
    """Where the command caches a model's calibration: <cache dir>/triattention/<model>.pt
    (`flexevict.core.paths.cache_dir`)."""
    return os.path.join(cache_dir(), "triattention", file_name(model))


def find_calibration(model: str) -> str | None:
    """The model's calibration file: the cached one, else the shipped one, else None."""
    for path in (cache_path(model), os.path.join(SHIPPED, file_name(model))):
        if os.path.isfile(path):
            return path
    return None


def model_inv_freq(config) -> torch.Tensor:
    """(F,) the RoPE frequencies w of `config` (zeros for a family without RoPE)."""
    if config.family.uses_rope:
        return rope_inv_freq(config)
    return torch.zeros(config.dim_head // 2)


def query_statistics(q: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor,
                     inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The calibration's statistics of one layer's queries, in float64.

    q (S, R, g, d) post-RoPE queries in the rotate-half order (dims f and f + d/2 pair up),
    pos, valid (S, R); inv_freq (F,) -> q_mean (R, g, F, 2), q_abs (R, g, F): RoPE undone
    (each query rotated back by its position), then per frequency the mean over valid
    queries of the complex pair, and of its modulus."""
    f = q.shape[-1] // 2
    angle = -pos.double().unsqueeze(-1) * inv_freq.double()                  # (S, R, F)
    back = torch.polar(torch.ones_like(angle), angle).unsqueeze(2)           # (S, R, 1, F)
    z = torch.complex(q[..., :f].double(), q[..., f:].double()) * back       # (S, R, g, F)
    w = valid.double()[..., None, None] / valid.sum(0).clamp(min=1)[:, None, None]
    mean = (z * w).sum(0)
    return torch.view_as_real(mean), (z.abs() * w).sum(0)


# ------------------------------------------------------------------ the score

def offsets(horizon: int) -> torch.Tensor:
    """The future offsets o: 1, 2, 4, ..., up to horizon (float64)."""
    return 2.0 ** torch.arange(horizon.bit_length(), dtype=torch.float64)


def offset_mean(inv_freq: torch.Tensor, horizon: int) -> torch.Tensor:
    """m_f = mean over the offsets of e^{i o w_f}: (F,) complex128."""
    o = offsets(horizon).to(inv_freq.device)
    return torch.polar(torch.ones(()).double().to(inv_freq.device),
                       o[:, None] * inv_freq.double()).mean(0)


def effective_query(q_mean: torch.Tensor, t: torch.Tensor, inv_freq: torch.Tensor,
                    m: torch.Tensor) -> torch.Tensor:
    """The trigonometric series as a query: q_mean (R, g, F, 2), t (R,) the next query's
    position, inv_freq (F,), m (F,) complex (`offset_mean`) -> u (R, g, d) fp32 such that
    k_rot . u is S_trig averaged over the offsets, for a post-RoPE key k_rot (d,) of that row."""
    turn = torch.polar(torch.ones(()).double().to(t.device),
                       t.double()[:, None] * inv_freq.double()) * m                # (R, F)
    w = torch.view_as_complex(q_mean.double().contiguous()) * turn[:, None]      # (R, g, F)
    return torch.cat([w.real, w.imag], dim=-1).float()


def head_scores(k: torch.Tensor, t: torch.Tensor, stats: dict) -> torch.Tensor:
    """Each query head's score of each key: k (n, R, d) cached keys, t (R,) -> (n, R, g) fp32,
    S_trig + S_norm (`stats`: `TriAttention.row_stats`)."""
    kf = k.float()
    f = kf.shape[-1] // 2
    u = effective_query(stats["q_mean"], t, stats["inv_freq"], stats["m"])
    trig = torch.bmm(kf.transpose(0, 1), u.transpose(1, 2))                   # (R, n, g)
    modulus = torch.sqrt(kf[..., :f] ** 2 + kf[..., f:] ** 2).transpose(0, 1)  # (R, n, F)
    norm = torch.bmm(modulus, stats["excess"].transpose(1, 2))                # (R, n, g)
    return (trig + norm).transpose(0, 1)


def combined(scores: torch.Tensor, valid: torch.Tensor, normalize: bool) -> torch.Tensor:
    """scores (n, R, g), valid (n, R) -> (n, R): each head's scores z-normalised over the
    row's valid keys (when `normalize`), then the max over the kv head's query heads; 0 at
    invalid slots."""
    if normalize:
        w = valid.unsqueeze(-1).float()
        count = w.sum(0).clamp(min=1)
        mean = (scores * w).sum(0) / count
        std = (((scores - mean) ** 2 * w).sum(0) / count).sqrt().clamp(min=1e-6)
        scores = (scores - mean) / std
    return torch.where(valid, scores.amax(-1), 0.0)


# ------------------------------------------------------------------ the policy

@dataclass(frozen=True)
class Binding:
    """What a run's model gives the policy: its name, the calibration (None: none) and RoPE
    frequencies (F,), and why no calibration was used (`missing`)."""
    model: str
    calibration: Calibration | None
    inv_freq: torch.Tensor | None
    missing: str = ""


@register
@dataclass(frozen=True)
class TriAttention(Policy):
    window: int = 0
    horizon: int = 65536
    normalize: bool = True
    stats: str = "auto"
    name = "triattention"
    graph_safe = True
    stacks = True
    min_slots = 2                     # one cached key + the token being decoded
    _binding = None                   # set on a copy by `for_model`

    def __post_init__(self):
        super().__post_init__()
        if self.window < 0:
            raise UserError(f"{setting('policy_args')} window={self.window}: must be >= 0 (the "
                            "newest tokens never evicted; 0: none)")
        if self.horizon < 1:
            raise UserError(f"{setting('policy_args')} horizon={self.horizon}: must be >= 1 (the "
                            "largest future offset scored)")
        if self.stats not in ("auto", "none") and not os.path.isfile(self.stats):
            raise UserError(f"{setting('policy_args')} stats={self.stats}: expected auto, none "
                            "or a calibration file")

    # ------------------------------------------------------------------ the model
    def for_model(self, config) -> "TriAttention":
        """This policy bound to a run's model: its calibration (`stats`) and RoPE frequencies."""
        if self._binding is not None and self._binding.model == config.name:
            return self
        path = self.stats if self.stats not in ("auto", "none") else None
        if self.stats == "auto":
            path = find_calibration(config.name)
        cal = load_calibration(path) if path else None
        if cal is not None:
            cal.check(config)
        missing = "" if cal else (
            "stats=none" if self.stats == "none" else
            f"no calibration for model '{config.name}' ({COMMAND.format(config.name)})")
        if not cal and self.stats == "auto":     # asked for the method, given a much weaker one
            print(f"flexevict: triattention has {missing}: it ranks keys by the norm term alone, "
                  "far less accurate (SmolLM2 at 10%: perplexity 7489 against 30 calibrated); "
                  "`--policy-arg stats=none` chooses that on purpose", file=sys.stderr)
        bound = dataclasses.replace(self)
        object.__setattr__(bound, "_binding", Binding(config.name, cal, model_inv_freq(config),
                                                      missing))
        return bound

    def describe(self, layout=None) -> dict:
        """Besides the arguments, the calibration used: its model, text and tokens, or why the
        norm term alone ranks the keys."""
        b = self._binding
        cal = ("unbound (no model yet: norm term alone)" if b is None else
               b.calibration.describe() if b.calibration else f"none, norm term alone: {b.missing}")
        return {**super().describe(layout), "calibration": cal}

    def row_stats(self, buf) -> dict:
        """The statistics of each of buf's rows, made once per buffer and device
        (`buf.constant`): q_mean (R, g, F, 2), excess = E|q| - |q_mean| (R, g, F), inv_freq
        (F,), m (F,) complex. Row r is kv head r % kv_heads of layer `buf.layer` (a stack of
        every layer: of layer r // (R / layers))."""
        return buf.constant("triattention", functools.partial(self._row_stats, buf))

    def _row_stats(self, buf, device) -> dict:
        rows, f = buf.valid.shape[1], buf.head_dim // 2
        b = self._binding
        cal = b.calibration if b else None
        inv = (b.inv_freq if b else torch.zeros(f)).to(device)
        if cal is None:
            return {"q_mean": torch.zeros(rows, 1, f, 2, device=device),
                    "excess": torch.ones(rows, 1, f, device=device), "inv_freq": inv,
                    "m": offset_mean(inv, self.horizon)}
        layers, heads = cal.q_mean.shape[:2]
        g, r = heads // cal.kv_heads, torch.arange(rows)
        layer = r // (rows // layers) if buf.layer is None else torch.full_like(r, buf.layer)
        head = (r % cal.kv_heads)[:, None] * g + torch.arange(g)                 # (R, g)
        q_mean = cal.q_mean[layer[:, None], head]                               # (R, g, F, 2)
        excess = cal.q_abs[layer[:, None], head] - torch.linalg.vector_norm(q_mean, dim=-1)
        return {"q_mean": q_mean.to(device), "excess": excess.to(device), "inv_freq": inv,
                "m": offset_mean(inv, self.horizon)}

    def scores(self, buf, k, valid, t) -> torch.Tensor:
        """k (n, R, d), valid (n, R), t (R,) the next query's position -> (n, R) fp32: the
        higher, the more the key is kept (`head_scores`, `combined`)."""
        return combined(head_scores(k, t, self.row_stats(buf)), valid, self.normalize)

    def protected(self, capacity: int) -> int:
        """The newest tokens never evicted (`window`, leaving at least two to compete)."""
        return max(0, min(self.window, capacity - 1))

    # ------------------------------------------------------------------ hooks
    def prefill(self, buf, k, v, pos, valid, scores=None):
        n = buf.capacity
        if k.shape[0] <= n:
            return buf.store_prompt(k, v, pos, valid)
        order = left_aligned(valid)
        k, v, pos, valid, _ = gather_prompt(order, k, v, pos, valid)
        t = torch.where(valid, pos, -1).amax(0).long() + 1
        rank = torch.where(valid, self.scores(buf, k, valid, t), float("-inf"))
        idx = torch.arange(k.shape[0], device=k.device).unsqueeze(1)
        rank = rank.masked_fill(valid & (idx >= valid.sum(0) - self.protected(n)), float("inf"))
        buf.store_prompt(k, v, pos, valid, keep=top_rows(rank, n))

    def commit(self, buf, slot):
        if not buf.layout.evicts or slot != buf.scratch:
            return buf.commit_appended(slot)
        n, newest = buf.scratch + 1, buf.pos[buf.scratch]
        value = self.scores(buf, buf.k[:n], buf.valid[:n], newest.long() + 1)
        w = self.protected(buf.capacity)
        if w:                                # the `window` newest stay
            value = value.masked_fill(buf.pos[:n] > newest - w, float("inf"))
        # the lowest score goes (a scratch victim drops the new token after one step)
        kernels.evict_commit(buf, n, cursor=False, value=value, commit="replace")
