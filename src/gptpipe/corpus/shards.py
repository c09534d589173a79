"""Stage 0's shards: the input cut into pieces that workers judge independently, in an order that makes one
corpus whatever the number of workers.

A shard is some consecutive files of one source (about `shard_mb` of them, or MANPAGES_PER_SHARD man pages,
whose cost is groff's per page, not their bytes), or one line range of a plain .jsonl file or object larger than
`shard_mb` (a line belongs to the range its first byte falls in: data/ranges.py, as stage 2 cuts its input; an
object is read from its range with ranged reads). Files in a bucket are sized from one listing and planned as
local ones are. An HF dataset in a folder or a bucket is planned by its data files (parquet, or a save_to_disk
folder's arrow files); one named on the hub is one shard. Compressed or JSON-array files, data files and a
source with `max_documents` are not cut below their files (the first N documents of a source are only known by
reading it in order).

The plan depends on the sources and `shard_mb` only, never on the workers: the shards are joined in plan order.
A line range's records are numbered from its own first line; `LineBases` turns them into the file's line numbers
when the shards are joined, from the line counts of the ranges before it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gptpipe.corpus.config import CorpusConfig, SourceConfig
from gptpipe.corpus.sources import SUFFIXES, open_bytes, source_sizes

MANPAGES_PER_SHARD = 200  # ~4 s of groff on one core
MB = 1 << 20  # the unit of corpus.shard_mb
# "file:line", maybe followed by what a drop's example says about it: " (duplicate of other.jsonl:3)"
ORIGIN = re.compile(r"(.*):(\d+)((?: \(.*\))?)", re.DOTALL)


@dataclass(frozen=True)
class Shard:
    """What one worker reads: `files` of source number `source`, or the lines starting in bytes [start, end) of
    its one file (end None: the whole files). `size`: input bytes, for the progress bar."""

    index: int
    source: int
    files: tuple[str, ...]
    size: int
    start: int = 0
    end: int | None = None

    @property
    def span(self) -> tuple[int, int] | None:
        return None if self.end is None else (self.start, self.end)

    def name(self) -> str:
        return shard_name(self.index)


def shard_name(index: int) -> str:
    """The folder of shard number `index` in stage 0's work folder."""
    return f"shard-{index:06d}"


def plan_shards(config: CorpusConfig) -> list[Shard]:
    """The shards of every source, in input order."""
    shards: list[Shard] = []
    shard_bytes = config.shard_mb * MB

    def add(source: int, files: list[str], size: int, start: int = 0, end: int | None = None) -> None:
        shards.append(Shard(len(shards), source, tuple(files), size, start, end))

    for number, source in enumerate(config.sources):
        if source.type == "hf_dataset" and source.name:  # streamed from the hub in its order: one shard
            add(number, [], 0)
            continue
        sizes = source_sizes(source)
        if source.max_documents is not None:
            add(number, list(sizes), sum(sizes.values()))
            continue
        group: list[str] = []
        group_size = group_weight = 0
        for file, size in sizes.items():
            weight = shard_bytes // MANPAGES_PER_SHARD if source.type == "manpages" else size
            if size > shard_bytes and _cuttable(source, file):
                if group:
                    add(number, group, group_size)
                    group, group_size, group_weight = [], 0, 0
                for start in range(0, size, shard_bytes):
                    add(number, [file], min(shard_bytes, size - start), start, min(start + shard_bytes, size))
                continue
            if group and group_weight + weight > shard_bytes:
                add(number, group, group_size)
                group, group_size, group_weight = [], 0, 0
            group.append(file)
            group_size += size
            group_weight += weight
        if group:
            add(number, group, group_size)
    return shards


def _cuttable(source: SourceConfig, file: str) -> bool:
    """A plain jsonl file or object of one document per line (not one JSON array)."""
    if source.type != "jsonl" or file.endswith(".gz") or not file.endswith(SUFFIXES["jsonl"]):
        return False
    with open_bytes(file) as fh:
        return not fh.read(64).lstrip().startswith(b"[")


class LineBases:
    """The line number before each line-range shard's first line: the lines of the earlier ranges of its file,
    fed the shards in order with how many lines each read."""

    def __init__(self) -> None:
        self.lines: dict[str, int] = {}  # lines read so far in each cut file

    def base(self, shard: Shard, lines: int) -> int:
        if shard.end is None:
            return 0
        [file] = shard.files
        before = self.lines.get(file, 0) if shard.start else 0
        self.lines[file] = before + lines
        return before


def relocate(origin: str, base: int) -> str:
    """`origin` (file:line within a range, maybe followed by what a drop's example says about it, e.g.
    "(duplicate of other.jsonl:3)") as file:line within the file."""
    if not base:
        return origin
    path, line, about = ORIGIN.fullmatch(origin).groups()
    return f"{path}:{int(line) + base}{about}"
