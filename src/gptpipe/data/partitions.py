"""Stage 2 on the engine (tokenize.executor: ray): a dataset made as partitions, then put together in parallel.

Every byte range of the input (data/ranges.py) is a Ray task that writes a partition: a dataset prefix of its own,
<prefix>.partitions/part-NNNNNNN.bin/.idx, then, last and atomically, its record part-NNNNNNN.json (its byte range,
the key of the input and settings it was made from, its counts). The ranges are planned once and saved with that
key (plan.json), so a rerun after a kill (of the driver, a node, a task) plans the same ranges and encodes only the
partitions that have no record. When every partition is there, Ray tasks copy each one into its place of the final
.bin/.idx (indexed.allocate/place): no machine copies the whole dataset, and the bytes are the one-machine run's.
The partitions folder goes once the dataset is in place; until then it holds a second copy of the ids.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from gptpipe.data.indexed import Placement, allocate, bin_path, idx_path, place, write_index
from gptpipe.data.ranges import Task
from gptpipe.data.worker import WorkerSettings, encode_task
from gptpipe.stage import atomic_path, file_fingerprint, package_versions, write_text_atomic
from gptpipe.taskpool import TaskPool

# What the worker settings hold that does not decide a partition's bytes: the tokenizer file's place (a fresh
# scratch folder each run for a base model's tokenizer: its identity is the tokenizer fingerprint instead), the
# read size, the folder written to.
NOT_IN_KEY = ("model_path", "block_bytes", "parts_dir")


def partitions_folder(prefix: Path) -> Path:
    return prefix.with_name(f"{prefix.name}.partitions")


def partition_key(files: list[Path], tokenizer: Any, settings: WorkerSettings,
                  shard: tuple[int, int] | None) -> str:
    """What a partition's bytes derive from: the input files as they are now, the tokenizer, the settings, the
    encoding libraries (an upgrade between a kill and the rerun could change the ids of the rest)."""
    made_of = {"files": [[str(f), file_fingerprint(f)] for f in files], "tokenizer": tokenizer, "shard": shard,
               "settings": {k: v for k, v in dataclasses.asdict(settings).items() if k not in NOT_IN_KEY},
               "versions": package_versions(("sentencepiece", "tokenizers"))}
    return hashlib.sha256(json.dumps(made_of, sort_keys=True, default=str).encode()).hexdigest()


@dataclass
class Record:
    """A finished partition: its range, what it holds, the lines it skipped or repaired (line numbers within the
    range, as a worker counts them)."""

    task: Task
    documents: int
    tokens: int
    lines: int
    counts: dict[str, int]
    examples: dict[str, list[int]]


def _name(folder: Path, index: int) -> Path:
    return folder / f"part-{index:07d}"


def encode_partition(settings: WorkerSettings, key: str, task: Task) -> Record:
    """A Ray task: encode one range into its partition (settings.parts_dir), the record written last."""
    result = encode_task(settings, task)  # writes <parts_dir>/part-NNNNNNN.bin
    prefix = _name(Path(settings.parts_dir), task.index)
    with atomic_path(idx_path(prefix)) as tmp:
        write_index(tmp, np.dtype(settings.dtype), result.sizes)
    record = Record(task, len(result.sizes), int(result.sizes.sum(dtype=np.int64)), result.lines,
                    dict(result.reasons.counts), result.reasons.examples)
    write_text_atomic(prefix.with_suffix(".json"), json.dumps({"key": key, **dataclasses.asdict(record)}))
    return record


def _read_record(path: Path, key: str, task: Task) -> Record | None:
    """The partition's record if it was made from `key` for `task` and its files are there."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if raw.pop("key", None) != key or Task(**raw.pop("task")) != task:
        return None
    prefix = path.with_suffix("")
    if not (bin_path(prefix).is_file() and idx_path(prefix).is_file()):
        return None
    return Record(task, **raw)


def _plan(folder: Path, key: str, make: Callable[[], tuple[list[Task], int]]) -> tuple[list[Task], int]:
    """The ranges saved by an earlier run from the same key, else `make`'s (the folder emptied first: its
    partitions were made from other input or settings)."""
    saved = folder / "plan.json"
    try:
        raw = json.loads(saved.read_text())
        if raw["key"] == key:
            return [Task(**t) for t in raw["tasks"]], raw["bytes"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    tasks, total = make()
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    write_text_atomic(saved, json.dumps({"key": key, "bytes": total, "tasks": [dataclasses.asdict(t) for t in tasks]}))
    return tasks, total


class Partitioned:
    """One dataset made as partitions by `pool`'s tasks (Ray's in stage 2; see the module's docstring)."""

    def __init__(self, pool: TaskPool, prefix: Path, key: str, make_plan: Callable[[], tuple[list[Task], int]]):
        self.pool, self.prefix, self.key = pool, prefix, key
        self.folder = partitions_folder(prefix)
        self.tasks, self.total_bytes = _plan(self.folder, key, make_plan)
        for stale in self.folder.glob(".*.tmp-*"):  # left by tasks of a killed run
            stale.unlink(missing_ok=True)
        self.records = {t.index: r for t in self.tasks
                        if (r := _read_record(_name(self.folder, t.index).with_suffix(".json"), key, t))}

    def encode(self, settings: WorkerSettings) -> Iterator[Record]:
        """Encode the partitions without a record, yielding each record as its task finishes."""
        todo = [t for t in self.tasks if t.index not in self.records]
        settings = dataclasses.replace(settings, parts_dir=str(self.folder))
        for record in self.pool.each(partial(encode_partition, settings, self.key), todo, "range(s) to encode"):
            self.records[record.task.index] = record
            yield record

    def ordered(self) -> list[Record]:
        return [self.records[t.index] for t in self.tasks]

    def put_together(self, dtype: np.dtype) -> None:
        """Write <prefix>.bin/.idx (atomically) from the partitions, each copied into place by a task; then
        delete the partitions."""
        records = self.ordered()
        sequences = sum(r.documents for r in records)
        with atomic_path(bin_path(self.prefix)) as tmp_bin, atomic_path(idx_path(self.prefix)) as tmp_idx:
            allocate(tmp_bin, tmp_idx, dtype, sequences, sum(r.tokens for r in records))
            first_sequence = first_token = 0
            places = []
            for r in records:
                at = Placement(os.path.abspath(tmp_bin), os.path.abspath(tmp_idx), dtype.name, sequences,
                               first_sequence, first_token)
                places.append((at, str(_name(self.folder, r.task.index).absolute())))
                first_sequence, first_token = first_sequence + r.documents, first_token + r.tokens
            for _ in self.pool.each(_place_item, places, "partition(s) to put in place"):
                pass
        shutil.rmtree(self.folder)


def _place_item(item: tuple[Placement, str]) -> None:
    at, prefix = item
    place(Path(prefix), at)
