"""Stage 2's byte ranges: cutting the input into them, reading the lines of one, numbering those lines.

The input (one or more jsonl files, taken as one stream) is cut into byte ranges. A line belongs to the
range its first byte falls in, so each worker finds its own line boundaries and every line is read by
exactly one worker, wherever the cuts fall.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from collections.abc import Iterator

BLOCK_BYTES = 4 << 20  # a worker reads and encodes this much at a time
MIN_TASK_BYTES, MAX_TASK_BYTES = 1 << 20, 64 << 20
TASKS_PER_WORKER = 8  # enough ranges that workers finish together


@dataclass(frozen=True)
class Task:
    """One byte range of one input file: the lines that start in [start, end)."""

    index: int
    file_index: int
    path: str
    start: int
    end: int


def plan_tasks(files: list[Path], workers: int, task_bytes: int,
               shard: tuple[int, int] | None) -> tuple[list[Task], int]:
    """Byte ranges covering the input (or the shard's part of it, cut at the same line rule); their total."""
    sizes = [p.stat().st_size for p in files]
    total = sum(sizes)
    index, count = shard or (0, 1)
    low, high = total * index // count, total * (index + 1) // count
    if task_bytes <= 0:
        task_bytes = min(MAX_TASK_BYTES, max(MIN_TASK_BYTES, (high - low) // (workers * TASKS_PER_WORKER)))
    tasks: list[Task] = []
    file_start = 0
    for file_index, (path, size) in enumerate(zip(files, sizes)):
        a, b = max(low, file_start) - file_start, min(high, file_start + size) - file_start
        for start in range(a, b, task_bytes):
            tasks.append(Task(len(tasks), file_index, str(path), start, min(start + task_bytes, b)))
        file_start += size
    return tasks, high - low


def first_line_start(f: IO[bytes], start: int, end: int) -> int:
    """The first line start at or after ``start`` (a line that began earlier belongs to the previous range)."""
    if start == 0:
        return 0
    f.seek(start - 1)
    if f.read(1) == b"\n":
        return start
    position = start
    while position < end:
        block = f.read(BLOCK_BYTES)
        if not block:
            break
        newline = block.find(b"\n")
        if newline >= 0:
            return position + newline + 1
        position += len(block)
    return end


def read_lines(f: IO[bytes], start: int, end: int, max_line_bytes: int, block_bytes: int,
               ) -> Iterator[list[bytes | None]]:
    """Batches of the lines starting in [start, end) (``start`` is a line start), without their newline.

    A line is finished even when it runs past ``end``. A line longer than ``max_line_bytes`` comes out as
    None and is never held whole in memory.
    """
    f.seek(start)
    offset = start
    pending: list[bytes] = []  # the pieces of a line whose end is not read yet
    pending_bytes = 0
    overlong = False  # skipping the rest of an over-long line

    def take(block: bytes) -> list[bytes | None]:
        nonlocal pending, pending_bytes, overlong
        lines: list = block.split(b"\n")
        rest = lines.pop()  # after the last newline: the start of an unfinished line
        if lines:  # a line ends in this block
            if overlong:  # the first piece is the tail of the over-long line
                lines[0], overlong = None, False
            elif pending:
                lines[0] = b"".join([*pending, lines[0]])
            pending, pending_bytes = ([rest] if rest else []), len(rest)
        elif not overlong:
            pending.append(rest)
            pending_bytes += len(rest)
        if pending_bytes > max_line_bytes:
            pending, pending_bytes, overlong = [], 0, True
        return lines

    while offset < end:
        block = f.read(min(block_bytes, end - offset))
        if not block:  # end of file
            break
        offset += len(block)
        lines = take(block)
        if lines:
            yield lines
    # A line that started before `end` may still be open: read on to its newline (or the end of the file).
    while pending or overlong:
        block = f.read(block_bytes)
        if not block:
            yield [None] if overlong else [b"".join(pending)]
            return
        newline = block.find(b"\n")  # only this line: the next one starts at or after `end`
        lines = take(block if newline < 0 else block[:newline + 1])
        if lines:
            yield lines
            return


def capped_lines(f: IO[bytes], max_line_bytes: int) -> Iterator[bytes | None]:
    """Every line of a stream from its start (a gzip stream too), without its newline; a line longer than
    ``max_line_bytes`` comes out as None and is never held whole."""
    for lines in read_lines(f, 0, sys.maxsize, max_line_bytes, BLOCK_BYTES):
        yield from lines


def lines_before(path: str, position: int) -> int:
    """How many lines start before ``position``: the line-number base of a range that starts there."""
    if position == 0:
        return 0
    count, remaining = 1, position - 1
    with open(path, "rb") as f:
        while remaining > 0:
            block = f.read(min(BLOCK_BYTES, remaining))
            if not block:
                break
            count += block.count(b"\n")
            remaining -= len(block)
    return count


class LineNumbers:
    """Turns (range, line within the range) into file:line, fed the ranges in order."""

    def __init__(self) -> None:
        self.first_start: dict[int, int] = {}
        self.seen: dict[int, int] = {}  # lines in the ranges of each file already passed
        self.base: dict[int, int] = {}  # lines before the first range of each file, counted when needed

    def locate(self, task: Task, lines: int, examples: dict[str, list[Any]]) -> dict[str, list[str]]:
        """``examples`` (line numbers within ``task``, which holds ``lines`` lines) as file:line."""
        self.first_start.setdefault(task.file_index, task.start)
        seen = self.seen.get(task.file_index, 0)
        located = {}
        for reason, numbers in examples.items():
            if task.file_index not in self.base:
                self.base[task.file_index] = lines_before(task.path, self.first_start[task.file_index])
            base = self.base[task.file_index] + seen
            located[reason] = [f"{task.path}:{base + n}" for n in numbers]
        self.seen[task.file_index] = seen + lines
        return located
