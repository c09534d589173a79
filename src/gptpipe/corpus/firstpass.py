"""Stage 0's first pass over one shard, in a worker: read its records; drop the unreadable ones, the exact
duplicates within the shard and what a rule of corpus/judge.py rejects (a quote of an evaluation item among them,
or cut out of the document: corpus/decontaminate.py's index, which the driver saved in the work folder); write
the kept documents with their origins, text digests and MinHash signatures, the shard's dropped samples, and
last its completion record.

A shard's folder is built under a temporary name and renamed into place, so a folder that exists is finished:
a rerun after a kill skips it. Exact duplicates across shards and near duplicates are found afterwards over
all shards' digests and signatures (corpus/neardup.py); the origins stay numbered within a line range until the
shards are joined (corpus/shards.py LineBases).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from gptpipe.corpus.config import CorpusConfig
from gptpipe.corpus.decontaminate import INDEX_FILE, Index, load, removed
from gptpipe.corpus.dropped import SAMPLES_FOLDER, Drops
from gptpipe.corpus.judge import Judge
from gptpipe.corpus.neardup import MinHasher
from gptpipe.corpus.shards import Shard
from gptpipe.corpus.sources import read_source
from gptpipe.stage import atomic_dir
from gptpipe.storage import is_url

DONE = "done.json"
KEPT, ORIGINS, DIGESTS, SIGNATURES = "kept.jsonl", "origins.jsonl", "digests.bin", "signatures.bin"


@dataclass
class ShardResult:
    """A finished shard's completion record: what it read, kept and dropped (origins within its range)."""

    index: int
    records: int  # records read: a line range's lines, so that the next range's line numbers follow on
    kept: int
    chars: int
    dropped: dict[str, int]
    examples: dict[str, list[str]]
    notes: dict[str, int]  # kept, but worth knowing
    languages: dict[str, int]  # the main language of each document judged


def finished(folder: Path) -> ShardResult | None:
    """The completion record of the shard in `folder`, if it finished."""
    done = folder / DONE
    return ShardResult(**json.loads(done.read_text(encoding="utf-8"))) if done.is_file() else None


def contamination_index(work: Path) -> Index:
    """The evaluation items' n-grams the driver saved in `work` (read once per worker process)."""
    path = work / INDEX_FILE
    return load(path, path.stat().st_mtime_ns)


def judge_shard(config: CorpusConfig, shard: Shard, work: Path) -> ShardResult:
    """Judge one shard into work/<shard name>/ (nothing to do when it is there already)."""
    folder = work / shard.name()
    result = finished(folder)
    if result:
        return result
    source = config.sources[shard.source]
    files = [f if is_url(f) else Path(f) for f in shard.files] or None
    index = contamination_index(work) if config.decontamination.on else None
    judge = Judge(config, index=index)
    near = config.near_dedup if config.near_dedup.threshold is not None else None
    hasher = MinHasher(near) if near else None
    seen: set[bytes] = set()  # 8-byte digests: ~80 bytes per document of the shard
    notes: Counter[str] = Counter()
    records = kept = chars = 0
    with atomic_dir(folder) as tmp:
        (tmp / SAMPLES_FOLDER).mkdir()
        drops = Drops(tmp / SAMPLES_FOLDER, config.dropped_samples)
        with (open(tmp / KEPT, "w", encoding="utf-8") as out, open(tmp / ORIGINS, "w", encoding="utf-8") as origins,
              open(tmp / DIGESTS, "wb") as digests, open(tmp / SIGNATURES, "wb") as signatures):
            for record in read_source(source, files, shard.span, config.quality.max_chars):
                records += 1
                if record.text is None:
                    drops.drop(record.problem or "unreadable", record.origin)
                    continue
                if record.problem:
                    notes[record.problem] += 1
                text = record.text.replace("\x00", "").strip()
                digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
                if config.dedup:
                    if digest in seen:
                        drops.drop("exact duplicate", record.origin, text)
                        continue
                    seen.add(digest)
                failed = judge.reject(text)
                if failed:
                    drops.drop(failed.reason, record.origin, text, **failed.about)
                    continue
                if index is not None and config.decontamination.action == "remove_span":
                    overlap = index.find(text)
                    if overlap:
                        rest = removed(text, overlap.spans)
                        if len(rest) < config.min_chars:
                            drops.drop(f"contaminated: {overlap.tasks[0]}", record.origin, text,
                                       overlaps=index.describe(overlap), left=f"{len(rest)} characters")
                            continue
                        for task in overlap.tasks:
                            notes[f"contaminated spans removed: {task}"] += 1
                        text = rest
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
                origins.write(json.dumps(record.origin) + "\n")
                digests.write(digest)
                if hasher:
                    signatures.write(hasher.signature(text).astype("<u4").tobytes())
                kept += 1
                chars += len(text)
        result = ShardResult(shard.index, records, kept, chars, dict(drops.counts), drops.examples, dict(notes),
                             dict(judge.languages))
        (tmp / DONE).write_text(json.dumps(dataclasses.asdict(result), ensure_ascii=False), encoding="utf-8")
    return result

