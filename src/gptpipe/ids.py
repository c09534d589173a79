"""Token id sequences compared: where two encodings of the same text, or two runtimes' continuations, part."""

from __future__ import annotations

from collections.abc import Sequence


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where `a` and `b` differ, or where the shorter ends; None when they are equal."""
    if list(a) == list(b):
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
