"""Stage 0's near-duplicate removal: MinHash LSH over shingles, on disk, clustered transitively.

Per document (`MinHasher.signature`, a pure function of the text, so that it can run in any worker): the text
is cut into shingles, by characters for scripts written without spaces (Japanese, Chinese, Thai: a word
tokenizer finds one "word" per sentence there, the failure datatrove #234 and EleutherAI/dps #62 report), by
words otherwise; rensa's MinHash (Rust; the one HojiChar's LSH dedup uses) turns them into bands x rows 32-bit
hashes, which the caller appends to a signature file (`bands * rows` little-endian uint32 per document).

Over all shards (corpus/dedup.py runs each step as engine tasks; RAM bounded per task whatever the corpus):
1. per shard (`write_buckets`): each band of each document becomes one (key, document) record, key a 64-bit
   hash of the band's hashes and its number, written grouped by partition (the key's top bits, about
   RECORDS_PER_PARTITION records per partition over the corpus) into one file per shard;
2. per partition (`partition_records`, `bucket_pairs`): its slice of every shard's file, sorted by key;
   documents with the same key are candidates, each paired with the first (lowest-numbered) of its bucket;
3. in the same task (`similar_pairs`): a candidate pair is a duplicate when the signatures agree in at least
   `threshold` of their hashes (the estimated Jaccard similarity), read from the shards' signature files;
4. once (`clusters`): the duplicate pairs are joined with union-find over the documents that are in a pair,
   vectorised with numpy (the root of a cluster is always its lowest number, so the first document in input
   order is the one kept). Memory grows with the duplicate pairs, not the corpus; datatrove's clustering step
   holds every pair in a Python dict and slows at terabyte scale (#298).
RAM per task: one shard's records, or one partition being sorted (~200 MB up to 200 M documents), one chunk of
candidate pairs' signatures (~16 MB); disk: 4 x bands x rows bytes of signature and 16 x bands bytes of records
per document. Exact duplicates across shards go through the same partitions and sort (corpus/dedup.py), one
64-bit digest of the text per document instead of its band keys.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from rensa import RMinHash

from gptpipe.corpus.charclass import SPACE, SPACELESS, class_counts

if TYPE_CHECKING:  # a leaf: the config module imports nothing from here
    from gptpipe.corpus.config import NearDedupConfig

SEED = 42  # rensa's permutations; any fixed value, the same in every worker
DOC_CHUNK = 1 << 15  # documents whose band keys are computed at once (~30 MB at 20 x 6)
RECORDS_PER_PARTITION = 1 << 22  # (key, document) records sorted at once: 64 MB, ~3 times that while sorting
MAX_PARTITIONS = 1 << 10  # tasks of step 2, each reading a slice of every shard's file: past 1024 x 4 M records
# (200 M documents at 20 bands) a partition grows with the corpus
PAIR_CHUNK = 1 << 14  # candidate pairs verified at once: their two signatures, 2 x 16 k x 480 bytes at 20 x 6
RECORD = np.dtype([("key", "<u8"), ("doc", "<u8")])
WORD = re.compile(r"\w+")
_MIX = np.uint64(0x9E3779B97F4A7C15)  # the 64-bit golden-ratio constant: multiply-xor mixing of band hashes


def spaceless_share(text: str) -> float:
    """Share of the non-space characters that belong to a script written without spaces."""
    counts = class_counts(text)
    visible = len(text) - counts[SPACE]
    return counts[SPACELESS] / visible if visible else 0.0


@dataclass(frozen=True)
class MinHasher:
    """The shingling and MinHash of `config`: the same signature for the same text in every process."""

    config: NearDedupConfig

    @property
    def num_perm(self) -> int:
        return self.config.bands * self.config.rows

    def by_characters(self, text: str) -> bool:
        return spaceless_share(text) >= self.config.spaceless_share

    def shingles(self, text: str) -> list[str]:
        """Character n-grams with all whitespace removed (re-wrapped Japanese reads the same), or word n-grams
        of the lower-cased words (punctuation and line breaks dropped); a short text is one shingle."""
        if self.by_characters(text):
            chars, n = "".join(text.lower().split()), self.config.char_shingle
            return [chars[i:i + n] for i in range(len(chars) - n + 1)] or [chars]
        words, n = WORD.findall(text.lower()), self.config.word_shingle
        return [" ".join(words[i:i + n]) for i in range(len(words) - n + 1)] or [" ".join(words)]

    def signature(self, text: str) -> np.ndarray:
        """bands x rows MinHash values (uint32) of the text's shingles."""
        minhash = RMinHash(num_perm=self.num_perm, seed=SEED)
        minhash.update(self.shingles(text))
        return np.asarray(minhash.digest(), dtype=np.uint32)


def estimated_jaccard(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Share of equal MinHash values, row by row: the estimate of the shingle sets' Jaccard similarity."""
    return (a == b).mean(axis=-1)


def _band_keys(signatures: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(documents, bands) uint64: a hash of each band's rows and of the band's number, so that equal keys mean
    equal bands (up to 64-bit collisions, which the Jaccard check then rejects)."""
    grouped = signatures.reshape(len(signatures), bands, rows).astype(np.uint64)
    keys = np.broadcast_to((np.arange(bands, dtype=np.uint64) + np.uint64(1)) * _MIX,
                           (len(signatures), bands)).copy()
    with np.errstate(over="ignore"):
        for row in range(rows):
            keys = (keys ^ grouped[:, :, row]) * _MIX
            keys ^= keys >> np.uint64(31)
    return keys


def partition_bits(records: int) -> int:
    """How many top bits of a key pick its partition: about RECORDS_PER_PARTITION records in each, at most
    MAX_PARTITIONS partitions (past 1 G records a partition grows with the corpus)."""
    bits = 0
    while (1 << bits) < min(MAX_PARTITIONS, -(-records // RECORDS_PER_PARTITION)):
        bits += 1
    return bits


def _index_of(path: Path) -> Path:
    return path.with_name(path.name + ".idx")


def write_buckets(path: Path, keys: np.ndarray, first_doc: int, bits: int) -> None:
    """One shard's (key, document) records, `keys` (documents, keys per document) being those of documents
    first_doc, first_doc + 1, ..., written to `path` grouped by partition (the key's top `bits`; documents in
    order within each), and beside it (`.idx`) where each partition starts: a partition's task then reads one
    slice of every shard's file, and a shard writes one file whatever the number of partitions."""
    records = np.empty(keys.size, dtype=RECORD)
    records["key"] = keys.ravel()
    records["doc"] = np.repeat(np.arange(first_doc, first_doc + len(keys), dtype=np.uint64), keys.shape[1])
    part = ((records["key"] >> np.uint64(64 - bits)).astype(np.int64) if bits
            else np.zeros(len(records), dtype=np.int64))
    order = np.argsort(part, kind="stable")  # keeps document order within a partition
    records[order].tofile(path)
    np.searchsorted(part[order], np.arange((1 << bits) + 1)).astype("<i8").tofile(_index_of(path))


def partition_records(paths: list[Path], partition: int) -> np.ndarray:
    """Partition `partition`'s records from the shards' bucket files, in shard order, hence in document order."""
    parts = []
    for path in paths:
        start, end = np.fromfile(_index_of(path), dtype="<i8", count=2, offset=8 * partition)
        parts.append(np.fromfile(path, dtype=RECORD, count=int(end - start), offset=int(start) * RECORD.itemsize))
    return np.concatenate(parts) if parts else np.empty(0, dtype=RECORD)


def bucket_pairs(records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pairs (first document of a bucket, another document of it) among one partition's records."""
    if not len(records):
        return np.empty(0, dtype=np.uint64), np.empty(0, dtype=np.uint64)
    # Stable: a bucket's documents stay in input order (they were read in it), so the first is the lowest.
    records = records[np.argsort(records["key"], kind="stable")]
    keys, docs = records["key"], records["doc"]
    opens = np.concatenate(([True], keys[1:] != keys[:-1]))  # the first record of each bucket
    first = docs[opens][np.cumsum(opens) - 1]
    others = docs != first
    return first[others], docs[others]


class Signatures:
    """The signatures of documents by number, read from the shards' signature files (`starts[i]`: the number
    of shard i's first document; one more entry for the end)."""

    def __init__(self, paths: list[Path], starts: np.ndarray, num_perm: int) -> None:
        self.paths, self.starts, self.num_perm = paths, starts, num_perm

    def rows(self, docs: np.ndarray) -> np.ndarray:
        shard_of = np.searchsorted(self.starts, docs, side="right") - 1
        rows = np.empty((len(docs), self.num_perm), dtype=np.uint32)
        for shard in np.unique(shard_of):
            count = int(self.starts[shard + 1] - self.starts[shard])
            file = np.memmap(self.paths[shard], dtype="<u4", mode="r", shape=(count, self.num_perm))
            mine = shard_of == shard
            rows[mine] = file[(docs[mine] - self.starts[shard]).astype(np.int64)]
        return rows


def similar_pairs(first: np.ndarray, other: np.ndarray, signatures: Signatures,
                  threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """The candidate pairs whose signatures agree in at least `threshold` of their hashes, checked a chunk at
    a time."""
    keep = [np.empty(0, dtype=np.uint64)] * 2
    for start in range(0, len(first), PAIR_CHUNK):
        a, b = first[start:start + PAIR_CHUNK], other[start:start + PAIR_CHUNK]
        similar = estimated_jaccard(signatures.rows(a), signatures.rows(b)) >= threshold
        keep = [np.concatenate((keep[0], a[similar])), np.concatenate((keep[1], b[similar]))]
    return keep[0], keep[1]


def _find(parent: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """The roots of `nodes`: parent pointers followed until they stop changing (vectorised)."""
    roots = parent[nodes]
    while True:
        up = parent[roots]
        if np.array_equal(up, roots):
            return roots
        roots = up


def _union(parent: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """Join the clusters of each pair (a[i], b[i]); the larger root points to the smaller, so that every root
    is its cluster's lowest document number. np.minimum.at keeps one link where several pairs hook onto one
    root in a round; the others are joined in the next round."""
    touched = np.unique(np.concatenate((a, b)))
    while len(a):
        ra, rb = _find(parent, a), _find(parent, b)
        apart = ra != rb
        a, b, ra, rb = a[apart], b[apart], ra[apart], rb[apart]
        np.minimum.at(parent, np.maximum(ra, rb), np.minimum(ra, rb))
    parent[touched] = _find(parent, touched)  # path compression: later finds from these take one step


def clusters(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The near-duplicate pairs (a[i], b[i]) joined transitively: the documents that are not the first (lowest
    numbered) of their cluster, in order, and the first of each. Memory grows with the pairs, not the corpus:
    the union-find runs over the documents that are in a pair, renumbered in order."""
    nodes, inverse = np.unique(np.concatenate((a, b)), return_inverse=True)
    parent = np.arange(len(nodes), dtype=np.int64)
    _union(parent, inverse[:len(a)], inverse[len(a):])
    roots = _find(parent, np.arange(len(nodes)))
    later = roots != np.arange(len(nodes))
    return nodes[later], nodes[roots[later]]
