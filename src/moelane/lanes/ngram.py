"""The 3-gram index behind the copy and recall drafters, and the longest-backward-match search.

An index over a token sequence maps each 3-gram to the positions just after its occurrences (where a continuation
starts), oldest first. Sequences only grow, so the index is extended incrementally.
"""

from __future__ import annotations

N = 3
MAX_CANDIDATES = 64  # occurrences of a 3-gram examined, newest first


class NgramIndex:
    __slots__ = ("n_indexed", "where")

    def __init__(self) -> None:
        self.where: dict[tuple[int, ...], list[int]] = {}
        self.n_indexed = 0

    def extend(self, tokens: list[int]) -> None:
        """Index the 3-grams of `tokens` not indexed yet (`tokens` extends what was indexed before)."""
        for end in range(max(self.n_indexed, N), len(tokens) + 1):
            self.where.setdefault(tuple(tokens[end - N : end]), []).append(end)
        self.n_indexed = max(self.n_indexed, len(tokens))


def longest_match(
    index: NgramIndex, source: list[int], query: list[int], max_match: int, exclude_end: int
) -> tuple[int, int] | None:
    """(continuation start in `source`, match length) of the longest backward match of `query`'s tail in `source`,
    newest occurrence first on ties; occurrences ending at or after `exclude_end` are skipped."""
    if len(query) < N:
        return None
    ends = index.where.get(tuple(query[-N:]))
    if not ends:
        return None
    best: tuple[int, int] | None = None
    seen = 0
    for end in reversed(ends):
        if end >= exclude_end:
            continue
        k = N
        while k < max_match and k < len(query) and end - 1 - k >= 0 and source[end - 1 - k] == query[-1 - k]:
            k += 1
        if best is None or k > best[1]:
            best = (end, k)
        seen += 1
        if k >= max_match or seen >= MAX_CANDIDATES:
            break
    return best
