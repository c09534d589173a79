"""count_tokens.py: documents, tokens and the training plan, from the .idx files alone.

The original re-encoded the whole corpus in one Python loop (about 20 minutes for 2M documents) and the
user pasted the result into config.yaml. The .idx already holds every document's length, so this reads
only its header and sizes with numpy (no torch, no megatron import): instant at any size. It then writes
``train.train_tokens`` into config.yaml with a round-trip YAML library, keeping comments and key order.
"""

from __future__ import annotations


import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from gptpipe.data.indexed import idx_path, read_index
from gptpipe.data.split import SPLITS, split_documents, split_problems, split_shares
from gptpipe.data.config import CountRun, source_names
from gptpipe.log import get_logger
from gptpipe.stage import write_text_atomic
from gptpipe.artifacts import TOKENIZE
from gptpipe.storage import is_url


log = get_logger("count")


@dataclass
class DatasetCounts:
    """One stage-2 dataset: its totals and what each split receives."""

    prefix: Path | str  # as data.prefixes names it (a URL stays one)
    dtype: str
    documents: int
    tokens: int
    split_documents: tuple[int, int, int]
    split_tokens: tuple[int, int, int]


def count_dataset(prefix: Path | str, split: str, seed: int, cache_dir: Path | None = None) -> DatasetCounts:
    """Counts of a finished stage-2 dataset, each split cut from `document_order` exactly as training cuts it
    (refused, with what to run, when the dataset's manifest is incomplete). With `cache_dir` the order and the
    counts are cached there, the counts under the dataset's stage-2 manifest: a restart reads them instead of
    gathering every document's size again (3.4 s on rank 0 at 10^8 documents while the other ranks wait). A URL
    prefix is checked in the bucket and only its .idx is fetched (training fetches the .bin, train/data.py)."""
    if is_url(prefix):
        local = TOKENIZE.local_copy(prefix, only=lambda name: name.endswith(".idx"))
    else:
        local = prefix
        TOKENIZE.require(prefix)
    index = read_index(idx_path(local))  # memory-mapped
    cached = counts_file(cache_dir, TOKENIZE.fingerprint(local)["manifest_sha256"], split, seed) if cache_dir else None
    if cached is not None and cached.is_file():
        try:
            fields = json.loads(cached.read_text(encoding="utf-8"))
            counts = DatasetCounts(prefix, str(fields["dtype"]), int(fields["documents"]), int(fields["tokens"]),
                                   tuple(map(int, fields["split_documents"])), tuple(map(int, fields["split_tokens"])))
            if counts.documents == sum(counts.split_documents) == index.documents:
                return counts
        except (ValueError, KeyError, TypeError):
            pass
        log.warning(f"{cached} does not hold this dataset's counts: counting again")
    # gptpipe writes one sequence per document
    parts = split_documents(split, index.sequences, seed, cache_dir)
    docs = [len(part) for part in parts]
    tokens = [_tokens(index.sizes, part) for part in parts]
    counts = DatasetCounts(prefix, index.dtype.name, index.documents, index.tokens, tuple(docs), tuple(tokens))
    if cached is not None:
        fields = {k: v for k, v in asdict(counts).items() if k != "prefix"}  # the same counts wherever it is
        write_text_atomic(cached, json.dumps(fields) + "\n")
    return counts


COUNTS_FILE_PREFIX = "split_counts-"


def counts_file(cache_dir: Path, manifest_sha256: str, split: str, seed: int) -> Path:
    """Where `count_dataset` caches the counts of the dataset whose stage-2 manifest hashes to `manifest_sha256`,
    cut by `split` under `seed` (a rerun of stage 2 changes the manifest, so a stale count is never read)."""
    shares = "-".join(f"{share:.6g}" for share in split_shares(split))
    return Path(cache_dir) / f"{COUNTS_FILE_PREFIX}{manifest_sha256[:16]}-{shares}-{seed}.json"


def _tokens(sizes: np.ndarray, documents: np.ndarray, chunk: int = 1 << 22) -> int:
    """The tokens of `documents`, gathered a chunk at a time: at 10^8 documents one gather would hold 400 MB."""
    return sum(int(sizes[documents[i:i + chunk]].sum(dtype=np.int64)) for i in range(0, len(documents), chunk))


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


def counted_for(config: CountRun) -> str:
    """What a counted train_tokens depends on, as `key=value` words: each dataset's stage-2 manifest (it changes
    whenever stage 2 reruns), the split and its seed, seq_len and train_epochs."""
    datasets = ",".join(TOKENIZE.fingerprint(p)["manifest_sha256"][:12] for p in config.data.prefixes)
    return (f"datasets={datasets} split={config.data.split} seed={config.data.seed} "
            f"seq_len={config.train.seq_len} train_epochs={config.train.train_epochs:g}")


def stale_train_tokens(config: CountRun) -> str | None:
    """Why train.train_tokens no longer fits the data it was counted for (None: it fits, or it is a budget the
    user set by hand). A stale count would silently stop a run early or late."""
    train = config.train
    if train.train_tokens is None or train.train_tokens_counted_for is None:
        return None
    now = counted_for(config)
    if train.train_tokens_counted_for == now:
        return None
    then = dict(word.split("=", 1) for word in train.train_tokens_counted_for.split() if "=" in word)
    changed = [f"{key} {then.get(key)} → {value}" for key, value in
               (word.split("=", 1) for word in now.split()) if then.get(key) != value]
    return (f"train.train_tokens={train.train_tokens:,} was counted by count_tokens.py for other data or settings "
            f"({'; '.join(changed)}). Fix: rerun `python count_tokens.py` to count what you train on, or set "
            "train.train_tokens_counted_for=null to keep that number as a token budget of your own")


def write_train_tokens(config_path: Path, value: int, record: str) -> object:
    """Set train.train_tokens (and, right after it, train.train_tokens_counted_for = ``record``) in the YAML file,
    keeping comments, key order and indentation; returns the old train_tokens."""
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
    section = data["train"]
    old = section.get("train_tokens")
    section["train_tokens"] = value
    if "train_tokens_counted_for" in section:
        section["train_tokens_counted_for"] = record
    else:
        section.insert(list(section).index("train_tokens") + 1, "train_tokens_counted_for", record)
    out = StringIO()
    yaml.dump(data, out)
    write_text_atomic(config_path, out.getvalue())
    return old


def format_report(counts: list[DatasetCounts], split: str, plan: EpochSchedule, names: list[str],
                  weights: list[float] | None) -> str:
    """The datasets (by name: a source's label with tokenize.by_source), their splits, the epoch plan and, of a
    blend, each dataset's share of the planned training tokens (data.weights, else by tokens) and its epochs."""
    lines = []
    for name, c in zip(names, counts):
        lines.append(f"{name} ({c.prefix}): {c.documents:,} documents, {c.tokens:,} tokens ({c.dtype})")
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
    if len(counts) > 1:
        shares = weights or [float(c.tokens) for c in counts]
        lines.append(f"mixture ({'data.weights' if weights else 'by tokens'}, normalised):")
        for name, c, weight in zip(names, counts, shares):
            tokens = plan.train_tokens * weight / sum(shares)
            lines.append(f"  {name}: {tokens:,.0f} tokens ({weight / sum(shares):.1%}), "
                         f"{tokens / max(c.split_tokens[0], 1):.2f} epochs of its train split")
    return "\n".join(lines)


def run(config: CountRun, args: argparse.Namespace) -> int:
    """`gptpipe count` / count_tokens.py."""
    counts = [count_dataset(p, config.data.split, config.data.seed) for p in config.data.prefixes]
    train = config.train
    plan = epoch_schedule(counts, train.seq_len, train.global_batch_size, train.train_epochs)
    weights = config.data.weight_list() if config.data.weights is not None else None
    print(format_report(counts, config.data.split, plan, source_names(config.data.prefixes), weights), flush=True)
    for c in counts:
        for problem in split_problems(str(c.prefix), config.data.split, c.split_documents, c.split_tokens,
                                      train.seq_len):
            log.warning(f"{problem}; training will refuse this (megatron's GPTDataset hangs on it): use more "
                        f"documents or a larger share, e.g. data.split=90,9,1")
    if plan.iterations < 1:
        log.warning(f"{plan.train_samples:,} samples make less than one global batch of "
                    f"{train.global_batch_size}; lower train.global_batch_size or train.seq_len, or add data")
    if args.no_write:
        return 0
    if args.overrides:
        log.info(f"computed with command-line overrides {' '.join(args.overrides)}")
    old = write_train_tokens(Path(args.config), plan.train_tokens, counted_for(config))
    log.info(f"wrote train.train_tokens: {plan.train_tokens} into {args.config} (was {old}); training stops "
             "there. To train by train_epochs instead, set train_tokens back to null.")
    return 0
