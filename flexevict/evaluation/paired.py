"""Paired comparisons for accuracy claims: policy A against policy B on the same documents or
prompts, the mean per-item difference with a bootstrap confidence interval, and a verdict.

Each item (a document's perplexity, a prompt's ROUGE-L, a passkey trial) is scored under both
policies, so the per-item differences carry the comparison and the items' own difficulty
cancels. The interval is the percentile bootstrap of the mean difference (Efron & Tibshirani
1993, "An Introduction to the Bootstrap", Sec. 13.3), resampling items with replacement from a
seeded generator, so a result is reproducible.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HOLDS, FAILS, UNCLEAR = "holds", "does not hold", "not distinguishable at this sample size"
# Below this many items no verdict is given: a percentile bootstrap resamples only a handful of
# values and its interval is far narrower than the truth (it cannot see the unsampled spread).
MIN_ITEMS = 10


@dataclass(frozen=True)
class PairedDifference:
    """The mean of (A - B) per item, oriented so that positive means A is better, and its
    confidence interval [low, high]."""
    n: int
    mean: float
    low: float
    high: float
    confidence: float

    def verdict(self, margin: float = 0.0) -> str:
        """The claim "A is better than B by more than -margin": margin 0 is "A is better";
        margin m > 0 is "A is no worse than B by more than m" (non-inferiority)."""
        if self.n < MIN_ITEMS:
            return UNCLEAR
        if self.low > -margin:
            return HOLDS
        if self.high < -margin:
            return FAILS
        return UNCLEAR


def paired_difference(a, b, higher_is_better: bool = True, confidence: float = 0.95,
                      resamples: int = 10_000, seed: int = 0) -> PairedDifference:
    """a, b: one score per item under policies A and B (same items, same order) ->
    the oriented mean difference and its percentile-bootstrap interval."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"paired scores need two equal-length 1-D lists "
                         f"(got {a.shape}, {b.shape})")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1) (got {confidence})")
    diff = a - b if higher_is_better else b - a
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, diff.size, size=(resamples, diff.size))].mean(axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return PairedDifference(int(diff.size), float(diff.mean()), float(low), float(high),
                            confidence)
