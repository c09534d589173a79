"""One writer per output folder: `gptpipe train`, `finetune` and `prepare` hold an exclusive lock on theirs while
they run, so a second command on a live folder exits at once instead of deleting the first one's staging files,
appending to its metrics or pruning its checkpoints.

The lock is flock(2) on `.<folder name>.lock` beside the folder (outside it: a stage may swap its folder whole),
opened without following a symlink; the kernel releases it when the process dies, however it dies, so a killed
run never leaves a stale lock. The file records who holds it (host, pid, since) for the refusal. flock holds on
one machine's filesystem; a run folder in a bucket has its own staging folder per machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any
from collections.abc import Iterator

from gptpipe.stage import StageInputError


def holder_record(what: str) -> dict[str, Any]:
    """Who writes a folder: the command, this host and process, since when (a lock file's or a bucket lease's)."""
    return {"what": what, "host": socket.gethostname(), "pid": os.getpid(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def describe_holder(record: dict[str, Any]) -> str:
    """A holder_record as a refusal names it: `gptpipe train (host h, pid p, since s)`."""
    return (f"{record.get('what', 'process')} (host {record.get('host')}, pid {record.get('pid')}, since "
            f"{record.get('since')})")


def process_gone(host: object, pid: object) -> bool:
    """Whether the process a record names (its host and pid) is known to be gone: on this host, no process has
    that pid any more (it was killed or crashed). Another host's process cannot be looked at: not known gone."""
    if host != socket.gethostname() or not isinstance(pid, int) or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process
        return False
    return False


def owner_suffix() -> str:
    """`<pid>@<host>`: the end of a temporary file or folder's name, for `left_by_gone_process` to read."""
    return f"{os.getpid()}@{socket.gethostname()}"


def temporary_owner(name: str) -> tuple[str, int] | None:
    """(host, pid) that a temporary's name ends in (`-<owner_suffix()>`; a bare `-<pid>`, stage.atomic_path's, is
    this host's), or None when it names no process."""
    before, at, host = name.rpartition("@")  # a host name may hold "-", a pid does not
    if not at:
        before, host = name, socket.gethostname()
    pid = before.rsplit("-", 1)[-1]
    return (host, int(pid)) if pid.isdigit() else None


def left_by_gone_process(name: str) -> bool:
    """Whether a temporary's name (`temporary_owner`) is that of a process of this host that is gone."""
    owner = temporary_owner(name)
    return owner is not None and process_gone(*owner)


def lock_path(folder: Path) -> Path:
    folder = Path(folder).absolute()
    return folder.with_name(f".{folder.name}.lock")


class FolderLock:
    """An exclusive lock on `folder`, held until release() or the process's end."""

    def __init__(self, folder: Path, what: str):
        path = lock_path(folder)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:  # ELOOP: the lock file is a symlink someone planted
            raise StageInputError(f"{path}: cannot open the lock file of {folder} ({exc.strerror}); remove it if "
                                  "it is a link") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder()
            os.close(self._fd)
            raise StageInputError(f"{folder} is in use by another {holder}: one {what} writes a folder at a time. "
                                  f"Wait for it to end, or give this one another folder") from None
        os.ftruncate(self._fd, 0)
        os.write(self._fd, json.dumps(holder_record(what)).encode())

    def _holder(self) -> str:
        try:
            record = json.loads(os.pread(self._fd, 4096, 0) or b"{}")
        except (ValueError, OSError):
            return "process"
        return describe_holder(record) if isinstance(record, dict) and record else "process"

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = -1


@contextlib.contextmanager
def locked(folder: Path, what: str) -> Iterator[None]:
    """Hold the lock on `folder` for the block."""
    lock = FolderLock(folder, what)
    try:
        yield
    finally:
        lock.release()
