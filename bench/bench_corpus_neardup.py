"""Stage-0 benchmark: near-duplicate removal on man pages with near copies made from them.

    python 0_prepare_corpus.py corpus.join=true     # the man pages' stage-0 corpus as one file
    PYTHONPATH=src:tests python bench/bench_corpus_neardup.py --ja data/corpus/corpus.jsonl --en 300 \
        [--copies 1 10] [--edit-every 300]

Builds a corpus of originals (the Japanese pages of a stage-0 corpus.jsonl without near-dedup, and --en English
pages of /usr/share/man formatted with groff) followed by --copies near copies of each original of 1,500+
characters (tests/test_corpus_neardup.py's near_copy: random edits, re-wrapping, page boilerplate), then runs
`gptpipe prepare` on it in a child process twice, near-dedup off and on. Prints per run: wall seconds, MB/s,
the child's peak RSS, the copies dropped (recall, per language) and the originals dropped. The figures go in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from test_corpus_neardup import MAN, MIN_CHARS, manpage_texts, near_copy


# The child reports its own peak (VmHWM): getrusage counts the parent's pages a child holds before its exec, and
# this parent holds the whole generated corpus.
PEAK_RSS = ("import sys\nfrom gptpipe.cli import main\ncode = main(sys.argv[1:])\n"
            "print(next(line for line in open('/proc/self/status') if line.startswith('VmHWM')).split()[1])\n"
            "sys.exit(code)")


def run_stage0(folder: Path, documents: Path, near: bool) -> tuple[float, float, list[str]]:
    """Wall seconds, the child's peak RSS in MiB, the kept documents."""
    config = {"corpus": {"sources": [{"type": "jsonl", "path": str(documents)}], "output_dir": str(folder / "out"),
                         "dropped_samples": 0, "near_dedup": {"threshold": 0.8 if near else None}}}
    (folder / "config.yaml").write_text(yaml.safe_dump(config, allow_unicode=True), encoding="utf-8")
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PEAK_RSS, "prepare", "--config", str(folder / "config.yaml"),
                           "--force", "corpus.join=true"], check=True, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True)
    wall = time.perf_counter() - started
    rss = int(done.stdout.split()[-1]) / 1024
    with open(folder / "out" / "corpus.jsonl", encoding="utf-8") as fh:
        kept = [json.loads(line)["text"] for line in fh]
    return wall, rss, kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ja", type=Path, required=True, help="a stage-0 corpus.jsonl of the Japanese man pages")
    parser.add_argument("--en", type=int, default=300, help="English man pages to add (every 37th of man1-8)")
    parser.add_argument("--copies", type=int, nargs="+", default=[1], help="near copies of each long original")
    parser.add_argument("--edit-every", type=int, default=None, help="characters per random edit (default: "
                        "300 in Japanese, 600 in English, about one per 100 words)")
    args = parser.parse_args()
    with open(args.ja, encoding="utf-8") as fh:
        ja = [json.loads(line)["text"] for line in fh]
    en = manpage_texts(MAN, 37, args.en, min_chars=200)
    originals = [("ja", t) for t in ja] + [("en", t) for t in en]
    print(f"originals: {len(ja)} Japanese, {len(en)} English; {sum(len(t) >= MIN_CHARS for _, t in originals)} of "
          f"{MIN_CHARS:,}+ characters get copies")
    for copies in args.copies:
        rng = random.Random(copies)
        made = [(lang, near_copy(t, lang, rng, args.edit_every)) for lang, t in originals if len(t) >= MIN_CHARS
                for _ in range(copies)]
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            documents = folder / "docs.jsonl"
            documents.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n"
                                         for _, t in originals + made), encoding="utf-8")
            mb = documents.stat().st_size / 1e6
            print(f"\n{copies} cop{'y' if copies == 1 else 'ies'} each: {len(originals) + len(made):,} documents, "
                  f"{mb:.1f} MB")
            for near in (False, True):
                wall, rss, kept = run_stage0(folder, documents, near)
                kept_set = set(kept)
                lost = sum(t not in kept_set for _, t in originals)
                line = (f"  near-dedup {'on ' if near else 'off'}: {wall:6.1f} s, {mb / wall:5.2f} MB/s, peak RSS "
                        f"{rss:,.0f} MiB, originals dropped {lost}")
                for lang in ("ja", "en"):
                    mine = [t for language, t in made if language == lang]
                    gone = sum(t not in kept_set for t in mine)
                    line += f", {lang} copies dropped {gone}/{len(mine)} ({gone / max(len(mine), 1):.1%})"
                print(line)


if __name__ == "__main__":
    main()
