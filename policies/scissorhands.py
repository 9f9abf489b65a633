"""`scissorhands`: Scissorhands (Liu et al. 2023, "Scissorhands: Exploiting the Persistence of
Importance Hypothesis for LLM KV Cache Compression at Test Time", NeurIPS 2023, arXiv 2305.17118).

The paper is not in shared/papers and has no seed report. This follows its algorithm (Sec. 4,
Algorithm 1 "budget KV cache for a single attention head" and Algorithm 2 "compress KV cache";
section numbers from memory of the arXiv text, not checked against a copy here) as summarised in
research/anchors.md §3, and the defaults the VATP paper (shared paper 004, App. A) attributes to
it: "following Liu et al. (2023), the number of tokens selected by importance score is k - 10,
with a local window size of 10 and a history window size of w = 400" (seed-vatp.md §2.4, §6.3).

The rule: the cache holds a fixed budget. A token is *unimportant* for a query when its attention
is below the average, 1/n over the n tokens that query attends. Over a history window of the last
`window` queries a counter records how often each cached token was unimportant; when the cache
overflows, the token with the highest count is dropped, except the `recent` most recent tokens,
which are never dropped.

Mapping onto the buffer (RingPolicy): the `recent` newest tokens (the one being decoded included)
live in the ring; the other `slots - 1 - recent` committed slots hold tokens kept by importance.
Each full step the token leaving the ring competes with them; the one with the highest count is
dropped and its slot reused in place. Decisions:

- Drop amount m = 1: Algorithm 2 drops m tokens per compression to amortise its cost; a
  fixed-slot buffer drops exactly one per step, so the cache always holds its budget.
- Threshold per (sequence, kv head): a kv head's score is the sum of its g query heads'
  probabilities (DESIGN, GQA), so "unimportant" = sum < g / n_valid (the group's mean below the
  uniform 1/n); n_valid counts the valid tokens attended, the new token included. With g = 1
  (the paper's MHA models) this is exactly attention < 1/n.
- History window = the last `window` query steps of the batch (prompt queries included; a pad
  query step counts for nothing). A token younger than the window has only its own steps
  counted. The window is exact: every slot keeps one bit per step of the window (a ring of
  ceil(window/8) bytes per slot and row, `buf.sh_hist`, moved with its token), and the bit
  leaving the window is subtracted from the counter.
- Importance (higher = more important) per slot in `buf.score`: `window - count`, non-negative and
  in the paper's order, so a subclass can scale it: `importance(buf, slots)` is what eviction
  compares (the lowest goes, empty slots first, ties: the oldest; `victim_candidates` names
  the candidates), `prompt_rank(...)` ranks the prompt. `buf.state` is left free for a
  subclass (VATP: value norms).
- `score=attention`: the VATP paper's reading of Scissorhands (its Eq. 3, the base VATP scales):
  importance = the attention summed over the last `window` queries, exact in decode via a ring
  of `window` fp32 rows per slot (heavy: 4 * window bytes per slot and row); `window=0` sums over
  all queries (the VATP authors' code).
- Prompt: when it does not fit, Algorithm 2 runs once after prefill: the last `recent` prompt
  tokens are kept, the rest ranked by importance over the last `window` prompt queries.
  `prompt_scores(acc, p, first, valid)` computes that statistic from the prefill probabilities
  (count: the window's bits per key; attention: the window's sums), for an engine that lets a
  policy fold the prompt attention (the `fold` of kernels.prefill_column_sums). The
  current engine hands every policy the column sums over all prompt queries instead: then the
  prompt is ranked by those and, in count mode, counting starts at the first decode step. In
  attention mode the prompt's sum is spread evenly over its window steps (the per-query rows
  are not kept), so it leaves the window linearly during the first `window` decode steps.
"""
import torch

from flexevict.errors import UserError

from flexevict.policies import register
from flexevict.policies.base import RingPolicy, kv_head_probs

_POPCOUNT = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.uint8)


@register
class Scissorhands(RingPolicy):
    name = "scissorhands"
    args = {"recent": 10, "window": 400, "score": "count"}
    needs_prompt_scores = True

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        o = self.opts
        if o["score"] not in ("count", "attention"):
            raise UserError(f"--policy-arg score={o['score']}: expected 'count' (the paper's "
                            "low-attention counter) or 'attention' (windowed attention sum)")
        if o["recent"] < 1:
            raise UserError(f"--policy-arg recent={o['recent']}: must be >= 1 (the token being "
                            "decoded is always among the recent tokens)")
        if o["window"] < (1 if o["score"] == "count" else 0):
            raise UserError(f"--policy-arg window={o['window']}: must be >= 1 (score=attention "
                            "also accepts 0, no window)")
        self.counting = o["score"] == "count"

    # ------------------------------------------------------------------ sizing
    def minimum_slots(self) -> int:
        return self.opts["recent"] + 2            # the recent tokens, one kept by score, scratch

    def prefix_slots(self, capacity: int) -> int:
        return capacity - self.opts["recent"]

    # ------------------------------------------------------------------ importance (subclass hooks)
    def importance(self, buf, slots: torch.Tensor) -> torch.Tensor:
        """(len(slots), rows) importance of the tokens in `slots`; higher is kept."""
        return buf.score[slots]

    def victim_candidates(self, buf):
        # the lowest importance (buf.score) among the kept tokens and the oldest recent goes
        return buf.ring_start, True, None

    def prompt_rank(self, base, k, v, pos, valid) -> torch.Tensor:
        """(S, rows) rank of the prompt tokens for the kept set, from their base importance
        (what `buf.score` stores); higher is kept. Default: the base importance itself."""
        return base

    # ------------------------------------------------------------------ prompt
    def prompt_scores(self, acc, p, first, valid):
        """Fold one block of prefill attention into the prompt statistic (proposed engine hook).

        p (B, Hk, g, c, S) fp32 probabilities of prompt queries [first, first + c) (pad queries
        zeroed), valid (B, S). Only the last `window` queries count. -> count mode: (B, Hk, S,
        bytes) uint8, bit (i % window) set when query i found the key unimportant; attention
        mode: (B, Hk, S) fp32 attention summed over those queries."""
        b, hk, g, c, s = p.shape
        w = self.opts["window"] or s
        qi = torch.arange(first, first + c, device=p.device)
        score = p.sum(dim=2)                                          # (B, Hk, c, S)
        inwin = (qi >= s - w) & (qi < s)
        if not self.counting:
            total = (score * inwin[:, None]).sum(dim=2)
            return total if acc is None else acc + total
        seen = valid.long().cumsum(1).gather(1, qi.clamp(max=s - 1).expand(b, -1))   # (B, c)
        keys = torch.arange(s, device=p.device)
        visible = (keys <= qi[:, None]) & valid[:, None, :]          # (B, c, S)
        low = score < g / seen.clamp(min=1)[:, None, :, None]
        low &= (visible & valid.gather(1, qi.clamp(max=s - 1).expand(b, -1))[..., None])[:, None]
        low &= inwin[:, None]
        nbytes = (w + 7) // 8
        bit = qi % w
        weight = torch.zeros(c, nbytes, device=p.device)              # row -> (byte, 1 << bit)
        weight[torch.arange(c, device=p.device), bit // 8] = (1 << (bit % 8)).float()
        packed = torch.einsum("bhcs,cy->bhsy", low.float(), weight).to(torch.uint8)  # sum = or
        return packed if acc is None else acc | packed

    def prefill(self, buf, k, v, pos, valid, scores=None):
        buf.sh_step = k.shape[0]                  # the next query's step index
        if not self.evicts:
            return super().prefill(buf, k, v, pos, valid)
        self.hist(buf).zero_()
        if scores is None:
            scores = torch.zeros(pos.shape, device=pos.device)
        w = self.opts["window"]
        bits = self.counting and scores.dim() == 3
        base = w - _popcount(scores) if bits else scores.float()
        self._rank = self.prompt_rank(base, k, v, pos, valid)
        super().prefill(buf, k, v, pos, valid, base)
        self._rank = None
        if self.counting and not bits:            # no per-query prompt history: count from now
            buf.score[:buf.capacity] = float(w)
        elif bits or w:
            self._seed_history(buf, scores, pos, valid)

    def prefix_rank(self, scores, pos, valid):
        return self._rank

    def _seed_history(self, buf, stat, pos, valid):
        """Put the kept prompt tokens' window history into `buf.sh_hist`."""
        s, cap = pos.shape[0], buf.capacity
        # the prompt index of each kept slot, from its (per-row unique) position
        top = int(pos.max()) + 1                  # pads: a spare last row (a prefill-only read)
        where = torch.zeros(top + 1, pos.shape[1], dtype=torch.int64, device=pos.device)
        idx = torch.arange(s, device=pos.device).unsqueeze(1).expand_as(pos)
        where.scatter_(0, torch.where(valid, pos, top).long(), idx)
        src = where.gather(0, buf.pos[:cap].clamp(min=0).long())      # (cap, rows)
        kept = buf.valid[:cap]
        hist = buf.sh_hist
        if self.counting:
            bits = stat.gather(0, src.unsqueeze(-1).expand(-1, -1, stat.shape[-1]))
            hist[:, :cap] = (bits * kept.unsqueeze(-1)).permute(2, 0, 1).to(torch.uint8)
        elif self.opts["window"]:
            w = self.opts["window"]
            steps = torch.arange(max(0, s - w), s, device=pos.device) % w
            share = buf.score[:cap] * kept / len(steps)
            hist[steps, :cap] = share.unsqueeze(0).expand(len(steps), -1, -1)

    # ------------------------------------------------------------------ decode
    def hist(self, buf) -> torch.Tensor:
        """The per-slot window history, allocated once per buffer (count: bits; attention: fp32
        rows; no window: empty)."""
        if getattr(buf, "sh_hist", None) is None:
            n, rows = buf.score.shape
            w = self.opts["window"]
            if self.counting:
                buf.sh_hist = torch.zeros((w + 7) // 8, n, rows, dtype=torch.uint8,
                                          device=buf.score.device)
            else:
                buf.sh_hist = torch.zeros(w, n, rows, dtype=torch.float32, device=buf.score.device)
        return buf.sh_hist

    def after_attention(self, buf, slot, probs):
        if not self.evicts:
            return buf.commit_appended(slot)
        self.accumulate(buf, slot, probs)
        if slot != buf.scratch:
            return buf.commit_appended(slot)
        cursor = buf.cursor                        # the commit advances it
        victims = self.commit(buf)
        hist, rows = self.hist(buf), buf.rows_index
        hist[:, victims, rows] = hist[:, cursor, rows]               # as ring_commit moved them
        hist[:, cursor] = hist[:, buf.scratch]

    def accumulate(self, buf, slot, probs):
        n = probs.shape[-1]
        hist, w, t = self.hist(buf), self.opts["window"], buf.sh_step
        buf.sh_step = t + 1
        hist[:, slot] = 0                          # the new token has no history yet
        score = kv_head_probs(probs)               # (n, rows)
        if self.counting:
            valid = buf.valid[:n]
            low = (score < probs.shape[1] / valid.sum(0)) & valid
            new = torch.zeros_like(hist[0])
            new[:n] = low.to(torch.uint8)
            byte, bit = (t % w) // 8, (t % w) % 8
            old = (hist[byte] >> bit) & 1
            hist[byte] = (hist[byte] & (255 ^ (1 << bit))) | (new << bit)
            buf.score += old.float() - new.float()                    # importance = window - count
            buf.score[slot] = w - new[slot].float()                   # a fresh token starts at w
        elif w:
            new = torch.zeros_like(hist[0])
            new[:n] = score
            buf.score += new - hist[t % w]
            hist[t % w] = new
        else:
            buf.score[:n] += score


def _popcount(bits: torch.Tensor) -> torch.Tensor:
    """(..., bytes) uint8 -> (...) number of set bits, fp32."""
    return _POPCOUNT.to(bits.device)[bits.long()].sum(-1).float()
