"""Stage-0 benchmark: man pages → text with groff (gptpipe.corpus.manpages) over a whole man-page tree.

    python bench/bench_manpages.py [--root /usr/share/man/ja] [--workers 1 2] [--save texts.jsonl]
                                   [--compare other.jsonl]

Converts every page file stage 0 reads (symlinked aliases skipped; .so pages come out empty) once per worker
count, in a thread pool (each page is its own groff process). Prints wall seconds, the groff processes' CPU
seconds, characters, Japanese characters, roff left-overs, the longest line, and the pages groff failed on.
--save writes {"page", "text"} lines (page: its path under --root); --compare reads such a file (e.g. from
another converter) and prints, per page, the share of the other text's character 3-grams (whitespace
removed) found in this one and back, with the worst pages. The figures go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gptpipe.corpus.manpages import GroffError, find_manpages, read_manpage, roff_to_text

JAPANESE = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uff00-\uffef]")
# A man/mdoc macro line or a font escape: in the text only where a page about roff quotes one.
ROFF_LEFTOVER = re.compile(r"^\.(TH|SH|SS|Sh|Ss|Dd|Dt|PP|Pp|TP|IP|It|nf|fi|B|I|BR)( |$)|\\f[BIRP]", re.MULTILINE)


def convert(page: Path) -> tuple[str | None, str | None]:
    try:
        return roff_to_text(read_manpage(page), str(page)), None
    except GroffError as exc:
        return None, str(exc)


def trigrams(text: str) -> set[str]:
    text = re.sub(r"\s+", "", text)
    return {text[i:i + 3] for i in range(len(text) - 2)}


def compare(texts: dict[str, str], other_path: Path, worst: int = 8) -> None:
    with open(other_path, encoding="utf-8") as fh:
        other = {row["page"]: row["text"] for row in map(json.loads, fh)}
    common = sorted(set(texts) & set(other))
    rows = []
    for page in common:
        ours, theirs = trigrams(texts[page]), trigrams(other[page])
        shared = len(ours & theirs)
        rows.append((page, shared / max(1, len(theirs)), shared / max(1, len(ours)),
                     len(other[page]), len(texts[page])))
    print(f"compared {len(common)} pages with {other_path} ({len(set(other) - set(texts))} only there, "
          f"{len(set(texts) - set(other))} only here)")
    if not rows:
        return
    for column, name in ((1, "other's 3-grams found here"), (2, "our 3-grams found there")):
        values = [row[column] for row in rows]
        print(f"  {name}: mean {statistics.mean(values):.4f}, median {statistics.median(values):.4f}, "
              f"pages below 0.9: {sum(v < 0.9 for v in values)}")
        for row in sorted(rows, key=lambda r: r[column])[:worst]:
            print(f"    {row[column]:.3f} {row[0]} (other {row[3]:,} chars, here {row[4]:,})")
    print(f"  other, on these pages: {sum(len(other[p]) for p in common):,} chars, "
          f"{sum(len(JAPANESE.findall(other[p])) for p in common):,} Japanese")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path("/usr/share/man/ja"))
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--save", type=Path)
    parser.add_argument("--compare", type=Path)
    args = parser.parse_args()

    pages = find_manpages(args.root)
    if not pages:
        sys.exit(f"no man pages under {args.root}")
    results: list[tuple[str | None, str | None]] = []
    for workers in args.workers:
        cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:
            results = list(pool.map(convert, pages))
        wall = time.perf_counter() - started
        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime
        print(f"{len(pages)} page files, {workers} worker(s): {wall:.1f} s wall, {cpu:.1f} s groff CPU "
              f"({1000 * cpu / len(pages):.0f} ms/page)")
    texts = {str(p.relative_to(args.root)): text for p, (text, _) in zip(pages, results) if text}
    failed = [(str(p), problem) for p, (_, problem) in zip(pages, results) if problem is not None]
    all_text = list(texts.values())
    print(f"texts: {len(texts)}, aliases (.so): {len(pages) - len(texts) - len(failed)}, "
          f"failed: {len(failed)} {failed[:5]}")
    non_space = sum(len(re.sub(r"\s", "", t)) for t in all_text)
    print(f"characters: {sum(map(len, all_text)):,}, Japanese: {sum(len(JAPANESE.findall(t)) for t in all_text):,}, "
          f"non-space: {non_space:,}")
    print(f"roff left-overs (macro lines, font escapes): {sum(len(ROFF_LEFTOVER.findall(t)) for t in all_text)}"
          f", longest line: {max(len(line) for t in all_text for line in t.splitlines())}")
    if args.save:
        with open(args.save, "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps({"page": page, "text": text}, ensure_ascii=False) + "\n"
                          for page, text in texts.items())
    if args.compare:
        compare(texts, args.compare)


if __name__ == "__main__":
    main()
