"""Stage 2: jsonl → Megatron <prefix>.bin/.idx, in parallel worker processes.

The input (one or more jsonl files, taken as one stream) is cut into byte ranges (data/ranges.py). A pool
of worker processes reads, checks and encodes one range each into a part file (data/worker.py); the main
process concatenates the parts in order into the final files, so the output does not depend on the number
of workers, the range size or on sharding. Lines that cannot become a document are skipped and counted by
reason, with file:line examples (data/jsonl.py names the reasons).

With ``tokenize.executor: ray`` the ranges are Ray tasks that each write a partition, kept by a rerun after a
kill, and the partitions are put in place by Ray tasks too (data/partitions.py): the same bytes again.

``--shard I/N`` tokenizes only the I-th of N equal byte ranges of the input, into
<prefix>.shard-I-of-N.bin/.idx with its own manifest; ``gptpipe merge --shards N`` joins them into the
prefix, byte-for-byte what a single run writes (data/shards.py).
"""

from __future__ import annotations


import argparse
import glob
import os
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack, closing
from functools import partial
from pathlib import Path
import numpy as np
from tqdm import tqdm

from gptpipe.config.core import to_plain
from gptpipe.data.config import TokenizeConfig, TokenizeRun
from gptpipe.data.indexed import IndexedDatasetWriter, bin_path, idx_path, token_dtype
from gptpipe.data.jsonl import Reasons
from gptpipe.data.ranges import BLOCK_BYTES, LineNumbers, plan_tasks
from gptpipe.data.partitions import Partitioned, partition_key, partitions_folder
from gptpipe.data.shards import parse_shard, read_shards, shard_prefix
from gptpipe.data.worker import WorkerSettings, encode_task
from gptpipe.lock import left_by_gone_process, owner_suffix
from gptpipe.log import get_logger
from gptpipe.taskpool import TaskPool
from gptpipe.remote import staging
from gptpipe.stage import Manifest, StageInputError, StageResult, atomic_path
from gptpipe.artifacts import PREPARE, TOKENIZE, TRAIN_TOKENIZER, check_input_files, corpus_sources, read_tokenizer
from gptpipe.storage import is_url
from gptpipe.data.base_tokenizer import is_pretrained_tokenizer, read_pretrained_tokenizer, tokenizer_folder


STAGE = TOKENIZE.name
log = get_logger(STAGE)
merge_log = get_logger("merge")
# Settings that change how fast the output is made, never the output: left out of the manifest's config,
# so changing them does not make a finished dataset look stale.
OUTPUT_NEUTRAL = ("workers", "task_bytes", "executor", "ray_address")


def _manifest_config(cfg: TokenizeConfig, **extra: object) -> dict:
    plain = {k: v for k, v in to_plain(cfg).items() if k not in OUTPUT_NEUTRAL}
    return {**plain, **extra}


def remove_stale_temporaries(prefix: Path) -> None:
    """Delete temporaries of earlier runs at this prefix that were killed (their process, on this host, is gone)."""
    for path in prefix.parent.glob(f".{glob.escape(prefix.name)}.*"):
        if left_by_gone_process(path.name):
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def _counts(documents: int, tokens: int, dtype: np.dtype, lines: int, input_bytes: int, reasons: Reasons,
            **extra: object) -> dict:
    return {"documents": documents, "tokens": tokens, "dtype": dtype.name, "lines": lines,
            "input_bytes": input_bytes, **reasons.manifest_counts(), **extra}


def tokenize_files(files: list[Path], prefix: Path, settings: WorkerSettings, pool: TaskPool, task_bytes: int,
                   shard: tuple[int, int] | None, key: str = "") -> StageResult:
    """The work of stage 2: tokenize ``files`` into <prefix>.bin/.idx (written atomically) on ``pool``; on a Ray
    pool as partitions that a rerun under the same ``key`` (data/partitions.py: partition_key) keeps."""
    started = time.perf_counter()
    if pool.kind == "ray":
        return _partitioned(files, prefix, settings, pool, task_bytes, shard, key, started)
    # The ranges are sized for the pool (tokenize.workers 0: every core here).
    tasks, total_bytes = plan_tasks(files, pool.capacity, task_bytes, shard)
    parts_dir = prefix.parent / f".{prefix.name}.parts-{owner_suffix()}"
    parts_dir.mkdir(parents=True, exist_ok=True)
    settings = WorkerSettings(**{**settings.__dict__, "parts_dir": str(parts_dir)})
    dtype = np.dtype(settings.dtype)
    reasons = Reasons()
    lines = documents = tokens = 0
    line_numbers = LineNumbers()
    log.info(f"{total_bytes / 1e6:,.1f} MB in {len(tasks)} range(s) → {prefix}")
    try:
        with (closing(pool.each(partial(encode_task, settings), tasks, "range(s) to encode", in_order=True))
                      as results,
              atomic_path(bin_path(prefix)) as tmp_bin, atomic_path(idx_path(prefix)) as tmp_idx,
              tqdm(total=total_bytes, unit="B", unit_scale=True, desc=STAGE, file=sys.stderr) as bar):
            writer = IndexedDatasetWriter(tmp_bin, dtype)
            try:
                for result in results:
                    writer.add_raw(Path(result.part), result.sizes)
                    os.unlink(result.part)
                    documents += len(result.sizes)
                    tokens += int(result.sizes.sum(dtype=np.int64))
                    lines += result.lines
                    reasons.merge(result.reasons.counts,
                                  line_numbers.locate(result.task, result.lines, result.reasons.examples))
                    bar.update(result.task.end - result.task.start)
                    bar.set_postfix_str(f"{documents / (time.perf_counter() - started):,.0f} docs/s", refresh=False)
            finally:
                writer.close()
            _check_not_empty(files, documents, lines, reasons, shard)
            writer.finalize(tmp_idx)
    finally:  # the workers have stopped (results closed): the ranges in flight finished before their folder goes
        shutil.rmtree(parts_dir, ignore_errors=True)
    # The partitions of a Ray run killed before it put them in place are of no use now.
    shutil.rmtree(partitions_folder(prefix), ignore_errors=True)
    return _result(prefix, documents, tokens, dtype, lines, total_bytes, reasons,
                   max(1, min(pool.capacity, len(tasks))), shard, started)


def _partitioned(files: list[Path], prefix: Path, settings: WorkerSettings, pool: TaskPool, task_bytes: int,
                 shard: tuple[int, int] | None, key: str, started: float) -> StageResult:
    """tokenize_files on Ray: each range a partition, kept across runs; then the partitions put in place."""
    made = Partitioned(pool, prefix, key, lambda: plan_tasks(files, pool.capacity, task_bytes, shard))
    kept = sum(made.tasks[i].end - made.tasks[i].start for i in made.records)
    log.info(f"{made.total_bytes / 1e6:,.1f} MB in {len(made.tasks)} partition(s) → {prefix}"
             + (f"; {len(made.records)} finished by an earlier run, kept" if made.records else ""))
    with tqdm(total=made.total_bytes, initial=kept, unit="B", unit_scale=True, desc=STAGE, file=sys.stderr) as bar:
        for record in made.encode(settings):
            bar.update(record.task.end - record.task.start)
    reasons, line_numbers = Reasons(), LineNumbers()
    records = made.ordered()
    for r in records:
        reasons.merge(r.counts, line_numbers.locate(r.task, r.lines, r.examples))
    documents, lines = sum(r.documents for r in records), sum(r.lines for r in records)
    try:
        _check_not_empty(files, documents, lines, reasons, shard)
    except StageInputError:
        shutil.rmtree(made.folder, ignore_errors=True)  # nothing worth keeping
        raise
    dtype = np.dtype(settings.dtype)
    made.put_together(dtype)
    return _result(prefix, documents, sum(r.tokens for r in records), dtype, lines, made.total_bytes, reasons,
                   max(1, min(pool.capacity, len(made.tasks))), shard, started)


def _check_not_empty(files: list[Path], documents: int, lines: int, reasons: Reasons,
                     shard: tuple[int, int] | None) -> None:
    if documents == 0 and shard is None:
        raise StageInputError(f"no documents in {', '.join(map(str, files))}: all {lines:,} lines were "
                              f"skipped ({reasons.summary()})")


def _result(prefix: Path, documents: int, tokens: int, dtype: np.dtype, lines: int, total_bytes: int,
            reasons: Reasons, workers: int, shard: tuple[int, int] | None, started: float) -> StageResult:
    elapsed = time.perf_counter() - started
    log.info(f"{documents:,} documents, {tokens:,} tokens ({dtype.name}) in {elapsed:.1f} s "
             f"({total_bytes / 1e6 / elapsed:,.1f} MB/s, {documents / elapsed:,.0f} docs/s)")
    reasons.report(STAGE, lines)
    return StageResult(
        outputs=[bin_path(prefix), idx_path(prefix)],
        counts=_counts(documents, tokens, dtype, lines, total_bytes, reasons,
                       workers=workers, **({"shard": f"{shard[0]}/{shard[1]}"} if shard else {})),
        timings={"tokenize_s": round(elapsed, 3)},
    )


def run(config: TokenizeRun, args: argparse.Namespace) -> int:
    """`gptpipe tokenize [--shard I/N]`."""
    cfg = config.tokenize
    shard = parse_shard(getattr(args, "shard", None))
    if shard is not None and is_url(cfg.output_prefix):
        raise StageInputError(f"--shard writes local shards for `gptpipe merge`: set tokenize.output_prefix to a "
                              f"local path for the shard runs (it is {cfg.output_prefix}), or tokenize in one run")
    files, fingerprints = check_input_files(cfg.input, "tokenize.input", PREPARE)
    if cfg.by_source:
        if shard is not None:
            raise StageInputError("--shard cuts one dataset; with tokenize.by_source each source's dataset is one "
                                  "run (use executor: ray to spread them over machines)")
        groups: dict[str | None, list[Path]] = _by_source(cfg.input)
        prefixes = {label: cfg.source_prefix(label) for label in groups}
    else:
        groups = {None: files}
        prefixes = {None: cfg.dataset_prefix if shard is None else shard_prefix(cfg.dataset_prefix, *shard)}
    # The tokenizer.json transformers builds of a base model's tokenizer: beside the output with Ray, whose
    # workers on other nodes see that folder (a shared filesystem) but not this machine's /tmp.
    beside = staging(TOKENIZE, next(iter(prefixes.values()))).parent if cfg.executor == "ray" else None
    if beside is not None:
        beside.mkdir(parents=True, exist_ok=True)
    scratch = tempfile.TemporaryDirectory(prefix="gptpipe-tokenize-", dir=beside)
    # a base model's own tokenizer (continued pretraining), or one stage 1 extended (its output_dir: its hf/)
    hf_dir = cfg.tokenizer_dir if is_url(cfg.tokenizer_dir) else tokenizer_folder(cfg.tokenizer_dir)
    if not is_url(hf_dir) and not TRAIN_TOKENIZER.has_manifest(hf_dir) and is_pretrained_tokenizer(hf_dir):
        base = read_pretrained_tokenizer(hf_dir)
        if base.rebuilt:
            log.warning(f"tokenize.tokenizer_dir {hf_dir}: {base.rebuilt} when loading it; the data gets "
                        "the ids AutoTokenizer gives, not those of tokenizer.json as the file has it")
        model_path = str(base.tokenizer_json(Path(scratch.name)))
        eod_id, bos_id, vocab_size = base.eod_id, base.bos_id, base.vocab_size
        inputs = {"files": fingerprints, "tokenizer": base.fingerprint()}
        boundaries = base.boundaries()
    else:
        info = read_tokenizer(cfg.tokenizer_dir)
        model_path, eod_id, bos_id, vocab_size = str(info.model_path), info.eod_id, None, info.vocab_size
        inputs = {"files": fingerprints, "tokenizer": TRAIN_TOKENIZER.fingerprint(cfg.tokenizer_dir)}
        boundaries = {"tokenizer": "sentencepiece", "bos_id": None, "eod_id": eod_id, "vocab_size": vocab_size}
    dtype = token_dtype(vocab_size)
    if not 0 <= eod_id < vocab_size:
        raise StageInputError(f"{cfg.tokenizer_dir}: eod id {eod_id} is outside the vocabulary ({vocab_size})")
    settings = WorkerSettings(
        model_path=model_path, eod_id=eod_id, bos_id=bos_id, dtype=dtype.name, text_key=cfg.text_key,
        max_chars=cfg.max_document_chars, max_line_bytes=cfg.max_line_bytes,
        block_bytes=min(BLOCK_BYTES, cfg.task_bytes or BLOCK_BYTES), parts_dir="")
    # One pool for every dataset of the run (with Ray: the cluster joined once), started when a dataset is made.
    with scratch, ExitStack() as stack:
        started: list[TaskPool] = []

        def pool() -> TaskPool:
            if not started:
                started.append(stack.enter_context(TaskPool(cfg.executor, cfg.workers, cfg.ray_address, log, "")))
            return started[0]

        for label, group in groups.items():
            if label is not None:
                log.info(f"source {label}: {len(group):,} file(s) → {prefixes[label]}")
            extra = {"shard": f"{shard[0]}/{shard[1]}"} if shard else {"source": label} if label else {}
            local = staging(TOKENIZE, prefixes[label])  # a URL prefix is written here, then uploaded (gptpipe.remote)

            def work(group: list[Path] = group, local: Path = local, label: str | None = label) -> StageResult:
                remove_stale_temporaries(local)
                if args.force:  # redo everything, the partitions a killed Ray run kept too
                    shutil.rmtree(partitions_folder(local), ignore_errors=True)
                key = partition_key(group, inputs["tokenizer"], settings, shard) if cfg.executor == "ray" else ""
                pool().died = (f"nothing was written to {local}. Try fewer tokenize.workers or a lower "
                               "tokenize.max_document_chars")
                result = tokenize_files(group, local, settings, pool(), cfg.task_bytes, shard, key)
                result.counts["boundaries"] = boundaries
                if label is not None:
                    result.counts["source"] = label
                return result

            TOKENIZE.run(prefixes[label], _manifest_config(cfg, **extra), inputs, work, force=args.force,
                         versions=("sentencepiece", "tokenizers", "transformers", "numpy", "orjson"),
                         input_paths={"tokenize.tokenizer_dir": cfg.tokenizer_dir,
                                      **{f"tokenize.input {f}": f for f in group}})
    return 0


def _by_source(patterns: list[Path]) -> dict[str | None, list[Path]]:
    """tokenize.by_source: the corpus files of the stage-0 folders in `patterns` by source label, in order
    (check_input_files has vouched for them)."""
    groups: dict[str | None, list[Path]] = {}
    for pattern in patterns:
        # read, not verified again: check_input_files has just verified it
        manifest = Manifest.read(PREPARE.manifest_path(pattern)) if Path(pattern).is_dir() else None
        sources = corpus_sources(Path(pattern), manifest) if manifest else None
        if sources is None:
            why = ("its manifest records no files per source (a corpus.jsonl joined from them with corpus.join: "
                   "true, or written before gptpipe recorded them: rerun stage 0 with --force)" if manifest else
                   "it is not a stage-0 output folder (a file's source is known from stage 0's manifest)")
            raise StageInputError(f"tokenize.by_source: tokenize.input {pattern}: {why}; list stage 0's output "
                                  "folder written without corpus.join, or set tokenize.by_source: false")
        for label, files in sources.items():
            if files:
                groups.setdefault(label, []).extend(files)
    return groups


def merge(config: TokenizeRun, args: argparse.Namespace) -> int:
    """`gptpipe merge --shards N`: join the N shard datasets into the configured prefix."""
    cfg = config.tokenize
    if is_url(cfg.output_prefix):
        raise StageInputError(f"merge joins local shards: tokenize.output_prefix must be a local path (it is "
                              f"{cfg.output_prefix}); upload the merged prefix with one `gptpipe tokenize` run instead")
    count = args.shards
    shards, manifests = read_shards(cfg, count)
    prefix = cfg.dataset_prefix
    inputs = {p.name: TOKENIZE.fingerprint(p) for p in shards}

    def work() -> StageResult:
        remove_stale_temporaries(prefix)
        dtype = np.dtype(manifests[0].counts["dtype"])
        reasons = Reasons()
        with atomic_path(bin_path(prefix)) as tmp_bin, atomic_path(idx_path(prefix)) as tmp_idx:
            writer = IndexedDatasetWriter(tmp_bin, dtype)
            try:
                for p, m in tqdm(list(zip(shards, manifests)), desc="merge", unit="shard", file=sys.stderr):
                    writer.add_dataset(p)
                    reasons.merge_manifest(m.counts)
            finally:
                writer.close()
            index = writer.finalize(tmp_idx)
            if index.documents == 0:
                raise StageInputError(f"the {count} shards hold no documents")
        total = {k: sum(m.counts[k] for m in manifests) for k in ("lines", "input_bytes")}
        merge_log.info(f"{count} shards → {prefix}: {index.documents:,} documents, {index.tokens:,} tokens")
        return StageResult(outputs=[bin_path(prefix), idx_path(prefix)],
                           counts=_counts(index.documents, index.tokens, dtype, total["lines"],
                                          total["input_bytes"], reasons, merged_shards=count,
                                          **{k: manifests[0].counts[k] for k in ("boundaries",)
                                             if k in manifests[0].counts}))

    TOKENIZE.run(prefix, _manifest_config(cfg, merged_shards=count), inputs, work,
                 force=args.force, versions=("numpy",))
    return 0
