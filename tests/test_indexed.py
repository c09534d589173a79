"""The numpy-only .bin/.idx writer and reader against megatron-core's own IndexedDatasetBuilder/IndexedDataset."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronDataset

from gptpipe.data.indexed import (IndexedDataset, IndexedDatasetWriter, Placement, allocate, bin_path, idx_path,
                                  place, read_index, token_dtype)


def random_documents(seed: int, count: int, vocab: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n) for n in rng.integers(1, 400, size=count)]


def megatron_build(prefix: Path, documents: list[np.ndarray], dtype: np.dtype) -> None:
    builder = IndexedDatasetBuilder(str(bin_path(prefix)), dtype=dtype.type)
    for doc in documents:
        builder.add_document(doc, [len(doc)])
    builder.finalize(str(idx_path(prefix)))


def megatron_build_sentences(prefix: Path, documents: list[np.ndarray], dtype: np.dtype, pieces: int) -> None:
    """A dataset made elsewhere, with several sequences (sentences) per document."""
    builder = IndexedDatasetBuilder(str(bin_path(prefix)), dtype=dtype.type)
    for doc in documents:
        for piece in np.array_split(doc, pieces):
            builder.add_item(torch.from_numpy(piece))
        builder.end_document()
    builder.finalize(str(idx_path(prefix)))


def ours_build(prefix: Path, documents: list[np.ndarray], dtype: np.dtype) -> None:
    writer = IndexedDatasetWriter(bin_path(prefix), dtype)
    half = len(documents) // 2
    for batch in (documents[:half], documents[half:]):  # appended in two calls, as worker parts are
        if batch:
            writer.add_documents(np.concatenate(batch), np.array([len(d) for d in batch]))
    writer.finalize(idx_path(prefix))


def assert_same_files(a: Path, b: Path) -> None:
    for path in (bin_path, idx_path):
        assert path(a).read_bytes() == path(b).read_bytes(), f"{path(a).name} differs from megatron's"


@pytest.mark.parametrize("vocab", [32_000, 65_499, 65_500, 100_000])
def test_dtype_rule_is_megatrons(vocab: int) -> None:
    assert token_dtype(vocab).type is DType.optimal_dtype(vocab)


@pytest.mark.parametrize("vocab,count", [(32_000, 300), (100_000, 300), (32_000, 0)])
def test_writer_is_byte_identical_to_megatron_builder(tmp_path: Path, vocab: int, count: int) -> None:
    documents = random_documents(vocab + count, count, vocab)
    dtype = token_dtype(vocab)
    megatron_build(tmp_path / "megatron", documents, dtype)
    ours_build(tmp_path / "ours", documents, dtype)
    assert_same_files(tmp_path / "ours", tmp_path / "megatron")

    if count:  # and megatron reads ours back document by document, as our reader does
        theirs = MegatronDataset(str(tmp_path / "ours"), mmap=True)
        mine = IndexedDataset(tmp_path / "ours")
        assert len(theirs) == len(mine) == count
        for i, doc in enumerate(documents):
            assert theirs[i].tolist() == doc.tolist() == mine[i].tolist()


def test_merge_is_byte_identical_to_megatron_add_index(tmp_path: Path) -> None:
    dtype = token_dtype(32_000)
    parts = []
    for i in range(3):
        parts.append(tmp_path / f"part{i}")
        megatron_build(parts[-1], random_documents(i, 50 + i, 32_000), dtype)
    # A dataset with several sequences per document keeps its document boundaries.
    parts.append(tmp_path / "sentences")
    megatron_build_sentences(parts[-1], random_documents(9, 20, 32_000), dtype, pieces=3)

    builder = IndexedDatasetBuilder(str(bin_path(tmp_path / "megatron")), dtype=dtype.type)
    writer = IndexedDatasetWriter(bin_path(tmp_path / "ours"), dtype)
    for part in parts:
        builder.add_index(str(part))
        writer.add_dataset(part)
    builder.finalize(str(idx_path(tmp_path / "megatron")))
    writer.finalize(idx_path(tmp_path / "ours"))
    assert_same_files(tmp_path / "ours", tmp_path / "megatron")


def test_placed_parts_are_byte_identical_to_megatron_add_index(tmp_path: Path) -> None:
    """Stage 2's parallel merge: parts copied into their places of an allocated dataset, in any order (an empty
    part too), give megatron-core's bytes for the parts appended in order."""
    dtype = token_dtype(32_000)
    parts = []
    for i, count in enumerate((40, 0, 1, 73)):
        parts.append(tmp_path / f"part{i}")
        megatron_build(parts[-1], random_documents(i, count, 32_000), dtype)
    builder = IndexedDatasetBuilder(str(bin_path(tmp_path / "megatron")), dtype=dtype.type)
    for part in parts:
        builder.add_index(str(part))
    builder.finalize(str(idx_path(tmp_path / "megatron")))

    indexes = [read_index(idx_path(p)) for p in parts]
    sequences, tokens = sum(i.sequences for i in indexes), sum(i.tokens for i in indexes)
    ours = tmp_path / "ours"
    allocate(bin_path(ours), idx_path(ours), dtype, sequences, tokens)
    first_sequence = np.cumsum([0] + [i.sequences for i in indexes])
    first_token = np.cumsum([0] + [i.tokens for i in indexes])
    for k in (3, 1, 0, 2):
        place(parts[k], Placement(str(bin_path(ours)), str(idx_path(ours)), dtype.name, sequences,
                                  int(first_sequence[k]), int(first_token[k])))
    assert_same_files(ours, tmp_path / "megatron")

    megatron_build_sentences(tmp_path / "sentences", random_documents(9, 5, 32_000), dtype, pieces=3)
    with pytest.raises(ValueError, match="one sequence per document"):
        place(tmp_path / "sentences", Placement(str(bin_path(ours)), str(idx_path(ours)), dtype.name, sequences, 0, 0))


def test_reader_matches_megatron_on_sentence_level_data(tmp_path: Path) -> None:
    prefix = tmp_path / "sentences"
    megatron_build_sentences(prefix, random_documents(3, 30, 100_000), token_dtype(100_000), pieces=2)
    ours, theirs = read_index(idx_path(prefix)), MegatronDataset(str(prefix), mmap=True).index
    assert ours.dtype == np.int32
    assert ours.sizes.tolist() == theirs.sequence_lengths.tolist()
    assert ours.pointers.tolist() == theirs.sequence_pointers.tolist()
    assert ours.document_indices.tolist() == theirs.document_indices.tolist()
    assert ours.documents == 30 and ours.sequences == 60


def test_read_index_rejects_other_files(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.idx"
    bogus.write_bytes(b"not an index at all, just some bytes")
    with pytest.raises(ValueError, match="bogus.idx: not a Megatron .idx"):
        read_index(bogus)
    ours_build(tmp_path / "cut", random_documents(1, 10, 100), token_dtype(100))
    whole = idx_path(tmp_path / "cut").read_bytes()
    idx_path(tmp_path / "cut").write_bytes(whole[:-8])
    with pytest.raises(ValueError, match="truncated"):
        read_index(idx_path(tmp_path / "cut"))
