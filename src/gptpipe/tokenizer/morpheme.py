"""Morpheme-aware training (pretokenize: morpheme): pieces never span a morpheme boundary.

Training lines are cut into morphemes with fugashi + unidic-lite and joined with :data:`DELIMITER`, which
SentencePiece receives as ``pretokenization_delimiter``: it splits training sentences there and drops the
mark, so no piece is learned across a boundary, yet the mark never enters the vocabulary and the model
encodes raw text with no analyzer at use time. Whitespace before a morpheme stays attached to it, the way
SentencePiece itself prefixes pieces with "▁", so English in the corpus still yields "▁word" pieces.

At use time the Viterbi search sees raw text, so a learned piece can still happen to match across a
boundary of a new sentence; :func:`crossing_share` measures how often (the stage records it).
"""

from __future__ import annotations

from typing import Any
from collections.abc import Iterable

# U+2063 INVISIBLE SEPARATOR: practically absent from real text; removed from training lines if present.
DELIMITER = "\u2063"


class MorphemeSplitter:
    """fugashi (MeCab) with the unidic-lite dictionary; import errors say which extra to install."""

    def __init__(self) -> None:
        try:
            import fugashi
            import unidic_lite  # noqa: F401  (fugashi finds the dictionary through this package)
        except ImportError as exc:
            raise ImportError(f"pretokenize: morpheme needs fugashi and unidic-lite ({exc}); "
                              "install them with: pip install -e .[ja]") from None
        self._tagger = fugashi.Tagger()

    def chunks(self, line: str) -> list[str]:
        """``line`` cut at morpheme boundaries; whitespace joins the morpheme after it. Joins back to ``line``."""
        chunks: list[str] = []
        pos = 0
        for word in self._tagger(line):
            start = line.find(word.surface, pos)
            if start < 0:  # cannot happen with MeCab surfaces; keep the rest whole rather than lose text
                break
            end = start + len(word.surface)
            chunks.append(line[pos:end])  # MeCab skips whitespace: it goes with this morpheme
            pos = end
        if pos < len(line):
            if chunks and not line[pos:].strip():
                chunks[-1] += line[pos:]  # trailing whitespace
            else:
                chunks.append(line[pos:])
        return chunks

    def presplit(self, line: str) -> str:
        """The training form of ``line``: morphemes joined with :data:`DELIMITER`."""
        return DELIMITER.join(self.chunks(line.replace(DELIMITER, "")))

    def boundaries(self, text: str) -> set[int]:
        """Character offsets of every morpheme boundary inside ``text`` (newlines are boundaries too)."""
        cuts: set[int] = set()
        offset = 0
        for line in text.split("\n"):
            for chunk in self.chunks(line):
                offset += len(chunk)
                cuts.add(offset)
            offset += 1  # the newline
            cuts.add(offset)
        return cuts


def crossing_share(sp: Any, splitter: MorphemeSplitter, texts: Iterable[str]) -> tuple[int, int]:
    """(pieces that span a morpheme boundary, all pieces) when ``sp`` encodes ``texts`` as raw text."""
    crossing = total = 0
    for text in texts:
        cuts = splitter.boundaries(text)
        # Piece offsets come in UTF-8 bytes; map them to characters to compare with the boundaries.
        char_at = _byte_to_char_offsets(text)
        for piece in sp.encode(text, return_type="proto").pieces:
            begin, end = char_at[piece.begin], char_at[piece.end]
            total += 1
            crossing += any(c in cuts for c in range(begin + 1, end))
    return crossing, total


def _byte_to_char_offsets(text: str) -> dict[int, int]:
    offsets, byte = {}, 0
    for i, ch in enumerate(text):
        offsets[byte] = i
        byte += len(ch.encode("utf-8"))
    offsets[byte] = len(text)
    return offsets
