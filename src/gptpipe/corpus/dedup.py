"""Stage 0's duplicates across shards, as engine tasks (corpus/executor.py: local processes or Ray), the driver
holding only what grows with the duplicates found.

After the shards are judged (corpus/firstpass.py: each kept document's text digest and MinHash signature in its
shard's folder), with the kept documents numbered in shard order:
1. per shard, `bucket`: its documents' band keys (and text digests) written grouped by partition
   (corpus/neardup.py write_buckets);
2. per partition, `search`: its slice of every shard's keys sorted, equal keys paired, near pairs checked on
   their signatures; the pairs found go to a file of the partition's;
3. on the driver, `Removal.find`: exact pairs as they are (one digest per document: each later copy names its
   first), near pairs joined into clusters (neardup.clusters); the documents to drop, each with the document
   it duplicates, written to two small sorted arrays;
4. per shard, `keep`: its kept documents copied without those, each line given its source's label and its
   origin (file:line), its drops counted and sampled. This step runs when there is nothing to compare too.
The driver then merges the shards' drops in shard order and puts their outputs in place as the corpus (stage 0,
corpus/prepare.py): the same documents, samples and counts whatever the number of workers, nodes or partitions
(a partition's pairs depend on its keys only, and the clusters' first members on the numbering only).
"""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np
from tqdm import tqdm

from gptpipe.corpus.config import CorpusConfig, NearDedupConfig
from gptpipe.corpus.dropped import EXAMPLES_PER_REASON, Drops
from gptpipe.corpus.executor import Executor
from gptpipe.corpus.firstpass import DIGESTS, KEPT, ORIGINS, SIGNATURES, ShardResult
from gptpipe.corpus.neardup import (DOC_CHUNK, Signatures, _band_keys, bucket_pairs, clusters, partition_bits,
                                    partition_records, similar_pairs, write_buckets)
from gptpipe.corpus.shards import relocate, shard_name
from gptpipe.log import get_logger
from gptpipe.stage import atomic_path

log = get_logger("prepare")
FOLDER = "dedup"  # under the work folder: the plan, each partition's pairs, the removal arrays
KINDS = {"exact": "digest-keys.bin", "near": "band-keys.bin"}  # each kind's bucket file in a shard's folder
OUTPUT, DROPPED = "deduplicated.jsonl", "deduplicated-dropped"  # a shard's step-4 output, in its folder
EXACT = "exact duplicate"
REMOVED = np.dtype([("doc", "<u8"), ("first", "<u8")])


def near_dup_reason(config: NearDedupConfig) -> str:
    return f"near duplicate (Jaccard ≥ {config.threshold:g})"


class Clock:
    """Wall seconds per step, into a stage's timings."""

    def __init__(self, timings: dict[str, float]) -> None:
        self.timings, self.last = timings, time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.timings[name] = round(now - self.last, 3)
        self.last = now


@dataclass(frozen=True)
class Plan:
    """What every task reads from work/dedup/plan.json: the numbering of the shards' documents (`starts[i]`:
    shard i's first; one more entry, the total) and each kind's partition bits (absent: not searched)."""

    starts: list[int]
    bits: dict[str, int]

    def save(self, work: Path) -> None:
        (work / FOLDER / "plan.json").write_text(json.dumps({"starts": self.starts, "bits": self.bits}),
                                                 encoding="utf-8")

    @classmethod
    def load(cls, work: Path) -> Plan:
        return cls(**json.loads((work / FOLDER / "plan.json").read_text(encoding="utf-8")))

    def shard_of(self, doc: int) -> int:
        return int(np.searchsorted(self.starts, doc, side="right")) - 1


@dataclass(frozen=True)
class Search:
    """Step 2's item: one partition of one kind."""

    kind: str
    partition: int


@dataclass(frozen=True)
class Keep:
    """Step 4's item: a shard, its source's label, the line base of its origins (corpus/shards.py LineBases) and
    the origins of the documents that the first sampled near duplicates duplicate (the driver looked them up
    once)."""

    shard: int
    source: str
    base: int
    firsts: dict[int, str]


@dataclass
class KeepResult:
    """A shard's step-4 record: what it dropped (origins in the file's line numbers)."""

    shard: int
    dropped: dict[str, int]
    dropped_chars: int
    examples: dict[str, list[str]]


def bucket(config: CorpusConfig, shard: int, work: Path) -> int:
    """Step 1 for one shard: write each searched kind's keys grouped by partition. Returns the shard."""
    plan, folder = Plan.load(work), work / shard_name(shard)
    start = plan.starts[shard]
    if "exact" in plan.bits:
        digests = np.fromfile(folder / DIGESTS, dtype="<u8")[:, None]
        write_buckets(folder / KINDS["exact"], digests, start, plan.bits["exact"])
    if "near" in plan.bits:
        near = config.near_dedup
        signatures = np.fromfile(folder / SIGNATURES, dtype="<u4").reshape(-1, near.bands * near.rows)
        keys = np.concatenate([_band_keys(signatures[a:a + DOC_CHUNK], near.bands, near.rows)
                               for a in range(0, len(signatures), DOC_CHUNK)] or
                              [np.empty((0, near.bands), dtype=np.uint64)])
        write_buckets(folder / KINDS["near"], keys, start, plan.bits["near"])
    return shard


def search(config: CorpusConfig, item: Search, work: Path) -> tuple[int, int]:
    """Step 2 for one partition: the duplicate pairs among its records, saved as work/dedup/<kind>-<p>.npy (2 x
    pairs: the first of a bucket, the other). Returns the candidate pairs and the duplicates among them."""
    plan = Plan.load(work)
    shards = range(len(plan.starts) - 1)
    records = partition_records([work / shard_name(s) / KINDS[item.kind] for s in shards], item.partition)
    first, other = bucket_pairs(records)
    candidates = len(first)
    if item.kind == "near":
        near = config.near_dedup
        signatures = Signatures([work / shard_name(s) / SIGNATURES for s in shards], np.asarray(plan.starts),
                                near.bands * near.rows)
        first, other = similar_pairs(first, other, signatures, near.threshold)
    with atomic_path(work / FOLDER / f"{item.kind}-{item.partition:05d}.npy") as tmp, open(tmp, "wb") as fh:
        np.save(fh, np.stack((first, other)))
    return candidates, len(first)


def _pairs(work: Path, kind: str) -> tuple[np.ndarray, np.ndarray]:
    pairs = [np.load(path) for path in sorted((work / FOLDER).glob(f"{kind}-*.npy"))]
    both = np.concatenate(pairs, axis=1) if pairs else np.empty((2, 0), dtype=np.uint64)
    return both[0], both[1]


def _removal(later: np.ndarray, first: np.ndarray, path: Path) -> np.ndarray:
    """Save the documents to drop and the first of each, sorted by document; returns what it saved."""
    removed = np.empty(len(later), dtype=REMOVED)
    removed["doc"], removed["first"] = later, first
    removed.sort(order="doc")
    np.save(path, removed)
    return removed


def _removed_in(path: Path, start: int, end: int) -> dict[int, int]:
    """The documents of [start, end) that `path` (a removal array) drops, with the first of each."""
    if not path.is_file():
        return {}
    removed = np.load(path, mmap_mode="r")
    a, b = np.searchsorted(removed["doc"], [start, end])
    return dict(zip(removed["doc"][a:b].tolist(), removed["first"][a:b].tolist()))


def keep(config: CorpusConfig, item: Keep, work: Path) -> KeepResult:
    """Step 4 for one shard: its kept documents without the duplicates found, to <shard>/deduplicated.jsonl,
    each with "source" and "origin" (file:line) after its text; the dropped ones counted, sampled to
    <shard>/deduplicated-dropped/ (origins already in file line numbers)."""
    plan, folder = Plan.load(work), work / shard_name(item.shard)
    start, end = plan.starts[item.shard], plan.starts[item.shard + 1]
    exact = _removed_in(work / FOLDER / "exact.npy", start, end)
    near = _removed_in(work / FOLDER / "near.npy", start, end)
    reason = near_dup_reason(config.near_dedup) if near else ""
    samples = folder / DROPPED
    shutil.rmtree(samples, ignore_errors=True)
    samples.mkdir()
    drops, dropped_chars = Drops(samples, config.dropped_samples), 0
    source = b', "source": ' + json.dumps(item.source).encode() + b', "origin": '
    with (atomic_path(folder / OUTPUT) as tmp, open(tmp, "wb") as out, open(folder / KEPT, "rb") as lines,
          open(folder / ORIGINS, encoding="utf-8") as origins):
        for doc, line, origin_line in zip(range(start, end), lines, origins):
            origin = relocate(json.loads(origin_line), item.base)
            if doc not in exact and doc not in near:
                # firstpass wrote {"text": ...}\n: the fields go before its closing brace, the text untouched
                out.write(line[:-2] + source + json.dumps(origin, ensure_ascii=False).encode() + b"}\n")
                continue
            text = json.loads(line)["text"]
            dropped_chars += len(text)
            if doc in exact:
                drops.drop(EXACT, origin, text if drops.wants(EXACT) else None)
            elif drops.wants(reason):
                first = near[doc]
                drops.drop(reason, origin, text, duplicate_of=item.firsts.get(first, f"document {first}"))
            else:
                drops.drop(reason, origin)
    return KeepResult(item.shard, dict(drops.counts), dropped_chars, drops.examples)


def _origins(work: Path, plan: Plan, bases: list[int], docs: list[int]) -> dict[int, str]:
    """The origins (file line numbers) of a few documents, read from their shards' origin files."""
    found: dict[int, str] = {}
    by_shard: dict[int, list[int]] = {}
    for doc in sorted(set(docs)):
        by_shard.setdefault(plan.shard_of(doc), []).append(doc)
    for shard, wanted in by_shard.items():
        with open(work / shard_name(shard) / ORIGINS, encoding="utf-8") as origins:
            start = plan.starts[shard]
            for doc, line in zip(range(start, wanted[-1] + 1), islice(origins, wanted[-1] - start + 1)):
                if doc in wanted:
                    found[doc] = relocate(json.loads(line), bases[shard])
    return found


def deduplicated(engine: Executor, config: CorpusConfig, results: list[ShardResult], labels: list[str],
                 bases: list[int], work: Path, drops: Drops,
                 timings: dict[str, float]) -> tuple[list[Path], list[int], list[int]]:
    """Steps 1-4 over the judged shards (`results`, in shard order; `labels`, their sources' labels; `bases`,
    their line bases): the files whose concatenation is the corpus (one per shard, in order), and per shard the
    documents and characters the steps dropped (added to `drops`); each step's wall seconds go into `timings`."""
    bits = {}
    total = sum(r.kept for r in results)
    if config.dedup and len(results) > 1:  # a shard drops its own exact duplicates as it is judged
        bits["exact"] = partition_bits(total)
    if config.near_dedup.threshold is not None:
        bits["near"] = partition_bits(total * config.near_dedup.bands)
    if total == 0:  # nothing to compare, nothing to keep
        bits = {}
    shutil.rmtree(work / FOLDER, ignore_errors=True)  # a killed run's steps are redone, the judged shards kept
    (work / FOLDER).mkdir()
    plan = Plan(np.concatenate(([0], np.cumsum([r.kept for r in results]))).tolist(), bits)
    plan.save(work)
    shards = list(range(len(results)))
    clock = Clock(timings)
    firsts: dict[int, str] = {}
    if bits:
        firsts = _search(engine, config, plan, bases, work, clock)
    items = [Keep(shard, labels[shard], bases[shard], firsts) for shard in shards]
    outcome = {r.shard: r for r in tqdm(engine.run(keep, items, work, "shard(s) to filter"), total=len(items),
                                        desc="stage 0: shards filtered", mininterval=1.0)}
    clock.lap("filter_s")
    for shard in shards:
        result = outcome[shard]
        drops.merge(result.dropped, result.examples, work / shard_name(shard) / DROPPED, lambda origin: origin)
    results_in_order = [outcome[shard] for shard in shards]
    return ([work / shard_name(shard) / OUTPUT for shard in shards],
            [sum(r.dropped.values()) for r in results_in_order], [r.dropped_chars for r in results_in_order])


def _search(engine: Executor, config: CorpusConfig, plan: Plan, bases: list[int], work: Path,
            clock: Clock) -> dict[int, str]:
    """Steps 1-3: the removal arrays written to the dedup folder; the origins of the documents that the first
    sampled near duplicates duplicate."""
    bits, shards = plan.bits, list(range(len(plan.starts) - 1))
    for _ in tqdm(engine.run(bucket, shards, work, "shard(s) to bucket for duplicates"), total=len(shards),
                  desc="stage 0: shards bucketed", mininterval=1.0):
        pass
    clock.lap("bucket_s")
    searches = [Search(kind, p) for kind, b in bits.items() for p in range(1 << b)]
    found: Counter[str] = Counter()
    for kind, (candidates, duplicates) in tqdm(
            ((s.kind, counts) for s, counts in zip(searches, engine.run(search, searches, work,
                                                                         "partition(s) to search for duplicates"))),
            total=len(searches), desc="stage 0: partitions searched", mininterval=1.0):
        found[kind + " candidates"] += candidates
        found[kind] += duplicates
    clock.lap("search_s")
    if "exact" in bits:
        earliest, later = _pairs(work, "exact")
        _removal(later, earliest, work / FOLDER / "exact.npy")
    firsts: dict[int, str] = {}
    if "near" in bits:
        later, first = clusters(*_pairs(work, "near"))
        near = _removal(later, first, work / FOLDER / "near.npy")
        # The near duplicates sampled or shown are the first ones: the documents they duplicate, by origin.
        wanted = near["first"][:config.dropped_samples + EXAMPLES_PER_REASON].tolist()
        firsts = _origins(work, plan, bases, wanted)
        near_config = config.near_dedup
        log.info(f"near duplicates: {found['near candidates']:,} pairs in a shared bucket ({near_config.bands} "
                 f"bands x {near_config.rows} rows; a pair counts once per band it shares), {found['near']:,} of "
                 f"them at estimated Jaccard >= {near_config.threshold:g}, {len(near):,} documents in a "
                 "cluster after its first")
    clock.lap("cluster_s")
    return firsts
