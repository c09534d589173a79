"""A run folder in a bucket, on real object-storage servers on 127.0.0.1: moto's S3 server (s3fs) and
gcp-storage-emulator (gcsfs). The preemption drill (on S3): SIGTERM and SIGKILL at random steps, the local disk
wiped each time (a new machine), and the per-step losses still equal an uninterrupted local run's. On GCS a
shorter round trip (commit on SIGTERM, fetch and resume on a new machine) proves gcsfs carries the same protocol;
the checkpoint code above the filesystem is the same for both stores."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
from conftest import (FAKE_KEY_ID, FAKE_SECRET, QUICK_TRAIN, REFERENCE_RUN, REFERENCE_STEPS, assert_no_secret,
                      bucket_losses, bucket_steps, open_store, run_cli, run_train, start_train, train_losses,
                      wait_for_step)

from gptpipe.config.core import ConfigError, Url, load_config
from gptpipe.pipeline import PipelineConfig
from gptpipe.artifacts import EXIT_PREEMPTED
from gptpipe.runtime.checkpoint import complete_checkpoints

STEPS = REFERENCE_STEPS
# How long a SIGTERM save may wait for its upload (AWS spot's notice; the default is GCE's ~25 s). The servers run
# in this test process: on a loaded 2-core machine an upload took longer than 25 s, and the drill is about
# resuming exactly, not about the grace period (the outage test checks that).
GRACE = "train.preempt_grace_seconds=120"


@pytest.fixture(params=["s3", "gs"])
def store(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """A running store with an empty bucket, its env set for this process and its children."""
    with open_store(request.param, monkeypatch) as store:
        yield store


def test_url_values_stay_urls_and_secrets_stay_out(tmp_path: Path) -> None:
    yaml = tmp_path / "config.yaml"
    yaml.write_text("train:\n  output_model_dir: gs://bucket/runs/ja\n  local_dir: staging\n"
                    "storage:\n  endpoint_url: http://127.0.0.1:9000\n")
    config = load_config(PipelineConfig, yaml)
    assert config.train.output_model_dir == "gs://bucket/runs/ja" and isinstance(config.train.output_model_dir, Url)
    assert config.train.local_dir == tmp_path / "staging"  # a path beside it still resolves against its folder
    with pytest.raises(ConfigError) as err:
        load_config(PipelineConfig, yaml, [f"train.output_model_dir=s3://{FAKE_KEY_ID}:{FAKE_SECRET}@bucket/x",
                                           "corpus.output_dir=gs://bucket/corpus",
                                           "storage.endpoint_url=ftp://host"])
    message = str(err.value)
    assert "carries credentials" in message and FAKE_SECRET not in message
    assert "corpus.output_dir: 'gs://bucket/corpus' is a URL, but this key takes a local path only" in message
    assert "storage.endpoint_url: expected http(s)://host[:port]" in message


def test_a_run_redone_at_the_same_url_is_not_read_from_an_earlier_runs_cache(store, tmp_path: Path) -> None:
    """Stage 4's reader caches a bucket checkpoint locally by URL. A run redone at the same URL writes files of
    the same sizes (same model shape): the reader must download them again, not serve the first run's copy."""
    from gptpipe.runtime import checkpoint
    from gptpipe.runtime.bucket import Bucket, fetch_checkpoint

    url = f"{store.scheme}://{store.bucket}/runs/redone"
    bucket = Bucket(url, None)
    for weights in (b"first run " * 8, b"second run" * 8):
        folder = tmp_path / weights[:5].decode().strip() / checkpoint.tag_of(2)
        folder.mkdir(parents=True)
        (folder / "mp_rank_00_model_states.pt").write_bytes(weights)
        (folder / checkpoint.STATE).write_text("{}")
        (folder / checkpoint.HF_CONFIG).write_text("{}")
        bucket.commit(2, bucket.upload_part(2, folder))
        fetched = fetch_checkpoint(url)
        assert (fetched / "mp_rank_00_model_states.pt").read_bytes() == weights
    assert fetch_checkpoint(url) == fetched  # unchanged in the bucket: the cached copy serves


def test_preemption_drill_resumes_exactly_on_fresh_machines(reference_run, workspace: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    config = workspace / "config.yaml"
    full = reference_run()  # the same settings but keep_checkpoints, which changes no step
    reference = train_losses(full)
    common = (*REFERENCE_RUN, "train.keep_checkpoints=2", GRACE)
    with open_store("s3", monkeypatch) as store:
        drill(store, config, workspace, full, reference, common, tmp_path)


def drill(store, config: Path, workspace: Path, full: Path, reference: dict[int, float], common: tuple[str, ...],
          tmp_path: Path) -> None:
    url = f"{store.url}/runs/drill"
    bucket_run = (*common, f"train.output_model_dir={url}")
    outputs: list[str] = []
    rng = random.Random(os.getpid())

    # 1. SIGTERM at a random step on machine 1: a save within one step, its upload, exit 75.
    machine = tmp_path / "machine1"
    process = start_train(config, *bucket_run, f"train.local_dir={machine}")
    wait_for_step(machine, rng.randint(1, 4), process)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=300)
    outputs.append(stderr)
    assert process.returncode == EXIT_PREEMPTED, stderr[-3000:]
    assert f"the run is mirrored in {url}" in stderr
    first = max(step for step, done in bucket_steps(store, url).items() if done)
    shutil.rmtree(machine)  # the preempted VM's disk is gone

    # 2. A new machine resumes from the bucket; SIGKILL it while a newer checkpoint is half uploaded.
    machine = tmp_path / "machine2"
    process = start_train(config, *bucket_run, f"train.local_dir={machine}")
    mid_upload = False
    deadline = time.monotonic() + 300
    while not mid_upload and process.poll() is None and time.monotonic() < deadline:
        mid_upload = any(step > first and not done for step, done in bucket_steps(store, url).items())
        time.sleep(0.05)
    process.kill_all()  # the machine is lost: its uploader too, so no upload in flight commits afterwards
    _, stderr = process.communicate(timeout=60)
    outputs.append(stderr)
    assert f"downloaded {url}/checkpoints/global_step{first}" in stderr
    assert mid_upload, "no upload was caught in flight"
    shutil.rmtree(machine)

    # 3. A third machine (TensorBoard and wandb on): the half-uploaded checkpoint does not exist for it.
    complete = max(step for step, done in bucket_steps(store, url).items() if done)
    machine = tmp_path / "machine3"
    done = run_train("--config", config, *QUICK_TRAIN, *bucket_run, f"train.local_dir={machine}",
                     "logging.tensorboard=true", "logging.wandb=true")
    outputs.append(done.stderr)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"downloaded {url}/checkpoints/global_step{complete}" in done.stderr
    assert bucket_losses(store, url) == reference
    steps = bucket_steps(store, url)
    # keep-last-2 (a save that waited behind an upload may have been replaced by a newer one), no leftovers
    assert max(steps) == STEPS and len(steps) <= 2 and all(steps.values()), steps
    assert store.fs.cat_file(f"{url}/checkpoints/latest") == f"global_step{STEPS}".encode()
    for name in ("train.resolved.yaml", "plan.txt", "ds_config.json", "wandb_run_id"):
        assert store.fs.exists(f"{url}/{name}"), name
    assert store.fs.glob(f"{url}/tensorboard/events.out.tfevents.*") and store.fs.glob(f"{url}/wandb/*/*.wandb")

    # Stage 4 from the bucket run folder gives the verified HF folder a local convert of the uninterrupted run gives.
    convert = workspace / "convert_config.yaml"
    for name, run in (("from-bucket", url), ("from-local", full)):
        run_cli("convert", "--config", convert, f"input_model_dir={run}",
                f"output_tokenizer_and_model_dir={tmp_path / name}")
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json"):
        assert (tmp_path / "from-bucket" / name).read_bytes() == (tmp_path / "from-local" / name).read_bytes(), name
    report = json.loads((tmp_path / "from-bucket" / "manifest.json").read_text())["counts"]
    assert report["verified"] is True and report["step"] == STEPS

    # 4. A checkpoint missing one file in the bucket is never resumed from: the run redoes the last steps.
    store.fs.rm_file(f"{url}/checkpoints/global_step{STEPS}/rng_state_rank0.pt")
    machine = tmp_path / "machine4"
    done = run_train("--config", config, *QUICK_TRAIN, *bucket_run, f"train.local_dir={machine}")
    outputs.append(done.stderr)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"global_step{STEPS} is not used: its marker lists 1 file(s) missing" in done.stderr
    assert f"downloaded {url}/checkpoints/global_step{sorted(steps)[-2]}" in done.stderr
    assert bucket_losses(store, url) == reference
    assert_no_secret(outputs, [tmp_path], store, url)


# Where the uploader of a bucket run loses its machine inside runtime/bucket.py's commit order, fed the reference
# run's checkpoints one commit at a time (keep 1; a training run's uploader may replace a waiting save with a newer
# one, so which saves it commits depends on timing): step 6's files uploaded, its marker not; step 6's marker
# written, `latest` not moved; step 4 pruned at step 6's commit, its marker gone, its files not.
@pytest.mark.parametrize("point", ["bucket-uploaded@6", "bucket-marked@6", "bucket-prune-withdrawn@4"])
def test_a_machine_lost_inside_a_bucket_commit_leaves_a_checkpoint_to_resume_from(
        point: str, reference_run, workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    import sys

    from gptpipe.runtime.bucket import Bucket
    from gptpipe.runtime.uploader import UPLOADS

    full = reference_run()  # checkpoints 4, 6 and 8 (keep 3)
    reference = train_losses(full)
    with open_store("s3", monkeypatch) as store:
        url = f"{store.url}/runs/lost"
        stage = tmp_path / "machine1"
        uploader = subprocess.Popen([sys.executable, "-m", "gptpipe.runtime.uploader"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True, start_new_session=True,
                                    env={**os.environ, "GPTPIPE_KILL_AT": point})
        assert uploader.stdin is not None and uploader.stdout is not None

        def send(message: dict) -> None:
            uploader.stdin.write(json.dumps(message) + "\n")
            uploader.stdin.flush()

        send({"url": url, "endpoint_url": None, "local": str(stage), "keep": 1, "synced": {}, "node": 0,
              "nodes": 1, "attempt": "a", "committed": None})
        for step in (4, 6):
            copy = stage / UPLOADS / f"global_step{step}"
            shutil.copytree(full / "checkpoints" / f"global_step{step}", copy)
            send({"step": step, "folder": str(copy)})
            committed = None
            for line in uploader.stdout:  # state lines until this step is committed (or the machine is lost)
                committed = json.loads(line)["committed"]
                if committed == step:
                    break
        assert uploader.wait(60) == -signal.SIGKILL, point
        bucket = Bucket(url, None)
        marked = [step for step in bucket.steps() if bucket.marker(step) is not None]
        assert marked and all(bucket.verified(step) is not None for step in marked), point  # each one whole
        newest = bucket.newest()[0]
        assert newest == (4 if point == "bucket-uploaded@6" else 6), point

        # A fresh machine resumes from the newest whole checkpoint and trains the steps after it as the
        # uninterrupted run did.
        done = run_train("--config", workspace / "config.yaml", *QUICK_TRAIN, *REFERENCE_RUN, GRACE,
                         f"train.output_model_dir={url}", f"train.local_dir={tmp_path / 'machine2'}")
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"downloaded {url}/checkpoints/global_step{newest}" in done.stderr
        resumed = bucket_losses(store, url)
        assert sorted(resumed) == list(range(newest + 1, STEPS + 1))
        assert resumed == {step: reference[step] for step in resumed}
        assert Bucket(url, None).newest()[0] == STEPS


def test_gcs_run_commits_on_sigterm_and_resumes_exactly_on_a_fresh_machine(reference_run, workspace: Path,
                                                                           tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The drill's first and last legs through gcsfs: a SIGTERM commits a checkpoint to the emulator, a new
    machine fetches it and finishes the run with the uninterrupted run's losses."""
    config = workspace / "config.yaml"
    reference = train_losses(reference_run())
    with open_store("gs", monkeypatch) as store:
        url = f"{store.url}/runs/roundtrip"
        bucket_run = (*REFERENCE_RUN, GRACE, f"train.output_model_dir={url}")
        machine = tmp_path / "machine1"
        process = start_train(config, *bucket_run, f"train.local_dir={machine}")
        wait_for_step(machine, 3, process)  # past the first scheduled save (step 2)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == EXIT_PREEMPTED, stderr[-3000:]
        assert f"the run is mirrored in {url}" in stderr
        committed = [step for step, done in bucket_steps(store, url).items() if done]
        assert committed and max(committed) < STEPS, committed
        shutil.rmtree(machine)

        machine = tmp_path / "machine2"
        done = run_train("--config", config, *QUICK_TRAIN, *bucket_run, f"train.local_dir={machine}")
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"downloaded {url}/checkpoints/global_step{max(committed)}" in done.stderr
        assert bucket_losses(store, url) == reference
        assert bucket_steps(store, url)[STEPS] is True
        assert store.fs.cat_file(f"{url}/checkpoints/latest") == f"global_step{STEPS}".encode()


def test_store_outage_training_goes_on_and_the_bucket_catches_up(dataset_prefix: Path, workspace: Path,
                                                                 tmp_path: Path, monkeypatch) -> None:
    with open_store("s3", monkeypatch) as s3:
        outage(s3, workspace, tmp_path)


def outage(s3, workspace: Path, tmp_path: Path) -> None:
    url = f"{s3.url}/runs/x"
    machine = tmp_path / "machine"
    run = (f"train.output_model_dir={url}", f"train.local_dir={machine}", "train.save_interval=2",
           "train.preempt_grace_seconds=3")
    config = workspace / "config.yaml"
    # The store goes down after the first upload; training goes on and the failures are reported.
    process = start_train(config, "train.train_iters=1000", *run)
    try:
        deadline = time.monotonic() + 300
        while not any(bucket_steps(s3, url).values()):
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()[-3000:]
            time.sleep(0.1)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(process.stderr), daemon=True)
        reader.start()
        s3.stop()
        # The console line says so within a few steps (one quick attempt per try: storage.filesystem).
        down = time.monotonic()
        while not any("failing (" in line for line in lines):  # the console line's note (warnings say "failed")
            assert process.poll() is None and time.monotonic() < down + 120, "".join(lines)[-3000:]
            time.sleep(0.1)
        # Stopping with the store down: a clear message, exit 75, the local staging folder intact.
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
        reader.join(timeout=10)
        stderr = "".join(lines)
        assert process.returncode == EXIT_PREEMPTED, stderr[-3000:]
        assert f"the upload to {url} did not finish within train.preempt_grace_seconds (3 s from the signal)" in stderr
        saved = max(int(p.name.removeprefix("global_step")) for p in (machine / "checkpoints").glob("global_step*"))
        assert (machine / "checkpoints" / f"global_step{saved}" / "complete").is_file()

        # Back up: the same command on the same machine uploads what the bucket missed, then goes on.
        s3.start()
        done = run_train("--config", config, *QUICK_TRAIN, f"train.train_iters={saved + 2}", *run)
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"holds global_step{saved}, newer than the bucket's" in done.stderr
        # The catch-up upload, or the final save's when it came first: a waiting save is superseded by a newer one.
        assert re.search(rf"uploaded global_step({saved}|{saved + 2}) to {re.escape(url)}", done.stderr), \
            done.stderr[-3000:]
        assert bucket_steps(s3, url)[saved + 2] is True
        assert_no_secret([stderr, done.stderr], [tmp_path], s3, url)
    finally:
        if process.poll() is None:  # a failed check must not leave a 1000-step run behind
            process.kill()
            process.wait()


def test_a_sigterm_save_that_cannot_fit_the_grace_is_skipped_and_the_resume_step_said(
        dataset_prefix: Path, workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No grace at all (train.preempt_grace_seconds=0): the last periodic save's measured time does not fit, so
    the step a SIGTERM stops at is not saved; the console says so, and which checkpoint the run resumes from."""
    with open_store("s3", monkeypatch) as s3:
        url = f"{s3.url}/runs/nograce"
        machine = tmp_path / "machine"
        process = start_train(workspace / "config.yaml", "train.train_iters=1000", "train.save_interval=3",
                              "train.preempt_grace_seconds=0", f"train.output_model_dir={url}",
                              f"train.local_dir={machine}")
        wait_for_step(machine, 4, process)  # past the save at step 3: its time is known
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=300)
    assert process.returncode == EXIT_PREEMPTED, stderr[-3000:]
    assert re.search(r"saved \S+global_step3 in \d+\.\d s", stderr), stderr[-3000:]
    stopped, resumed = map(int, re.search(r"SIGTERM: stopped at step (\d+), checkpoint at step (\d+)",
                                          stderr).groups())
    saved = [step for step, _ in complete_checkpoints(machine / "checkpoints")]
    assert stopped > resumed == max(saved) and resumed % 3 == 0, (stopped, saved)
    assert re.search(rf"SIGTERM: step {stopped} is not saved: a save takes ~\d+\.\d s \(the last one\) and "
                     r"0\.0 s of train\.preempt_grace_seconds=0 are left", stderr), stderr[-3000:]
    assert f"the upload to {url} did not finish within train.preempt_grace_seconds (0 s from the signal)" in stderr


def test_a_committed_folder_exists_only_once_its_record_is_written_last(store, tmp_path: Path) -> None:
    """The one protocol stage outputs and checkpoints share (gptpipe.committed), on the real server: a record
    that would vouch for a missing file is refused; a file of another size or a withdrawn record makes the
    folder unusable; a fetch lands whole files only and is redone when the record changes, same sizes or not."""
    from gptpipe.committed import CommittedFolder

    local = tmp_path / "local"
    (local / "sub").mkdir(parents=True)
    (local / "a.bin").write_bytes(b"a" * 100)
    (local / "sub" / "b.txt").write_bytes(b"first")
    files = {"a.bin": 100, "sub/b.txt": 5}
    folder = CommittedFolder(f"{store.scheme}://{store.bucket}/folder", "record.json")
    folder.put(local, ["a.bin"])
    with pytest.raises(OSError, match="sub/b.txt is missing"):
        folder.commit(b"first", files)
    assert folder.read_record() is None
    folder.put(local, ["sub/b.txt"])
    folder.commit(b"first", files)
    assert folder.read_record() == b"first" and folder.problems(files) == []
    assert folder.problems({"../escape": 1}) == [f"the record lists '../escape', a path outside {folder.url}"]

    target, kept = tmp_path / "copy", tmp_path / "copy.record"
    (target / "stale").parent.mkdir(parents=True)
    (target / "stale").write_text("another commit's file")
    assert folder.fetch(files, target, record=b"first", keep=kept, clean=True) == 105
    assert sorted(p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file()) == ["a.bin", "sub/b.txt"]
    assert kept.read_bytes() == b"first"
    assert folder.fetch(files, target, record=b"first", keep=kept) == 0  # the same commit: the copy serves

    (local / "sub" / "b.txt").write_bytes(b"again")  # redone: same sizes, another record
    folder.withdraw()
    assert folder.read_record() is None
    folder.put(local, ["sub/b.txt"])
    folder.commit(b"second", files)
    assert folder.fetch(files, target, record=b"second", keep=kept) == 105
    assert (target / "sub" / "b.txt").read_bytes() == b"again" and kept.read_bytes() == b"second"

    store.fs.pipe_file(f"{store.bucket}/folder/a.bin", b"short")
    assert folder.problems(files) == [f"{folder.url}/a.bin has 5 bytes, its record lists 100"]


def test_an_upload_to_s3_goes_in_concurrent_parts_and_each_file_lands_whole(store, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """committed.put hands s3fs its part options (storage.upload_options): a file of three parts or more reaches
    the real S3 server as one multipart upload (its ETag counts the parts), a small one as one PUT; gcsfs and a
    local folder get none of them. Every file is committed and fetched back byte for byte."""
    import fsspec

    from gptpipe import storage
    from gptpipe.committed import CommittedFolder

    monkeypatch.setattr(storage, "UPLOAD_PART", 5 << 20)  # S3's smallest part: a 12 MiB file is 3 parts
    local = tmp_path / "local"
    local.mkdir()
    payload = {"shard.pt": os.urandom((12 << 20) + 1), "small.json": b'{"step": 2}'}
    for name, data in payload.items():
        (local / name).write_bytes(data)
    files = {name: len(data) for name, data in payload.items()}
    folder = CommittedFolder(f"{store.scheme}://{store.bucket}/parts", "record.json")
    folder.put(local, list(files))
    folder.commit(b"parts", files)
    if store.scheme == "s3":
        etags = {name: store.fs.info(f"{store.bucket}/parts/{name}")["ETag"].strip('"') for name in files}
        assert etags["shard.pt"].endswith("-3") and "-" not in etags["small.json"], etags
    else:
        assert storage.upload_options(folder.fs, list(files.values())) == {}
    assert folder.fetch(files, tmp_path / "copy") == sum(files.values())
    assert {name: (tmp_path / "copy" / name).read_bytes() for name in files} == payload
    assert storage.upload_options(fsspec.filesystem("file"), [1 << 30]) == {}


def test_s3_upload_options_keep_their_memory_bound_and_s3s_part_limit() -> None:
    """At most UPLOAD_PARTS_IN_FLIGHT parts in flight (files at once x parts at once, each a part of memory),
    whatever the number of files; a file too large for 10,000 parts of UPLOAD_PART gets larger parts."""
    from gptpipe import storage

    s3 = storage.filesystem("s3://bucket/x", "http://127.0.0.1:9")
    for count in range(1, 20):
        options = storage.upload_options(s3, [64 << 20] * count)
        assert options["chunksize"] == storage.UPLOAD_PART and options["max_concurrency"] >= 2
        assert options["batch_size"] * options["max_concurrency"] <= storage.UPLOAD_PARTS_IN_FLIGHT, count
    assert storage.upload_options(s3, [1])["max_concurrency"] == storage.UPLOAD_PARTS_IN_FLIGHT
    huge = 200 << 30  # a 200 GiB stage-2 .bin
    chunk = storage.upload_options(s3, [1, huge])["chunksize"]
    assert chunk > storage.UPLOAD_PART and -(-huge // chunk) <= storage.S3_MAX_PARTS


def test_a_second_run_on_a_live_bucket_run_folder_exits_and_the_lease_goes_with_the_first(
        reference_run, workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No file lock reaches a bucket: the run's lease.json does. A second run on the same URL (another staging
    folder, as another machine) exits 2 naming the holder while the first lives (paused here); the first then
    finishes with the uninterrupted run's losses and its lease leaves the bucket with it."""
    with open_store("s3", monkeypatch) as store:
        url = f"{store.url}/runs/leased"
        first = start_train(workspace / "config.yaml", *REFERENCE_RUN, f"train.output_model_dir={url}",
                            f"train.local_dir={tmp_path / 'one'}", GRACE)
        wait_for_step(tmp_path / "one", 2, first)
        first.send_signal(signal.SIGSTOP)
        try:
            second = run_train("--config", workspace / "config.yaml", *QUICK_TRAIN, *REFERENCE_RUN,
                               f"train.output_model_dir={url}", f"train.local_dir={tmp_path / 'two'}")
        finally:
            first.send_signal(signal.SIGCONT)
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"{url} is in use by another gptpipe run (host " in second.stderr
        assert f"pid {first.pid}," in second.stderr
        assert first.wait() == 0
        assert bucket_losses(store, url) == train_losses(reference_run())
        store.fs.invalidate_cache()
        assert not store.fs.exists(f"{url}/lease.json")
