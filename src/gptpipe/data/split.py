"""The train/valid/test split (`data.split`, `data.seed`): one definition for count_tokens, training and export.

Megatron cuts each split as a contiguous range of documents; gptpipe cuts the same ranges out of a seeded
permutation of the documents (`document_order`), so that a corpus written in a sorted order (man pages by
section, Wikipedia by title) does not validate on its tail only (the original pipeline's defect). Counting
(count_tokens), the GPTDataset training builds and stage 4's held-out documents all come from here.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

SPLITS = ("train", "valid", "test")


def split_shares(split: str) -> list[float]:
    """The three normalised shares of a split string like "969,30,1"; ValueError says what is wrong."""
    try:
        parts = [float(p) for p in split.split(",")]
    except ValueError:
        parts = []
    if len(parts) != len(SPLITS) or any(p < 0 for p in parts) or parts[0] <= 0:
        raise ValueError(f"must be three non-negative numbers with a positive train share, like '969,30,1', "
                         f"got {split!r}")
    total = sum(parts)
    return [p / total for p in parts]


def split_bounds(split: str, documents: int) -> list[tuple[int, int] | None]:
    """[begin, end) of each split over the documents, as megatron-core's BlendedMegatronDatasetBuilder cuts
    them: the normalised shares are summed into book-ends, each rounded to a document; a zero share is None."""
    ends = [0.0]
    for share in split_shares(split):
        ends.append(ends[-1] + share)
    return [None if end <= begin else (int(round(begin * float(documents))), int(round(end * float(documents))))
            for begin, end in zip(ends[:-1], ends[1:])]


def document_order(documents: int, seed: int, cache_dir: Path | None = None) -> np.ndarray:
    """The seeded permutation of the documents that every split is cut from (data.seed). With `cache_dir` (the
    run's index cache, data.cache_dir) it is computed once per (documents, seed), by whichever process asks first,
    and read by every other one memory-mapped: at 10^8 documents a computation takes ~7 s and 1.2 GB of RAM, and
    each rank asked four times per dataset (docs/benchmarks.md)."""
    if cache_dir is None:
        return _permutation(documents, seed)
    path = order_file(cache_dir, documents, seed)
    if not path.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(temporary, "wb") as out:  # np.save on a name would add its own suffix
            np.save(out, _permutation(documents, seed))
        os.replace(temporary, path)  # processes racing here write the same bytes
    order = np.load(path, mmap_mode="r")
    if order.shape != (documents,) or order.dtype != np.int32:
        raise ValueError(f"{path} holds {order.dtype}{list(order.shape)}, not the order of {documents:,} documents: "
                         "delete it (it is recomputed)")
    return order


ORDER_FILE_PREFIX = "document_order-"


def order_file(cache_dir: Path, documents: int, seed: int) -> Path:
    """Where `document_order` caches the order of `documents` documents under `seed`."""
    return Path(cache_dir) / f"{ORDER_FILE_PREFIX}{documents}-{seed}.npy"


def _permutation(documents: int, seed: int) -> np.ndarray:
    return np.random.RandomState(seed).permutation(documents).astype(np.int32)


def split_documents(split: str, documents: int, seed: int, cache_dir: Path | None = None) -> list[np.ndarray]:
    """The document indices of each split (train, valid, test), in `document_order` (cached in `cache_dir`)."""
    order = document_order(documents, seed, cache_dir)
    return [order[b[0]:b[1]] if b else order[:0] for b in split_bounds(split, documents)]


def unseen_documents(split: str, documents: int, seed: int) -> np.ndarray:
    """The validation then test documents: everything training never reads, in `document_order`."""
    train = split_bounds(split, documents)[0]
    return document_order(documents, seed)[train[1] if train else 0:]


def unseen_document_ids(prefix: Path | str, count: int, split: str, seed: int, drop: frozenset[int] = frozenset(),
                        max_tokens: int | None = None) -> list[list[int]]:
    """The token ids of the first `count` documents of the dataset at `prefix` that training never reads
    (`unseen_documents`), without the ids in `drop` (the separators stage 2 put around them); empty ones and
    ones over `max_tokens` passed over. Every held-out reader takes them from here: stage 4's gate, `gptpipe
    gguf`'s llama.cpp check and continued pretraining's tokenizer round trip."""
    from gptpipe.data.indexed import IndexedDataset

    reader = IndexedDataset(prefix)
    documents: list[list[int]] = []
    for i in unseen_documents(split, len(reader), seed):
        if len(documents) == count:
            break
        ids = [t for t in reader[int(i)].tolist() if t not in drop]
        if ids and (max_tokens is None or len(ids) <= max_tokens):
            documents.append(ids)
    return documents


def split_problems(name: str, split: str, documents: tuple[int, ...], tokens: tuple[int, ...],
                   seq_len: int) -> list[str]:
    """Splits with a non-zero share that cannot give one sample of `seq_len` tokens in dataset `name`.

    megatron-core's GPTDataset loops forever on such a split; count_tokens warns with these lines, training
    refuses with them.
    """
    wanted = [b is not None for b in split_bounds(split, 1_000_000)]
    return [f"{name}: the {split_name} split gets {docs:,} documents / {toks:,} tokens (one sample needs "
            f"{seq_len + 1:,} tokens)"
            for split_name, want, docs, toks in zip(SPLITS, wanted, documents, tokens)
            if want and (docs == 0 or toks < seq_len + 1)]
