"""count_tokens.py: documents, tokens and the training plan, from the .idx files alone.

The original re-encoded the whole corpus in one Python loop (about 20 minutes for 2M documents) and the
user pasted the result into config.yaml. The .idx already holds every document's length, so this reads
only its header and sizes with numpy (no torch, no megatron import): instant at any size. It then writes
``train.train_tokens`` into config.yaml with a round-trip YAML library, keeping comments and key order.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gptpipe.config.pipeline import PipelineConfig
from gptpipe.data.indexed import idx_path, read_dataset_manifest, read_index
from gptpipe.stage import say, write_text_atomic

SPLITS = ("train", "valid", "test")


def split_bounds(split: str, documents: int) -> list[tuple[int, int] | None]:
    """[begin, end) of each split over the documents, as megatron-core's BlendedMegatronDatasetBuilder cuts
    them: the normalised shares are summed into book-ends, each rounded to a document; a zero share is None."""
    shares = [float(x) for x in re.findall(r"[.0-9]+", split)]
    shares += [0.0] * (len(SPLITS) - len(shares))
    shares = (np.array(shares, dtype=np.float64) / np.sum(shares)).tolist()
    ends = [0.0]
    for share in shares:
        ends.append(ends[-1] + share)
    return [None if end <= begin else (int(round(begin * float(documents))), int(round(end * float(documents))))
            for begin, end in zip(ends[:-1], ends[1:])]


@dataclass
class DatasetCounts:
    """One stage-2 dataset: its totals and what each split receives."""

    prefix: Path
    dtype: str
    documents: int
    tokens: int
    split_documents: tuple[int, int, int]
    split_tokens: tuple[int, int, int]


def document_order(documents: int, seed: int) -> np.ndarray:
    """The seeded permutation of the documents that training cuts its splits from (data.seed).

    Megatron cuts contiguous ranges of the corpus order; a corpus written in a sorted order (man pages by
    section, Wikipedia by title) would then validate on its tail only (the original's defect 5).
    """
    return np.random.RandomState(seed).permutation(documents).astype(np.int32)


def count_dataset(prefix: Path, split: str, seed: int) -> DatasetCounts:
    """Counts of a finished stage-2 dataset, each split cut from `document_order` exactly as training cuts it
    (refused, with what to run, when the dataset's manifest is incomplete)."""
    read_dataset_manifest(prefix)
    index = read_index(idx_path(prefix))  # memory-mapped
    order = document_order(index.sequences, seed)  # gptpipe writes one sequence per document
    docs, tokens = [], []
    for bounds in split_bounds(split, index.sequences):
        begin, end = bounds or (0, 0)
        docs.append(end - begin)
        tokens.append(int(index.sizes[order[begin:end]].sum(dtype=np.int64)))
    return DatasetCounts(prefix, index.dtype.name, index.documents, index.tokens, tuple(docs), tuple(tokens))


@dataclass
class EpochSchedule:
    """What config.yaml's schedule makes of the counted train split (the rule training uses too)."""

    seq_len: int
    global_batch_size: int
    samples_per_epoch: int
    train_epochs: float
    train_samples: int

    @property
    def iterations_per_epoch(self) -> int:
        return self.samples_per_epoch // self.global_batch_size

    @property
    def iterations(self) -> int:
        return self.train_samples // self.global_batch_size

    @property
    def train_tokens(self) -> int:
        """The value for train.train_tokens: training reads it back as train_tokens // seq_len samples."""
        return self.train_samples * self.seq_len


def epoch_schedule(counts: list[DatasetCounts], seq_len: int, global_batch_size: int,
                   train_epochs: float) -> EpochSchedule:
    # GPTDataset makes (tokens - 1) // seq_len samples per pass: each sample reads one extra token (the last
    # target), and every prefix is sampled on its own.
    samples = sum(max(0, c.split_tokens[0] - 1) // seq_len for c in counts)
    return EpochSchedule(seq_len, global_batch_size, samples, train_epochs, int(train_epochs * samples))


def write_train_tokens(config_path: Path, value: int) -> object:
    """Set train.train_tokens in the YAML file, keeping comments, key order and indentation; returns the old value."""
    from ruamel.yaml import YAML
    from ruamel.yaml.comments import CommentedMap
    from ruamel.yaml.compat import StringIO
    from ruamel.yaml.util import load_yaml_guess_indent

    text = config_path.read_text(encoding="utf-8")
    # ruamel guesses the block-sequence indentation; the mapping indentation is the first indented key's.
    _, sequence_indent, dash_offset = load_yaml_guess_indent(text)
    mapping_indent = next((len(line) - len(line.lstrip(" ")) for line in text.splitlines()
                           if line.startswith(" ") and not line.lstrip().startswith(("-", "#"))
                           and line.strip()), 2)
    yaml = YAML()  # round-trip mode
    yaml.preserve_quotes = True
    yaml.width = 4096  # never re-wrap long lines
    yaml.indent(mapping=mapping_indent, sequence=sequence_indent or mapping_indent, offset=dash_offset or 0)
    # ruamel writes None as an empty value; keep the `null` users wrote (and our shipped YAML uses).
    yaml.representer.add_representer(
        type(None), lambda rep, _: rep.represent_scalar("tag:yaml.org,2002:null", "null"))
    data = yaml.load(text)
    if data.get("train") is None:
        data["train"] = CommentedMap()
    old = data["train"].get("train_tokens")
    data["train"]["train_tokens"] = value
    out = StringIO()
    yaml.dump(data, out)
    write_text_atomic(config_path, out.getvalue())
    return old


def format_report(counts: list[DatasetCounts], split: str, plan: EpochSchedule) -> str:
    lines = []
    for c in counts:
        lines.append(f"{c.prefix}: {c.documents:,} documents, {c.tokens:,} tokens ({c.dtype})")
    if len(counts) > 1:
        lines.append(f"all {len(counts)} datasets: {sum(c.documents for c in counts):,} documents, "
                     f"{sum(c.tokens for c in counts):,} tokens")
    lines.append(f"split {split} (by documents, from the data.seed shuffle training uses):")
    for i, name in enumerate(SPLITS):
        docs = sum(c.split_documents[i] for c in counts)
        tokens = sum(c.split_tokens[i] for c in counts)
        lines.append(f"  {name:<5} {docs:>12,} documents {tokens:>16,} tokens")
    lines += [
        f"plan: seq_len {plan.seq_len:,}, global_batch_size {plan.global_batch_size:,} "
        f"({plan.seq_len * plan.global_batch_size:,} tokens per iteration)",
        f"  samples per epoch     {plan.samples_per_epoch:,}",
        f"  iterations per epoch  {plan.iterations_per_epoch:,}",
        f"  train_epochs {plan.train_epochs:g} → {plan.train_samples:,} samples, {plan.iterations:,} iterations, "
        f"train_tokens {plan.train_tokens:,}",
    ]
    return "\n".join(lines)


def _empty_splits(counts: list[DatasetCounts], split: str) -> list[str]:
    wanted = [b is not None for b in split_bounds(split, 1_000_000)]
    return [f"{c.prefix}: the {name} split gets no documents (megatron's GPTDataset hangs on an empty split); "
            f"use more documents or a larger share, e.g. data.split=90,9,1"
            for c in counts for name, want, docs in zip(SPLITS, wanted, c.split_documents) if want and docs == 0]


def run(config: PipelineConfig, args: argparse.Namespace) -> int:
    """`gptpipe count` / count_tokens.py."""
    counts = [count_dataset(p, config.data.split, config.data.seed) for p in config.data.prefixes]
    train = config.train
    plan = epoch_schedule(counts, train.seq_len, train.global_batch_size, train.train_epochs)
    print(format_report(counts, config.data.split, plan), flush=True)
    for problem in _empty_splits(counts, config.data.split):
        say(f"warning: {problem}")
    if plan.iterations < 1:
        say(f"warning: {plan.train_samples:,} samples make less than one global batch of "
            f"{train.global_batch_size}; lower train.global_batch_size or train.seq_len, or add data")
    if args.no_write:
        return 0
    if args.overrides:
        say(f"note: computed with command-line overrides {' '.join(args.overrides)}")
    old = write_train_tokens(Path(args.config), plan.train_tokens)
    say(f"wrote train.train_tokens: {plan.train_tokens} into {args.config} (was {old}); training stops there. "
        "To train by train_epochs instead, set train_tokens back to null.")
    return 0
