"""Stage 3 with its run folder in a bucket: train in a local staging folder, mirror it in the background.

`train.output_model_dir: s3://bucket/runs/x` (or gs://, any fsspec URL). DeepSpeed saves into a local
staging folder exactly as for a local run (train/checkpoint.py: same layout, same markers); a background
thread mirrors the folder to the bucket. A bucket has no rename, so a checkpoint is committed by order:

    checkpoints/global_step{N}/...        every file, uploaded one by one from a hard-linked staging copy
    checkpoints/global_step{N}/complete   then the marker, listing every file and its size
    checkpoints/latest                    then the tag, a hint for people and DeepSpeed only

A reader trusts a checkpoint only when its marker exists and every file it lists is there with its size;
`latest` is never trusted (listing caches and eventually consistent stores can serve a stale one). One
checkpoint upload is in flight at a time: a newer save arriving meanwhile waits, and replaces any save still
waiting (the older one is dropped, never half-committed). Failures are retried with backoff forever, shown on
the console line, and never mark anything complete. Keep-last-N applies in the bucket too, never to the
checkpoint `latest` names.

Besides checkpoints the thread mirrors the run's other files when they change (metrics.jsonl, the resolved
config.yaml and ds_config.json, the TensorBoard event files, which the logger closes as it rotates them, and
wandb's offline folder and run id). On a fresh machine the same command finds the newest complete checkpoint
in the bucket, downloads only it (and those small files), and training continues exactly.

Ranks share the staging folder (one machine, or several with a shared disk): every rank's files land in the
one checkpoint folder, and rank 0 uploads them all and writes the marker after every rank's files are there.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptpipe.log import get_logger
from gptpipe.stage import StageInputError, write_text_atomic
from gptpipe.storage import filesystem, join, local_name, strip_protocol
from gptpipe.train import checkpoint
from gptpipe.train.logging import read_metrics

log = get_logger("train")

RECORD = "mirror.json"  # in the staging folder: the URL it stands in for
UPLOADS = ".uploads"  # hard-linked copies of checkpoints waiting for or in upload
# Never mirrored: the dataset index cache (rebuilt from the data), the checkpoint folder (uploaded by
# protocol, not by change), our own bookkeeping, and temporary files of atomic writes.
SKIPPED = ("checkpoints", "data_cache", UPLOADS, RECORD)
SIDE_SYNC_SECONDS = 60.0
FINAL_WAIT_SECONDS = 900.0  # how long a finished run keeps retrying an unreachable store before giving up


def staging_folder(url: str, local_dir: Path | None) -> Path:
    """`train.local_dir`, else a folder under the system temp named after the run and its URL."""
    if local_dir is not None:
        return local_dir
    digest = hashlib.sha256(url.encode()).hexdigest()[:10]
    return Path(tempfile.gettempdir()) / "gptpipe-runs" / digest / local_name(url)


def _backoff(failures: int) -> float:
    return min(30.0, 0.5 * 2 ** min(failures, 6))


@dataclass
class _Job:
    step: int
    folder: Path  # the staging copy under UPLOADS


class Bucket:
    """A run folder in object storage, read and written by the commit order of the module doc."""

    def __init__(self, url: str, endpoint_url: str | None):
        self.url = url.rstrip("/")
        self.fs = filesystem(url, endpoint_url)
        self.checkpoints = join(self.url, "checkpoints")

    def _listing(self, folder: str) -> dict[str, int]:
        """{path relative to `folder`: size} of every object under it, bypassing fsspec's listing cache."""
        self.fs.invalidate_cache(strip_protocol(folder))
        base = strip_protocol(folder) + "/"
        try:
            found = self.fs.find(folder, detail=True)
        except FileNotFoundError:
            return {}
        return {name.removeprefix(base): int(info["size"]) for name, info in found.items() if name.startswith(base)}

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

    def marker(self, step: int) -> dict[str, int] | None:
        """{file: size} the checkpoint's marker lists; None without a (readable) marker."""
        try:
            data = json.loads(self.fs.cat_file(join(self.checkpoints, checkpoint.tag_of(step),
                                                    checkpoint.COMPLETE_MARKER)))
            return {str(k): int(v) for k, v in data["files"].items()}
        except (FileNotFoundError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def verified(self, step: int) -> dict[str, int] | None:
        """The marker's file list when every file it names is in the bucket with its size; None otherwise."""
        listed = self.marker(step)
        if listed is None:
            return None
        present = self._listing(join(self.checkpoints, checkpoint.tag_of(step)))
        bad = [name for name, size in listed.items() if present.get(name) != size]
        if bad:
            log.warning(f"{join(self.checkpoints, checkpoint.tag_of(step))} is not used: its marker lists "
                        f"{len(bad)} file(s) missing or of another size in the bucket ({bad[0]}, ...)")
            return None
        return listed

    def newest(self) -> tuple[int, dict[str, int]] | None:
        """(step, files) of the newest checkpoint that is complete in the bucket."""
        for step in reversed(self.steps()):
            files = self.verified(step)
            if files is not None:
                return step, files
        return None

    def download_checkpoint(self, step: int, files: dict[str, int], root: Path) -> Path:
        """The checkpoint into `root`/global_step{N}, marker last (so a kill leaves an ignored folder)."""
        tag = checkpoint.tag_of(step)
        folder = root / tag
        shutil.rmtree(folder, ignore_errors=True)
        for name in files:
            target = folder / name
            target.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(join(self.checkpoints, tag, name), str(target))
        write_text_atomic(folder / checkpoint.COMPLETE_MARKER, f"{tag}\n")
        write_text_atomic(root / checkpoint.LATEST, tag)
        return folder

    def download_side_files(self, local: Path) -> list[Path]:
        """The run's small files (metrics, run id, configs) that are not already in `local`."""
        got = []
        for name in self._listing(self.url):
            if name.split("/", 1)[0] in SKIPPED or (local / name).exists():
                continue
            if name in ("metrics.jsonl", "wandb_run_id"):  # what a resumed run appends to or continues
                (local / name).parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(join(self.url, name), str(local / name))
                got.append(local / name)
        return got

    def upload_checkpoint(self, step: int, folder: Path) -> None:
        """Files, then marker, then `latest` (module doc). Raises on any failure; nothing is marked then."""
        tag = checkpoint.tag_of(step)
        remote = join(self.checkpoints, tag)
        if self.marker(step) is not None:  # this step again (a resumed run re-saving it): uncommit first
            self.fs.rm_file(join(remote, checkpoint.COMPLETE_MARKER))
        files = {p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.rglob("*"))
                 if p.is_file() and p.name != checkpoint.COMPLETE_MARKER}
        if checkpoint.STATE not in files or checkpoint.HF_CONFIG not in files:
            raise OSError(f"{folder} is not a whole checkpoint (no {checkpoint.STATE}); not uploaded")
        for name in files:
            self.fs.put_file(str(folder / name), join(remote, name))
        present = self._listing(remote)
        missing = [n for n, size in files.items() if present.get(n) != size]
        if missing:
            raise OSError(f"after upload the bucket lacks {missing[0]} of {tag}")
        self.fs.pipe_file(join(remote, checkpoint.COMPLETE_MARKER),
                          json.dumps({"tag": tag, "files": files}, indent=1).encode())
        self.fs.pipe_file(join(self.checkpoints, checkpoint.LATEST), tag.encode())

    def prune(self, newest: int, keep: int) -> None:
        """Keep the `keep` newest complete checkpoints (and always `newest`, the one `latest` names); drop
        older unmarked leftovers of interrupted uploads. A marker goes before its files."""
        complete, unmarked = [], []
        for step in self.steps():
            (complete if self.marker(step) is not None else unmarked).append(step)
        doomed = [s for s in complete[:-keep] if s != newest] + [s for s in unmarked if s < newest]
        for step in doomed:
            remote = join(self.checkpoints, checkpoint.tag_of(step))
            try:
                self.fs.rm_file(join(remote, checkpoint.COMPLETE_MARKER))
            except FileNotFoundError:
                pass
            self.fs.rm(remote, recursive=True)

    def put(self, local: Path, name: str) -> None:
        self.fs.put_file(str(local), join(self.url, name))


class RunMirror:
    """The local staging folder of a bucket run and the thread that mirrors it (main rank only)."""

    def __init__(self, url: str, local_dir: Path | None, endpoint_url: str | None, keep: int, grace_s: float,
                 is_main: bool):
        self.url = url.rstrip("/")
        self.local = staging_folder(self.url, local_dir)
        self.keep, self.grace_s, self.is_main = keep, grace_s, is_main
        self.bucket = Bucket(self.url, endpoint_url) if is_main else None
        self._cv = threading.Condition()
        self._waiting: _Job | None = None
        self._busy: _Job | None = None
        self._failures = 0
        self._last_error = ""
        self._side_synced: dict[str, tuple[int, int]] = {}
        self._side_due = time.monotonic() + SIDE_SYNC_SECONDS
        self._closing = False
        self.committed_step: int | None = None  # the newest checkpoint known complete in the bucket
        self._thread: threading.Thread | None = None

    # --- before training ----------------------------------------------------------------------------
    def restore(self) -> None:
        """Make the staging folder match the bucket: reuse it when it is this run's and at least as new as
        the bucket's newest complete checkpoint (a newer local one is uploaded), else download that one."""
        if not self.is_main:
            return
        assert self.bucket is not None
        record = self.local / RECORD
        if record.is_file() and json.loads(record.read_text()).get("url") != self.url:
            raise StageInputError(f"{self.local} is the staging folder of {json.loads(record.read_text())['url']}, "
                                  f"not of {self.url}; set train.local_dir to another folder")
        if not record.is_file() and self.local.is_dir() and any(self.local.iterdir()):
            raise StageInputError(f"train.local_dir {self.local} is not empty and is no staging folder of "
                                  f"{self.url}; give an empty or new folder")
        self.local.mkdir(parents=True, exist_ok=True)
        write_text_atomic(record, json.dumps({"url": self.url}) + "\n")
        shutil.rmtree(self.local / UPLOADS, ignore_errors=True)
        root = self.local / "checkpoints"
        checkpoint.remove_stale(root)
        remote = self.bucket.newest()
        local = checkpoint.complete_checkpoints(root)
        local_step = local[-1][0] if local else None
        remote_step = self.committed_step = remote[0] if remote else None
        if local_step is not None and (remote_step is None or local_step > remote_step):
            log.info(f"the staging folder {self.local} holds global_step{local_step}, newer than the bucket's "
                     f"{'none' if remote_step is None else f'global_step{remote_step}'}: resuming from it and "
                     f"uploading it")
            self.start()
            self.submit(local_step, local[-1][1])
            return
        if remote is None:
            log.info(f"no complete checkpoint in {self.url}: starting from scratch (staging in {self.local})")
        elif local_step == remote_step and self._matches(local[-1][1], remote[1]):
            log.info(f"the staging folder {self.local} matches {self.url} (global_step{remote_step}): reused")
        else:
            if local_step is not None:
                log.info(f"the staging folder {self.local} is behind {self.url}: replaced by the bucket's state")
            # What a resumed run appends to must be the bucket's, not an older process's local copy.
            for name in ("checkpoints", "metrics.jsonl", "wandb_run_id"):
                target = self.local / name
                shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
            started = time.monotonic()
            step, files = remote
            self.bucket.download_checkpoint(step, files, root)
            log.info(f"downloaded {join(self.bucket.checkpoints, checkpoint.tag_of(step))} "
                     f"({sum(files.values()) / 2**20:,.1f} MiB in {time.monotonic() - started:.1f} s)")
        for path in self.bucket.download_side_files(self.local):
            self._side_synced[path.relative_to(self.local).as_posix()] = _stamp(path)
        logged = max((row.get("step", 0) for row in read_metrics(self.local / "metrics.jsonl")), default=0)
        if remote is not None and logged > remote[0]:
            log.info(f"steps {remote[0] + 1}-{logged} were logged by the stopped process after its last complete "
                     f"checkpoint and are redone now: metrics.jsonl keeps both (equal) copies; wandb drops the "
                     f"re-logged steps below its last one")
        self.start()

    def check_shared(self) -> None:
        """Collective, after restore: every rank must see the staging folder rank 0 prepared, since rank 0
        uploads all ranks' files from it (nodes without a shared disk are not supported)."""
        import torch

        seen = torch.tensor([1 if (self.local / RECORD).is_file() else 0], dtype=torch.int32)
        torch.distributed.all_reduce(seen, op=torch.distributed.ReduceOp.MIN)
        if not seen.item():
            raise StageInputError(f"some ranks do not see the staging folder {self.local}: with the run folder in "
                                  f"a bucket, set train.local_dir to a folder every node shares")

    @staticmethod
    def _matches(folder: Path, files: dict[str, int]) -> bool:
        return all((folder / name).is_file() and (folder / name).stat().st_size == size for name, size in files.items())

    # --- during training ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None and self.is_main:
            self._thread = threading.Thread(target=self._run, name="gptpipe-mirror", daemon=True)
            self._thread.start()

    def submit(self, step: int, folder: Path) -> None:
        """Queue the checkpoint just saved in `folder`: a hard-linked copy, so that keep-last-N may delete
        the original while it uploads; replaces a checkpoint still waiting (not the one in flight)."""
        if not self.is_main:
            return
        copy = self.local / UPLOADS / f"{folder.name}-{time.monotonic_ns()}"
        shutil.copytree(folder, copy, copy_function=_link_or_copy)
        with self._cv:
            if self._waiting is not None:
                log.info(f"upload: global_step{step} replaces global_step{self._waiting.step}, which was still "
                         f"waiting behind the upload in flight")
                shutil.rmtree(self._waiting.folder, ignore_errors=True)
            self._waiting = _Job(step, copy)
            self._cv.notify_all()

    def status(self) -> str:
        """A note for the console line while uploads fail; empty while all is well."""
        with self._cv:
            if not self._failures:
                return ""
            job = self._busy or self._waiting
            what = f"global_step{job.step}" if job else "run files"
            return f"  upload of {what} failing ({self._failures} tries, retrying)"

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._waiting is None and not self._closing and time.monotonic() < self._side_due:
                    self._cv.wait(timeout=max(0.0, self._side_due - time.monotonic()))
                job, self._waiting = self._waiting, None
                self._busy = job
                closing = self._closing
            uploaded = self._upload(job) if job else True
            ok = self._sync_side_files() and uploaded
            with self._cv:
                self._busy = None
                if ok:
                    self._failures, self._last_error = 0, ""
                else:
                    self._failures += 1
                    if not uploaded and self._waiting is None:
                        self._waiting = job  # retry it, unless a newer save replaced it meanwhile
                    elif not uploaded:
                        shutil.rmtree(job.folder, ignore_errors=True)
                        log.info(f"upload: gave up global_step{job.step} for the newer global_step"
                                 f"{self._waiting.step}")
                self._side_due = time.monotonic() + (SIDE_SYNC_SECONDS if ok else _backoff(self._failures))
                self._cv.notify_all()
                if closing and self._waiting is None and ok:
                    return
            if not ok:
                time.sleep(_backoff(self._failures))

    def _upload(self, job: _Job) -> bool:
        assert self.bucket is not None
        started = time.monotonic()
        try:
            self.bucket.upload_checkpoint(job.step, job.folder)
        except Exception as exc:
            self._report(f"upload of global_step{job.step} to {self.url} failed", exc)
            return False
        size = sum(p.stat().st_size for p in job.folder.rglob("*") if p.is_file())
        log.info(f"uploaded global_step{job.step} to {self.url} ({size / 2**20:,.1f} MiB in "
                 f"{time.monotonic() - started:.1f} s)")
        self.committed_step = job.step
        shutil.rmtree(job.folder, ignore_errors=True)
        try:
            self.bucket.prune(job.step, self.keep)
        except Exception as exc:
            self._report("removing old checkpoints from the bucket failed", exc)
        return True

    def _sync_side_files(self) -> bool:
        """Upload every run file (outside checkpoints/ and data_cache/) changed since its last upload."""
        assert self.bucket is not None
        ok = True
        for path in sorted(self.local.rglob("*")):
            name = path.relative_to(self.local).as_posix()
            if not path.is_file() or name.split("/", 1)[0] in SKIPPED or ".tmp-" in path.name:
                continue
            try:
                stamp = _stamp(path)
                if self._side_synced.get(name) == stamp:
                    continue
                self.bucket.put(path, name)
                self._side_synced[name] = stamp
            except FileNotFoundError:  # removed while we looked (a rotated temp file)
                continue
            except Exception as exc:
                self._report(f"upload of {name} to {self.url} failed", exc)
                ok = False
                break
        return ok

    def _report(self, what: str, exc: Exception) -> None:
        # The exception's text names the endpoint and the object, never a credential (botocore and
        # google-auth keep them out of messages); only its first line is shown.
        message = f"{what}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if message != self._last_error or self._failures % 10 == 0:
            log.warning(f"{message} (retrying in {_backoff(self._failures + 1):.0f} s)")
        self._last_error = message

    # --- at the end ---------------------------------------------------------------------------------
    def finish(self, code: int, preempted: int) -> int:
        """Wait for the last checkpoint and the run's files to reach the bucket: within
        train.preempt_grace_seconds after a signal, else up to FINAL_WAIT_SECONDS. Returns the exit code."""
        if not self.is_main or self._thread is None:
            return code
        budget = self.grace_s if code == preempted else FINAL_WAIT_SECONDS
        deadline = time.monotonic() + budget
        with self._cv:
            self._closing = True
            self._side_due = 0.0  # one last pass over the run's files
            self._cv.notify_all()
            while self._thread.is_alive() and time.monotonic() < deadline:
                self._cv.wait(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        if not self._thread.is_alive():
            log.info(f"the run is mirrored in {self.url}")
            return code
        # What this process knows (asking the store now could take longer than the budget left).
        where = (f"its newest complete checkpoint is global_step{self.committed_step}"
                 if self.committed_step is not None else "it holds no complete checkpoint of this run")
        log.warning(f"the upload to {self.url} did not finish within {budget:.0f} s: {where}, and a new machine "
                    f"resumes from there. This machine's staging folder {self.local} keeps everything: running "
                    f"the same command here uploads it first.")
        return code if code == preempted else 1


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def _link_or_copy(src: str, dst: str) -> None:
    """A hard link (instant, no space: DeepSpeed never rewrites a saved file in place), a copy across devices."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def open_mirror(train: Any, storage: Any, is_main: bool) -> RunMirror:
    return RunMirror(str(train.output_model_dir), train.local_dir, storage.endpoint_url, train.keep_checkpoints,
                     train.preempt_grace_seconds, is_main)


def fetch_checkpoint(url: str, step: int | None = None, endpoint_url: str | None = None) -> Path:
    """A complete checkpoint of the bucket run `url` (the newest, or `step`) in a local cache, downloaded once
    (a cached copy is reused when every file matches the marker's sizes), with the run's metrics.jsonl beside
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
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:10]
    run = Path(tempfile.gettempdir()) / "gptpipe-cache" / digest / local_name(url)
    folder = run / "checkpoints" / checkpoint.tag_of(step)
    if not ((folder / checkpoint.COMPLETE_MARKER).is_file() and RunMirror._matches(folder, files)):
        started = time.monotonic()
        bucket.download_checkpoint(step, files, run / "checkpoints")
        log.info(f"downloaded {join(bucket.checkpoints, checkpoint.tag_of(step))} to {folder} "
                 f"({sum(files.values()) / 2**20:,.1f} MiB in {time.monotonic() - started:.1f} s)")
    try:
        bucket.fs.get_file(join(bucket.url, "metrics.jsonl"), str(run / "metrics.jsonl"))
    except FileNotFoundError:
        pass
    return folder


ASSUMED_UPLOAD_BYTES_PER_S = 100e6  # one machine to its region's bucket, a few parallel streams


def describe_run_folder(url: str, local_dir: Path | None, checkpoint_bytes: float, save_interval: int,
                        step_seconds: float | None) -> tuple[str, str | None]:
    """The plan's line for a bucket run (where it lives, how long a checkpoint upload takes) and a warning
    when checkpoints would be saved faster than they upload."""
    upload_s = checkpoint_bytes / ASSUMED_UPLOAD_BYTES_PER_S
    line = (f"{url}, staged in {staging_folder(url.rstrip('/'), local_dir)}; a checkpoint uploads in ~{upload_s:.0f} s "
            f"at an assumed {ASSUMED_UPLOAD_BYTES_PER_S / 1e6:.0f} MB/s")
    if step_seconds is None:
        return line, None
    between = save_interval * step_seconds
    line += f", saves every ~{between:.0f} s"
    if between >= upload_s:
        return line, None
    return line, (f"checkpoints would come every ~{between:.0f} s but take ~{upload_s:.0f} s to upload: saves would "
                  f"replace each other while they wait; raise train.save_interval to at least "
                  f"{int(upload_s / step_seconds) + 1}")
