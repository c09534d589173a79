"""Training data: megatron-core GPTDataset over one or several stage-2 prefixes, blended and split.

Two guards run before anything is built, because megatron-core fails badly on both:
- a split that receives no document (or fewer tokens than one sample) makes GPTDataset loop forever;
- a run that asks for many epochs builds index arrays of epochs × documents in host RAM (the original's
  "-9" kill with train_samples=300M).

The splits are cut from a seeded permutation of the documents, so validation samples the whole corpus.
Sample order is a pure function of (data.seed, the data, the sample's position): GPTDataset shuffles
with the seed, and step s on data-parallel rank r reads fixed positions of that shuffled order
(`sample_positions`). Resuming therefore needs only the consumed-sample count, no replay.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from collections.abc import Iterator

from gptpipe.data.config import DataConfig, source_names
from gptpipe.data.count import DatasetCounts
from gptpipe.data.split import document_order, split_problems
from gptpipe.artifacts import TOKENIZE
from gptpipe.runtime.batching import to_device
from gptpipe.train.index_cache import bucket_copy, builds_here, indices_folder, provide
from gptpipe.trust import check_index_cache

if TYPE_CHECKING:
    import torch


class DataError(ValueError):
    """The data cannot give the run what it asks for; the message says why and what to change."""


def check_splits(stats: list[DatasetCounts], split: str, seq_len: int) -> None:
    """Every split with a non-zero share, in every prefix, must hold at least one full sample."""
    problems = [p for s in stats for p in split_problems(str(s.prefix), split, s.split_documents, s.split_tokens,
                                                         seq_len)]
    if problems:
        raise DataError(
            f"data.split {split!r} leaves a split (nearly) empty, which makes megatron-core's GPTDataset hang:\n  "
            + "\n  ".join(problems)
            + f"\nFix: give that split a larger share (e.g. data.split=90,9,1), use more documents, "
              f"or lower train.seq_len (now {seq_len}).")


def blend_weights(data_cfg: DataConfig, stats: list[DatasetCounts]) -> list[float] | None:
    """Explicit weights (a list in prefix order, or by source name), or the prefixes' token counts; None for a
    single prefix (no blending needed)."""
    if len(stats) == 1:
        return None
    if data_cfg.weights is not None:
        return data_cfg.weight_list()
    return [float(s.tokens) for s in stats]


@dataclass
class SourceShare:
    """What one source gives the training mix."""

    name: str
    tokens: int
    share: float  # of the run's training tokens
    epochs: float  # passes over the source's own train split

    def line(self) -> str:
        return f"{self.name}: {self.tokens:,} tokens ({self.share:.1%}), {self.epochs:.2f} epochs of its train split"


def source_counts(dataset: Any, samples: int, sources: int) -> list[int]:
    """How many of a training dataset's first `samples` samples each source gives (from the blend's index)."""
    import numpy

    index = getattr(dataset, "dataset_index", None)
    if index is None:
        return [samples]
    return numpy.bincount(numpy.asarray(index[:samples]), minlength=sources).tolist()


def mixture(samples: list[float], stats: list[DatasetCounts], seq_len: int) -> list[SourceShare]:
    """Each source's part of a run that reads `samples[i]` samples of source i. Every sample is seq_len tokens,
    so a data.weights entry is a token share: megatron normalises the weights and draws each sample from the
    source furthest below its share."""
    total = sum(samples) or 1
    names = source_names([s.prefix for s in stats])
    return [SourceShare(name, round(n * seq_len), n / total, n * seq_len / max(s.split_tokens[0], 1))
            for name, n, s in zip(names, samples, stats)]


def index_bytes(stats: list[DatasetCounts], weights: list[float] | None, sizes: list[int], seq_len: int) -> int:
    """Host RAM for the index arrays GPTDataset builds (document, sample, shuffle) and the blend index.

    This grows with epochs × documents: asking for hundreds of epochs is what killed the original.
    """
    total_weight = sum(weights) if weights else 1.0
    total = 0
    for i, s in enumerate(stats):
        share = weights[i] / total_weight if weights else 1.0
        # megatron's .idx arrays: sizes int32, pointers int64 per sequence, document indices int64
        total += 12 * s.documents + 8 * (s.documents + 1)
        for split_index, size in enumerate(sizes):
            tokens, docs = s.split_tokens[split_index], s.split_documents[split_index]
            if not docs:
                continue
            samples = math.ceil(size * share * 1.005)
            epochs = max(1, math.ceil((samples * seq_len + 1) / tokens))
            total += 4 * epochs * docs + 16 * (samples + 1) + 8 * samples
    if weights:
        total += 9 * sum(sizes)  # blend: dataset index (int16) + sample index (int64)
    return total


# What the index builder (train/index_cache.py's child) holds beyond the indices it writes: the split order's
# permutation and its sort, int64 each, per document of every dataset. bench/bench_startup.py at 10^8 documents:
# the child's peak 4.2 GB (its forked image of ~0.5 GB included) for 2.4 GB of indices (docs/benchmarks.md).
BUILD_BYTES_PER_DOCUMENT = 16


def index_build_bytes(stats: list[DatasetCounts], index_ram: int) -> int:
    """Host RAM at the peak of building the indices (`index_ram`: index_bytes'), once per cache folder."""
    return index_ram + BUILD_BYTES_PER_DOCUMENT * sum(s.documents for s in stats)


class _MegatronTokenizer:
    """The little megatron-core needs from a tokenizer: vocab size, the document separator, an identity."""

    def __init__(self, vocab_size: int, eod: int):
        self.vocab_size = vocab_size
        self.eod = eod
        self.unique_identifiers = {"class": "gptpipe", "vocab_size": vocab_size, "eod": eod}


def build_datasets(data_cfg: DataConfig, stats: list[DatasetCounts], seq_len: int, sizes: list[int],
                   cache_dir: Path | None, vocab_size: int, eod_id: int, document_mask: bool = False) -> list[Any]:
    """[train, valid, test] megatron-core datasets of at least `sizes` samples each (after the guards).
    `document_mask` (train.document_mask): a sample's positions restart after each end-of-document token and the
    token after one is not trained (see `collate`).

    Call on every rank once torch.distributed is initialized. With `cache_dir` the indices are built once per
    folder (one process of the ranks that see it: per job, or per node where the nodes share none) and memory-
    mapped by every rank (train/index_cache.py); without it every rank builds them in its own memory.
    """
    check_splits(stats, data_cfg.split, seq_len)
    build = (data_cfg.split, data_cfg.seed, seq_len, sizes, vocab_size, eod_id, document_mask)
    # A URL prefix reads its verified local copy (the .bin fetched here, once per machine: gptpipe.remote).
    blend = ([str(TOKENIZE.local_copy(s.prefix)) for s in stats], blend_weights(data_cfg, stats))
    if cache_dir is None:
        return megatron_datasets(blend, *build, None, None)
    cache_dir.mkdir(parents=True, exist_ok=True)
    check_index_cache(cache_dir)  # megatron-core loads its cached indices with allow_pickle
    settings = dict(zip(("split", "seed", "seq_len", "sizes", "vocab_size", "eod", "document_mask"), build),
                    weights=blend[1])
    folder = indices_folder(cache_dir, [s.prefix for s in stats], settings)
    if builds_here(folder):
        copy = bucket_copy([s.prefix for s in stats], folder, blend[0])
        provide(folder, copy, [(s.documents, data_cfg.seed) for s in stats], megatron_datasets, blend, *build,
                cache_dir)
    _barrier()  # the builders are done: every rank finds the indices it opens
    return megatron_datasets(blend, *build, cache_dir, folder, prebuilt=True)


def _barrier() -> None:
    import torch.distributed as td

    if td.is_initialized():
        td.barrier()


def megatron_datasets(blend: tuple[list[str], list[float] | None], split: str, seed: int, seq_len: int,
                      sizes: list[int], vocab_size: int, eod_id: int, document_mask: bool, order_dir: Path | None,
                      path_to_cache: Path | None, prebuilt: bool = False) -> list[Any]:
    """megatron-core's BlendedMegatronDatasetBuilder over `blend` (prefixes, weights), each split cut from
    `document_order` (cached in `order_dir`); indices read from or saved into `path_to_cache` (None: built in
    memory). Where a process group exists, megatron-core builds on global rank 0 and the others load after a
    barrier; a folder built beforehand (build_datasets: `prebuilt`) makes every rank's call a cache hit, made by
    all ranks at once."""
    import logging

    import numpy
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    logging.getLogger("megatron").setLevel(logging.WARNING)
    if path_to_cache is None:  # megatron-core says so on every build; it is the intent here
        logging.getLogger("megatron.core.datasets").addFilter(
            lambda record: "because path_to_cache is None" not in record.getMessage())
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_len,
        blend=blend,
        split=split,
        # "" (not None, which megatron-core replaces with a folder beside the data) builds without a cache.
        path_to_cache="" if path_to_cache is None else str(path_to_cache),
        tokenizer=_MegatronTokenizer(vocab_size, eod_id),
        # train.document_mask: positions restart after each end-of-document token, and no loss where the input is
        # one (its next token, the next document's first, is not predictable from the document before it).
        reset_position_ids=document_mask,
        reset_attention_mask=False,
        eod_mask_loss=document_mask,
        create_attention_mask=False,  # SDPA builds the causal mask itself; a seq×seq mask per sample is waste
    )

    class ShuffledSplitGPTDataset(GPTDataset):
        """GPTDataset over the documents of its split in `document_order`, not a contiguous range."""

        def __init__(self, indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config):
            # computed once per folder and memory-mapped (or, without a cache folder, in every process)
            order = document_order(len(indexed_dataset.sequence_lengths), config.random_seed, order_dir)
            if prebuilt:  # megatron-core reads no indices on a cache hit: the split's slice of the mapped order
                begin = int(indexed_indices[0]) if len(indexed_indices) else 0
                documents = order[begin:begin + len(indexed_indices)]
            else:
                documents = numpy.sort(order[indexed_indices])
            super().__init__(indexed_dataset, dataset_path, documents, num_samples, index_split, config)

    builder = BlendedMegatronDatasetBuilder(ShuffledSplitGPTDataset, sizes, lambda: True, config)
    if not prebuilt:
        return builder.build()
    # Every index is in path_to_cache already (build_datasets' builder made them all), so a rank's build only
    # loads. megatron-core would still load on rank 0 first and on the others after a barrier (its protocol for a
    # cache it fills itself), which nearly doubles a warm start (bench_startup.py); seeing no process group,
    # every rank loads at once.
    with _no_process_group():
        return builder.build()


@contextlib.contextmanager
def _no_process_group() -> Iterator[None]:
    """torch.distributed.is_initialized() False for the block, as megatron-core reads it."""
    import torch.distributed as td

    is_initialized = td.is_initialized
    td.is_initialized = lambda: False
    try:
        yield
    finally:
        td.is_initialized = is_initialized


def collate(dataset: Any, positions: range | list[int], device: torch.device) -> dict[str, torch.Tensor]:
    """Input ids and next-token labels (-100 where megatron masks the loss), on `device`; and, where a sample's
    positions restart (train.document_mask), its position ids: transformers then builds a causal mask that keeps
    each document to itself (masking_utils' packed sequences; flash-attention's varlen kernels on CUDA), as the
    exported model sees a document alone at inference."""
    import torch

    samples = [dataset[i] for i in positions]
    tokens = torch.stack([s["tokens"] for s in samples])
    labels = torch.stack([s["labels"] for s in samples])
    labels[torch.stack([s["loss_mask"] for s in samples]) == 0] = -100
    batch = {"input_ids": tokens, "labels": labels}
    position_ids = torch.stack([s["position_ids"] for s in samples])
    if not torch.equal(position_ids, torch.arange(tokens.shape[1]).expand_as(position_ids)):
        batch["position_ids"] = position_ids
    return to_device(batch, device)


def eval_batches(dataset: Any, samples: int, micro_batch: int, dp_rank: int, dp_size: int,
                 device: torch.device) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """(source, batch): this rank's share of the first `samples` validation samples, the same set at every
    evaluation, grouped by the source each comes from (0 for a single prefix), so each source's loss is over
    its share of the blend's own samples. Of a blend, a source keeps a multiple of dp_size samples: every rank
    then runs the same number of forward passes (ZeRO-3 gathers weights in step)."""
    sources = getattr(dataset, "dataset_index", None)
    if sources is None:
        groups = [(0, list(range(dp_rank, samples, dp_size)))]
    else:
        import numpy

        groups = []
        for source in range(len(dataset.datasets)):
            positions = numpy.flatnonzero(numpy.asarray(sources[:samples]) == source)
            groups.append((source, positions[:len(positions) // dp_size * dp_size][dp_rank::dp_size].tolist()))
    for source, mine in groups:
        for i in range(0, len(mine), micro_batch):
            yield source, collate(dataset, mine[i:i + micro_batch], device)
