"""Stage 0's quality rules: each named, each with its threshold in config.yaml `corpus.quality:`.

The document rules are HojiChar's (written for Japanese web corpora), plus the duplicate-line share of Gopher's
rules, which HojiChar lacks, a short-line share that leaves short documents alone, and two character-class
shares: letters among all characters (tables, dumps) and hiragana among the Japanese characters (noun lists:
menus, keyword spam; NWJC, the NINJAL web corpus, drops sentences under 5% hiragana). Each rule measures one
value (HojiChar's formula, or its own function where it has one) so that `gptpipe prepare --explain` can print
it beside the threshold. HojiChar's web defaults
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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # a leaf: the config module imports nothing from here
    from gptpipe.corpus.config import QualityConfig


SHORT_LINE_CHARS, MIN_LINES = 10, 5
# A document with fewer kana than this is not Japanese text to judge by its hiragana: an English page quoting a
# Japanese name, or Chinese (Han without kana), which the hiragana rule would otherwise drop.
MIN_KANA = 20
_LETTER = re.compile(r"[^\W\d_]")  # a letter of any script (str.isalpha), one per character
_SPACE = re.compile(r"\s")
_HIRAGANA = re.compile(r"[\u3041-\u309f]")
_KANA = re.compile(r"[\u3041-\u309f\u30a0-\u30ff\u31f0-\u31ff\uff66-\uff9f]")
_KANJI = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")


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
    """Letters of any script (kana, kanji, Latin, Cyrillic, ...) over the non-whitespace characters: what is left
    are digits, punctuation and symbols. Gopher's rule counts words with a letter, which needs words; this one
    counts characters, so it judges Japanese as it judges English."""
    chars = len(text) - len(_SPACE.findall(text))
    return len(_LETTER.findall(text)) / chars if chars else 0.0


def hiragana_share(text: str) -> float:
    """Hiragana over the Japanese characters (kana and kanji) of a document with MIN_KANA kana or more; 1 for
    any other document. Japanese prose writes its particles and inflections in hiragana; a list of nouns (a
    menu, a tag cloud, keyword spam, a table) has almost none. Counted over the Japanese characters only, so
    that a technical page's English and code do not lower it."""
    kana = len(_KANA.findall(text))
    if kana < MIN_KANA:
        return 1.0
    return len(_HIRAGANA.findall(text)) / (kana + len(_KANJI.findall(text)))


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
    return max((len(m.group()) for m in re.finditer(r"(.)\1+", text, re.DOTALL)), default=min(len(text), 1))


def char_repetition(text: str) -> float:
    """HojiChar's (BigScience's) character 5-gram repetition ratio: the top sqrt of the distinct 5-grams' share
    of all."""
    from hojichar.filters.document_filters import CharRepetitionRatioFilter

    return CharRepetitionRatioFilter.compute_character_repetition_ratio(text, 5)


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
