"""Stage 0's near-duplicate removal: MinHash LSH over shingles, on disk, clustered transitively.

Per document (`MinHasher.signature`, a pure function of the text, so that it can run in any worker): the text
is cut into shingles, by characters for scripts written without spaces (Japanese, Chinese, Thai: a word
tokenizer finds one "word" per sentence there, the failure datatrove #234 and EleutherAI/dps #62 report), by
words otherwise; rensa's MinHash (Rust; the one HojiChar's LSH dedup uses) turns them into bands x rows 32-bit
hashes, which the caller appends to a signature file (`bands * rows` little-endian uint32 per document).

Over the signature file (`duplicate_of`), in bounded RAM whatever the corpus size:
1. each band of each document becomes one (key, document) record, key a 64-bit hash of the band's hashes and
   its number; the records go to partition files by the key's top bits, about RECORDS_PER_PARTITION each;
2. each partition is sorted in memory by key; documents with the same key are candidates, each paired with the
   first (lowest-numbered) document of its bucket;
3. a candidate pair is a duplicate when its signatures agree in at least `threshold` of their hashes (the
   estimated Jaccard similarity), read from the memory-mapped signature file;
4. duplicates are joined with union-find over an on-disk array of document numbers, vectorised with numpy (the
   root of a cluster is always its lowest number, so the first document in input order is the one kept).
   datatrove's clustering step holds every pair in a Python dict and slows at terabyte scale (#298).
RAM: one chunk of band keys (DOC_CHUNK documents), one partition being sorted (at most ~200 MB up to 200 M
documents), one chunk of candidate pairs' signatures (~16 MB), and the page cache of the memory-mapped files;
disk: 4 x bands x rows bytes of signature and 16 x bands bytes of records per document.
Exact duplicates across stage 0's shards (`exact_duplicate_of`) go through the same partitions and sort, one
64-bit digest of the text per document instead of its band keys.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from rensa import RMinHash

from gptpipe.corpus.charclass import SPACE, SPACELESS, class_counts
from gptpipe.log import get_logger

if TYPE_CHECKING:  # a leaf: the config module imports nothing from here
    from gptpipe.corpus.config import NearDedupConfig

log = get_logger("prepare")

SEED = 42  # rensa's permutations; any fixed value, the same in every worker
DOC_CHUNK = 1 << 15  # documents whose band keys are computed at once (~30 MB at 20 x 6)
RECORDS_PER_PARTITION = 1 << 22  # (key, document) records sorted at once: 64 MB, ~3 times that while sorting
MAX_PARTITIONS = 1 << 10  # open files while partitioning; past 1024 x 4 M records (200 M documents at 20 bands)
# a partition grows with the corpus
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


def _partition(count: int, keys_of: Callable[[int, int], np.ndarray], work: Path, name: str) -> list[Path]:
    """Write every (key, document) record to the partition file its key's top bits pick; `keys_of(a, b)` gives
    the keys of documents a to b-1, (documents, keys per document) uint64."""
    per_doc = keys_of(0, min(count, 1)).shape[1]
    total = count * per_doc
    bits = 0
    while (1 << bits) < min(MAX_PARTITIONS, -(-total // RECORDS_PER_PARTITION)):
        bits += 1
    paths = [work / f"{name}-{p:04d}.bin" for p in range(1 << bits)]
    files = [open(path, "wb") for path in paths]
    try:
        for start in range(0, count, DOC_CHUNK):
            keys = keys_of(start, min(start + DOC_CHUNK, count))
            records = np.empty(keys.size, dtype=RECORD)
            records["key"] = keys.ravel()
            records["doc"] = np.repeat(np.arange(start, start + len(keys), dtype=np.uint64), per_doc)
            if bits == 0:
                records.tofile(files[0])
                continue
            part = (records["key"] >> np.uint64(64 - bits)).astype(np.int64)
            order = np.argsort(part, kind="stable")  # keeps document order within a partition
            bounds = np.searchsorted(part[order], np.arange(len(files) + 1))
            for p, file in enumerate(files):
                records[order[bounds[p]:bounds[p + 1]]].tofile(file)
    finally:
        for file in files:
            file.close()
    return paths


def _candidates(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Pairs (first document of a bucket, another document of it) among one partition's records."""
    records = np.fromfile(path, dtype=RECORD)
    # Stable: a bucket's documents stay in input order (they were written in it), so the first is the lowest.
    records = records[np.argsort(records["key"], kind="stable")]
    keys, docs = records["key"], records["doc"]
    opens = np.concatenate(([True], keys[1:] != keys[:-1]))  # the first record of each bucket
    first = docs[opens][np.cumsum(opens) - 1]
    others = docs != first
    return first[others], docs[others]


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


def duplicate_of(signature_file: Path, config: NearDedupConfig, work: Path) -> np.ndarray:
    """For each document of `signature_file` (in order), the number of the document it is a near duplicate of
    (the first of its cluster), or its own number when it is kept. A memory-mapped array in `work`."""
    assert config.threshold is not None
    num_perm = config.bands * config.rows
    size = signature_file.stat().st_size
    count = size // (4 * num_perm)
    if size != count * 4 * num_perm:
        raise ValueError(f"{signature_file}: {size} bytes is not a whole number of {num_perm}-hash signatures")
    parent = _own_numbers(work / "parent.bin", count)
    if count == 0:
        return parent
    dtype = parent.dtype
    signatures = np.memmap(signature_file, dtype="<u4", mode="r", shape=(count, num_perm))
    candidates = duplicates = 0
    for path in _partition(count, lambda a, b: _band_keys(np.asarray(signatures[a:b]), config.bands, config.rows),
                           work, "bands"):
        first, other = _candidates(path)
        path.unlink()
        candidates += len(first)
        for start in range(0, len(first), PAIR_CHUNK):
            a, b = first[start:start + PAIR_CHUNK], other[start:start + PAIR_CHUNK]
            similar = estimated_jaccard(signatures[a], signatures[b]) >= config.threshold
            duplicates += int(similar.sum())
            _union(parent, a[similar].astype(dtype), b[similar].astype(dtype))
    for start in range(0, count, DOC_CHUNK):
        parent[start:start + DOC_CHUNK] = _find(parent, np.arange(start, min(start + DOC_CHUNK, count)))
    log.info(f"near duplicates: {candidates:,} pairs in a shared bucket ({config.bands} bands x {config.rows} rows; "
             f"a pair counts once per band it shares), {duplicates:,} of them at estimated Jaccard >= "
             f"{config.threshold:g}")
    return parent


def _own_numbers(path: Path, count: int) -> np.ndarray:
    """A memory-mapped array at `path` holding 0 .. count-1 (every document its own first)."""
    dtype = np.uint32 if count < 2**32 else np.uint64
    numbers = np.memmap(path, dtype=dtype, mode="w+", shape=(max(count, 1),))
    for start in range(0, count, DOC_CHUNK):
        numbers[start:start + DOC_CHUNK] = np.arange(start, min(start + DOC_CHUNK, count), dtype=dtype)
    return numbers[:count]


def exact_duplicate_of(digest_file: Path, work: Path) -> np.ndarray:
    """For each document of `digest_file` (one little-endian 64-bit digest of its text each, in order), the
    number of the first document with the same digest, or its own number: stage 0's exact duplicates across
    shards, bucketed on disk as the bands are. A memory-mapped array in `work`."""
    count = digest_file.stat().st_size // 8
    first = _own_numbers(work / "first-equal.bin", count)
    if count == 0:
        return first
    digests = np.memmap(digest_file, dtype="<u8", mode="r", shape=(count,))
    for path in _partition(count, lambda a, b: np.asarray(digests[a:b], dtype=np.uint64)[:, None], work, "digests"):
        earliest, later = _candidates(path)
        path.unlink()
        first[later] = earliest
    return first
