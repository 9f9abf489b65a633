"""RULER-style retrieval tasks (flexevict/evaluation/retrieval.py) on the packaged SmolLM2
tokenizer and model: needle placement, token budgets, determinism, scoring, the variable chain,
errors, and an end-to-end run with the full cache."""
import re

import pytest

from flexevict.errors import UserError
from flexevict.evaluation.retrieval import KINDS, Retrieval, Sample, make_samples, score
from flexevict.evaluation.tasks import FILLER
from flexevict.policies import PolicySpec

SENTENCE = max(len(s) + 2 for s in FILLER.split(". "))      # longest filler sentence, chars


@pytest.fixture(scope="module")
def tok(engine_smollm2_tokenizer):
    return engine_smollm2_tokenizer


def filler_position(sample: Sample, i: int) -> tuple[float, int]:
    """Needle i's start as a share of the haystack's filler characters (needles removed)
    -> (position, filler characters)."""
    h0, h1 = sample.haystack_span
    start = sample.needle_spans[i][0]
    before = sum(b - a for a, b in sample.needle_spans if b <= start)
    total = (h1 - h0) - sum(b - a for a, b in sample.needle_spans)
    return (start - h0 - before) / total, total


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("length", (256, 1024))
def test_needles_sit_at_their_depths_and_hold_the_answers(tok, kind, length):
    samples = make_samples(tok, kind, length, 4, seed=0)
    assert [round(s.depth, 6) for s in samples] == [0.05, 0.35, 0.65, 0.95]
    for s in samples:
        assert s.needle_depths[0] == s.depth and len(s.needles) == len(s.needle_spans) > 0
        for i, (a, b) in enumerate(s.needle_spans):
            assert s.prompt[a:b] == s.needles[i]
            assert s.haystack_span[0] <= a < b <= s.haystack_span[1]
            pos, total = filler_position(s, i)
            assert abs(pos - s.needle_depths[i]) <= SENTENCE / total, (kind, i, pos, s.depth)
            assert a == s.haystack_span[0] or s.prompt[a - 2:a] == ". " or \
                any(a == b2 + 1 for _, b2 in s.needle_spans)       # at a sentence start
        # every occurrence of every answer lies inside a needle: nowhere else in the prompt
        for ans in s.answers:
            hits = [m.start() for m in re.finditer(re.escape(ans), s.prompt)]
            assert hits and all(any(a <= h < b for a, b in s.needle_spans) for h in hits), ans
        if kind in ("niah-multivalue", "vt"):   # answer needles evenly spaced after depth
            m = len(s.needles)
            assert s.needle_depths == tuple(s.depth + k * (1 - s.depth) / m for k in range(m))
        if kind != "vt":                    # answer k is the value of answer needle k
            assert all(s.needles[k].endswith(f" {ans}.") for k, ans in enumerate(s.answers))
        # the haystack is the filler, intact, once the needles are taken out
        h0, h1 = s.haystack_span
        rest, pos = "", h0
        for a, b in sorted(s.needle_spans):
            rest, pos = rest + s.prompt[pos:a], b
        rest = " ".join((rest + s.prompt[pos:h1]).split())
        assert " ".join((FILLER * (len(rest) // len(FILLER) + 2)).split()).startswith(rest)


def test_the_asked_needle_is_one_of_several_keys(tok):
    for s in make_samples(tok, "niah-multikey", 1024, 4, seed=3):
        key = re.search(r"for (\S+) is", s.needles[0]).group(1)
        others = [re.search(r"for (\S+) is", n).group(1) for n in s.needles[1:]]
        assert len(others) == 3 and key not in others
        assert f"magic number for {key} in the text above?" in s.prompt
        assert not any(n.endswith(f" {s.answers[0]}.") for n in s.needles[1:])


@pytest.mark.parametrize("kind", KINDS)
def test_prompts_fill_the_token_budget_without_exceeding_it(tok, kind):
    for length in (256, 300, 1024, 2048):
        for s in make_samples(tok, kind, length, 3, seed=1):
            n = len(tok.encode(s.prompt))
            assert n == s.tokens and length - 4 <= n <= length, (kind, length, n)
            assert s.prompt.startswith("<|im_start|>user\n")       # SmolLM2 is a chat model
            assert "<|im_start|>assistant\n" in s.prompt


def test_seeds_reproduce_and_differ(tok):
    for kind in KINDS:
        a = make_samples(tok, kind, 256, 3, seed=5)
        assert a == make_samples(tok, kind, 256, 3, seed=5)
        b = make_samples(tok, kind, 256, 3, seed=6)
        assert all(x.answers != y.answers and x.prompt != y.prompt for x, y in zip(a, b))
        assert len({x.answers for x in a}) == 3                  # samples differ too


def test_score_is_the_share_of_answers_found(tok):
    s = make_samples(tok, "niah-multivalue", 256, 1, seed=0)[0]
    assert len(s.answers) == 4 and len(set(s.answers)) == 4
    assert score(" " + ", ".join(s.answers) + ".", s) == 1.0
    assert score(f" {s.answers[2]} and {s.answers[0]}, then 11111", s) == 0.5
    assert score(" 11111, 22222", s) == 0.0
    one = make_samples(tok, "niah-single", 256, 1, seed=0)[0]
    assert score(f" {one.answers[0]}.", one) == 1.0 and score("", one) == 0.0
    vt = make_samples(tok, "vt", 256, 1, seed=0)[0]
    assert score(" " + ", ".join(a.lower() for a in vt.answers), vt) == 1.0   # any case


def test_variable_tracking_answers_are_the_chain(tok):
    for s in make_samples(tok, "vt", 1024, 4, seed=2):
        value = re.search(r"assigned the value (\d{5})", s.prompt).group(1)
        # rebuild the chain from the prompt alone: variable -> what it is assigned
        assign = dict(re.findall(r"VAR ([A-Z]{5}) = (?:VAR )?([A-Z]{5}|\d{5})\.", s.prompt))
        assert len(assign) == 5 and len(s.needles) == 5
        holds = {v for v in assign if _resolve(assign, v) == value}
        assert holds == set(s.answers) and len(s.answers) == 5
        # the statements come in chain order: each variable is defined before it is read
        spans = [s.needle_spans[i][0] for i in range(5)]
        assert spans == sorted(spans)
        assert s.needles[0] == f"VAR {s.answers[0]} = {value}."


def _resolve(assign: dict, var: str) -> str:
    seen = set()
    while var in assign and var not in seen:
        seen.add(var)
        var = assign[var]
    return var


def test_bad_kind_and_too_small_length_are_one_line_errors(tok):
    with pytest.raises(UserError, match="unknown retrieval kind 'niah-double'") as e:
        make_samples(tok, "niah-double", 256, 1, 0)
    assert "\n" not in str(e.value) and "niah-single" in str(e.value)
    for kind in KINDS:
        with pytest.raises(UserError, match=f"too small for kind '{kind}'") as e:
            make_samples(tok, kind, 60, 1, 0)
        assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="empty"):
        make_samples(tok, "niah-single", 256, 1, 0, filler="  ")


def test_a_user_filler_replaces_the_haystack(tok):
    text = "Rivers run to the sea. Mountains rise above the clouds. "
    s = make_samples(tok, "niah-single", 256, 1, 0, filler=text)[0]
    assert "Mountains rise" in s.prompt and "grass" not in s.prompt
    assert 252 <= s.tokens <= 256


@pytest.mark.slow
def test_task_end_to_end_with_the_full_cache(engine_smollm2):
    llm = engine_smollm2
    task = Retrieval(llm, lengths=(256,), kinds=("niah-single",), n=2)
    assert task.lengths[0] <= 256 and task.lengths[1] >= 8
    assert task.settings["lengths"] == [256] and task.settings["n"] == 2
    r = task.run(llm, PolicySpec("full"))
    assert 0.0 <= r["accuracy"] <= 1.0
    assert set(r["per_kind"]) == {"niah-single"} and set(r["per_kind"]["niah-single"]) == {256}
    assert r["slots"] >= task.lengths[0] and len(r["per_sample"]) == 2
    # the full cache finds the 5-digit needle (SmolLM2-135M-Instruct does, at every depth)
    assert any(p["score"] == 1.0 for p in r["per_sample"]), r["per_sample"]


def test_quick_task_covers_every_kind(engine_smollm2):
    task = Retrieval(engine_smollm2, quick=True)
    assert [s.kind for s in task.samples] == list(KINDS)
    assert task.settings["lengths"] == [256] and task.settings["kinds"] == list(KINDS)
    assert task.lengths[0] <= 256 and task.new_tokens == task.lengths[1]
    assert task.settings["data"] != Retrieval(engine_smollm2, quick=True, seed=1).settings["data"]
