"""What one stage-2 worker process does with one byte range: read, check, encode, write a part file.

A worker decodes and parses each line on its own (a bad line costs only itself), encodes the surviving
texts with one batched sentencepiece call per block, appends EOD to every document and writes its ids to
a part file, which the main process concatenates in order (data/tokenize.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import sentencepiece

from gptpipe.data.jsonl import Reasons, record_text
from gptpipe.data.ranges import Task, first_line_start, read_lines


@dataclass
class TaskResult:
    task: Task
    part: str  # file of the range's ids, in the dataset's dtype
    sizes: np.ndarray  # tokens per document, EOD included
    lines: int  # lines that start in the range
    reasons: Reasons = field(default_factory=Reasons)  # examples: line numbers within the range


@dataclass(frozen=True)
class WorkerSettings:
    """What every worker needs, passed once when its process starts."""

    model_path: str
    eod_id: int
    dtype: str
    text_key: str
    max_chars: int
    max_line_bytes: int
    block_bytes: int
    parts_dir: str


_worker: tuple[WorkerSettings, sentencepiece.SentencePieceProcessor] | None = None  # set in each worker


def init_worker(settings: WorkerSettings) -> None:
    global _worker
    # One thread per process: the workers already use every core.
    _worker = (settings, sentencepiece.SentencePieceProcessor(model_file=settings.model_path, num_threads=1))


def encode_task(task: Task) -> TaskResult:
    """Read, check and encode one range; write its ids to a part file."""
    assert _worker is not None, "worker not initialised"
    settings, sp = _worker
    text_key, max_chars, max_line_bytes = settings.text_key, settings.max_chars, settings.max_line_bytes
    dtype = np.dtype(settings.dtype)  # ids < vocab size, so the int32 → uint16 cast below never wraps
    eod = np.array([settings.eod_id], dtype=np.int32)
    part = os.path.join(settings.parts_dir, f"part-{task.index:07d}.bin")
    result = TaskResult(task, part, np.zeros(0, dtype=np.int32), 0)
    reasons = result.reasons
    number = 0  # of the line within the range
    sizes: list[np.ndarray] = []
    with open(task.path, "rb") as f, open(part, "wb") as out:
        start = first_line_start(f, task.start, task.end)
        for lines in read_lines(f, start, task.end, max_line_bytes, settings.block_bytes):
            texts = []
            for line in lines:
                number += 1
                text, reason = record_text(line, text_key, max_chars, max_line_bytes)
                if reason:
                    reasons.add(reason, number)
                if text is not None:
                    texts.append(text)
            if not texts:
                continue
            # One batched call returning int32 arrays: the C++ loop, and no Python int per token.
            ids = sp.encode(texts, return_type="numpy")
            sizes.append(np.fromiter(map(len, ids), dtype=np.int32, count=len(ids)) + 1)  # EOD included
            tokens = np.concatenate([piece for doc in ids for piece in (doc, eod)], dtype=dtype, casting="unsafe")
            out.write(tokens.data)
    result.lines = number
    if sizes:
        result.sizes = np.concatenate(sizes)
    return result
