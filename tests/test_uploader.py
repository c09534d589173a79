"""The bucket mirror's upload scheduling, without a training run: one upload in flight, the newest waiting save
replaces an older one, failures retried with backoff and never committed, and the training process's wait at
the end bounded by its grace. The store is a real fsspec one (a local folder behind a file:// URL); a plain
file where the checkpoints folder belongs makes every checkpoint upload fail until it is removed. The uploader
moves a save's files as they are, so each save here is a folder of three small files under the names the
commit requires."""

from __future__ import annotations

import io
import json
import logging
import queue
import threading
import time
from pathlib import Path

import pytest

from gptpipe.runtime import checkpoint
from gptpipe.runtime.bucket import Bucket
from gptpipe.runtime.mirror import RunMirror
from gptpipe.runtime.uploader import UPLOADS, Uploader


@pytest.fixture
def store(tmp_path: Path) -> tuple[str, Path]:
    """(the run's URL, the plain file that blocks its checkpoint uploads while it exists)."""
    run = tmp_path / "store" / "run"
    run.mkdir(parents=True)
    blocker = run / "checkpoints"
    blocker.write_text("not a folder")
    return f"file://{run}", blocker


def save(stage: Path, step: int) -> Path:
    folder = stage / UPLOADS / f"{checkpoint.tag_of(step)}-{time.monotonic_ns()}"
    folder.mkdir(parents=True)
    for name in (checkpoint.STATE, checkpoint.HF_CONFIG, "weights.bin"):
        (folder / name).write_text(f"step {step}: {name}")
    return folder


def states(out: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_newer_save_replaces_the_waiting_one_and_failures_never_commit(store, tmp_path: Path) -> None:
    url, blocker = store
    stage = tmp_path / "stage"
    inbox: queue.Queue = queue.Queue()
    out = io.StringIO()
    setup = {"url": url, "endpoint_url": None, "local": str(stage), "keep": 2, "synced": {}, "node": 0,
             "nodes": 1, "attempt": "a", "committed": None}
    first = save(stage, 1)
    inbox.put({"step": 1, "folder": str(first)})
    uploader = threading.Thread(target=Uploader(setup, inbox, out).run, daemon=True)
    uploader.start()
    wait_for(lambda: any(s["failures"] >= 2 and s["step"] == 1 for s in states(out)))  # retried, not dropped
    assert Bucket(url, None).newest() is None and first.is_dir()

    second, third = save(stage, 2), save(stage, 3)
    inbox.put({"step": 2, "folder": str(second)})
    inbox.put({"step": 3, "folder": str(third)})
    wait_for(lambda: states(out)[-1]["step"] == 3)  # the console line now names the newest save
    assert not first.exists() and not second.exists() and third.is_dir()  # the replaced ones are dropped

    blocker.unlink()
    wait_for(lambda: states(out)[-1]["committed"] == 3)
    inbox.put({"close": True})
    uploader.join(timeout=30)
    assert not uploader.is_alive()
    bucket = Bucket(url, None)
    assert bucket.steps() == [3]  # 1 and 2 never reached the store, not even in part
    step, files = bucket.newest()
    assert step == 3 and set(files) == {checkpoint.STATE, checkpoint.HF_CONFIG, "weights.bin"}
    assert (Path(url.removeprefix("file://")) / "checkpoints" / checkpoint.LATEST).read_text() == "global_step3"
    assert states(out)[-1] == {"failures": 0, "step": None, "committed": 3} and not third.exists()


@pytest.mark.parametrize("reachable", [False, True], ids=["store-failing", "store-reachable"])
def test_the_training_process_waits_for_the_uploader_within_the_grace(store, tmp_path: Path, reachable: bool,
                                                                      caplog) -> None:
    """RunMirror's side: its uploader process gets the save and "close"; after a SIGTERM (exit code 75) the
    wait ends within train.preempt_grace_seconds even while the store fails, and the code stays 75."""
    url, blocker = store
    if reachable:
        blocker.unlink()
    # Reachable, the uploader process must start (its imports: seconds on a loaded machine) and commit within the
    # grace: 30 s leaves room; failing, the wait must end at the grace, so a short one.
    grace = 30.0 if reachable else 3.0
    mirror = RunMirror(url, tmp_path / "stage", None, keep=2, grace_s=grace)
    mirror.local.mkdir(parents=True)
    saved = tmp_path / "saved" / checkpoint.tag_of(5)
    saved.mkdir(parents=True)
    for name in (checkpoint.STATE, checkpoint.HF_CONFIG, "weights.bin"):
        (saved / name).write_text(name)
    mirror.submit(5, saved)
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="gptpipe"):
        code = mirror.finish(75, preempted=75)
    waited = time.monotonic() - started
    assert code == 75 and waited < grace + 2.0
    if reachable:
        assert Bucket(url, None).newest()[0] == 5 and mirror.committed_step == 5
        assert f"the run is mirrored in {url}: a rerun anywhere resumes from global_step5" in caplog.text
    else:
        assert Bucket(url, None).newest() is None and waited >= 3.0
        assert ("did not finish within train.preempt_grace_seconds (3 s from the signal): it holds no complete "
                "checkpoint of this run") in caplog.text
