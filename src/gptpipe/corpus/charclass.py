"""Character classes of code points, counted with numpy: what stage 0's character-class rules (quality.py) and
its choice of shingles (neardup.py) measure.

A document is read once as an array of code points and looked up in one table of class bits for the Basic
Multilingual Plane; a regular expression per class cost stage 0 about a tenth of its time on the man pages.
Outside the BMP (rare: emoji, CJK extension B and later) only letters and the supplementary ideograph planes
are told apart, per character.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache, lru_cache
from types import MappingProxyType

import numpy as np

LETTER, SPACE, HIRAGANA, KANA, KANJI, SPACELESS, NUMBER = 1, 2, 4, 8, 16, 32, 64
BITS = (LETTER, SPACE, HIRAGANA, KANA, KANJI, SPACELESS, NUMBER)
KANA_RANGES = ((0x3041, 0x309F), (0x30A0, 0x30FF), (0x31F0, 0x31FF), (0xFF66, 0xFF9F))  # + half-width
KANJI_RANGES = ((0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF))  # unified, extension A, compatibility
# Scripts written without spaces between words: Thai, Lao, Tibetan, Myanmar, Khmer, CJK (radicals to ideographs,
# kana), compatibility ideographs, half-width katakana; and the supplementary ideograph planes (ASTRAL_SPACELESS).
SPACELESS_RANGES = ((0x0E00, 0x0FFF), (0x1000, 0x109F), (0x1780, 0x17FF), (0x2E80, 0x9FFF), (0xF900, 0xFAFF),
                    (0xFF66, 0xFF9F))
ASTRAL_SPACELESS = (0x20000, 0x3FFFF)
_VALUES = 1 << len(BITS)
_VALUES_WITH = {bit: [value for value in range(_VALUES) if value & bit] for bit in BITS}


@cache
def _bmp_classes() -> np.ndarray:
    """The class bits of every BMP code point (letters by str.isalpha, whitespace by str.isspace: what str.split
    splits on, numbers by str.isnumeric: digits, fractions, numerals); built once per process, in ~50 ms."""
    chars = [chr(c) for c in range(0x10000)]
    table = np.zeros(0x10000, dtype=np.uint8)
    table[np.fromiter((c.isalpha() for c in chars), bool, 0x10000)] |= LETTER
    table[np.fromiter((c.isspace() for c in chars), bool, 0x10000)] |= SPACE
    table[np.fromiter((c.isnumeric() for c in chars), bool, 0x10000)] |= NUMBER
    table[0x3041:0x30A0] |= HIRAGANA
    for bit, ranges in ((KANA, KANA_RANGES), (KANJI, KANJI_RANGES), (SPACELESS, SPACELESS_RANGES)):
        for low, high in ranges:
            table[low:high + 1] |= bit
    return table


def code_points(text: str) -> np.ndarray:
    """The text's code points as uint32 (lone surrogates included: they are judged before they are dropped)."""
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)


# Cached: stage 0 asks three times per document (the letter and hiragana rules, then the choice of shingles).
@lru_cache(maxsize=4)
def class_counts(text: str) -> Mapping[int, int]:
    """How many characters of the text have each class bit (read-only: the mapping is shared by the callers)."""
    points = code_points(text)
    astral = points > 0xFFFF
    per_value = np.bincount(_bmp_classes()[points[~astral]], minlength=_VALUES)
    counts = {bit: int(per_value[values].sum()) for bit, values in _VALUES_WITH.items()}
    if astral.any():
        outside = points[astral]
        counts[LETTER] += sum(chr(c).isalpha() for c in outside.tolist())
        counts[SPACELESS] += int(((outside >= ASTRAL_SPACELESS[0]) & (outside <= ASTRAL_SPACELESS[1])).sum())
    return MappingProxyType(counts)


def classes(points: np.ndarray) -> np.ndarray:
    """The class bits of each code point (outside the BMP: letters, numbers and the supplementary ideographs,
    as SPACELESS, per character)."""
    astral = points > 0xFFFF
    bits = np.zeros(len(points), dtype=np.uint8)
    bits[~astral] = _bmp_classes()[points[~astral]]
    if astral.any():
        at = np.flatnonzero(astral)
        bits[at] = [(LETTER if chr(c).isalpha() else 0) | (NUMBER if chr(c).isnumeric() else 0)
                    | (SPACELESS if ASTRAL_SPACELESS[0] <= c <= ASTRAL_SPACELESS[1] else 0)
                    for c in points[at].tolist()]
    return bits


def counts_per_piece(pieces: list[str], bits: int) -> list[int]:
    """How many characters of each piece have any of the class `bits` (one lookup for all pieces; outside the
    BMP only the supplementary ideographs count, as SPACELESS)."""
    points = code_points("".join(pieces))
    astral = points > 0xFFFF
    hits = np.zeros(len(points), dtype=np.int64)
    hits[~astral] = (_bmp_classes()[points[~astral]] & bits) != 0
    if bits & SPACELESS and astral.any():
        hits[astral] = (points[astral] >= ASTRAL_SPACELESS[0]) & (points[astral] <= ASTRAL_SPACELESS[1])
    ends = np.cumsum([len(piece) for piece in pieces])
    totals = np.concatenate(([0], np.cumsum(hits)))[ends] if len(pieces) else np.zeros(0, dtype=np.int64)
    return np.diff(totals, prepend=0).tolist()
