"""The uploader process of a bucket run (runtime/mirror.py starts it): `python -m gptpipe.runtime.uploader`.

It reads setup, then checkpoint folders and finally "close" as JSON lines on stdin, and answers its state
(failures, the save it retries, the newest committed step) as JSON lines on stdout. One checkpoint upload is
in flight at a time; a newer save arriving meanwhile waits, and replaces any save still waiting (the older
one is dropped, never half-committed). The run's other files are uploaded when they change. Failures are
retried with backoff and never mark anything complete. It ignores SIGTERM/SIGINT (the training process decides
when to stop) and quits at once when the training process dies (stdin closed without "close").
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from gptpipe.log import get_logger
from gptpipe.runtime import checkpoint
from gptpipe.runtime.bucket import Bucket

log = get_logger("train")

UPLOADS = ".uploads"  # in the staging folder: hard-linked copies of checkpoints waiting for or in upload
RECORD = "mirror.json"  # in the staging folder: the URL it stands in for
# Never mirrored as run files: the dataset index cache (rebuilt from the data), the checkpoint folder (uploaded
# by protocol, not by change), our own bookkeeping, and temporary files of atomic writes.
SKIPPED = ("checkpoints", "data_cache", UPLOADS, RECORD)
SIDE_SYNC_SECONDS = 60.0
NODE_WAIT_SECONDS = 300.0  # how long rank 0 waits for the other nodes' parts of a checkpoint before retrying


def backoff_seconds(failures: int) -> float:
    return min(30.0, 0.5 * 2 ** min(failures, 6))


@dataclass
class Job:
    step: int
    folder: Path  # the staging copy under UPLOADS


class Uploader:
    """The uploader process's loop: one checkpoint at a time, the newest waiting one next, the run's other
    files every SIDE_SYNC_SECONDS (rank 0 only), retries with backoff; its state goes to `out` as JSON lines."""

    def __init__(self, setup: dict[str, Any], inbox: queue.Queue, out: IO[str]):
        self.url, self.local, self.keep = setup["url"], Path(setup["local"]), setup["keep"]
        self.node, self.nodes, self.attempt = setup["node"], setup["nodes"], setup["attempt"]
        self.bucket = Bucket(self.url, setup["endpoint_url"])
        self.inbox, self.out = inbox, out
        self.synced = {name: tuple(stamp) for name, stamp in setup["synced"].items()}
        self.committed: int | None = setup["committed"]
        self.waiting: Job | None = None
        self.closing = False
        self.failures = 0
        self.last_error = ""

    def _take(self, timeout: float | None) -> bool:
        """Read one message (waiting up to `timeout`; None: do not wait); False when none came."""
        try:
            message = self.inbox.get(timeout=timeout) if timeout else self.inbox.get_nowait()
        except queue.Empty:
            return False
        if message.get("close"):
            self.closing = True
        else:
            job = Job(message["step"], Path(message["folder"]))
            if self.waiting is not None:
                log.info(f"upload: global_step{job.step} replaces global_step{self.waiting.step}, which was still "
                         f"waiting behind the upload in flight")
                shutil.rmtree(self.waiting.folder, ignore_errors=True)
            self.waiting = job
            if self.failures:  # the console line names the save being retried
                self._publish(job)
        return True

    def _drain(self) -> None:
        while self._take(None):
            pass

    def _publish(self, job: Job | None) -> None:
        self.out.write(json.dumps({"failures": self.failures, "step": job.step if job else None,
                                   "committed": self.committed}) + "\n")
        self.out.flush()

    def run(self) -> None:
        due = time.monotonic() + SIDE_SYNC_SECONDS
        while True:
            while self.waiting is None and not self.closing and time.monotonic() < due:
                self._take(max(0.01, due - time.monotonic()))
            self._drain()
            job, self.waiting = self.waiting, None
            uploaded = self._upload(job) if job else True
            ok = (self.node > 0 or self._sync_side_files()) and uploaded
            self._drain()
            if ok:
                self.failures, self.last_error = 0, ""
            else:
                self.failures += 1
                if not uploaded and self.waiting is None:
                    self.waiting = job  # retry it, unless a newer save replaced it meanwhile
                elif not uploaded:
                    shutil.rmtree(job.folder, ignore_errors=True)
                    log.info(f"upload: gave up global_step{job.step} for the newer global_step{self.waiting.step}")
            self._publish(self.waiting if not ok else None)
            if self.closing and self.waiting is None and ok:
                return
            if ok:
                due = time.monotonic() + SIDE_SYNC_SECONDS
            else:  # back off; when closing, at most 1 s (the grace budget is short); a newer save does not cut it
                until = time.monotonic() + backoff_seconds(self.failures)
                while time.monotonic() < until:
                    if self.closing:
                        until = min(until, time.monotonic() + 1.0)
                    self._take(max(0.01, until - time.monotonic()))
                due = time.monotonic()

    def _upload(self, job: Job) -> bool:
        started = time.monotonic()
        tag = checkpoint.tag_of(job.step)
        try:
            files = self.bucket.upload_part(job.step, job.folder)
            if self.node > 0:
                self.bucket.put_node_marker(job.step, self.node, self.attempt, files)
            else:
                files.update(self._other_nodes(job.step))
                self.bucket.commit(job.step, files)
        except Exception as exc:
            self._report(f"upload of {tag} to {self.url} failed", exc)
            return False
        size = sum(p.stat().st_size for p in job.folder.rglob("*") if p.is_file())
        what = f"node {self.node}'s part of {tag}" if self.nodes > 1 else tag
        log.info(f"uploaded {what} to {self.url} ({size / 2**20:,.1f} MiB in {time.monotonic() - started:.1f} s)")
        shutil.rmtree(job.folder, ignore_errors=True)
        if self.node > 0:
            return True
        self.committed = job.step
        try:
            self.bucket.prune(job.step, self.keep)
        except Exception as exc:
            self._report("removing old checkpoints from the bucket failed", exc)
        return True

    def _other_nodes(self, step: int) -> dict[str, int]:
        """The files the other nodes uploaded of `step`, once all their markers are there; raises after
        NODE_WAIT_SECONDS or when a newer save is waiting (this one is then given up)."""
        deadline = time.monotonic() + NODE_WAIT_SECONDS
        while True:
            parts = self.bucket.node_parts(step, self.nodes, self.attempt)
            if len(parts) == self.nodes - 1:
                return {name: size for files in parts.values() for name, size in files.items()}
            missing = ", ".join(str(n) for n in range(1, self.nodes) if n not in parts)
            self._drain()
            if self.waiting is not None or time.monotonic() > deadline:
                raise OSError(f"node(s) {missing} did not upload their part of {checkpoint.tag_of(step)}")
            self._take(0.5)

    def _sync_side_files(self) -> bool:
        """Upload every run file (outside checkpoints/ and data_cache/) changed since its last upload."""
        for path in sorted(self.local.rglob("*")):
            name = path.relative_to(self.local).as_posix()
            if not path.is_file() or name.split("/", 1)[0] in SKIPPED or ".tmp-" in path.name:
                continue
            try:
                stamp = file_stamp(path)
                if self.synced.get(name) == stamp:
                    continue
                self.bucket.put(path, name)
                self.synced[name] = stamp
            except FileNotFoundError:  # removed while we looked (a rotated temp file)
                continue
            except Exception as exc:
                self._report(f"upload of {name} to {self.url} failed", exc)
                return False
        return True

    def _report(self, what: str, exc: Exception) -> None:
        # The exception's text names the endpoint and the object, never a credential (botocore and
        # google-auth keep them out of messages); only its first line is shown.
        message = f"{what}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if message != self.last_error or self.failures % 10 == 0:
            log.warning(f"{message} (retrying in {backoff_seconds(self.failures + 1):.0f} s)")
        self.last_error = message


def serve() -> None:
    """The uploader process: setup, then checkpoint folders and finally "close" on stdin. A closed stdin
    without "close" means the training process died: quit at once, leaving nothing half-committed."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    os.nice(10)  # background work: the training process comes first
    out, sys.stdout = sys.stdout, sys.stderr  # stdout carries our state lines only
    setup = json.loads(sys.stdin.readline() or "null")
    if setup is None:
        return
    inbox: queue.Queue = queue.Queue()

    def read() -> None:
        for line in sys.stdin:
            message = json.loads(line)
            inbox.put(message)
            if message.get("close"):
                return
        os._exit(1)

    threading.Thread(target=read, daemon=True).start()
    Uploader(setup, inbox, out).run()


def file_stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns




if __name__ == "__main__":
    serve()
