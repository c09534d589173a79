"""Stage 0's quality rules: each named, each with its threshold in config.yaml `corpus.quality:`.

The document rules are HojiChar's (written for Japanese web corpora), plus the duplicate-line share of Gopher's
rules, which HojiChar lacks, and a short-line share that leaves short documents alone. HojiChar's web defaults
drop good technical text: on the 1,785 Japanese man pages its short-line rule (0.5) drops 56%, its sentence-length
rule (。 every 100 characters) 37%, its character repetition rule (0.33) 1.7%. The defaults here keep every
Japanese man page (docs/benchmarks.md) and still drop what the rules are for: a page repeated, a menu of short
lines, a run of one character, lines ending in "...".
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a leaf: the config module imports nothing from here
    from gptpipe.corpus.config import QualityConfig


SHORT_LINE_CHARS, MIN_LINES = 10, 5


@dataclass(frozen=True)
class Rule:
    """One named rule: `rejects(text)` is True for a document the rule drops."""

    name: str
    rejects: Callable[[str], bool]


def duplicate_line_share(text: str) -> float:
    """Characters in non-blank lines that repeat an earlier line, over all non-blank lines' characters (Gopher's
    duplicate-line character fraction)."""
    lines = [line.strip() for line in text.split("\n") if line.strip()]
    total = sum(map(len, lines))
    repeated = sum(len(line) * (n - 1) for line, n in collections.Counter(lines).items())
    return repeated / total if total else 0.0


def short_line_share(text: str) -> float:
    """Share of the non-blank lines that have SHORT_LINE_CHARS characters or fewer, in a document of MIN_LINES
    non-blank lines or more (0 for a shorter one). HojiChar's rule counts blank lines too, and a one-line
    document as all short: it would drop a corpus of sentences."""
    lengths = [len(line.strip()) for line in text.split("\n") if line.strip()]
    if len(lengths) < MIN_LINES:
        return 0.0
    return sum(n <= SHORT_LINE_CHARS for n in lengths) / len(lengths)


def ng_word_pattern(path: Path) -> re.Pattern[str]:
    """The words of `path` (one per line); a katakana-only word matches only where no katakana touches it, so
    that "アホ" does not hit "アホウドリ". (HojiChar's NgWordsFilterJa does the same with ignore_confused, but its
    pattern matches every text when the list lacks katakana-only words or the others.)"""
    words = [w.strip() for w in path.read_text(encoding="utf-8").splitlines() if w.strip()]
    if not words:
        raise ValueError(f"{path}: no words")
    katakana = re.compile(r"[ァ-ヴー]+")
    return re.compile("|".join(rf"(?<![ァ-ヴー]){re.escape(w)}(?![ァ-ヴー])" if katakana.fullmatch(w) else re.escape(w)
                               for w in words))


def _hojichar(filter_: object) -> Callable[[str], bool]:
    from hojichar import Document

    return lambda text: filter_.apply(Document(text)).is_rejected  # type: ignore[attr-defined]


def rules(config: QualityConfig) -> list[Rule]:
    """The rules `config` turns on (a threshold of null turns one off), in the order they run."""
    from hojichar.filters import document_filters as hf

    found = []
    if config.max_chars is not None:
        limit = config.max_chars
        found.append(Rule(f"longer than max_chars ({limit:,})", lambda text: len(text) > limit))
    if config.single_char_run_max is not None:
        found.append(Rule(f"a character repeated {config.single_char_run_max}+ times",
                          _hojichar(hf.SingleCharacterRepetitionFilter(config.single_char_run_max))))
    if config.duplicate_line_share_max is not None:
        share = config.duplicate_line_share_max
        found.append(Rule(f"duplicate lines > {share:g}", lambda text: duplicate_line_share(text) > share))
    if config.char_repetition_max is not None:
        found.append(Rule(f"character 5-gram repetition >= {config.char_repetition_max:g}",
                          _hojichar(hf.CharRepetitionRatioFilter(config.char_repetition_max, 5))))
    if config.short_line_share_max is not None:
        most = config.short_line_share_max
        found.append(Rule(f"short lines > {most:g}", lambda text: short_line_share(text) > most))
    if config.ellipsis_line_share_max is not None:
        found.append(Rule(f"lines ending in ellipsis > {config.ellipsis_line_share_max:g}",
                          _hojichar(hf.DiscardTooManyEndingEllipsis(config.ellipsis_line_share_max))))
    if config.kuten_sentence_chars_max is not None:
        found.append(Rule(f"fewer than one 。 per {config.kuten_sentence_chars_max} characters",
                          _hojichar(hf.DiscardRareKuten(config.kuten_sentence_chars_max))))
    if config.ng_words_file is not None:
        pattern = ng_word_pattern(Path(config.ng_words_file))
        found.append(Rule(f"an NG word of {Path(config.ng_words_file).name}",
                          lambda text: pattern.search(text) is not None))
    return found


def pii_masker(config: QualityConfig) -> Callable[[str], str] | None:
    """HojiChar's masking of e-mail addresses and phone numbers (xxxx@yyy.com, 090-1234-XXXX), when on."""
    if not config.mask_pii:
        return None
    from hojichar import Document
    from hojichar.filters.document_filters import MaskPersonalInformation

    masker = MaskPersonalInformation()
    return lambda text: masker.apply(Document(text)).text
