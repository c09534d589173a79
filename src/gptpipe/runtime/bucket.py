"""A run folder in object storage (s3://, gs://, any fsspec URL) and the commit order that makes a checkpoint
exist for its readers. A bucket has no rename, so a checkpoint is committed by order:

    checkpoints/global_step{N}/...        every file, uploaded one by one
    checkpoints/global_step{N}/complete   then the marker, listing every file and its size
    checkpoints/latest                    then the tag, a hint for people and DeepSpeed only

Each checkpoint folder is a committed folder (gptpipe.committed) whose record is the marker: a reader trusts
a checkpoint only when its marker exists and every file it lists is there with its size; `latest` is never
trusted (listing caches and eventually consistent stores can serve a stale one). A multi-node run without a
shared disk adds one marker per node but the first, `global_step{N}/nodes/node{K}.json`, naming the files that
node uploaded; the marker `complete` comes only after all of them.

The writer is the uploader process of a training run (runtime/uploader.py); the readers are a resumed run and
stage 4 (`fetch_checkpoint`). GPTPIPE_KILL_AT=bucket-uploaded|bucket-marked|bucket-prune-withdrawn@<step> loses
the machine (the training process and its uploader) at that point of the order (checkpoint.fault).
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from gptpipe.committed import CommittedFolder
from gptpipe.lock import describe_holder, holder_record, process_gone
from gptpipe.log import get_logger
from gptpipe.stage import StageInputError, write_text_atomic
from gptpipe.storage import cache_folder, filesystem, is_url, join, strip_protocol
from gptpipe.runtime import checkpoint

log = get_logger("train")

NODES = "nodes"  # in a checkpoint folder of a multi-node run: one marker per node but the first
# Files one rank writes (DeepSpeed's ZeRO shards, our RNG state); every other file is shared by all ranks.
RANK_FILE = re.compile(r"(?:^|_)zero_pp_rank_(\d+)_|^rng_state_rank(\d+)\.pt$")


def needed_by(name: str, ranks: set[int]) -> bool:
    """Whether the checkpoint file `name` is read by one of `ranks`: shared files, and those ranks' own."""
    match = RANK_FILE.search(name)
    return match is None or int(match.group(1) or match.group(2)) in ranks


def ranks_in(files: dict[str, int]) -> set[int]:
    """The ranks whose own files a checkpoint's file list holds: the ranks that saved it."""
    return {int(match.group(1) or match.group(2)) for name in files if (match := RANK_FILE.search(name))}


class Bucket:
    """A run folder in object storage, read and written by the commit order of the module doc."""

    def __init__(self, url: str, endpoint_url: str | None):
        self.url = url.rstrip("/")
        self.fs = filesystem(url, endpoint_url)
        self.checkpoints = join(self.url, "checkpoints")

    def checkpoint(self, step: int) -> CommittedFolder:
        """The checkpoint folder of ``step``, with its marker as the record."""
        return CommittedFolder(join(self.checkpoints, checkpoint.tag_of(step)), checkpoint.COMPLETE_MARKER, self.fs)

    def steps(self) -> list[int]:
        """Steps that have a checkpoint folder in the bucket (complete or not), oldest first."""
        self.fs.invalidate_cache(strip_protocol(self.checkpoints))
        try:
            names = self.fs.ls(self.checkpoints, detail=False)
        except FileNotFoundError:
            return []
        steps = []
        for name in names:
            tag = name.rstrip("/").rsplit("/", 1)[-1]
            if tag.startswith("global_step") and tag.removeprefix("global_step").isdigit():
                steps.append(int(tag.removeprefix("global_step")))
        return sorted(steps)

    def _json(self, path: str) -> Any:
        try:
            return json.loads(self.fs.cat_file(path))
        except (FileNotFoundError, ValueError):
            return None

    def marker(self, step: int) -> dict[str, int] | None:
        """{file: size} the checkpoint's marker lists; None without a (readable) marker."""
        data = self.checkpoint(step).read_record()
        try:
            return {str(k): int(v) for k, v in json.loads(data)["files"].items()}
        except (KeyError, TypeError, AttributeError, ValueError):
            return None

    def verified(self, step: int) -> dict[str, int] | None:
        """The marker's file list when every file it names is in the bucket with its size; None otherwise."""
        listed = self.marker(step)
        if listed is None:
            return None
        problems = self.checkpoint(step).problems(listed)
        if problems:
            log.warning(f"{self.checkpoint(step).url} is not used: its marker lists {len(problems)} file(s) "
                        f"missing or of another size in the bucket ({problems[0]}, ...)")
            return None
        return listed

    def newest(self) -> tuple[int, dict[str, int]] | None:
        """(step, files) of the newest checkpoint that is complete in the bucket."""
        for step in reversed(self.steps()):
            files = self.verified(step)
            if files is not None:
                return step, files
        return None

    def download_checkpoint(self, step: int, files: dict[str, int], root: Path, record: bytes = b"",
                            keep: Path | None = None) -> int:
        """The checkpoint's `files` into `root`/global_step{N}, its local marker and `latest` after them (so a
        kill leaves an ignored folder); returns the bytes downloaded. With `keep` (where the marker `record`
        it comes under is kept), a copy already there under that very marker is reused."""
        tag = checkpoint.tag_of(step)
        fetched = self.checkpoint(step).fetch(files, root / tag, record=record, keep=keep, clean=True)
        write_text_atomic(root / tag / checkpoint.COMPLETE_MARKER, f"{tag}\n")
        write_text_atomic(root / checkpoint.LATEST, tag)
        return fetched

    def download_run_files(self, local: Path, names: tuple[str, ...]) -> list[Path]:
        """Those of the run's files `names` that are in the bucket and not yet in `local`."""
        got = []
        for name in names:
            target = local / name
            if target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                self.fs.get_file(join(self.url, name), str(target))
            except FileNotFoundError:
                target.unlink(missing_ok=True)
                continue
            got.append(target)
        return got

    def upload_part(self, step: int, folder: Path) -> dict[str, int]:
        """Every file of `folder` into the checkpoint's folder, checked by listing; returns {file: size}.
        A checkpoint of this step already committed (a resumed run re-saving it) is uncommitted first."""
        remote = self.checkpoint(step)
        remote.withdraw()
        files = {p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.rglob("*"))
                 if p.is_file() and p.name != checkpoint.COMPLETE_MARKER}
        remote.put(folder, files)
        checkpoint.fault("bucket-uploaded", step, machine=True)
        problems = remote.problems(files)
        if problems:
            raise OSError(f"after upload of {checkpoint.tag_of(step)}: {problems[0]}")
        return files

    def put_node_marker(self, step: int, node: int, attempt: str, files: dict[str, int]) -> None:
        self.fs.pipe_file(join(self.checkpoints, checkpoint.tag_of(step), NODES, f"node{node}.json"),
                          json.dumps({"attempt": attempt, "files": files}).encode())

    def node_parts(self, step: int, nodes: int, attempt: str) -> dict[int, dict[str, int]]:
        """{node: its files} of the nodes 1..nodes-1 whose marker of this `attempt` is in the bucket."""
        parts = {}
        for node in range(1, nodes):
            data = self._json(join(self.checkpoints, checkpoint.tag_of(step), NODES, f"node{node}.json"))
            if isinstance(data, dict) and data.get("attempt") == attempt:
                parts[node] = {str(k): int(v) for k, v in data["files"].items()}
        return parts

    def commit(self, step: int, files: dict[str, int]) -> None:
        """The marker listing `files` (all checked present with their size), then `latest`."""
        tag = checkpoint.tag_of(step)
        if checkpoint.STATE not in files or checkpoint.HF_CONFIG not in files:
            raise OSError(f"{tag} is not a whole checkpoint (no {checkpoint.STATE}); not committed")
        # The commit id tells this commit from another of the same step and sizes (a run redone at this URL):
        # a reader's cached copy is reused only while the marker it was downloaded under is the bucket's.
        marker = {"tag": tag, "commit": uuid.uuid4().hex, "files": files}
        self.checkpoint(step).commit(json.dumps(marker, indent=1).encode(), files)
        checkpoint.fault("bucket-marked", step, machine=True)
        self.fs.pipe_file(join(self.checkpoints, checkpoint.LATEST), tag.encode())

    def prune(self, newest: int, keep: int) -> None:
        """Keep the `keep` newest complete checkpoints (and always `newest`, the one `latest` names); drop
        older unmarked leftovers of interrupted uploads. A marker goes before its files."""
        complete, unmarked = [], []
        for step in self.steps():
            (complete if self.marker(step) is not None else unmarked).append(step)
        doomed = [s for s in complete[:-keep] if s != newest] + [s for s in unmarked if s < newest]
        for step in doomed:
            self.checkpoint(step).withdraw()
            checkpoint.fault("bucket-prune-withdrawn", step, machine=True)
            self.fs.rm(self.checkpoint(step).url, recursive=True)

    def put(self, local: Path, name: str) -> None:
        self.fs.put_file(str(local), join(self.url, name))


LEASE = "lease.json"  # in the run folder: who writes it now, until when
LEASE_SECONDS = 60.0  # a lease not refreshed for this long is free (a lost machine); refreshed every third of it


class Lease:
    """One writer per run folder in a bucket, where no file lock reaches: `lease.json` names the holder (host, pid,
    since) and an expiry that a thread keeps pushing forward while the run lives. Another run refuses the folder
    until the lease expires or its holder releases it (a finished or preempted run does); a lease left by a lost
    machine frees itself after LEASE_SECONDS. The store has no compare-and-swap here, so taking it is write, then
    read back: of two runs starting within the same instant, the one whose write lands second keeps it, and the
    other, reading that, exits. A holder on the same machine whose process is gone frees it at once."""

    def __init__(self, bucket: Bucket, what: str):
        self.bucket, self.path = bucket, join(bucket.url, LEASE)
        self.record = {"holder": uuid.uuid4().hex, **holder_record(what)}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> dict[str, Any] | None:
        self.bucket.fs.invalidate_cache(strip_protocol(self.path))
        data = self.bucket._json(self.path)
        return data if isinstance(data, dict) else None

    def _write(self) -> None:
        self.bucket.fs.pipe_file(self.path, json.dumps({**self.record, "expires": time.time() + LEASE_SECONDS})
                                 .encode())

    def _refuse_if_held(self) -> None:
        held = self._read()
        if held and held.get("holder") != self.record["holder"] and held.get("expires", 0) > time.time() \
                and not self._holder_gone(held):
            left = held["expires"] - time.time()
            raise StageInputError(f"{self.bucket.url} is in use by another {describe_holder(held)}: one run writes a "
                                  f"run folder at a time. Its lease ({LEASE}) ends in {left:.0f} s unless it is "
                                  "renewed: wait for that run to end, or give this one another folder")

    @staticmethod
    def _holder_gone(held: dict[str, Any]) -> bool:
        """A holder on this machine whose process no longer exists (killed, crashed): its lease is free now."""
        return process_gone(held.get("host"), held.get("pid"))

    def take(self) -> None:
        self._refuse_if_held()
        self._write()
        self._refuse_if_held()  # another run's write landed after ours: it holds the folder
        self._thread = threading.Thread(target=self._renew, name="bucket-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(LEASE_SECONDS / 3):
            # A store outage (its clients raise many kinds): the next renewal tries again; training goes on.
            with contextlib.suppress(Exception):
                self._write()

    def release(self) -> None:
        """End the renewals and free the folder for the next run (a crash, or a store that is down at the end,
        leaves the lease to expire)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with contextlib.suppress(Exception):
            held = self._read()
            if held and held.get("holder") == self.record["holder"]:
                self.bucket.fs.rm(self.path)


def fetch_checkpoint(url: str, step: int | None = None, endpoint_url: str | None = None) -> Path:
    """A complete checkpoint of the bucket run `url` (the newest, or `step`) in a local cache, downloaded once
    (a cached copy is reused while the bucket's marker is the one it came under: a run redone at the same URL
    has files of the same sizes, but another commit id), with the run's metrics.jsonl beside
    it as in a local run folder. For readers such as stage 4; the run's own staging folder is left alone."""
    bucket = Bucket(url, endpoint_url)
    if step is None:
        found = bucket.newest()
        if found is None:
            raise StageInputError(f"no complete checkpoint in {url} (an upload that was interrupted has no "
                                  f"'{checkpoint.COMPLETE_MARKER}' marker)")
        step, files = found
    else:
        files = bucket.verified(step)
        if files is None:
            raise StageInputError(f"no complete checkpoint for step {step} in {url} (complete steps: "
                                  f"{', '.join(str(s) for s in bucket.steps() if bucket.marker(s)) or 'none'})")
    run = cache_folder(url)
    tag = checkpoint.tag_of(step)
    marker = bucket.checkpoint(step).read_record()  # the commit the cached copy must come from
    if marker is None:
        raise StageInputError(f"{bucket.checkpoint(step).url} was removed while being read")
    started = time.monotonic()
    fetched = bucket.download_checkpoint(step, files, run / "checkpoints", record=marker,
                                         keep=run / ".bucket-markers" / f"{tag}.json")
    folder = run / "checkpoints" / tag
    if fetched:
        log.info(f"downloaded {bucket.checkpoint(step).url} to {folder} ({fetched / 2**20:,.1f} MiB in "
                 f"{time.monotonic() - started:.1f} s)")
    try:
        bucket.fs.get_file(join(bucket.url, "metrics.jsonl"), str(run / "metrics.jsonl"))
    except FileNotFoundError:
        pass
    return folder


def local_checkpoint_source(input_dir: Path | str, step: int | None = None) -> Path:
    """A local folder for ``find_checkpoint``: ``input_dir`` itself, or for the URL of a run folder in a bucket
    its complete checkpoint (the newest, or ``step``) fetched into the local cache."""
    return fetch_checkpoint(str(input_dir), step) if is_url(input_dir) else Path(input_dir)
