"""Long-context retrieval tasks generated offline, after RULER (Hsieh et al. 2024, "RULER:
What's the Real Context Size of Your Long-Context Language Models?", Sec. 3: the
needle-in-a-haystack "Retrieval" tasks and the "Multi-hop Tracing" variable-tracking task).

    from flexevict.evaluation.retrieval import Retrieval, make_samples, score
    task = Retrieval(llm, lengths=(1024,), kinds=("niah-single", "vt"))
    print(task.run(llm, PolicySpec("h2o", budget=0.2)))  # {"accuracy": ..., "per_kind": ...}

Four kinds, each hidden in a haystack of filler text (the passkey task's sentences by default,
`filler=` / `--text` replaces them) and built through the tokenizer to an exact token budget:

- `niah-single`: one needle "The special magic number for <key> is: <5 digits>."; asked for it.
- `niah-multikey`: four needles with different keys; asked for one key's number (the other
  three are distractors at random depths).
- `niah-multivalue`: four needles with the same key and different numbers; all four must be
  returned.
- `vt`: variable tracking, one chain of four hops "VAR A = 12345." "VAR B = VAR A." ...
  (five variables); asked which variables hold the value, all five must be returned.

A sample's `depth` (spread evenly over [0.05, 0.95] across a (kind, length)'s samples) is where
its first answer needle sits, as a share of the haystack's characters, moved to the nearest
sentence start. The other answer needles (multivalue, vt) follow in order at evenly spaced depths
after it: needle k of m at depth + k (1 - depth) / m. Scoring is RULER's string-match recall: the
share of a sample's answers found in the greedy completion (case-insensitive).
"""
from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass

from flexevict.errors import UserError
from flexevict.evaluation.tasks import FILLER, Task, digest, first_tokens, uses_chatml
from flexevict.policies import PolicySpec

KINDS = ("niah-single", "niah-multikey", "niah-multivalue", "vt")
NEEDLES = 4                  # niah-multikey: needles (1 asked + 3 distractors); multivalue: values
HOPS = 4                     # vt: assignments after the first, so HOPS + 1 variables
MIN_FILLER = 16              # tokens of haystack a prompt needs at least
NEW_TOKENS = {"niah-single": 12, "niah-multikey": 12, "niah-multivalue": 40, "vt": 40}

# keys are "adjective-noun" pairs (RULER draws words too); 24 x 24 distinct keys
ADJECTIVES = ("amber", "brave", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy",
              "jolly", "keen", "lively", "misty", "noble", "odd", "pale", "quiet", "rapid",
              "silent", "tall", "vivid", "warm", "young", "zesty")
NOUNS = ("anchor", "badger", "canyon", "dolphin", "ember", "falcon", "garden", "harbor",
         "island", "jungle", "kettle", "lantern", "meadow", "needle", "orchard", "pebble",
         "quartz", "river", "saddle", "thistle", "valley", "willow", "yacht", "zephyr")

INTRO = {"niah": "A special magic number is hidden in the following text. Find it and memorize "
                 "it. I will ask you about it afterwards.\n\n",
         "many": "Some special magic numbers are hidden in the following text. Find them and "
                 "memorize them. I will ask you about them afterwards.\n\n",
         "vt": "Memorize and track the chain of variable assignments hidden in the following "
               "text.\n\n"}
NEEDLE = "The special magic number for {key} is: {value}."
QUESTION = {"one": ("\n\nWhat is the special magic number for {key} in the text above?",
                    "The special magic number for {key} is:"),
            "all": ("\n\nWhat are all the special magic numbers for {key} in the text above?",
                    "The special magic numbers for {key} are:"),
            "vt": ("\n\nFind all variables that are assigned the value {key} in the text above.",
                   "The variables assigned the value {key} are:")}


@dataclass(frozen=True)
class Sample:
    """One retrieval prompt.

    kind: one of KINDS; prompt: the full text given to the model (chat template included);
    answers: strings that must all appear in the completion; depth: the first answer needle's
    position as a share of the haystack's characters (0 = start, 1 = end).
    needles: the inserted sentences, in insertion order (answer needles first, then
    distractors); needle_depths: each one's requested depth; needle_spans: each one's
    (start, end) character span in `prompt`; haystack_span: the (start, end) characters of
    `prompt` holding the filler with its needles; tokens: len(tok.encode(prompt)).
    """
    kind: str
    prompt: str
    answers: tuple[str, ...]
    depth: float
    needles: tuple[str, ...] = ()
    needle_depths: tuple[float, ...] = ()
    needle_spans: tuple[tuple[int, int], ...] = ()
    haystack_span: tuple[int, int] = (0, 0)
    tokens: int = 0


@dataclass(frozen=True)
class _Draw:
    """A sample's content before the haystack: what goes in, what is asked, what is right."""
    intro: str
    needles: tuple[str, ...]
    depths: tuple[float, ...]
    question: str
    prefix: str
    answers: tuple[str, ...]


def _numbers(rng: random.Random, k: int) -> list[str]:
    return [str(v) for v in rng.sample(range(10000, 100000), k)]


def _keys(rng: random.Random, k: int) -> list[str]:
    return [f"{ADJECTIVES[i // len(NOUNS)]}-{NOUNS[i % len(NOUNS)]}"
            for i in rng.sample(range(len(ADJECTIVES) * len(NOUNS)), k)]


def _spread(depth: float, m: int) -> tuple[float, ...]:
    """m answer needles: the first at depth, the rest evenly spaced after it, in order."""
    return tuple(depth + k * (1 - depth) / m for k in range(m))


def _draw(kind: str, rng: random.Random, depth: float) -> _Draw:
    """The needles, question and answers of one sample of `kind` (random keys and values)."""
    if kind == "niah-single":
        key, value = _keys(rng, 1)[0], _numbers(rng, 1)[0]
        q, p = QUESTION["one"]
        return _Draw(INTRO["niah"], (NEEDLE.format(key=key, value=value),), (depth,),
                     q.format(key=key), p.format(key=key), (value,))
    if kind == "niah-multikey":
        keys, values = _keys(rng, NEEDLES), _numbers(rng, NEEDLES)
        depths = (depth,) + tuple(rng.uniform(0.05, 0.95) for _ in keys[1:])
        q, p = QUESTION["one"]
        return _Draw(INTRO["many"], tuple(NEEDLE.format(key=k, value=v)
                                          for k, v in zip(keys, values)), depths,
                     q.format(key=keys[0]), p.format(key=keys[0]), (values[0],))
    if kind == "niah-multivalue":
        key, values = _keys(rng, 1)[0], _numbers(rng, NEEDLES)
        q, p = QUESTION["all"]
        return _Draw(INTRO["many"], tuple(NEEDLE.format(key=key, value=v) for v in values),
                     _spread(depth, NEEDLES), q.format(key=key), p.format(key=key),
                     tuple(values))
    if kind == "vt":
        names = _variables(rng, HOPS + 1)
        value = _numbers(rng, 1)[0]
        chain = [f"VAR {names[0]} = {value}."] + \
            [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
        q, p = QUESTION["vt"]
        return _Draw(INTRO["vt"], tuple(chain), _spread(depth, len(chain)),
                     q.format(key=value), p.format(key=value), tuple(names))
    raise UserError(f"unknown retrieval kind '{kind}'; known kinds: {', '.join(KINDS)}")


def _variables(rng: random.Random, k: int) -> list[str]:
    """k distinct 5-letter upper-case names (RULER's variable style)."""
    names: list[str] = []
    while len(names) < k:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in names:
            names.append(name)
    return names


def _wrap(tok, body: str, prefix: str) -> str:
    """The user turn and the answer's start: ChatML for chat models, else plain text."""
    if uses_chatml(tok):
        return f"<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n{prefix}"
    return f"{body}\n\n{prefix}"


def _haystack(tok, filler: str, m: int) -> str:
    """The first m tokens of the filler (repeated if shorter), as text."""
    text = filler.strip()
    if not text:
        raise UserError("the retrieval filler text is empty; give a text with some sentences")
    ids = first_tokens(tok, text, m)
    if len(ids) < m:
        ids = first_tokens(tok, " ".join([text] * (m // max(1, len(ids)) + 2)), m)
    return tok.decode(ids)


def _cut(hay: str, depth: float) -> int:
    """The sentence start nearest to depth * len(hay) (word starts in a text without
    sentences); the end counts only when the text ends a sentence, so no needle splits one."""
    starts = [m.end() for m in re.finditer(r"[.!?]\s+|\n", hay)] or \
        [m.end() for m in re.finditer(r"\s+", hay)]
    ends = re.search(r"[.!?]\s*$", hay) is not None
    starts = [0] + [s for s in starts if s < len(hay)] + ([len(hay)] if ends else [])
    return min(starts, key=lambda s: (abs(s - depth * len(hay)), s))


def _insert(hay: str, draw: _Draw) -> tuple[str, list[tuple[int, int]]]:
    """hay with each needle at its depth's cut (ties keep needle order), one space apart
    -> (text, each needle's span in the text, in needle order)."""
    order = sorted(range(len(draw.needles)), key=lambda i: (_cut(hay, draw.depths[i]), i))
    out, spans, pos = "", [(0, 0)] * len(order), 0
    for i in order:
        cut = _cut(hay, draw.depths[i])
        out += hay[pos:cut]
        pos = cut
        if out and not out[-1].isspace():
            out += " "
        spans[i] = (len(out), len(out) + len(draw.needles[i]))
        out += draw.needles[i] + (" " if pos < len(hay) and not hay[pos].isspace() else "")
    return out + hay[pos:], spans


def _build(tok, draw: _Draw, filler: str, length: int, kind: str, depth: float) -> Sample:
    """Fit the filler so that the prompt has at most `length` tokens (as close as it goes)."""
    body = lambda hay: draw.intro + hay + draw.question            # noqa: E731
    fixed = len(tok.encode(_wrap(tok, body(" ".join(draw.needles)), draw.prefix)))
    m = length - fixed
    while True:
        if m < MIN_FILLER:
            raise UserError(f"retrieval length {length} is too small for kind '{kind}' (needs "
                            f"at least {fixed + MIN_FILLER} tokens)")
        text, spans = _insert(_haystack(tok, filler, m), draw)
        prompt = _wrap(tok, body(text), draw.prefix)
        n = len(tok.encode(prompt))
        if n <= length:
            break
        m -= n - length                     # token merges at the cuts: shrink and refit
    at = prompt.index(draw.intro) + len(draw.intro)
    return Sample(kind, prompt, draw.answers, depth, draw.needles, draw.depths,
                  tuple((a + at, b + at) for a, b in spans), (at, at + len(text)), n)


def depths(n: int) -> list[float]:
    """n depths spread evenly over [0.05, 0.95] (0.5 for a single sample)."""
    return [0.5] if n == 1 else [0.05 + 0.9 * i / (n - 1) for i in range(n)]


def make_samples(tok, kind: str, length: int, n: int, seed: int,
                 filler: str | None = None) -> list[Sample]:
    """n samples of `kind` with prompts of at most `length` tokens (tok.encode), at depths
    spread over [0.05, 0.95]. Deterministic in (kind, length, n, seed); keys and values differ
    between seeds. filler: the haystack text (default the passkey task's FILLER)."""
    if kind not in KINDS:
        raise UserError(f"unknown retrieval kind '{kind}'; known kinds: {', '.join(KINDS)}")
    if n < 1:
        raise UserError(f"retrieval needs at least 1 sample per kind and length (got {n})")
    rng = random.Random(f"retrieval:{kind}:{length}:{n}:{seed}")
    return [_build(tok, _draw(kind, rng, d), FILLER if filler is None else filler, length,
                   kind, d) for d in depths(n)]


def score(completion: str, sample: Sample) -> float:
    """The share of sample.answers found in the completion (case-insensitive substring match:
    RULER's recall-style scoring), in [0, 1]."""
    low = completion.lower()
    return sum(a.lower() in low for a in sample.answers) / len(sample.answers)


class Retrieval(Task):
    """RULER-style retrieval: every kind x length, `n` samples each, greedy answers scored by
    `score`; `accuracy` is the mean over all samples."""
    name = "retrieval"
    metrics = {"accuracy": ("retrieval accuracy (answers found)", False)}
    breakdowns = {"per_length": "retrieval accuracy by prompt length (tokens)",
                  "per_kind": "retrieval accuracy by kind (mean over lengths)"}
    sizes = {"lengths": ((1024, 2048, 4096), (256,)), "kinds": (KINDS, KINDS), "n": (4, 1)}

    def __init__(self, llm, text: str | None = None, quick: bool = False, lengths=None,
                 kinds=None, n=None, seed: int = 0):
        lengths = tuple(int(x) for x in self.size(quick, "lengths", lengths))
        kinds = tuple(self.size(quick, "kinds", kinds))
        n = int(self.size(quick, "n", n))
        if not lengths or not kinds:
            raise UserError("retrieval needs at least one length and one kind")
        self.samples = [s for k in kinds for length in lengths for s in
                        make_samples(llm.tokenizer, k, length, n, seed, text)]
        self.targets = [length for k in kinds for length in lengths for _ in range(n)]
        self.prompts = [s.prompt for s in self.samples]
        self.new_tokens = max(NEW_TOKENS[k] for k in kinds)
        self.lengths = (max(s.tokens for s in self.samples), self.new_tokens)
        self.settings = {"lengths": list(lengths), "kinds": list(kinds), "n": n, "seed": seed,
                         "filler": "grass" if text is None else "text",
                         "data": digest(self.prompts)}

    def run(self, llm, spec: PolicySpec) -> dict:
        """Greedy answers, one generate call per target length (prompts of about one length
        share batches) -> {"accuracy", "per_kind": {kind: {length: mean}}, "slots" (at the
        longest length), "slots_per_length", "per_length", "per_sample", "items"}."""
        completions: list[str] = [""] * len(self.samples)
        slots = {}
        for length in sorted(set(self.targets)):
            idx = [i for i, t in enumerate(self.targets) if t == length]
            out = llm.generate([self.prompts[i] for i in idx], self.new_tokens, policy=spec,
                               batch_size=len(idx), stop_ids=())
            slots[length] = out[-1]["resolved"]["slots"]
            for i, o in zip(idx, out):
                completions[i] = o["completion"]
        per = [{"kind": s.kind, "length": t, "depth": s.depth, "score": score(c, s),
                "completion": c} for s, t, c in zip(self.samples, self.targets, completions)]
        per_kind: dict = {}
        for p in per:
            per_kind.setdefault(p["kind"], {}).setdefault(p["length"], []).append(p["score"])
        per_kind = {k: {t: sum(v) / len(v) for t, v in d.items()} for k, d in per_kind.items()}
        per_length = {t: sum(p["score"] for p in per if p["length"] == t) /
                      sum(p["length"] == t for p in per) for t in slots}
        return {"accuracy": sum(p["score"] for p in per) / len(per), "per_kind": per_kind,
                "per_length": per_length, "slots": slots[max(slots)],
                "slots_per_length": slots, "per_sample": per,
                "items": {"accuracy": [p["score"] for p in per]}}
