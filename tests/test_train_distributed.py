"""Two CPU ranks (gloo) with ZeRO-2 and ZeRO-3, through the launchers users run: the same global batch
split over two ranks gives the losses of one rank, and every rank's shard is checkpointed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import QUICK_TRAIN, REPO, run_train, train_env, train_losses, wait_for_step

from gptpipe.ports import free_port

STEPS = 4


@pytest.fixture(scope="module")
def one_rank(dataset_prefix: Path, workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    run = tmp_path_factory.mktemp("one-rank")
    done = run_train("--config", workspace / "config.yaml", *QUICK_TRAIN, f"train.train_iters={STEPS}",
                     f"train.output_model_dir={run}")
    assert done.returncode == 0, done.stderr[-3000:]
    losses = train_losses(run)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def test_zero2_two_ranks_via_3_train_node1(one_rank: dict[int, float], workspace: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    env = {**train_env(2), "NPROC": "2", "PYTHON": sys.executable}
    env.pop("OMP_NUM_THREADS")  # the script sets it: cores / ranks
    done = subprocess.run(["bash", str(REPO / "3_train_node1.sh"), "--config", str(workspace / "config.yaml"),
                           *QUICK_TRAIN, f"train.train_iters={STEPS}", "train.zero_stage=2",
                           f"train.output_model_dir={run}"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "× 2 data-parallel ranks" in done.stderr
    assert train_losses(run) == pytest.approx(one_rank, rel=1e-4)  # same samples, gradients averaged over ranks
    folder = run / "checkpoints" / f"global_step{STEPS}"
    assert len(list(folder.glob("*optim_states.pt"))) == 2 and len(list(folder.glob("rng_state_rank*.pt"))) == 2


def test_two_ranks_sigterm_to_3_train_node1_saves_and_exits_75(dataset_prefix: Path, workspace: Path,
                                                              tmp_path: Path) -> None:
    """torchrun turns the ranks' 75 into 1; the script must still say "saved, run again"."""
    import signal

    run = tmp_path / "run"
    env = {**train_env(2), "NPROC": "2", "PYTHON": sys.executable}
    process = subprocess.Popen(["bash", str(REPO / "3_train_node1.sh"), "--config", str(workspace / "config.yaml"),
                                *QUICK_TRAIN, "train.train_iters=1000", "train.save_interval=1000",
                                f"train.output_model_dir={run}"], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    wait_for_step(run, 1, process)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 75, stderr[-3000:]
    assert "SIGTERM: stopped at step" in stderr and len(list((run / "checkpoints").glob("global_step*"))) == 1


def test_zero3_two_ranks_via_3_train_multi_node(one_rank: dict[int, float], workspace: Path, tmp_path: Path) -> None:
    """The hostfile script (deepspeed launcher) as each node runs it without ssh, here with one host."""
    run = tmp_path / "run"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    env = {**train_env(2), "HOSTFILE": str(hostfile), "MASTER_PORT": str(free_port()), "PYTHON": sys.executable,
           "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    done = subprocess.run(["bash", str(REPO / "3_train_multi_node.sh"), "--config", str(workspace / "config.yaml"),
                           *QUICK_TRAIN, f"train.train_iters={STEPS}", "train.zero_stage=3",
                           f"train.output_model_dir={run}"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "× 2 data-parallel ranks" in done.stderr
    assert train_losses(run) == pytest.approx(one_rank, rel=1e-4)
    folder = run / "checkpoints" / f"global_step{STEPS}"
    assert len(list(folder.glob("zero_pp_rank_*_model_states.pt"))) == 2  # parameters sharded over both ranks


def test_two_nodes_without_ssh_sigterm_to_3_train_multi_node_saves_and_exits_75(dataset_prefix: Path, workspace: Path,
                                                                                tmp_path: Path) -> None:
    """Each node runs the script with its NODE_RANK (here two "nodes" on 127.0.0.1, one rank each); a SIGTERM
    to both must end both scripts with the ranks' 75, not with the launcher's death by the same signal."""
    import signal
    import time

    run = tmp_path / "run"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    port = free_port()
    scripts = []
    for node in (0, 1):
        env = {**train_env(2), "HOSTFILE": str(hostfile), "MASTER_PORT": str(port), "PYTHON": sys.executable,
               "NODE_RANK": str(node), "MASTER_ADDR": "127.0.0.1"}
        scripts.append(subprocess.Popen(
            ["bash", str(REPO / "3_train_multi_node.sh"), "--config", str(workspace / "config.yaml"), *QUICK_TRAIN,
             "train.train_iters=1000", "train.save_interval=1000", f"train.output_model_dir={run}"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True))
    deadline = time.monotonic() + 300
    while not train_losses(run):
        assert all(s.poll() is None for s in scripts) and time.monotonic() < deadline, scripts[0].stderr.read()[-3000:]
        time.sleep(0.05)
    for script in scripts:
        os.killpg(script.pid, signal.SIGTERM)  # the script's whole process group, as a job scheduler may
    errors = [script.communicate(timeout=300)[1] for script in scripts]
    codes = [s.returncode for s in scripts]
    assert codes == [75, 75], f"{codes}\n" + "\n".join(e[-3000:] for e in errors)
    assert "SIGTERM: stopped at step" in errors[0] and len(list((run / "checkpoints").glob("global_step*"))) == 1


def test_multi_node_script_refuses_a_missing_hostfile(tmp_path: Path) -> None:
    env = {**train_env(), "HOSTFILE": str(tmp_path / "nope")}
    done = subprocess.run(["bash", str(REPO / "3_train_multi_node.sh")], env=env, capture_output=True, text=True)
    assert done.returncode == 2 and f"hostfile {tmp_path / 'nope'} not found" in done.stderr
