"""Stage 3 with its run folder in a bucket (`train.output_model_dir: s3://…`, gs://, any fsspec URL).

DeepSpeed saves into a local staging folder as for a local run; an uploader process (runtime/uploader.py, niced)
mirrors it to the bucket, each checkpoint in runtime/bucket.py's commit order, plus the run's other files when
they change (metrics.jsonl, config, TensorBoard, wandb). At the end or on SIGTERM training waits for it within
train.preempt_grace_seconds. On a fresh machine the same command downloads the newest complete checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from gptpipe.committed import local_matches
from gptpipe.log import get_logger
from gptpipe.stage import StageInputError, write_text_atomic
from gptpipe.storage import join, local_folder
from gptpipe.runtime import checkpoint
from gptpipe.runtime.bucket import Bucket, Lease, needed_by, ranks_in
from gptpipe.runtime.metrics_rows import read_metrics
from gptpipe.runtime.uploader import RECORD, UPLOADS, file_stamp

log = get_logger("train")

# What a resumed run appends to, continues or reuses: stage 7's DPO reference log-probs (finetune/kinds/preference.py),
# computed once from the starting model, are reused rather than recomputed on a fresh machine.
REFERENCE_LOGPROBS_FILE = "reference_logprobs.json"
RESUMED_FILES = ("metrics.jsonl", "wandb_run_id", REFERENCE_LOGPROBS_FILE)
FINAL_WAIT_SECONDS = 900.0  # how long a finished run keeps retrying an unreachable store before giving up


def staging_folder(url: str, local_dir: Path | None) -> Path:
    """`train.local_dir`, else a folder under the system temp named after the run and its URL."""
    return local_dir if local_dir is not None else local_folder(url, "gptpipe-runs")


class RunMirror:
    """The local staging folder of a bucket run, on every rank, and its uploader process (on the ranks that
    upload: rank 0, and each node's first local rank when the nodes share no disk)."""

    def __init__(self, url: str, local_dir: Path | None, endpoint_url: str | None, keep: int, grace_s: float,
                 rank: int = 0, local_rank: int = 0, world_size: int = 1):
        self.url = url.rstrip("/")
        self.local = staging_folder(self.url, local_dir)
        self.endpoint_url, self.keep, self.grace_s = endpoint_url, keep, grace_s
        self.rank, self.local_rank, self.world_size = rank, local_rank, world_size
        self.is_main = rank == 0
        self.uploads = self.is_main  # per-node staging makes each node's first local rank an uploader too
        self.node, self.nodes = 0, 1
        self.attempt = uuid.uuid4().hex  # node markers of an earlier process never count for this one
        self.bucket = Bucket(self.url, endpoint_url) if self.is_main else None
        self._side_synced: dict[str, tuple[int, int]] = {}
        self._state: dict[str, Any] = {"failures": 0, "step": None, "committed": None}
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None  # reads the uploader's state lines
        self._group: Any = None  # the ranks' gloo group (restore), for the barrier at the end (finish)
        self.lease: Lease | None = None  # rank 0's hold on the bucket folder (bucket.Lease)

    @property
    def committed_step(self) -> int | None:
        """The newest checkpoint known complete in the bucket."""
        with self._lock:
            return self._state["committed"]

    # --- before training ----------------------------------------------------------------------------
    def restore(self) -> None:
        """Collective (every rank): make the staging folders match the bucket (see _restore_main), deciding
        first whether the ranks share rank 0's staging folder or each node stages on its own disk.

        Shared (one machine, or nodes sharing a disk): rank 0 uploads every rank's files. Otherwise each
        node's first local rank uploads the files its node's ranks wrote (DeepSpeed writes the shared model
        states on global rank 0, each rank its ZeRO shards), then a node marker
        `global_step{N}/nodes/node{K}.json` naming them; global rank 0 writes `complete` only once every
        node's marker of this attempt is there. On resume each node downloads the shared files and its own
        ranks' files. Rank 0 first takes the folder's lease: a second run on the same URL exits here."""
        if self.is_main:
            assert self.bucket is not None
            self.lease = Lease(self.bucket, "gptpipe run")
            self.lease.take()
        if self.world_size == 1:
            self._restore_main()
            return
        import torch.distributed as td

        group = self._group = td.new_group(backend="gloo")  # CPU objects also when the training group is NCCL
        shared, leaders = self._probe(group)
        if shared:
            if self.is_main:
                self._restore_main()
            td.barrier(group=group)
            return
        self.node, self.nodes = sorted(set(leaders)).index(leaders[self.rank]), len(set(leaders))
        my_ranks = {r for r, leader in enumerate(leaders) if leader == leaders[self.rank]}
        self.uploads = self.local_rank == 0
        newest: list[Any] = [None, None]
        if self.is_main:  # one rank decides the resume point, so that every node resumes the same step
            newest = [self.bucket.newest(), self.attempt]
        td.broadcast_object_list(newest, src=0, group=group)
        remote, self.attempt = newest
        if self.uploads:
            self.bucket = self.bucket or Bucket(self.url, self.endpoint_url)
            self._restore_node(remote, my_ranks)
        td.barrier(group=group)

    def _probe(self, group: Any) -> tuple[bool, list[int]]:
        """(every rank sees rank 0's staging folder, each rank's node leader): each node's first local rank
        writes a probe file into its staging folder, and each rank says whose probes it sees."""
        import torch.distributed as td

        nonce: list[Any] = [uuid.uuid4().hex]
        td.broadcast_object_list(nonce, src=0, group=group)
        leader = self.rank - self.local_rank  # launchers number a node's ranks consecutively
        probe = self.local / f".probe-{nonce[0]}-{self.rank}"
        if self.local_rank == 0:
            self.local.mkdir(parents=True, exist_ok=True)
            probe.write_text("")
        td.barrier(group=group)
        seen = sorted(int(p.name.rsplit("-", 1)[1]) for p in self.local.glob(f".probe-{nonce[0]}-*"))
        views: list[Any] = [None] * self.world_size
        td.all_gather_object(views, (leader, seen), group=group)
        td.barrier(group=group)
        probe.unlink(missing_ok=True)
        td.barrier(group=group)  # no probe left when rank 0 checks that the folder is new or its own
        leaders = [v[0] for v in views]
        if all(v[1] == sorted(set(leaders)) for v in views):
            return True, leaders
        if all(v[1] == [v[0]] for v in views):
            return False, leaders
        raise StageInputError(f"the staging folder {self.local} is shared by some nodes but not all: set "
                              f"train.local_dir to a folder on each node's own disk, or to one all nodes share")

    def _prepare(self) -> Path:
        """The staging folder, checked to be this run's (or new), without leftovers of a killed process."""
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
        return root

    def _restore_main(self) -> None:
        """Rank 0 of a shared staging folder: reuse it when it is this run's and at least as new as the
        bucket's newest complete checkpoint (a newer local one is uploaded), else download that one."""
        assert self.bucket is not None
        root = self._prepare()
        remote = self.bucket.newest()
        local = checkpoint.complete_checkpoints(root)
        local_step = local[-1][0] if local else None
        remote_step = self._state["committed"] = remote[0] if remote else None
        if local_step is not None and (remote_step is None or local_step > remote_step):
            log.info(f"the staging folder {self.local} holds global_step{local_step}, newer than the bucket's "
                     f"{'none' if remote_step is None else f'global_step{remote_step}'}: resuming from it and "
                     f"uploading it")
            self.start()
            self.submit(local_step, local[-1][1])
            return
        if remote is None:
            log.info(f"no complete checkpoint in {self.url}: starting from scratch (staging in {self.local})")
        elif local_step == remote_step and local_matches(local[-1][1], remote[1]):
            log.info(f"the staging folder {self.local} matches {self.url} (global_step{remote_step}): reused")
        else:
            self._download(remote, root, local_step is not None)
        self._after_download(remote)

    def _restore_node(self, remote: tuple[int, dict[str, int]] | None, ranks: set[int]) -> None:
        """A node's first local rank, nodes without a shared disk: the bucket's newest complete checkpoint,
        only the files `ranks` read (all of them when another number of ranks saved it); a newer local checkpoint
        never reached the bucket on every node, so the run resumes from the bucket's."""
        root = self._prepare()
        local = checkpoint.complete_checkpoints(root)
        remote_step = self._state["committed"] = remote[0] if remote else None
        if local and (remote_step is None or local[-1][0] > remote_step):
            log.info(f"node {self.node}: the staging folder {self.local} holds global_step{local[-1][0]}, which "
                     f"is not complete in the bucket: resuming from the bucket's "
                     f"{'none' if remote_step is None else f'global_step{remote_step}'}")
            shutil.rmtree(root, ignore_errors=True)
            local = []
        if remote is None:
            log.info(f"node {self.node}: no complete checkpoint in {self.url}: starting from scratch (staging in "
                     f"{self.local})")
        else:
            # Saved by another number of ranks: each node converts the whole checkpoint for the new number
            # (checkpoint.universal_copy), so it fetches every rank's files.
            saved = ranks_in(remote[1])
            wanted = ranks if saved == set(range(self.world_size)) else saved
            files = {name: size for name, size in remote[1].items() if needed_by(name, wanted)}
            if local and local[-1][0] == remote_step and local_matches(local[-1][1], files):
                log.info(f"node {self.node}: the staging folder {self.local} matches {self.url} "
                         f"(global_step{remote_step}): reused")
            else:
                self._download((remote[0], files), root, bool(local))
        if self.is_main:
            self._after_download(remote)
        self.start()

    def _download(self, remote: tuple[int, dict[str, int]], root: Path, replaced: bool) -> None:
        assert self.bucket is not None
        if replaced:
            log.info(f"the staging folder {self.local} is behind {self.url}: replaced by the bucket's state")
        # What a resumed run appends to must be the bucket's, not an older process's local copy.
        for name in ("checkpoints", *RESUMED_FILES):
            target = self.local / name
            shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
        started = time.monotonic()
        step, files = remote
        self.bucket.download_checkpoint(step, files, root)
        log.info(f"downloaded {join(self.bucket.checkpoints, checkpoint.tag_of(step))} "
                 f"({sum(files.values()) / 2**20:,.1f} MiB in {time.monotonic() - started:.1f} s)")

    def _after_download(self, remote: tuple[int, dict[str, int]] | None) -> None:
        """Rank 0: the run's small files from the bucket, a note on re-logged steps, the uploader."""
        assert self.bucket is not None
        for path in self.bucket.download_run_files(self.local, RESUMED_FILES):
            self._side_synced[path.relative_to(self.local).as_posix()] = file_stamp(path)
        logged = max((row.step for row in read_metrics(self.local / "metrics.jsonl")), default=0)
        if remote is not None and logged > remote[0]:
            log.info(f"steps {remote[0] + 1}-{logged} were logged by the stopped process after its last complete "
                     f"checkpoint and are redone now: metrics.jsonl keeps both (equal) copies; wandb drops the "
                     f"re-logged steps below its last one")
        self.start()

    # --- during training ----------------------------------------------------------------------------
    def start(self) -> None:
        """The uploader process, told what it mirrors on its first input line."""
        if self._process is not None or not self.uploads:
            return
        self._process = subprocess.Popen([sys.executable, "-m", "gptpipe.runtime.uploader"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True, bufsize=1)
        self._send({"url": self.url, "endpoint_url": self.endpoint_url, "local": str(self.local), "keep": self.keep,
                    "synced": self._side_synced, "node": self.node, "nodes": self.nodes, "attempt": self.attempt,
                    "committed": self._state["committed"]})
        self._reader = threading.Thread(target=self._read_state, name="gptpipe-mirror-state", daemon=True)
        self._reader.start()

    def _send(self, message: dict[str, Any]) -> None:
        assert self._process is not None and self._process.stdin is not None
        self._process.stdin.write(json.dumps(message) + "\n")
        self._process.stdin.flush()

    def _read_state(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            with self._lock:
                self._state.update(json.loads(line))

    def submit(self, step: int, folder: Path) -> None:
        """Queue the checkpoint just saved in `folder` (every rank calls this; uploaders act): a hard-linked
        copy, so that keep-last-N may delete the original while it uploads. On a node other than rank 0's the
        ranks' files are still in the save's temporary folder (only rank 0 moves a save into place): moved."""
        if not self.uploads:
            return
        copy = self.local / UPLOADS / f"{folder.name}-{time.monotonic_ns()}"
        copy.parent.mkdir(parents=True, exist_ok=True)
        if self.is_main:
            shutil.copytree(folder, copy, copy_function=_link_or_copy)
        else:
            pending = folder.parent / f".tmp-{folder.name}"
            (pending / folder.name).rename(copy)
            shutil.rmtree(pending, ignore_errors=True)
        self.start()
        self._send({"step": step, "folder": str(copy)})

    def status(self) -> str:
        """A note for the console line while uploads fail; empty while all is well."""
        with self._lock:
            if self._process is not None and self._process.poll() not in (None, 0):
                return f"  uploader process exited ({self._process.returncode}): nothing more reaches the bucket"
            if not self._state["failures"]:
                return ""
            what = f"global_step{self._state['step']}" if self._state["step"] is not None else "run files"
            return f"  upload of {what} failing ({self._state['failures']} tries, retrying)"

    # --- at the end ---------------------------------------------------------------------------------
    def finish(self, code: int, preempted: int, grace_left: float | None = None) -> int:
        """Wait for the last checkpoint and the run's files to reach the bucket: after a signal within what is left
        of train.preempt_grace_seconds since it came (`grace_left`; None: all of it), else up to
        FINAL_WAIT_SECONDS. Returns the exit code; the console says which step a rerun resumes from.

        Collective: no rank returns before every uploader's commit has, since launchers (torchrun, deepspeed's)
        stop a node's other ranks as soon as one exits non-zero (75 after a signal), an uploader among them."""
        code = self._finish_uploads(code, preempted, grace_left)
        if self._group is not None:
            import torch.distributed as td

            td.barrier(group=self._group)
        if self.lease is not None:
            self.lease.release()
        return code

    def _finish_uploads(self, code: int, preempted: int, grace_left: float | None) -> int:
        if self._process is None:
            return code
        if code != preempted:
            budget = FINAL_WAIT_SECONDS
        else:
            budget = self.grace_s if grace_left is None else grace_left
        try:
            self._send({"close": True})
            self._process.wait(timeout=budget)
        except (subprocess.TimeoutExpired, BrokenPipeError):
            pass
        if self._process.returncode == 0:
            if self._reader is not None:  # its last state line (the step it committed) read to the end
                self._reader.join(timeout=5.0)
            committed = self.committed_step
            resumes = "" if committed is None else f": a rerun anywhere resumes from global_step{committed}"
            log.info(f"the run is mirrored in {self.url}{resumes}" if self.is_main else
                     f"node {self.node}: its part of the run is mirrored in {self.url}")
            return code
        self._process.kill()
        self._process.wait()
        # What this process knows (asking the store now could take longer than the budget left).
        committed = self.committed_step
        where = (f"its newest complete checkpoint is global_step{committed}"
                 if committed is not None else "it holds no complete checkpoint of this run")
        within = (f"train.preempt_grace_seconds ({self.grace_s:g} s from the signal)" if code == preempted
                  else f"{budget:.0f} s")
        log.warning(f"the upload to {self.url} did not finish within {within}: {where}, and a new machine "
                    f"resumes from there. This machine's staging folder {self.local} keeps everything: running "
                    f"the same command here uploads it first.")
        return code if code == preempted else 1


def _link_or_copy(src: str, dst: str) -> None:
    """A hard link (instant, no space: DeepSpeed never rewrites a saved file in place), a copy across devices."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def open_mirror(train: Any, storage: Any, dist: Any) -> RunMirror:
    return RunMirror(str(train.output_model_dir), train.local_dir, storage.endpoint_url, train.keep_checkpoints,
                     train.preempt_grace_seconds, dist.rank, dist.local_rank, dist.world_size)


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
