"""Accuracy metrics that compare an evicted run with the full-cache run."""
from __future__ import annotations


def lcs_length(a: list, b: list) -> int:
    """Longest common subsequence length, O(len(a) * len(b)) time, O(len(b)) memory."""
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 over lower-cased whitespace tokens (1.0 for two empty texts)."""
    c, r = candidate.lower().split(), reference.lower().split()
    if not c and not r:
        return 1.0
    lcs = lcs_length(c, r)
    if lcs == 0:
        return 0.0
    p, rec = lcs / len(c), lcs / len(r)
    return 2 * p * rec / (p + rec)


def token_agreement(candidate: list[int], reference: list[int]) -> tuple[float, int]:
    """(fraction of positions with the same token, first step where they differ or the length)."""
    n = max(len(candidate), len(reference))
    same = [i < len(candidate) and i < len(reference) and candidate[i] == reference[i]
            for i in range(n)]
    first = same.index(False) if False in same else n
    return (sum(same) / n if n else 1.0), first
