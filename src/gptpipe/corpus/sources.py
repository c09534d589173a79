"""Readers for stage 0's sources. Each yields Record(origin, text, problem) and never raises on bad data:
an unreadable record carries the reason instead of text, so the stage can count and report it. jsonl
records are checked as in stages 1 and 2, with the same reason names (data/jsonl.py).

Memory stays bounded whatever a file holds: a jsonl line, a text paragraph or file longer than the source's
max_chars allows (data/jsonl.py's max_line_bytes) is dropped as too long without being held whole, and a .json
array file is read only up to JSON_ARRAY_MAX_BYTES. A truncated or corrupt .gz stops the stage with an error
naming the file and the last line read."""

from __future__ import annotations

import contextlib
import glob
import gzip
import hashlib
import io
import itertools
import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Iterator

from gptpipe.corpus.config import SourceConfig
from gptpipe.corpus.manpages import GroffError, find_manpages, formatter_version, read_manpage, roff_to_text
from gptpipe.data.jsonl import INVALID_JSON, TOO_LONG, UNDECODABLE, max_line_bytes, object_text, record_text
from gptpipe.data.ranges import BLOCK_BYTES, capped_lines, first_line_start, read_lines
from gptpipe.stage import StageInputError, tree_fingerprint
from gptpipe.storage import filesystem, is_url


@dataclass
class Record:
    """One document (text), or the reason it could not be read (problem only); origin is 'file:line'.

    A record with both text and problem is kept, and the problem is counted as a note."""

    origin: str
    text: str | None = None
    problem: str | None = None


# A .json file holding one array is parsed whole: past this size it is refused (write it as .jsonl instead).
JSON_ARRAY_MAX_BYTES = 64 << 20
SUFFIXES = {"jsonl": (".jsonl", ".json", ".jsonl.gz", ".json.gz"), "text": (".txt", ".txt.gz"), "hf_dataset": ("",)}
# What identifies one version of an object, by store: S3's ETag and LastModified, GCS's generation and md5Hash...
OBJECT_VERSION_KEYS = ("ETag", "etag", "LastModified", "generation", "md5Hash", "updated", "mtime")


def source_files(source: SourceConfig) -> list[Path] | list[str]:
    """The files a source reads, in a stable order; an empty match is an error."""
    assert source.path is not None
    path = source.path
    if is_url(path):
        files: list = list(_remote_objects(source))
    elif source.type == "manpages":
        files = find_manpages(path)
    elif any(ch in str(path) for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(SUFFIXES[source.type]))
    else:
        files = [path] if path.is_file() else []
    if not files:
        hint = " (apt-get install manpages-ja manpages-ja-dev)" if source.type == "manpages" else ""
        raise StageInputError(f"corpus source {source.type} {path}: no input files found{hint}")
    return files


def source_sizes(source: SourceConfig) -> dict[str, int]:
    """{file: bytes} of the files a source reads, in `source_files`' order: a bucket's from one listing (its
    objects' sizes), local ones from the file system."""
    hf = source.type == "hf_dataset"  # its data files only (not a save_to_disk folder's state.json)
    if is_url(source.path):
        objects = {url: info for url, info in _remote_objects(source).items() if not hf or url.endswith(".parquet")}
        if not objects:
            hf_data_files(source) if hf else source_files(source)  # the error naming the source
        return {url: int(info.get("size") or 0) for url, info in objects.items()}
    return {str(f): Path(f).stat().st_size for f in (hf_data_files(source) if hf else source_files(source))}


def _remote_objects(source: SourceConfig) -> dict[str, dict[str, Any]]:
    """{URL: fsspec info} of the objects a source in a bucket names: one object, a glob, or a folder's files
    with the source type's suffixes; sorted by URL."""
    url = str(source.path)
    fs = filesystem(url)
    fs.invalidate_cache()
    if any(ch in url for ch in "*?["):
        found = fs.glob(url, detail=True)
    elif fs.isdir(url):
        found = {name: info for name, info in fs.find(url, detail=True).items()
                 if name.endswith(SUFFIXES[source.type])}
    else:
        try:
            found = {url: fs.info(url)}
        except FileNotFoundError:
            found = {}
    objects = {fs.unstrip_protocol(name) if not is_url(name) else name: info for name, info in found.items()
               if info.get("type") != "directory"}
    return dict(sorted(objects.items()))


def fingerprint(source: SourceConfig) -> dict[str, Any]:
    """What identifies a source's content: file names/sizes/mtimes (objects: their stores' version ids), or the
    hub coordinates."""
    if source.type == "hf_dataset" and source.name:
        return {"hub": source.name, "subset": source.subset, "split": source.split}
    if is_url(source.path):
        objects = _remote_objects(source)
        if not objects:
            source_files(source)  # the error naming the source
        digest = hashlib.sha256()
        for url, info in objects.items():
            version = [str(info[k]) for k in OBJECT_VERSION_KEYS if k in info]
            digest.update(f"{url}\0{info.get('size')}\0{'/'.join(version)}\n".encode())
        return {"files": len(objects), "size": sum(int(i.get("size") or 0) for i in objects.values()),
                "sha256": digest.hexdigest()}
    if source.type == "manpages":  # the text is groff's: another groff, another corpus
        return {**tree_fingerprint(source_files(source)), "formatter": formatter_version()}
    return tree_fingerprint(source_files(source))


def read_source(source: SourceConfig, files: list[Path] | list[str] | None = None,
                span: tuple[int, int] | None = None, max_chars: int | None = None) -> Iterator[Record]:
    """All records of one source, at most max_documents of them; or of a shard of it (corpus/shards.py):
    `files`, some of its files, or `span`, the lines starting in one byte range of its one local plain jsonl
    file (numbered from 1 at the range's first line). `max_chars` (corpus.max_chars) bounds what a line, a
    paragraph or a text file may hold before it is dropped unread (max_line_bytes)."""
    cap = max_line_bytes(max_chars)
    if source.type == "hf_dataset":
        records = _hf_dataset(source, [str(f) for f in files] if files else None)
    elif source.type == "jsonl":
        records = _jsonl(source, files or source_files(source), span, cap)
    elif source.type == "text":
        records = _text(source, files or source_files(source), cap)
    else:
        records = _manpages(source, files or source_files(source))
    for n, record in enumerate(records):
        if source.max_documents is not None and n >= source.max_documents:
            return
        yield record


def _manpages(source: SourceConfig, files: list) -> Iterator[Record]:
    root = source.path

    def convert(page: Path) -> Record:
        origin = str(page.relative_to(root)) if root else str(page)
        try:
            text = roff_to_text(read_manpage(page), str(page))
        except (OSError, UnicodeDecodeError, EOFError) as exc:
            return Record(origin, problem=f"unreadable ({type(exc).__name__})")
        except GroffError as exc:
            return Record(origin, problem=str(exc))
        return Record(origin, text) if text else Record(origin, problem="alias page (.so)")

    # One groff process per page: a thread per core keeps them all busy; records stay in page order.
    pool = ThreadPoolExecutor(os.cpu_count() or 1)
    try:
        yield from pool.map(convert, files)
    finally:  # also when the reader stops early (max_documents): pages not started are not converted
        pool.shutdown(cancel_futures=True)


@contextlib.contextmanager
def open_bytes(path: Path | str) -> Iterator[io.BufferedIOBase]:
    """A buffered binary stream of a file or an object (streamed in blocks, never downloaded whole), gunzipped
    when its name ends in .gz."""
    if not is_url(path):
        with (gzip.open(path, "rb") if Path(path).suffix == ".gz" else open(path, "rb")) as fh:
            yield fh  # type: ignore[misc]
        return
    with filesystem(str(path)).open(str(path), "rb") as raw:
        stream = gzip.GzipFile(fileobj=raw) if str(path).endswith(".gz") else io.BufferedReader(raw, 1 << 20)
        yield stream  # type: ignore[misc]


@contextlib.contextmanager
def _decompressing(path: Path | str) -> Iterator[list[int]]:
    """Name the file, and the last line read (the yielded counter's one item), in a decompression error: a
    truncated .gz raises a bare EOFError."""
    read = [0]
    try:
        yield read
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        why = f"{type(exc).__name__}{': ' + str(exc) if str(exc) else ''}"
        raise StageInputError(f"{path}: the gzip data is truncated or corrupt after line {read[0]} ({why}); download "
                              "or compress it again, or remove it from the source") from None


def _jsonl(source: SourceConfig, files: list, span: tuple[int, int] | None, cap: int) -> Iterator[Record]:
    if span is not None:  # a plain jsonl file or object, read from the first line starting in the range
        [path] = files
        with open_bytes(path) as fh:
            lineno = 0
            for lines in read_lines(fh, first_line_start(fh, *span), span[1], cap, BLOCK_BYTES):
                for raw in lines:
                    lineno += 1
                    yield Record(f"{path}:{lineno}", *record_text(raw, source.text_key, max_line_bytes=cap))
        return
    for path in files:
        with open_bytes(path) as fh, _decompressing(path) as read:
            head = fh.peek(64)[:64] if hasattr(fh, "peek") else b""
            if head.lstrip().startswith(b"["):  # a .json file holding one array of objects
                yield from _json_array(path, fh.read(JSON_ARRAY_MAX_BYTES + 1), source.text_key)
                continue
            for raw in capped_lines(fh, cap):
                read[0] += 1
                yield Record(f"{path}:{read[0]}", *record_text(raw, source.text_key, max_line_bytes=cap))


def _json_array(path: Path, data: bytes, text_key: str) -> Iterator[Record]:
    if len(data) > JSON_ARRAY_MAX_BYTES:
        yield Record(str(path), problem=f"{TOO_LONG}: a .json array over {JSON_ARRAY_MAX_BYTES >> 20} MiB (write it "
                                        "as .jsonl, one object a line)")
        return
    try:
        items = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        yield Record(str(path), problem=UNDECODABLE)
        return
    except json.JSONDecodeError:
        yield Record(str(path), problem=INVALID_JSON)
        return
    for i, obj in enumerate(items):
        yield Record(f"{path}[{i}]", *object_text(obj, text_key))


def _decoded(data: bytes) -> tuple[str, str | None]:
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError:  # keep the text; undecodable bytes become U+FFFD and are counted
        return data.decode("utf-8", errors="replace"), "invalid UTF-8 bytes replaced"


def _text(source: SourceConfig, files: list, cap: int) -> Iterator[Record]:
    for path in files:
        with open_bytes(path) as fh, _decompressing(path) as read:
            if source.text_unit == "file":
                data = fh.read(cap + 1)
                yield Record(str(path), problem=TOO_LONG) if len(data) > cap else Record(str(path), *_decoded(data))
                continue
            # Paragraphs: blocks between empty lines, each at most `cap` bytes (a longer one is dropped unread).
            block: list[bytes] = []
            size, start, too_long = 0, 1, False
            for raw in itertools.chain(capped_lines(fh, cap), [b""]):  # an empty line closes the last block
                read[0] += 1
                if raw == b"":
                    if too_long:
                        yield Record(f"{path}:{start}", problem=TOO_LONG)
                    elif b"".join(block).strip():
                        yield Record(f"{path}:{start}", *_decoded(b"\n".join(block)))
                    block, size, too_long = [], 0, False
                    continue
                if not block and not too_long:
                    start = read[0]
                size += len(raw or b"") + 1
                too_long = too_long or raw is None or size > cap
                if too_long:
                    block.clear()
                else:
                    block.append(raw)


def hf_data_files(source: SourceConfig) -> list[str]:
    """The data files of an hf_dataset source with a path, in the dataset's row order: a save_to_disk folder's
    arrow files (of its `split`, for a DatasetDict), or .parquet files (local, or objects in a bucket)."""
    path = source.path
    assert path is not None
    if not is_url(path) and path.is_dir():
        folder = path / source.split if (path / "dataset_dict.json").is_file() else path
        if (folder / "state.json").is_file():
            state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
            return [str(folder / data["filename"]) for data in state["_data_files"]]
    files = [str(f) for f in source_files(source) if str(f).endswith(".parquet")]
    if not files:
        raise StageInputError(f"hf_dataset {path}: " + ("a URL source reads .parquet objects, and it names none"
                                                        if is_url(path) else
                                                        "neither a save_to_disk folder nor .parquet files"))
    return files


def _hf_dataset(source: SourceConfig, files: list[str] | None) -> Iterator[Record]:
    """A hub dataset's rows (streamed by `datasets`), or the rows of a local or bucket dataset's data files
    (`files`: a shard's, corpus/shards.py; else all), a record batch at a time, numbered within each file
    (`datasets` would first copy a bucket's files whole into its own cache)."""
    if source.name:
        try:
            import datasets
        except ImportError:
            raise StageInputError("an hf_dataset source named on the hub needs the datasets package: pip install "
                                  "-e .[datasets]") from None
        ds = datasets.load_dataset(source.name, source.subset, split=source.split, streaming=True)
        for i, row in enumerate(ds):
            yield Record(f"{source.name}[{i}]", *object_text(row, source.text_key))
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    for file in files or hf_data_files(source):
        with contextlib.ExitStack() as stack:
            if file.endswith(".arrow"):  # save_to_disk's files: Arrow IPC streams, memory-mapped
                batches = iter(pa.ipc.open_stream(stack.enter_context(pa.memory_map(file))))
            else:
                fh = stack.enter_context(filesystem(file).open(file, "rb") if is_url(file) else open(file, "rb"))
                batches = pq.ParquetFile(fh).iter_batches(batch_size=1024)
            i = 0
            for batch in batches:
                for row in batch.to_pylist():
                    yield Record(f"{file}[{i}]", *object_text(row, source.text_key))
                    i += 1
