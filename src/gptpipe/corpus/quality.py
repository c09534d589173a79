"""Stage 0's quality rules: each named, each with its threshold in config.yaml `corpus.quality:`.

The document rules are HojiChar's (written for Japanese web corpora), plus the duplicate-line share of Gopher's
rules, which HojiChar lacks, a short-line share that leaves short documents alone, and two character-class
shares: letters among all characters (tables, dumps) and hiragana among the Japanese characters (noun lists:
menus, keyword spam; NWJC, the NINJAL web corpus, drops sentences under 5% hiragana). Each rule measures one
value (HojiChar's formula, the same value HojiChar's function gives) so that `gptpipe prepare --explain` can
print it beside the threshold; the counting ones run over numpy arrays of code points (corpus/charclass.py),
not Python loops or a regex per class. HojiChar's web defaults drop good technical text: on the 1,785 Japanese
man pages its short-line rule (0.5) drops 56%, its sentence-length rule (。 every 100 characters) 37%, its
character repetition rule (0.33) 1.7%. The defaults here keep every
Japanese man page (docs/benchmarks.md) and still drop what the rules are for: a page repeated, a menu of short
lines, a run of one character, lines ending in "...".
"""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gptpipe.corpus.charclass import HIRAGANA, KANA, KANJI, LETTER, SPACE, class_counts, code_points

if TYPE_CHECKING:  # a leaf: the config module imports nothing from here
    from gptpipe.corpus.config import QualityConfig


SHORT_LINE_CHARS, MIN_LINES = 10, 5
# A document with fewer kana than this is not Japanese text to judge by its hiragana: an English page quoting a
# Japanese name, or Chinese (Han without kana), which the hiragana rule would otherwise drop.
MIN_KANA = 20
REPETITION_NGRAM = 5  # HojiChar's CharRepetitionRatioFilter default, BigScience's setting


@dataclass(frozen=True)
class Rule:
    """One named rule: `measure(text)` is the value it tests (what `gptpipe prepare --explain` prints), `past`
    says whether that value drops the document."""

    name: str
    measure: Callable[[str], float]
    past: Callable[[float], bool]


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


def letter_share(text: str) -> float:
    """Letters of any script (kana, kanji, Latin, Cyrillic, ...; str.isalpha) over the non-whitespace
    characters: what is left are digits, punctuation and symbols. Gopher's rule counts words with a letter,
    which needs words; this one counts characters, so it judges Japanese as it judges English."""
    counts = class_counts(text)
    chars = len(text) - counts[SPACE]
    return counts[LETTER] / chars if chars else 0.0


def hiragana_share(text: str) -> float:
    """Hiragana over the Japanese characters (kana and kanji) of a document with MIN_KANA kana or more; 1 for
    any other document. Japanese prose writes its particles and inflections in hiragana; a list of nouns (a
    menu, a tag cloud, keyword spam, a table) has almost none. Counted over the Japanese characters only, so
    that a technical page's English and code do not lower it."""
    counts = class_counts(text)
    if counts[KANA] < MIN_KANA:
        return 1.0
    return counts[HIRAGANA] / (counts[KANA] + counts[KANJI])


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


def longest_run(text: str) -> int:
    """The longest run of one character (HojiChar's SingleCharacterRepetitionFilter tests it)."""
    points = code_points(text)
    if len(points) < 2:
        return len(points)
    ends = np.flatnonzero(points[1:] != points[:-1])  # the last index of every run but the last
    return int(np.diff(np.concatenate(([-1], ends, [len(points) - 1]))).max())


def char_repetition(text: str) -> float:
    """HojiChar's (BigScience's) character 5-gram repetition ratio: the share of all 5-grams held by the most
    frequent ones (the top sqrt of the distinct count, only among those seen twice or more). The same value as
    HojiChar's `compute_character_repetition_ratio`, which counts in a Python dict (a quarter of stage 0's
    time): here each 5-gram is one uint64 (the ranks of its characters among the document's distinct ones,
    packed), sorted and counted with numpy; HojiChar's function for a text of more distinct characters than
    fit (4,096 at 5-grams)."""
    n = REPETITION_NGRAM
    grams = len(text) - n + 1
    if grams <= 0:
        return 0.0
    distinct_chars, ranks = np.unique(code_points(text), return_inverse=True)
    bits = max(len(distinct_chars) - 1, 1).bit_length()
    if bits * n > 64:
        from hojichar.filters.document_filters import CharRepetitionRatioFilter

        return CharRepetitionRatioFilter.compute_character_repetition_ratio(text, n)
    ranks = ranks.astype(np.uint64)
    keys = np.zeros(grams, dtype=np.uint64)
    for offset in range(n):
        keys = (keys << np.uint64(bits)) | ranks[offset:offset + grams]
    keys.sort()
    starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))
    freqs = np.diff(np.append(starts, grams))
    top = min(math.isqrt(len(freqs)), int((freqs > 1).sum()))
    if top <= 0:
        return 0.0
    return int(np.partition(freqs, len(freqs) - top)[len(freqs) - top:].sum()) / grams


def ellipsis_line_share(text: str) -> float:
    """Lines ending in ... or … per line break (HojiChar's DiscardTooManyEndingEllipsis, as it counts)."""
    return len(re.findall(r"(\.{3}|…)\n", text)) / max(text.count("\n"), 1)


def chars_per_kuten(text: str) -> float:
    """Characters per 。 (HojiChar's DiscardRareKuten drops a document with fewer than one 。 per n characters);
    infinite without any 。."""
    kuten = text.count("。")
    return len(text) / kuten if kuten else (float("inf") if text else 0.0)


def _ng_word_count(path: Path) -> Callable[[str], float]:
    pattern = ng_word_pattern(path)
    return lambda text: len(pattern.findall(text))


def _const(measure: Callable[[str], float]) -> Callable[[Any], Callable[[str], float]]:
    return lambda setting: measure


# (QualityConfig key, the rule's name for its setting, its measure for the setting, whether a measured value is
# past the setting), in the order the rules run: the cheap ones first. A new rule is a line here and a key there.
RULES: list[tuple[str, str, Callable[[Any], Callable[[str], float]], Callable[[float, Any], bool]]] = [
    ("max_chars", "longer than max_chars ({:,})", _const(len), lambda chars, n: chars > n),
    ("single_char_run_max", "a character repeated {}+ times", _const(longest_run), lambda run, n: run >= n),
    ("duplicate_line_share_max", "duplicate lines > {:g}", _const(duplicate_line_share), lambda v, x: v > x),
    ("char_repetition_max", "character 5-gram repetition >= {:g}", _const(char_repetition), lambda v, x: v >= x),
    ("short_line_share_max", "short lines > {:g}", _const(short_line_share), lambda v, x: v > x),
    ("letter_share_min", "letters < {:g} of the characters", _const(letter_share), lambda v, x: v < x),
    ("hiragana_share_min", "hiragana < {:g} of the Japanese characters", _const(hiragana_share),
     lambda v, x: v < x),
    ("ellipsis_line_share_max", "lines ending in ellipsis > {:g}", _const(ellipsis_line_share), lambda v, x: v > x),
    ("kuten_sentence_chars_max", "fewer than one 。 per {} characters", _const(chars_per_kuten),
     lambda v, n: v > n),
    ("ng_words_file", "an NG word of {.name}", _ng_word_count, lambda count, path: count > 0),
]


def rules(config: QualityConfig) -> list[Rule]:
    """The rules `config` turns on (null turns one off), in the order they run."""
    return [_rule(name, measure, past, value)
            for key, name, measure, past in RULES if (value := getattr(config, key)) is not None]


def _rule(name: str, measure: Callable[[Any], Callable[[str], float]], past: Callable[[float, Any], bool],
          setting: Any) -> Rule:
    return Rule(name.format(setting), measure(setting), lambda value: past(value, setting))


def pii_masker(config: QualityConfig) -> Callable[[str], str] | None:
    """HojiChar's masking of e-mail addresses and phone numbers (xxxx@yyy.com, 090-1234-XXXX), when on."""
    if not config.mask_pii:
        return None
    from hojichar import Document
    from hojichar.filters.document_filters import MaskPersonalInformation

    masker = MaskPersonalInformation()
    return lambda text: masker.apply(Document(text)).text
