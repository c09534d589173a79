"""Stage 2: jsonl → Megatron <prefix>.bin/.idx, in parallel worker processes.

The input (one or more jsonl files, taken as one stream) is cut into byte ranges. A line belongs to the
range its first byte falls in, so each worker finds its own line boundaries and every line is read by
exactly one worker. A worker decodes and parses each line on its own (a bad line costs only itself),
encodes the surviving texts with one batched sentencepiece call per block, appends EOD to every document
and writes its ids to a part file. The main process concatenates the parts in order into the final files,
so the output does not depend on the number of workers, the range size or on sharding.

Lines that cannot become a document are skipped and counted by reason, with file:line examples:

    blank_line       only whitespace
    invalid_utf8     the bytes are not UTF-8
    invalid_json     not parseable as JSON
    invalid_unicode  JSON with lone surrogate escapes (not encodable text)
    not_an_object    JSON, but not an object
    missing_text     the object has no text_key
    text_not_string  the text_key holds a number, list, null, ...
    empty_text       the text is "" (also after removing NULs)
    too_long         over max_document_chars characters (or a line too long to hold one)

NUL characters are removed and the document kept (counted as nul_stripped): they come from binary junk
or broken extraction and mean nothing to a language model.

``--shard I/N`` tokenizes only the I-th of N equal byte ranges of the input, into
<prefix>.shard-I-of-N.bin/.idx with its own manifest; ``gptpipe merge --shards N`` joins them into the
prefix, byte-for-byte what a single run writes.
"""

from __future__ import annotations

import argparse
import glob
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterator

import numpy as np
import orjson
import sentencepiece
from tqdm import tqdm

from gptpipe.config.core import ConfigError, to_plain
from gptpipe.config.pipeline import PipelineConfig
from gptpipe.corpus.prepare import CORPUS_FILE
from gptpipe.data.config import TokenizeConfig
from gptpipe.data.indexed import IndexedDatasetWriter, bin_path, idx_path, token_dtype
from gptpipe.stage import (StageFailed, StageInputError, StageResult, atomic_path, file_fingerprint,
                           run_stage, say)
from gptpipe.stages import PREPARE, TOKENIZE, TRAIN_TOKENIZER, read_tokenizer

STAGE = TOKENIZE.name
REPAIRS = ("nul_stripped",)  # reasons counted for documents that are kept
EXAMPLES_PER_REASON = 5
BLOCK_BYTES = 4 << 20  # a worker reads and encodes this much at a time
MIN_TASK_BYTES, MAX_TASK_BYTES = 1 << 20, 64 << 20
TASKS_PER_WORKER = 8  # enough ranges that workers finish together
# Settings that change how fast the output is made, never the output: left out of the manifest's config,
# so changing them does not make a finished dataset look stale.
OUTPUT_NEUTRAL = ("workers", "task_bytes")


@dataclass(frozen=True)
class Task:
    """One byte range of one input file: the lines that start in [start, end)."""

    index: int
    file_index: int
    path: str
    start: int
    end: int


@dataclass
class TaskResult:
    task: Task
    part: str  # file of the range's ids, in the dataset's dtype
    sizes: np.ndarray  # tokens per document, EOD included
    lines: int  # lines that start in the range
    reasons: Counter = field(default_factory=Counter)  # skipped and repaired lines by reason
    examples: dict[str, list[int]] = field(default_factory=dict)  # reason -> line numbers within the range


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


def _init_worker(settings: WorkerSettings) -> None:
    global _worker
    # One thread per process: the workers already use every core.
    _worker = (settings, sentencepiece.SentencePieceProcessor(model_file=settings.model_path, num_threads=1))


# ---------------------------------------------------------------------------------------------- worker side


def _first_line_start(f: IO[bytes], start: int, end: int) -> int:
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


def _read_lines(f: IO[bytes], start: int, end: int, max_line_bytes: int, block_bytes: int,
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


_MISSING = object()


def _document_text(line: bytes | None, settings: WorkerSettings) -> tuple[str | None, str | None]:
    """(text or None, reason or None): the document in a line, or why there is none (or what was fixed)."""
    # The length test also applies to lines that happened to be read whole, so the outcome never depends
    # on where blocks and ranges were cut.
    if line is None or len(line) > settings.max_line_bytes:
        return None, "too_long"
    try:
        return _text_of(orjson.loads(line), settings)  # orjson also rejects invalid UTF-8 and lone surrogates
    except orjson.JSONDecodeError:
        return _document_text_slowly(line, settings)


def _text_of(obj: object, settings: WorkerSettings) -> tuple[str | None, str | None]:
    if not isinstance(obj, dict):
        return None, "not_an_object"
    text = obj.get(settings.text_key, _MISSING)
    if text is _MISSING:
        return None, "missing_text"
    if not isinstance(text, str):
        return None, "text_not_string"
    if len(text) > settings.max_chars:
        return None, "too_long"
    reason = None
    if "\x00" in text:
        text, reason = text.replace("\x00", ""), "nul_stripped"
    if not text:
        return None, "empty_text"
    return text, reason


def _document_text_slowly(line: bytes, settings: WorkerSettings) -> tuple[str | None, str | None]:
    """The rare lines orjson refuses: name the problem, or accept what the stdlib reads (BOM, NaN, 1e400)."""
    if not line.strip():
        return None, "blank_line"
    try:
        decoded = line.decode("utf-8-sig")
    except UnicodeDecodeError:
        return None, "invalid_utf8"
    try:
        obj = json.loads(decoded)
    except ValueError:
        return None, "invalid_json"
    text, reason = _text_of(obj, settings)
    if text is not None:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogate escapes: no text sentencepiece could encode
            return None, "invalid_unicode"
    return text, reason


def _encode_task(task: Task) -> TaskResult:
    """Read, parse and encode one range; write its ids to a part file."""
    assert _worker is not None, "worker not initialised"
    settings, sp = _worker
    dtype = np.dtype(settings.dtype)  # ids < vocab size, so the int32 → uint16 cast below never wraps
    eod = np.array([settings.eod_id], dtype=np.int32)
    part = os.path.join(settings.parts_dir, f"part-{task.index:07d}.bin")
    result = TaskResult(task, part, np.zeros(0, dtype=np.int32), 0)
    sizes: list[np.ndarray] = []
    with open(task.path, "rb") as f, open(part, "wb") as out:
        start = _first_line_start(f, task.start, task.end)
        for lines in _read_lines(f, start, task.end, settings.max_line_bytes, settings.block_bytes):
            texts = []
            for line in lines:
                result.lines += 1
                text, reason = _document_text(line, settings)
                if reason:
                    result.reasons[reason] += 1
                    examples = result.examples.setdefault(reason, [])
                    if len(examples) < EXAMPLES_PER_REASON:
                        examples.append(result.lines)
                if text is not None:
                    texts.append(text)
            if not texts:
                continue
            # One batched call returning int32 arrays: the C++ loop, and no Python int per token.
            ids = sp.encode(texts, return_type="numpy")
            sizes.append(np.fromiter(map(len, ids), dtype=np.int32, count=len(ids)) + 1)  # EOD included
            tokens = np.concatenate([part for doc in ids for part in (doc, eod)], dtype=dtype, casting="unsafe")
            out.write(tokens.data)
    if sizes:
        result.sizes = np.concatenate(sizes)
    return result


# ------------------------------------------------------------------------------------------------ planning


def parse_shard(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        index, count = (int(x) for x in text.split("/"))
        if not 0 <= index < count:
            raise ValueError
    except ValueError:
        raise ConfigError("command line", [f"--shard {text!r}: expected I/N with 0 <= I < N, e.g. 0/4"]) from None
    return index, count


def shard_prefix(prefix: Path, index: int, count: int) -> Path:
    return prefix.with_name(f"{prefix.name}.shard-{index}-of-{count}")


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


def _lines_before(path: str, position: int) -> int:
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
    """Turns (range, line within range) into file:line, fed the ranges' results in order."""

    def __init__(self) -> None:
        self.first_start: dict[int, int] = {}
        self.seen: dict[int, int] = {}  # lines in the ranges of each file already passed
        self.base: dict[int, int] = {}  # lines before the first range of each file, counted when needed

    def locate(self, result: TaskResult) -> dict[str, list[str]]:
        task = result.task
        self.first_start.setdefault(task.file_index, task.start)
        seen = self.seen.get(task.file_index, 0)
        located = {}
        for reason, lines in result.examples.items():
            if task.file_index not in self.base:
                self.base[task.file_index] = _lines_before(task.path, self.first_start[task.file_index])
            base = self.base[task.file_index] + seen
            located[reason] = [f"{task.path}:{base + n}" for n in lines]
        self.seen[task.file_index] = seen + result.lines
        return located


# --------------------------------------------------------------------------------------------- main process


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _manifest_config(cfg: TokenizeConfig, **extra: object) -> dict:
    plain = {k: v for k, v in to_plain(cfg).items() if k not in OUTPUT_NEUTRAL}
    return {**plain, **extra}


def _pool_context() -> multiprocessing.context.BaseContext:
    # fork starts workers in milliseconds with everything already imported; elsewhere spawn is the safe choice.
    return multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(prefix: Path) -> None:
    """Delete temporaries of earlier runs at this prefix that were killed (their process is gone)."""
    for path in prefix.parent.glob(f".{glob.escape(prefix.name)}.*"):
        pid = path.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def _merge_reasons(total: Counter, examples: dict[str, list[str]], reasons: Counter,
                   located: dict[str, list[str]]) -> None:
    total.update(reasons)
    for reason, where in located.items():
        kept = examples.setdefault(reason, [])
        kept.extend(where[:EXAMPLES_PER_REASON - len(kept)])


def _report(reasons: Counter, examples: dict[str, list[str]], lines: int) -> None:
    for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
        what = "kept, repaired" if reason in REPAIRS else "skipped"
        say(f"[{STAGE}]   {reason}: {n:,} line(s) {what}, e.g. {', '.join(examples.get(reason, []))}")
    skipped = sum(n for r, n in reasons.items() if r not in REPAIRS)
    if skipped:
        say(f"[{STAGE}] skipped {skipped:,} of {lines:,} lines; every other line became a document")


def _counts(documents: int, tokens: int, dtype: np.dtype, lines: int, input_bytes: int,
            reasons: Counter, examples: dict[str, list[str]], **extra: object) -> dict:
    return {
        "documents": documents, "tokens": tokens, "dtype": dtype.name, "lines": lines, "input_bytes": input_bytes,
        "skipped": {r: n for r, n in sorted(reasons.items()) if r not in REPAIRS},
        "repaired": {r: n for r, n in sorted(reasons.items()) if r in REPAIRS},
        "examples": examples, **extra,
    }


def tokenize_files(files: list[Path], prefix: Path, settings: WorkerSettings, workers: int, task_bytes: int,
                   shard: tuple[int, int] | None) -> StageResult:
    """The work of stage 2: tokenize ``files`` into <prefix>.bin/.idx (written atomically)."""
    tasks, total_bytes = plan_tasks(files, workers, task_bytes, shard)
    workers = max(1, min(workers, len(tasks)))
    parts_dir = prefix.parent / f".{prefix.name}.parts-{os.getpid()}"
    parts_dir.mkdir(parents=True, exist_ok=True)
    settings = WorkerSettings(**{**settings.__dict__, "parts_dir": str(parts_dir)})
    dtype = np.dtype(settings.dtype)
    reasons: Counter = Counter()
    examples: dict[str, list[str]] = {}
    lines = documents = tokens = 0
    line_numbers = LineNumbers()
    pool = None
    started = time.perf_counter()
    try:
        if workers > 1:
            # An executor, not multiprocessing.Pool: when a worker dies (the OOM killer) it raises instead of
            # waiting forever for the lost range.
            pool = ProcessPoolExecutor(workers, mp_context=_pool_context(), initializer=_init_worker,
                                       initargs=(settings,))
            results = pool.map(_encode_task, tasks)
        else:  # one worker: no processes to start, no results to pass around
            _init_worker(settings)
            results = map(_encode_task, tasks)
        say(f"[{STAGE}] {total_bytes / 1e6:,.1f} MB in {len(tasks)} range(s), {workers} worker(s) → {prefix}")
        with atomic_path(bin_path(prefix)) as tmp_bin, atomic_path(idx_path(prefix)) as tmp_idx, \
                tqdm(total=total_bytes, unit="B", unit_scale=True, desc=STAGE, file=sys.stderr) as bar:
            writer = IndexedDatasetWriter(tmp_bin, dtype)
            try:
                for result in results:
                    writer.add_raw(Path(result.part), result.sizes)
                    os.unlink(result.part)
                    documents += len(result.sizes)
                    tokens += int(result.sizes.sum(dtype=np.int64))
                    lines += result.lines
                    _merge_reasons(reasons, examples, result.reasons, line_numbers.locate(result))
                    bar.update(result.task.end - result.task.start)
                    bar.set_postfix_str(f"{documents / (time.perf_counter() - started):,.0f} docs/s", refresh=False)
            finally:
                writer.close()
            if documents == 0 and shard is None:
                raise StageInputError(f"no documents in {', '.join(map(str, files))}: all {lines:,} lines were "
                                      f"skipped ({dict(reasons)})")
            writer.finalize(tmp_idx)
    except BrokenProcessPool:
        raise StageFailed(f"a tokenize worker process died (killed for memory?); nothing was written to "
                           f"{prefix}. Try fewer tokenize.workers or a lower tokenize.max_document_chars") from None
    finally:
        if pool is not None:  # after a failure, the ranges in flight finish before their folder goes
            pool.shutdown(cancel_futures=True)
        shutil.rmtree(parts_dir, ignore_errors=True)
    elapsed = time.perf_counter() - started
    say(f"[{STAGE}] {documents:,} documents, {tokens:,} tokens ({dtype.name}) in {elapsed:.1f} s "
        f"({total_bytes / 1e6 / elapsed:,.1f} MB/s, {documents / elapsed:,.0f} docs/s)")
    _report(reasons, examples, lines)
    return StageResult(
        outputs=[bin_path(prefix), idx_path(prefix)],
        counts=_counts(documents, tokens, dtype, lines, total_bytes, reasons, examples,
                       workers=workers, **({"shard": f"{shard[0]}/{shard[1]}"} if shard else {})),
        timings={"tokenize_s": round(elapsed, 3)},
    )


def _check_inputs(config: PipelineConfig) -> dict:
    """Input fingerprints, after checking every input exists and a stage-0 corpus has its manifest."""
    cfg = config.tokenize
    missing = [str(p) for p in cfg.input if not p.is_file()]
    if missing:
        raise StageInputError(f"tokenize.input: {', '.join(missing)} not found. Run: python 0_prepare_corpus.py "
                              "(or list your own jsonl files in tokenize.input)")
    for path in cfg.input:
        with open(path, "rb") as f:
            if f.read(2) == b"\x1f\x8b":
                raise StageInputError(f"tokenize.input: {path} is gzip-compressed; stage 2 splits plain jsonl into "
                                      "byte ranges. Decompress it, or list it as a jsonl source of stage 0")
        # A stage-0 output is accepted only with its complete manifest (a killed stage 0 leaves none).
        if path == config.corpus.output_dir / CORPUS_FILE or PREPARE.has_manifest(path.parent):
            PREPARE.require(path.parent)
    return {str(p): file_fingerprint(p) for p in cfg.input}


def run(config: PipelineConfig, args: argparse.Namespace) -> int:
    """`gptpipe tokenize [--shard I/N]`."""
    cfg = config.tokenize
    shard = parse_shard(getattr(args, "shard", None))
    files = _check_inputs(config)
    info = read_tokenizer(cfg.tokenizer_dir)
    dtype = token_dtype(info.vocab_size)
    if not 0 <= info.eod_id < info.vocab_size:
        raise StageInputError(f"{cfg.tokenizer_dir}: eod id {info.eod_id} is outside the vocabulary "
                              f"({info.vocab_size})")
    prefix = cfg.dataset_prefix if shard is None else shard_prefix(cfg.dataset_prefix, *shard)
    inputs = {"files": files, "tokenizer": TRAIN_TOKENIZER.fingerprint(cfg.tokenizer_dir)}
    settings = WorkerSettings(
        model_path=str(info.model_path), eod_id=info.eod_id, dtype=dtype.name, text_key=cfg.text_key,
        max_chars=cfg.max_document_chars, max_line_bytes=cfg.max_line_bytes,
        block_bytes=min(BLOCK_BYTES, cfg.task_bytes or BLOCK_BYTES), parts_dir="")
    workers = cfg.workers or default_workers()
    extra = {"shard": f"{shard[0]}/{shard[1]}"} if shard else {}

    def work() -> StageResult:
        remove_stale_temporaries(prefix)
        return tokenize_files(cfg.input, prefix, settings, workers, cfg.task_bytes, shard)

    run_stage(TOKENIZE, prefix, _manifest_config(cfg, **extra), inputs, work, force=args.force,
              versions=("sentencepiece", "numpy", "orjson"))
    return 0


def merge(config: PipelineConfig, args: argparse.Namespace) -> int:
    """`gptpipe merge --shards N`: join the N shard datasets into the configured prefix."""
    cfg = config.tokenize
    count = args.shards
    if count < 1:
        raise ConfigError("command line", [f"--shards {count}: must be >= 1"])
    prefix = cfg.dataset_prefix
    shards = [shard_prefix(prefix, i, count) for i in range(count)]
    try:
        manifests = [TOKENIZE.require(p) for p in shards]
    except StageInputError as exc:
        raise StageInputError(f"{exc}\n(shards made on other machines: copy each shard's .bin, .idx and "
                              f".manifest.json into {prefix.parent} keeping their mtimes: rsync -t, scp -p, cp -p; "
                              f"a shard is made with: bash 2_tokenize.sh --shard I/{count})") from None
    # What decides the bytes of a shard; paths may differ between machines.
    identity = [{"shard": m.config.get("shard"), "text_key": m.config["text_key"],
                 "max_document_chars": m.config["max_document_chars"], "tokenizer": m.inputs["tokenizer"],
                 "input_sizes": [f["size"] for f in m.inputs["files"].values()]} for m in manifests]
    for i, made in enumerate(identity):
        expected = {**identity[0], "shard": f"{i}/{count}", "text_key": cfg.text_key,
                    "max_document_chars": cfg.max_document_chars}
        if made != expected:
            different = ", ".join(k for k in made if made[k] != expected[k])
            raise StageInputError(f"{TOKENIZE.manifest_path(shards[i])} does not fit the other shards or this config "
                                  f"({different} differ); remake it: bash 2_tokenize.sh --shard {i}/{count}")
    inputs = {p.name: TOKENIZE.fingerprint(p) for p in shards}

    def work() -> StageResult:
        remove_stale_temporaries(prefix)
        dtype = np.dtype(manifests[0].counts["dtype"])
        reasons: Counter = Counter()
        examples: dict[str, list[str]] = {}
        with atomic_path(bin_path(prefix)) as tmp_bin, atomic_path(idx_path(prefix)) as tmp_idx:
            writer = IndexedDatasetWriter(tmp_bin, dtype)
            try:
                for p, m in tqdm(list(zip(shards, manifests)), desc="merge", unit="shard", file=sys.stderr):
                    writer.add_dataset(p)
                    _merge_reasons(reasons, examples, Counter({**m.counts["skipped"], **m.counts["repaired"]}),
                                   m.counts["examples"])
            finally:
                writer.close()
            index = writer.finalize(tmp_idx)
            if index.documents == 0:
                raise StageInputError(f"the {count} shards hold no documents")
        total = {k: sum(m.counts[k] for m in manifests) for k in ("lines", "input_bytes")}
        say(f"[merge] {count} shards → {prefix}: {index.documents:,} documents, {index.tokens:,} tokens")
        return StageResult(outputs=[bin_path(prefix), idx_path(prefix)],
                           counts=_counts(index.documents, index.tokens, dtype, total["lines"],
                                          total["input_bytes"], reasons, examples, merged_shards=count))

    run_stage(TOKENIZE, prefix, _manifest_config(cfg, merged_shards=count), inputs, work,
              force=args.force, versions=("numpy",))
    return 0
