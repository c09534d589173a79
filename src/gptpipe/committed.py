"""A committed folder at a URL: its files, then a record listing every file and its size, written last.

A bucket has no rename, so what a writer uploads becomes real by order alone: ``put`` the files, then
``commit`` the record (after checking every file it lists is there with its size). A reader trusts the folder
only while its record exists and every file it lists is there with its size (``problems``); a writer replacing
a committed folder ``withdraw``s the record first, so it never vouches for files being replaced.

``put`` and ``fetch`` move several files at once (FILES_AT_ONCE; an upload to S3 as storage.upload_options
says). ``fetch`` copies a committed folder into a local one: each file lands under a temporary name and is
renamed once whole and checked, and the record's bytes are kept
(``keep``) after every file. A later fetch reuses the local copy while the bucket's record is byte-for-byte the
kept one and every file still has its size: a folder redone at the same URL has a new record (a stage manifest's
timings, a checkpoint marker's commit id), even when its files have the same sizes.

Stage outputs (gptpipe.remote: the stage manifest is the record) and checkpoints of a run folder in a bucket
(runtime/bucket.py: the ``complete`` marker is the record) both reach a bucket through this module.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Any

from gptpipe.storage import filesystem, join, strip_protocol, upload_options

# Files in flight at once on an async store, so a checkpoint's many shards and small files do not wait for each
# other's round trips. Each large one also moves in s3fs's / gcsfs's own concurrent parts, up to max_concurrency x
# part size of memory per file: 10 x 50 MiB for a download from S3 (s3fs's defaults). Uploads to S3 have their own
# options (storage.upload_options: 8 files, 16 parts of 16 MiB in flight in all).
FILES_AT_ONCE = 4


def safe_name(name: str) -> bool:
    """A record's file name must stay inside its folder (a record in a bucket is not trusted with paths)."""
    parts = PurePosixPath(name).parts
    return bool(parts) and not PurePosixPath(name).is_absolute() and ".." not in parts


def local_matches(folder: Path, files: dict[str, int], mtimes: dict[str, int] | None = None) -> bool:
    """Whether the local ``folder`` holds every one of ``files`` with its size (and its mtime in ``mtimes``)."""
    return all(_has(folder / name, size, (mtimes or {}).get(name)) for name, size in files.items())


def _has(path: Path, size: int, mtime_ns: int | None) -> bool:
    if not path.is_file():
        return False
    st = path.stat()
    return st.st_size == size and (mtime_ns is None or st.st_mtime_ns == mtime_ns)


class CommittedFolder:
    """The folder ``url`` whose record is the file ``record`` inside it."""

    def __init__(self, url: str, record: str, fs: Any = None, endpoint_url: str | None = None):
        self.url = url.rstrip("/")
        self.record = record
        self.fs = fs if fs is not None else filesystem(self.url, endpoint_url)

    def path(self, name: str) -> str:
        return join(self.url, name)

    def read_record(self) -> bytes | None:
        """The record's bytes as the bucket has them now (None: not committed)."""
        self.fs.invalidate_cache()  # another process may have committed or withdrawn since this one listed
        try:
            return self.fs.cat_file(self.path(self.record))
        except FileNotFoundError:
            return None

    def sizes(self, names: Iterable[str]) -> dict[str, int]:
        """{name: size in the bucket} of those of ``names`` that are there: one listing per folder they lie in."""
        by_folder: dict[str, list[str]] = {}
        for name in names:
            parent = PurePosixPath(name).parent.as_posix()
            by_folder.setdefault("" if parent == "." else parent, []).append(name)
        found: dict[str, int] = {}
        for parent, members in by_folder.items():
            folder = join(self.url, parent) if parent else self.url
            self.fs.invalidate_cache(strip_protocol(folder))
            try:
                listing = self.fs.ls(folder, detail=True)
            except FileNotFoundError:
                continue
            base = strip_protocol(folder) + "/"
            present = {entry["name"].removeprefix(base): int(entry.get("size") or 0) for entry in listing
                       if entry.get("type") != "directory"}
            for name in members:
                if PurePosixPath(name).name in present:
                    found[name] = present[PurePosixPath(name).name]
        return found

    def problems(self, files: dict[str, int]) -> list[str]:
        """Why the files a record lists cannot be used (empty: every one is there with its size)."""
        unsafe = [name for name in files if not safe_name(name)]
        if unsafe:
            return [f"the record lists {unsafe[0]!r}, a path outside {self.url}"]
        present = self.sizes(files)
        problems = []
        for name, size in files.items():
            if name not in present:
                problems.append(f"{self.path(name)} is missing")
            elif present[name] != size:
                problems.append(f"{self.path(name)} has {present[name]:,} bytes, its record lists {size:,}")
        return problems

    def _concurrently(self) -> dict[str, Any]:
        """The transfer options of a list of files: an async filesystem (s3fs, gcsfs) moves FILES_AT_ONCE of them at
        once, each large one in concurrent ranged parts of its own (s3fs's max_concurrency, gcsfs's concurrency)."""
        return {"batch_size": FILES_AT_ONCE} if getattr(self.fs, "async_impl", False) else {}

    def put(self, local: Path, names: Iterable[str]) -> None:
        """Upload the files ``names`` of the local folder ``local`` (nothing vouches for them yet); to S3 with
        storage.upload_options, each large file in concurrent parts."""
        names = list(names)
        if names:
            options = upload_options(self.fs, [(local / name).stat().st_size for name in names])
            self.fs.put([str(local / name) for name in names], [self.path(name) for name in names],
                        **(options or self._concurrently()))

    def withdraw(self) -> None:
        """Remove the record: from now on nothing in the folder exists for a reader."""
        try:
            self.fs.rm_file(self.path(self.record))
        except FileNotFoundError:
            pass

    def commit(self, record: bytes, files: dict[str, int]) -> None:
        """Write the record listing ``files``, once every one of them is checked to be there with its size."""
        problems = self.problems(files)
        if problems:
            raise OSError(f"{self.url} is not committed: {problems[0]}" + (
                f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
        self.fs.pipe_file(self.path(self.record), record)

    def fetch(self, files: dict[str, int], target: Path, record: bytes = b"", keep: Path | None = None,
              mtimes: dict[str, int] | None = None, clean: bool = False) -> int:
        """Copy ``files`` (as the record ``record`` lists them) into the local folder ``target``; returns the
        bytes downloaded. With ``keep``: the local copy is reused while ``keep`` holds ``record`` and every file
        has its size, and ``record`` is written to ``keep`` after every file. ``mtimes`` stamps each file with
        the mtime its record vouches for (a stage manifest's fingerprints); a file that already has its size
        and stamped mtime is not downloaded again. ``clean`` empties ``target`` first (a checkpoint folder must
        hold no other commit's files, e.g. another world size's ZeRO shards)."""
        if keep is not None:
            if keep.is_file() and keep.read_bytes() == record and local_matches(target, files, mtimes):
                return 0
            keep.unlink(missing_ok=True)  # nothing local vouches for files while they are replaced
        if clean:
            shutil.rmtree(target, ignore_errors=True)
        mtimes = mtimes or {}
        wanted = {name: size for name, size in files.items()
                  if mtimes.get(name) is None or not _has(target / name, size, mtimes[name])}
        # Downloaded beside their places under a temporary name, checked, then moved in.
        parts = {name: (target / name).with_name(f".{Path(name).name}.part-{os.getpid()}") for name in wanted}
        try:
            for part in parts.values():
                part.parent.mkdir(parents=True, exist_ok=True)
            if parts:
                self.fs.get([self.path(name) for name in parts], [str(part) for part in parts.values()],
                            **self._concurrently())
            for name, part in parts.items():
                if not part.is_file() or part.stat().st_size != wanted[name]:
                    got = f"{part.stat().st_size:,} bytes" if part.is_file() else "nothing"
                    raise OSError(f"{self.path(name)} changed while it was downloaded ({got}, its record lists "
                                  f"{wanted[name]:,})")
                if (mtime := mtimes.get(name)) is not None:
                    os.utime(part, ns=(mtime, mtime))
                os.replace(part, target / name)
        finally:
            for part in parts.values():
                part.unlink(missing_ok=True)
        fetched = sum(wanted.values())
        if keep is not None:
            keep.parent.mkdir(parents=True, exist_ok=True)
            tmp = keep.with_name(f".{keep.name}.part-{os.getpid()}")
            tmp.write_bytes(record)
            os.replace(tmp, keep)
        return fetched
