"""How many English letters one Japanese character stands for: the weight stage 0's language vote gives a kana or
kanji (corpus/language.py IDEOGRAPH_WEIGHT), measured on translations against their English originals.

    PYTHONPATH=src:tests:bench python bench/bench_ideograph_weight.py

Needs the manuals in both languages (root: apt-get install --no-install-recommends debian-reference-ja
debian-reference-en debian-faq-ja debian-faq). po4a keeps a translation's structure, so a
section's n-th paragraph is the English original's n-th; a pair counts when the sections and their paragraph
counts agree, the English paragraph has 80+ letters and no Japanese, and the Japanese one is mainly Japanese
(kana and kanji at least half its letters: translated, not left in English). For each pair, the English letters
its Japanese characters replace: (English letters - Latin letters kept in the translation) / Japanese characters.
Counting characters, a page half Japanese by content would vote ~0.36 Japanese; counting UTF-8 bytes (3 per
Japanese character), ~0.63.
"""

from __future__ import annotations

import glob
import statistics
from pathlib import Path

from bench_corpus_acceptance import JAPANESE, KANA, LETTER, html_sections

# (Japanese edition, its English original) per chapter, for each manual installed in both languages.
MANUALS = {"Debian Reference": ("/usr/share/debian-reference/*.ja.html", lambda ja: ja.replace(".ja.html", ".en.html")),
           "Debian FAQ": ("/usr/share/doc/debian/FAQ/ja/*.ja.html",
                          lambda ja: ja.replace("/ja/", "/").replace(".ja.html", ".en.html"))}
MIN_ENGLISH_LETTERS = 80


def paragraph_pairs(japanese: str, english: str) -> list[tuple[str, str]]:
    """The aligned (translation, original) paragraphs of one chapter; [] when its sections do not align."""
    sections = html_sections(Path(japanese)), html_sections(Path(english))
    if len(sections[0]) != len(sections[1]):
        return []
    pairs = []
    for ja_section, en_section in zip(*sections):
        ja_lines, en_lines = ja_section.split("\n"), en_section.split("\n")
        if len(ja_lines) != len(en_lines):
            continue
        for ja_line, en_line in zip(ja_lines, en_lines):
            letters = len(LETTER.findall(ja_line))
            if (len(LETTER.findall(en_line)) >= MIN_ENGLISH_LETTERS and not JAPANESE.search(en_line)
                    and KANA.search(ja_line) and len(JAPANESE.findall(ja_line)) >= letters / 2):
                pairs.append((ja_line, en_line))
    return pairs


def main() -> None:
    print("| manual | paragraph pairs | English letters per Japanese character: pooled | median | quartiles |")
    print("| --- | --- | --- | --- | --- |")
    for name, (pattern, original) in MANUALS.items():
        replaced = japanese = 0
        ratios = []
        for path in sorted(glob.glob(pattern)):
            if not Path(original(path)).exists():
                continue
            for ja_line, en_line in paragraph_pairs(path, original(path)):
                characters = len(JAPANESE.findall(ja_line))
                kept_latin = len(LETTER.findall(ja_line)) - characters
                english = len(LETTER.findall(en_line)) - kept_latin
                replaced, japanese = replaced + english, japanese + characters
                ratios.append(english / characters)
        if not ratios:
            print(f"| {name} | not installed in both languages | | | |")
            continue
        quartiles = statistics.quantiles(ratios, n=4)
        print(f"| {name} | {len(ratios)} | {replaced / japanese:.2f} | {statistics.median(ratios):.2f} "
              f"| {quartiles[0]:.2f}–{quartiles[2]:.2f} |")


if __name__ == "__main__":
    main()
