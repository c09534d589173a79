"""Stage 2 and training-data settings: the `tokenize:` and `data:` sections of config.yaml."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from typing import Literal, Protocol

from gptpipe.config.core import Url, option
from gptpipe.storage import url_problems
from gptpipe.data.jsonl import max_line_bytes
from gptpipe.data.split import split_shares


@dataclass
class TokenizeConfig:
    """Stage 2: jsonl → Megatron indexed dataset (<output_prefix>_text_document.bin/.idx)."""

    input: list[Path] = option(factory=lambda: [Path("data/corpus")],
                               doc="jsonl file(s) to tokenize, one {text_key: ...} object per line: stage 0's "
                                   "output folder (the corpus files its manifest lists, in order), paths or glob "
                                   "patterns (data/*.jsonl), each expanded in sorted order")
    tokenizer_dir: Url | Path = option(
        Path("tokenizers/ja_32k"), "stage-1 output folder (its tokenizer.model is used), or its URL (s3://..., "
                                   "gs://...: fetched once into a verified local cache); or a base model's HF "
                                   "folder with tokenizer.json (continued pretraining: its ids, its BOS if it adds "
                                   "one, its EOS between documents)")
    output_prefix: Url | Path = option(
        Path("data/tokenized/ja"), "writes <output_prefix>_text_document.bin/.idx; or a URL prefix: written "
                                   "locally, then uploaded with the manifest last")
    text_key: str = option("text", "the field of each json object that holds the document")
    by_source: bool = option(
        False, "one dataset per source of the stage-0 corpus in `input` (corpus.sources' labels): "
               "<output_prefix>/<label>_text_document.bin/.idx, each with its manifest, for data.prefixes and "
               "data.weights by source name; false: one dataset of every input file")
    workers: int = option(0, "worker processes (0: all cores; executor ray: all the cluster's CPUs); does not "
                             "change the output")
    executor: Literal["local", "ray"] = option(
        "local", "local: worker processes on this machine; ray: Ray tasks on the cluster at ray_address, as stage "
        "0's corpus.executor (pip install -e .[ray]; the input, tokenizer_dir and output_prefix's folder at the "
        "same paths on every node, e.g. a shared filesystem), each range written as a partition "
        "(<prefix>.partitions/) that a rerun after a kill keeps, the partitions then put in place by Ray tasks; "
        "does not change the output")
    ray_address: str | None = option(
        None, "executor ray: the cluster to join (auto, or host:port of its head); null starts Ray on this "
              "machine only")
    task_bytes: int = option(
        0, "input bytes per worker task (0: automatic, 1-64 MiB, ~8 tasks per worker); does not change the output")
    max_document_chars: int = option(
        50_000_000, "documents longer than this are skipped and counted; so are lines over 12x this many bytes, "
        "which are never held whole in memory (bounds worker RAM)")

    def check(self) -> list[tuple[str, str]]:
        problems = []
        if not self.input:
            problems.append(("input", "list at least one jsonl file"))
        if self.workers < 0:
            problems.append(("workers", "must be >= 0"))
        if self.task_bytes < 0:
            problems.append(("task_bytes", "must be >= 0"))
        if self.max_document_chars < 1:
            problems.append(("max_document_chars", "must be >= 1"))
        if self.ray_address is not None and self.executor != "ray":
            problems.append(("ray_address", "is read only with executor: ray"))
        return problems + url_problems(self, ("tokenizer_dir", "output_prefix"))

    @property
    def max_line_bytes(self) -> int:
        """The longest jsonl line read (data/jsonl.py's max_line_bytes)."""
        return max_line_bytes(self.max_document_chars)

    def source_prefix(self, label: str) -> Url | Path:
        """The Megatron prefix of one source's dataset (by_source)."""
        if isinstance(self.output_prefix, Url):
            return Url(f"{self.output_prefix.rstrip('/')}/{label}_text_document")
        return self.output_prefix / f"{label}_text_document"

    @property
    def dataset_prefix(self) -> Url | Path:
        """The Megatron prefix actually written (the original pipeline's `_text_document` suffix)."""
        if isinstance(self.output_prefix, Url):
            return Url(self.output_prefix.rstrip("/") + "_text_document")
        return self.output_prefix.with_name(self.output_prefix.name + "_text_document")


@dataclass
class DataConfig:
    """Training data: one or several tokenized prefixes, blended, split into train/valid/test."""

    prefixes: list[Url | Path] = option(
        factory=lambda: [Path("data/tokenized/ja_text_document")],
        doc="Megatron dataset prefixes (without .bin/.idx) written by stage 2; URLs (s3://..., gs://...) are "
            "fetched once into a verified local cache. With several (e.g. a new corpus and replay of the base "
            "model's language), each evaluation also reports every prefix's own validation loss, "
            "val_loss/<name> (the file name without _text_document), over its part of the same "
            "eval_iters x global_batch_size samples (so a small share gets few: raise train.eval_iters), "
            "beginning with an evaluation before the first step")
    weights: dict[str, float] | list[float] | None = option(
        None, "blend weights, one per prefix, in order or by source name ({web: 0.7, wiki: 0.3}; a prefix's name "
              "is its file name without _text_document, a source's label for stage 2's tokenize.by_source): "
              "each prefix's share of the training tokens, normalised to sum 1 (a prefix smaller than its share "
              "is repeated; count_tokens.py, the plan and the start of training print each prefix's tokens, "
              "share and epochs). None: proportional to each prefix's token count")
    split: str = option("969,30,1", "train,valid,test proportions over documents")
    seed: int = option(1234, "seed of the document shuffle the splits are cut from, and of the sample order "
                             "(a pure function of seed, data and consumed samples)")
    cache_dir: Path | None = option(None, "where GPTDataset index caches go (with the split order and the plan's "
                                          "split counts), built once by one rank of those that see the folder and "
                                          "memory-mapped by all (None: <run dir>/data_cache; the nodes of a bucket "
                                          "run that share no disk build one each)")

    def check(self) -> list[tuple[str, str]]:
        problems = []
        if not self.prefixes:
            problems.append(("prefixes", "list at least one dataset prefix"))
        names = source_names(self.prefixes)
        if isinstance(self.weights, dict):
            for name in self.weights:
                if name not in names:
                    close = difflib.get_close_matches(name, names, n=1)
                    problems.append((f"weights.{name}", "no prefix of data.prefixes has this name (they are "
                                     f"{', '.join(names)})" + (f"; did you mean {close[0]!r}?" if close else "")))
            missing = [name for name in names if name not in self.weights]
            if missing:
                problems.append(("weights", f"no weight for {', '.join(missing)}: give every prefix one"))
        elif self.weights is not None and len(self.weights) != len(self.prefixes):
            problems.append(("weights", f"{len(self.weights)} weights for {len(self.prefixes)} prefixes"))
        if self.weights is not None and any(w <= 0 for w in self.weight_values()):
            problems.append(("weights", "every weight must be > 0"))
        try:
            split_shares(self.split)
        except ValueError as exc:
            problems.append(("split", str(exc)))
        return problems + url_problems(self, ("prefixes",))

    def weight_values(self) -> list[float]:
        return list(self.weights.values() if isinstance(self.weights, dict) else self.weights or [])

    def weight_list(self) -> list[float]:
        """The weights in prefix order (by name where given by name)."""
        if isinstance(self.weights, dict):
            return [float(self.weights[name]) for name in source_names(self.prefixes)]
        return [float(w) for w in self.weights or []]


def source_names(prefixes: list[Url | Path]) -> list[str]:
    """A short unique name per prefix, for data.weights, its metrics (val_loss/<name>) and the reports: the file
    name without stage 2's `_text_document` suffix (a source's label with tokenize.by_source), with -2, -3...
    after a name already taken."""
    names: list[str] = []
    for prefix in prefixes:
        stem = Path(str(prefix)).name.removesuffix("_text_document") or "data"
        name, n = stem, 1
        while name in names:
            n += 1
            name = f"{stem}-{n}"
        names.append(name)
    return names



class TokenizeRun(Protocol):
    """What stage 2 reads of config.yaml (pipeline.PipelineConfig is one: the stage need not import it)."""

    tokenize: TokenizeConfig


class CountedSchedule(Protocol):
    """The train section's values count_tokens.py counts for (train.config.TrainConfig is one)."""

    seq_len: int
    global_batch_size: int
    train_epochs: float
    train_tokens: int | None
    train_tokens_counted_for: str | None


class CountRun(Protocol):
    """What count_tokens.py reads of config.yaml."""

    data: DataConfig
    train: CountedSchedule
