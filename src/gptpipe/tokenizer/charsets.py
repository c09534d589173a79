"""Character sets a tokenizer gives a piece each, whether or not the training sample holds them.

A unigram tokenizer's GGUF reads a character without a piece as <unk> in llama.cpp (its unigram tokenizer has no
byte fallback), and a small corpus misses common characters: the Japanese man pages lack 1,515 of JIS X 0208's
2,965 level-1 kanji (材, 誌, 君 ...), and 1.6% of their held-out passages held one. The sets come from the national
standards every CJK system can write, read out of Python's own codecs (no data file, no download). `auto` takes
`basic` (ASCII, Latin-1, punctuation: coverage drops a rare "?" on a small English corpus) and the sets whose
script the sample writes (`SCRIPT_SHARE_MIN`), when they fit the vocabulary (`VOCAB_SHARE_MAX`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache

AUTO = "auto"
# a script written by at least this share of the sample's non-space characters earns its set under `auto`
SCRIPT_SHARE_MIN = 0.005
# `auto` leaves out a set that would take more than this share of vocab_size (it logs that it did)
VOCAB_SHARE_MAX = 0.25
ANY_SCRIPT = "any"  # a set auto takes whatever the sample writes
SCRIPTS = {"kana": re.compile(r"[\u3041-\u30ff]"), "hangul": re.compile(r"[\uac00-\ud7a3]"),
           "han": re.compile(r"[\u4e00-\u9fff]"), "space": re.compile(r"\s")}


def _euc_rows(codec: str, rows: Iterable[int]) -> str:
    """The characters of 94x94 table rows (ku) in an EUC encoding: bytes 0xA0+row, 0xA0+cell."""
    out = []
    for row in rows:
        for cell in range(1, 95):
            try:
                out.append(bytes([0xA0 + row, 0xA0 + cell]).decode(codec))
            except UnicodeDecodeError:  # unassigned cells
                pass
    return "".join(out)


def _big5_level1() -> str:
    """Big5's 5,401 frequently used hanzi (lead bytes 0xA4-0xC6, to 0xC67E)."""
    out = []
    for lead in range(0xA4, 0xC7):
        for trail in [*range(0x40, 0x7F), *range(0xA1, 0xFF)]:
            if (lead, trail) > (0xC6, 0x7E):
                break
            try:
                out.append(bytes([lead, trail]).decode("big5"))
            except UnicodeDecodeError:
                pass
    return "".join(out)


@dataclass(frozen=True)
class CharacterSet:
    name: str
    doc: str
    script: str  # the SCRIPTS entry `auto` looks for
    build: Callable[[], str]


def _ranges(*ranges: tuple[int, int]) -> str:
    """The characters of inclusive code point ranges."""
    return "".join(chr(c) for first, last in ranges for c in range(first, last + 1))


SETS = {s.name: s for s in (
    CharacterSet("basic", "printable ASCII, Latin-1 and general punctuation (quotes, dashes, ellipsis): 226 "
                 "characters every script's text uses; SentencePiece's coverage can drop rare ones such as ? "
                 "and & on a small corpus", ANY_SCRIPT,
                 lambda: _ranges((0x21, 0x7E), (0xA0, 0xFF), (0x2010, 0x2027), (0x2030, 0x203A))),
    CharacterSet("ja", "JIS X 0208 rows 1-8 (kana, symbols, full-width letters, Greek, Cyrillic, box drawing) and "
                 "its 2,965 level-1 kanji: 3,489 characters", "kana",
                 lambda: _euc_rows("euc_jp", range(1, 9)) + _euc_rows("euc_jp", range(16, 48))),
    CharacterSet("ja-level2", "JIS X 0208's 3,390 level-2 kanji (names, rarer words); never chosen by auto",
                 "", lambda: _euc_rows("euc_jp", range(48, 85))),
    CharacterSet("ko", "KS X 1001's 2,350 Hangul syllables", "hangul", lambda: _euc_rows("euc_kr", range(16, 41))),
    CharacterSet("zh-hans", "GB 2312's 3,755 level-1 hanzi", "han", lambda: _euc_rows("gb2312", range(16, 56))),
    CharacterSet("zh-hant", "Big5's 5,401 frequently used hanzi", "han", _big5_level1),
)}
NAMES = [AUTO, *SETS]


@cache
def characters(name: str) -> str:
    """The characters of one set, in table order."""
    return SETS[name].build()


def script_shares(lines: Iterable[str]) -> dict[str, float]:
    """Share of each script among the non-space characters of `lines`."""
    counts = dict.fromkeys(SCRIPTS, 0)
    total = 0
    for line in lines:
        total += len(line)
        for script, pattern in SCRIPTS.items():
            counts[script] += len(pattern.findall(line))
    written = max(1, total - counts.pop("space"))
    return {script: round(n / written, 5) for script, n in counts.items()}


@dataclass
class Choice:
    """The sets a run requires, the characters they add, and why `auto` took or left each."""

    names: list[str]
    characters: str
    reasons: list[str]
    shares: dict[str, float]


def choose(requested: list[str], shares: dict[str, float], vocab_size: int) -> Choice:
    """Resolve `character_sets` (names and/or auto) against the sample's script shares."""
    names = [n for n in requested if n != AUTO]
    reasons = []
    if AUTO in requested:
        # Han without kana is Chinese; with kana it is Japanese, whose set holds its kanji.
        chinese = shares["han"] >= SCRIPT_SHARE_MIN and shares["kana"] < SCRIPT_SHARE_MIN
        for name, charset in SETS.items():
            if not charset.script or name in names:
                continue
            share = 1.0 if charset.script == ANY_SCRIPT else shares[charset.script]
            if share < SCRIPT_SHARE_MIN or (charset.script == "han" and not chinese):
                continue
            size = len(characters(name))
            if size > VOCAB_SHARE_MAX * vocab_size:
                reasons.append(f"auto left out {name} ({size:,} characters > {VOCAB_SHARE_MAX:.0%} of "
                               f"vocab_size {vocab_size:,}; {charset.script} is {share:.1%} of the sample)")
                continue
            names.append(name)
            reasons.append(f"auto chose {name}" + ("" if charset.script == ANY_SCRIPT else
                                                   f": {charset.script} is {share:.1%} of the sample"))
    chars = "".join(dict.fromkeys("".join(characters(n) for n in names)))  # union, first occurrence order
    return Choice(names, chars, reasons, shares)
