"""A bucket run on two "nodes" without a shared disk: two single-rank nodes on 127.0.0.1 (forked with the variables
torchrun gives the ranks of `--nnodes 2`), each with its own temp folder, so each stages and uploads its own ranks'
files; rank 0 commits a checkpoint only after the other node's marker. Wiping both staging folders and rerunning
resumes exactly. The launchers' own multi-node paths are tested through 3_train_multi_node.sh."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (QUICK_TRAIN, REPO, bucket_losses, bucket_steps, open_store, run_train, train_env, train_losses,
                      wait_for_step)
from prewarmed import Forked, torchrun_env

from gptpipe.ports import free_port

ZERO = ("train.zero_stage=2",)


def _logged(node_tmp: Path, step: int) -> bool:
    """Whether the node's staging run folder (under its TMPDIR) has logged `step`. The run's other temporary
    folders there come and go while the glob walks them: one gone mid-walk is a "not yet"."""
    try:
        return any(f'"step": {step},' in m.read_text() for m in node_tmp.glob("*/*/*/metrics.jsonl"))
    except FileNotFoundError:
        return False


def run_two_nodes(config: Path, tmp: Path, *overrides: str, stop_after: int | None = None) -> list[str]:
    """`gptpipe train` on two single-rank nodes, each with TMPDIR tmp/node{K}; with `stop_after`, both get
    SIGTERM once that step is logged (a preemption). Returns their stderr. The nodes share no folder: each
    fetches nothing but its own data and builds its dataset indices itself."""
    port = free_port()
    nodes = []
    for node in (0, 1):
        (tmp / f"node{node}").mkdir(parents=True, exist_ok=True)
        env = {**train_env(2), **torchrun_env(node, 2, 1, port), "TMPDIR": str(tmp / f"node{node}")}
        nodes.append(Forked(["train", "--config", config, *QUICK_TRAIN, *ZERO, *overrides], env))
    if stop_after is not None:
        deadline = time.monotonic() + 600
        while not _logged(tmp / "node0", stop_after):
            assert all(n.poll() is None for n in nodes) and time.monotonic() < deadline, "a node stopped early"
            time.sleep(0.05)
        for process in nodes:
            process.send_signal(signal.SIGTERM)
    errors = [process.communicate(timeout=900)[1] for process in nodes]
    expected = 75 if stop_after is not None else 0
    assert [node.returncode for node in nodes] == [expected, expected], "\n".join(
        f"node {k}:\n{e[-3000:]}" for k, e in enumerate(errors))
    return errors


def staged(tmp: Path, node: int) -> Path:
    """The node's staging folder (the default one, under its TMPDIR)."""
    return next((tmp / f"node{node}" / f"gptpipe-runs-{os.getuid()}").glob("*/run"))


def test_nodes_without_shared_disk_upload_their_ranks_and_resume_exactly(dataset_prefix: Path, workspace: Path,
                                                                        tmp_path: Path, monkeypatch) -> None:
    config = workspace / "config.yaml"
    run = ("train.train_iters=6", "train.save_interval=4")
    full = run_train("--config", config, *QUICK_TRAIN, *ZERO, *run, f"train.output_model_dir={tmp_path / 'full'}",
                     ranks=2)
    assert full.returncode == 0, full.stderr[-3000:]
    reference = train_losses(tmp_path / "full")

    with open_store("s3", monkeypatch) as store:
        url = f"{store.url}/runs/run"
        # Preempted after step 2: each node saves, uploads its part, and rank 0 commits the checkpoint.
        machines = tmp_path / "machines1"
        first = run_two_nodes(config, machines, *run, f"train.output_model_dir={url}", stop_after=2)
        assert "the run is mirrored in" in first[0]
        saved = max(step for step, done in bucket_steps(store, url).items() if done)
        assert f"uploaded node 1's part of global_step{saved}" in first[1]
        marker = json.loads(store.fs.cat_file(f"{url}/checkpoints/global_step{saved}/complete"))
        # rank 1's ZeRO-2 shard and RNG state came from node 1's disk; the shared model states from node 0's
        assert {"rng_state_rank1.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt", "rng_state_rank0.pt",
                "mp_rank_00_model_states.pt"} <= set(marker["files"])
        assert not (staged(machines, 1) / "checkpoints" / f"global_step{saved}").exists()  # never whole there

        # Both machines are gone; new ones resume from the bucket, each fetching what its ranks read.
        machines = tmp_path / "machines2"
        second = run_two_nodes(config, machines, *run, f"train.output_model_dir={url}")
        for stderr in second:
            assert f"downloaded {url}/checkpoints/global_step{saved}" in stderr
        resumed = staged(machines, 1) / "checkpoints" / f"global_step{saved}"
        assert (resumed / "rng_state_rank1.pt").is_file() and (resumed / "mp_rank_00_model_states.pt").is_file()
        assert not (resumed / "rng_state_rank0.pt").exists()
        assert bucket_losses(store, url) == reference
        assert bucket_steps(store, url)[6] is True


def test_a_one_rank_run_resumes_on_two_nodes_without_shared_disk(dataset_prefix: Path, workspace: Path,
                                                                 tmp_path: Path, monkeypatch) -> None:
    """Preempted on one machine, resumed on two that share no disk: the checkpoint's optimizer states were cut for
    one rank, so each node fetches every rank's files and converts them to DeepSpeed's universal checkpoint on its
    own disk; the curve is the uninterrupted two-rank run's, within fp32 reduction-order noise."""
    config = workspace / "config.yaml"
    run = ("train.train_iters=4", "train.save_interval=100")
    full = run_train("--config", config, *QUICK_TRAIN, *ZERO, *run, f"train.output_model_dir={tmp_path / 'full'}",
                     ranks=2)
    assert full.returncode == 0, full.stderr[-3000:]
    with open_store("s3", monkeypatch) as store:
        url = f"{store.url}/runs/run"
        machine = tmp_path / "machine"
        machine.mkdir()
        first = Forked(["train", "--config", config, *QUICK_TRAIN, *ZERO, *run, f"train.output_model_dir={url}"],
                       {**train_env(), "TMPDIR": str(machine)})
        deadline = time.monotonic() + 600
        while not _logged(machine, 1):
            assert first.poll() is None and time.monotonic() < deadline, "the first run stopped early"
            time.sleep(0.05)
        first.send_signal(signal.SIGTERM)
        _, stderr = first.communicate(timeout=300)
        assert first.returncode == 75, stderr[-3000:]
        saved = max(step for step, done in bucket_steps(store, url).items() if done)
        assert saved < 4

        second = run_two_nodes(config, tmp_path / "machines", *run, f"train.output_model_dir={url}")
        for node, stderr in enumerate(second):
            resumed = staged(tmp_path / "machines", node) / "checkpoints"
            assert (resumed / f"global_step{saved}" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").is_file()
            assert not list(resumed.glob(".tmp-universal-*"))  # removed once loaded
        assert f"global_step{saved} was saved by 1 rank(s), this run has 2: converted" in second[0]
        assert bucket_losses(store, url) == pytest.approx(train_losses(tmp_path / "full"), rel=1e-4)
        assert bucket_steps(store, url)[4] is True


def test_two_ranks_on_a_node_keep_a_sigterm_upload_alive_until_it_commits(dataset_prefix: Path, workspace: Path,
                                                                         tmp_path: Path, monkeypatch) -> None:
    """2 ranks on one node (3_train_multi_node.sh, its deepspeed launcher) and a bucket run folder: on SIGTERM
    rank 1 has nothing to upload, and a launcher stops the other ranks of a node once one exits. The store is
    down for the first seconds after the signal, so rank 0's upload is still retrying when rank 1 is done
    saving: rank 0 must still commit the checkpoint, and the script exit 75."""
    script = None
    with open_store("s3", monkeypatch) as store:
        try:
            url = f"{store.url}/runs/run"
            hostfile = tmp_path / "hostfile"
            hostfile.write_text("localhost slots=2\n")
            env = {**train_env(2), "HOSTFILE": str(hostfile), "MASTER_PORT": str(free_port()), "PYTHON": sys.executable,
                   "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
            script = subprocess.Popen(
                ["bash", str(REPO / "3_train_multi_node.sh"), "--config", str(workspace / "config.yaml"), *QUICK_TRAIN,
                 "train.train_iters=1000", "train.save_interval=1000", "train.preempt_grace_seconds=120",
                 f"train.output_model_dir={url}", f"train.local_dir={tmp_path / 'staging'}"],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
            wait_for_step(tmp_path / "staging", 1, script)
            store.stop()
            script.send_signal(signal.SIGTERM)
            time.sleep(8)  # the deepspeed launcher polls its ranks every second
            store.start()
            _, stderr = script.communicate(timeout=300)
            assert script.returncode == 75, stderr[-3000:]
            assert "the run is mirrored in" in stderr
            saved = bucket_steps(store, url)
            assert len(saved) == 1 and all(saved.values()), saved
        finally:
            if script is not None:  # ranks a failed script left behind
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(script.pid, signal.SIGKILL)
