"""The Megatron indexed dataset (<prefix>.bin + <prefix>.idx), read and written with numpy alone.

Layout of the .idx (little-endian), as megatron-core's IndexedDatasetBuilder writes it:

    b"MMIDIDX\\x00\\x00" | version <Q = 1 | dtype code <B | sequence count <Q | document-index count <Q
    | sizes int32[sequences] | pointers int64[sequences] (byte offsets into .bin)
    | document indices int64[documents + 1] (sequence index where each document starts; first 0, last = count)

The .bin is the token ids back to back. Every document gptpipe writes is one sequence ending with EOD, and
the EOD is counted in its size. This module imports no torch/megatron, so counting tokens is instant; the
test suite proves the files byte-identical to megatron-core's builder and readable by its IndexedDataset.
"""

from __future__ import annotations

import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np


MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document-index count
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
               7: np.float32, 8: np.uint16}
CODE_OF_DTYPE = {np.dtype(t): code for code, t in DTYPE_CODES.items()}
UINT16_VOCAB_LIMIT = 65_500  # megatron-core's DType.optimal_dtype: uint16 below this vocab size


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab below 65,500, megatron's rule), else int32."""
    return np.dtype(np.uint16 if vocab_size < UINT16_VOCAB_LIMIT else np.int32)


def bin_path(prefix: Path) -> Path:
    return prefix.with_name(prefix.name + ".bin")


def idx_path(prefix: Path) -> Path:
    return prefix.with_name(prefix.name + ".idx")


def write_index(path: Path, dtype: np.dtype, sizes: np.ndarray, document_indices: np.ndarray | None = None) -> None:
    """Write a .idx for sequences of ``sizes`` tokens; by default each sequence is one document."""
    sizes = np.ascontiguousarray(sizes, dtype=np.int32)
    if document_indices is None:
        document_indices = np.arange(len(sizes) + 1, dtype=np.int64)
    document_indices = np.ascontiguousarray(document_indices, dtype=np.int64)
    pointers = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= np.dtype(dtype).itemsize
    with open(path, "wb") as fh:
        fh.write(HEADER.pack(MAGIC, VERSION, CODE_OF_DTYPE[np.dtype(dtype)], len(sizes), len(document_indices)))
        fh.write(sizes.astype("<i4", copy=False).tobytes())
        fh.write(pointers.astype("<i8", copy=False).tobytes())
        fh.write(document_indices.astype("<i8", copy=False).tobytes())


@dataclass
class Index:
    """The arrays of a .idx, memory-mapped: opening one costs nothing whatever its size."""

    dtype: np.dtype
    sizes: np.ndarray  # int32, tokens per sequence (EOD included)
    pointers: np.ndarray  # int64, byte offset of each sequence in the .bin
    document_indices: np.ndarray  # int64, documents + 1 entries

    @property
    def sequences(self) -> int:
        return len(self.sizes)

    @property
    def documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))


def read_index(path: Path) -> Index:
    """Read (memory-map) a .idx; raises ValueError naming the file when it is not one."""
    with open(path, "rb") as fh:
        raw = fh.read(HEADER.size)
    if len(raw) < HEADER.size:
        raise ValueError(f"{path}: too short to be a Megatron .idx")
    magic, version, code, sequences, doc_entries = HEADER.unpack(raw)
    if magic != MAGIC or version != VERSION or code not in DTYPE_CODES:
        raise ValueError(f"{path}: not a Megatron .idx (magic {magic!r}, version {version}, dtype code {code})")
    expected = HEADER.size + sequences * 12 + doc_entries * 8
    if path.stat().st_size < expected:
        raise ValueError(f"{path}: truncated ({path.stat().st_size} bytes, header says {expected})")
    mm = np.memmap(path, mode="r", dtype=np.uint8)
    offset = HEADER.size
    sizes = mm[offset:offset + 4 * sequences].view("<i4")
    offset += 4 * sequences
    pointers = mm[offset:offset + 8 * sequences].view("<i8")
    offset += 8 * sequences
    document_indices = mm[offset:offset + 8 * doc_entries].view("<i8")
    return Index(np.dtype(DTYPE_CODES[code]), sizes, pointers, document_indices)


class IndexedDataset:
    """Token ids of each sequence of a prefix, memory-mapped (a light stand-in for megatron's reader)."""

    def __init__(self, prefix: Path):
        self.index = read_index(idx_path(prefix))
        self.tokens = np.memmap(bin_path(prefix), mode="r", dtype=self.index.dtype)

    def __len__(self) -> int:
        return self.index.sequences

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.index.pointers[i]) // self.index.dtype.itemsize
        return np.asarray(self.tokens[start:start + int(self.index.sizes[i])])


@dataclass(frozen=True)
class Placement:
    """Where one dataset (a partition) goes in a dataset that is datasets concatenated in order, each sequence one
    document: its first sequence and first token there, and that dataset's files (allocated) and size."""

    bin_file: str
    idx_file: str
    dtype: str
    sequences: int  # of the whole dataset
    first_sequence: int
    first_token: int


def allocate(bin_file: Path, idx_file: Path, dtype: np.dtype, sequences: int, tokens: int) -> None:
    """Create the files of a dataset of `sequences` documents and `tokens` ids at their full size (sparse), with
    the .idx header; `place` then fills in each part, in any order and from any machine that sees the files."""
    with open(bin_file, "wb") as fh:
        fh.truncate(tokens * np.dtype(dtype).itemsize)
    with open(idx_file, "wb") as fh:
        fh.write(HEADER.pack(MAGIC, VERSION, CODE_OF_DTYPE[np.dtype(dtype)], sequences, sequences + 1))
        fh.truncate(HEADER.size + 12 * sequences + 8 * (sequences + 1))  # the first document index is 0


def place(prefix: Path, at: Placement) -> None:
    """Copy the dataset at `prefix` (each sequence one document) into its place in the allocated dataset: the
    bytes are those IndexedDatasetWriter writes appending the same datasets in order."""
    index = read_index(idx_path(prefix))
    if index.dtype != np.dtype(at.dtype) or index.documents != index.sequences:
        raise ValueError(f"{idx_path(prefix)}: {index.dtype} ids in {index.documents} documents of "
                         f"{index.sequences} sequences; expected {at.dtype}, one sequence per document")
    n, itemsize = index.sequences, index.dtype.itemsize
    with open(bin_path(prefix), "rb") as src, open(at.bin_file, "r+b") as dst:
        dst.seek(at.first_token * itemsize)
        shutil.copyfileobj(src, dst, 16 << 20)
    pointers = np.zeros(n, dtype="<i8")
    np.cumsum(index.sizes[:-1], dtype=np.int64, out=pointers[1:])
    pointers = (pointers + at.first_token) * itemsize
    with open(at.idx_file, "r+b") as fh:
        fh.seek(HEADER.size + 4 * at.first_sequence)
        fh.write(np.asarray(index.sizes, dtype="<i4").tobytes())
        fh.seek(HEADER.size + 4 * at.sequences + 8 * at.first_sequence)
        fh.write(pointers.tobytes())
        fh.seek(HEADER.size + 12 * at.sequences + 8 * (at.first_sequence + 1))
        fh.write(np.arange(at.first_sequence + 1, at.first_sequence + n + 1, dtype="<i8").tobytes())


class IndexedDatasetWriter:
    """Append documents (or whole datasets) to a .bin; ``finalize`` writes the .idx.

    The bytes equal megatron-core's IndexedDatasetBuilder fed the same documents with ``add_document``
    (one sequence per document) or whole prefixes with ``add_index``.
    """

    def __init__(self, bin_file: Path, dtype: np.dtype):
        self.dtype = np.dtype(dtype)
        self._bin: BinaryIO = open(bin_file, "wb")
        self._sizes: list[np.ndarray] = []
        self._document_indices: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]
        self._sequences = 0

    def add_documents(self, tokens: np.ndarray, sizes: np.ndarray) -> None:
        """Append documents given as their concatenated ids and their lengths (EOD already included)."""
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self._append_index(np.asarray(sizes, dtype=np.int32), None)

    def add_raw(self, bin_file: Path, sizes: np.ndarray) -> None:
        """Append a file of ids already in this dtype (a worker's part), one document per size."""
        with open(bin_file, "rb") as src:
            shutil.copyfileobj(src, self._bin, 16 << 20)
        self._append_index(np.asarray(sizes, dtype=np.int32), None)

    def add_dataset(self, prefix: Path) -> None:
        """Append a whole dataset (e.g. a shard), keeping its document boundaries."""
        index = read_index(idx_path(prefix))
        if index.dtype != self.dtype:
            raise ValueError(f"{idx_path(prefix)} holds {index.dtype} ids, this dataset {self.dtype}")
        with open(bin_path(prefix), "rb") as src:
            shutil.copyfileobj(src, self._bin, 16 << 20)
        self._append_index(np.array(index.sizes), np.array(index.document_indices[1:]))

    def _append_index(self, sizes: np.ndarray, document_ends: np.ndarray | None) -> None:
        if document_ends is None:  # one sequence per document
            document_ends = np.arange(1, len(sizes) + 1, dtype=np.int64)
        self._sizes.append(sizes)
        self._document_indices.append(document_ends + self._sequences)
        self._sequences += len(sizes)

    def finalize(self, idx_file: Path) -> Index:
        """Close the .bin and write the .idx; returns the index as written."""
        self._bin.close()
        sizes = np.concatenate(self._sizes) if self._sizes else np.zeros(0, dtype=np.int32)
        write_index(idx_file, self.dtype, sizes, np.concatenate(self._document_indices))
        return read_index(idx_file)

    def close(self) -> None:
        self._bin.close()
