"""The paired comparison behind accuracy verdicts, on constructed cases whose answer is known."""
import numpy as np
import pytest

from flexevict.evaluation.paired import FAILS, HOLDS, MIN_ITEMS, UNCLEAR, paired_difference


def test_a_constant_improvement_holds_with_a_point_interval():
    b = np.linspace(10, 20, 40)
    d = paired_difference(b - 1.5, b, higher_is_better=False)       # A's perplexity 1.5 lower
    assert (d.n, d.mean, d.low, d.high) == (40, pytest.approx(1.5), pytest.approx(1.5),
                                            pytest.approx(1.5))
    assert d.verdict() == HOLDS


def test_pairing_removes_the_items_own_spread():
    """Items differ wildly in difficulty, A is better on each by 0.1 +- 0.01: the paired
    interval excludes zero although the unpaired spreads overlap completely."""
    rng = np.random.default_rng(1)
    b = rng.uniform(0, 10, 50)
    a = b + 0.1 + rng.normal(0, 0.01, 50)
    d = paired_difference(a, b)
    assert 0.09 < d.low < d.mean < d.high < 0.11 and d.verdict() == HOLDS
    assert paired_difference(b, a).verdict() == FAILS                 # the reverse claim


def test_zero_mean_noise_is_not_distinguishable_and_the_interval_covers_it():
    rng = np.random.default_rng(2)
    b = rng.uniform(0, 1, 64)
    a = b + rng.normal(0, 0.2, 64)
    d = paired_difference(a, b)
    assert d.low < 0 < d.high and d.verdict() == UNCLEAR
    # the normal-theory half width for 64 items, within the bootstrap's own error
    half = 1.96 * (a - b).std(ddof=1) / 8
    assert (d.high - d.low) / 2 == pytest.approx(half, rel=0.15)


def test_non_inferiority_margin():
    b = np.linspace(0.3, 0.6, 32)
    d = paired_difference(b - 0.02, b)                                # A 0.02 worse everywhere
    assert d.verdict() == FAILS
    assert d.verdict(margin=0.05) == HOLDS                            # within a 0.05 margin


def test_seeded_and_checked():
    a, b = [1.0, 2.0, 4.0, 3.0], [1.5, 1.0, 3.0, 3.5]
    assert paired_difference(a, b, seed=3) == paired_difference(a, b, seed=3)
    with pytest.raises(ValueError, match="equal-length"):
        paired_difference([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="confidence"):
        paired_difference(a, b, confidence=1.5)


def test_too_few_items_get_no_verdict():
    """Two documents that agree perfectly still say nothing: the percentile bootstrap of two
    values cannot see the spread it did not sample."""
    d = paired_difference([2.0, 3.0], [1.0, 1.5])
    assert d.low > 0 and d.verdict() == UNCLEAR
    many = paired_difference([2.0, 3.0] * 5, [1.0, 1.5] * 5)
    assert many.n == MIN_ITEMS and many.verdict() == HOLDS
