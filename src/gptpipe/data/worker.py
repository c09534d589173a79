"""What one stage-2 worker process does with one byte range: read, check, encode, write a part file.

A worker decodes and parses each line on its own (a bad line costs only itself), encodes the surviving
texts with one batched call per block (sentencepiece for a stage-1 tokenizer, the `tokenizers` library for the
pipeline transformers builds of a base model's tokenizer), puts BOS before every document where the base model's
tokenizer adds one, appends EOD to every document and writes its ids to a part file, which the main process
concatenates in order (data/tokenize.py). With Ray the worker is a Ray task on any node (the input, the
tokenizer file and the parts folder at the same paths everywhere).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
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

    model_path: str  # a SentencePiece .model, or the tokenizer.json AutoTokenizer builds of a base model's folder
    eod_id: int
    dtype: str
    text_key: str
    max_chars: int
    max_line_bytes: int
    block_bytes: int
    parts_dir: str
    bos_id: int | None = None  # before every document (a base tokenizer that adds BOS)


Encoder = Callable[[list[str]], list[np.ndarray]]
_worker: tuple[WorkerSettings, Encoder] | None = None  # set in each worker


def _encoder(model_path: str) -> Encoder:
    """Texts → one int32 id array each, with no special tokens: one batched call into C++ or Rust."""
    if model_path.endswith(".json"):
        if multiprocessing.parent_process() is not None:
            # A pool worker: one thread, as the workers already use every core (set before the library's first
            # use here). The in-process single worker keeps the caller's setting: changing it after the library
            # has run threads in this process crashed it.
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(model_path)
        return lambda texts: [np.asarray(e.ids, dtype=np.int32)
                              for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
    sp = sentencepiece.SentencePieceProcessor(model_file=model_path, num_threads=1)
    return lambda texts: sp.encode(texts, return_type="numpy")


def encode_task(settings: WorkerSettings, task: Task) -> TaskResult:
    """Read, check and encode one range; write its ids to a part file. The encoder is loaded once per process
    (a worker process, a Ray worker, or the stage's own process with one worker)."""
    global _worker
    if _worker is None or _worker[0] != settings:
        _worker = (settings, _encoder(settings.model_path))
    encode = _worker[1]
    text_key, max_chars, max_line_bytes = settings.text_key, settings.max_chars, settings.max_line_bytes
    dtype = np.dtype(settings.dtype)  # ids < vocab size, so the int32 → uint16 cast below never wraps
    eod = np.array([settings.eod_id], dtype=np.int32)
    bos = np.array([] if settings.bos_id is None else [settings.bos_id], dtype=np.int32)
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
            ids = encode(texts)
            sizes.append(np.fromiter(map(len, ids), dtype=np.int32, count=len(ids)) + len(bos) + 1)  # BOS, EOD
            tokens = np.concatenate([piece for doc in ids for piece in (bos, doc, eod)], dtype=dtype,
                                    casting="unsafe")
            out.write(tokens.data)
    result.lines = number
    if sizes:
        result.sizes = np.concatenate(sizes)
    return result
