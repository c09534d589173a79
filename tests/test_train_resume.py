"""Faults: a run killed with SIGKILL, also inside a save, resumes to the same per-step losses as an uninterrupted
one; SIGTERM saves within one step and exits 75; non-finite steps are skipped, counted, and stop the run."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from conftest import (QUICK, QUICK_TRAIN, REFERENCE_RUN, REFERENCE_STEPS, metrics, run_train, start_train, train_env,
                      train_losses, wait_for_step)
from prewarmed import Forked

from gptpipe.artifacts import EXIT_PREEMPTED
from gptpipe.runtime.checkpoint import COMPLETE_MARKER, LATEST, STATE, complete_checkpoints
from gptpipe.runtime.metrics_rows import TrainRow

STEPS = REFERENCE_STEPS


# bf16 at ZeRO-1 (the GPU default) runs DeepSpeed's BF16_Optimizer, whose checkpoint is a format of its own.
@pytest.mark.parametrize("zero_stage,precision", [(1, "fp32"), (3, "fp32"), (1, "bf16")])
def test_sigkilled_run_resumes_with_identical_losses(reference_run, workspace: Path, tmp_path: Path,
                                                     zero_stage: int, precision: str) -> None:
    config = workspace / "config.yaml"
    common = (*REFERENCE_RUN, f"train.zero_stage={zero_stage}", f"train.precision={precision}")
    reference = train_losses(reference_run(zero_stage, precision))
    assert sorted(reference) == list(range(1, STEPS + 1))

    killed_dir = tmp_path / "killed"
    process = start_train(config, *common, f"train.output_model_dir={killed_dir}")
    wait_for_step(killed_dir, 3, process)
    process.send_signal(signal.SIGKILL)  # no handler runs: whatever was half-written stays half-written
    process.wait()
    saved = [step for step, _ in complete_checkpoints(killed_dir / "checkpoints")]
    assert saved and max(saved) < STEPS

    resumed = run_train("--config", config, *QUICK_TRAIN, *common, f"train.output_model_dir={killed_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {killed_dir / 'checkpoints'}/global_step{max(saved)}" in resumed.stderr
    assert train_losses(killed_dir) == reference  # bit-identical, also for the steps the killed run had done

    if (zero_stage, precision) != (1, "fp32"):
        return
    # A finished run, run again, evaluates once more and leaves its final checkpoint as it was (the finished
    # state is read from the run record, the same for every ZeRO stage: checked once).
    final = complete_checkpoints(killed_dir / "checkpoints")[-1][1]
    assert json.loads((final / STATE).read_text())["finished"] is True
    saved_ns = (final / COMPLETE_MARKER).stat().st_mtime_ns
    again = run_train("--config", config, *QUICK_TRAIN, *common, f"train.output_model_dir={killed_dir}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"finished {STEPS} steps" in again.stderr and "[train] saved" not in again.stderr
    assert (final / COMPLETE_MARKER).stat().st_mtime_ns == saved_ns


def killed_at(point: str, *argv: object) -> None:
    """`gptpipe train argv` killed (SIGKILL) at `point` of checkpoint.py's save or prune order (GPTPIPE_KILL_AT)."""
    done = Forked(["train", *argv], {**train_env(), "GPTPIPE_KILL_AT": point}).finish(600)
    assert done.returncode == -signal.SIGKILL, (point, done.returncode, done.stderr[-3000:])


def assert_resumable(checkpoints: Path) -> None:
    """What a kill may leave: every marked checkpoint whole (its DeepSpeed files and the run state), and `latest`
    naming a marked one."""
    complete = complete_checkpoints(checkpoints)
    for _, folder in complete:
        assert (folder / STATE).is_file() and any(folder.glob("*model_states.pt")), sorted(folder.iterdir())
    if (checkpoints / LATEST).is_file():
        assert (checkpoints / LATEST).read_text().strip() in {f.name for _, f in complete}


# Where a REFERENCE_RUN (a checkpoint every 2 steps, keep 3) is killed: step 2's save with its folder in place but
# unmarked; step 4's marked but `latest` not moved; step 8's save pruning step 2 with its marker gone, its files not.
@pytest.mark.parametrize("point", ["save-new-in@2", "save-marked@4", "prune-unmarked@2"])
def test_a_kill_inside_a_save_leaves_a_checkpoint_to_resume_from(point: str, reference_run, workspace: Path,
                                                                 tmp_path: Path) -> None:
    common = ("--config", workspace / "config.yaml", *QUICK_TRAIN, *REFERENCE_RUN, f"train.output_model_dir={tmp_path}")
    killed_at(point, *common)
    assert_resumable(tmp_path / "checkpoints")
    resumed = run_train(*common)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert train_losses(tmp_path) == train_losses(reference_run())
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize("point", ["save-unmarked-old@6", "save-old-aside@6"])
def test_a_kill_inside_a_re_save_keeps_a_complete_checkpoint(point: str, dataset_prefix: Path, workspace: Path,
                                                             tmp_path: Path) -> None:
    """A re-save at the same step (a lowered train_iters: the run resumes at its new last step and saves it as
    finished): killed with the old folder's marker gone, or with the old folder moved aside, the run still has a
    whole checkpoint, the one before, and finishes when run again."""
    common = ("--config", workspace / "config.yaml", *QUICK_TRAIN, *REFERENCE_RUN, f"train.output_model_dir={tmp_path}")
    checkpoints = tmp_path / "checkpoints"
    killed_at(f"save-new-in@{REFERENCE_STEPS}", *common)  # steps 2, 4, 6 saved; the final save cut short
    assert [step for step, _ in complete_checkpoints(checkpoints)] == [2, 4, 6]
    lowered = (*common, "train.train_iters=6")
    killed_at(point, *lowered)
    assert_resumable(checkpoints)
    assert [step for step, _ in complete_checkpoints(checkpoints)] == [2, 4]
    done = run_train(*lowered)
    assert done.returncode == 0, done.stderr[-3000:]
    final = complete_checkpoints(checkpoints)[-1][1]
    assert final.name == "global_step6" and json.loads((final / STATE).read_text())["finished"] is True
    assert_resumable(checkpoints)


def test_sigkilled_run_with_dropout_resumes_to_the_same_curve(dataset_prefix: Path, workspace: Path,
                                                              tmp_path: Path) -> None:
    """gpt2 with dropout, an evaluation with sample generation at every save, and log windows the checkpoints
    cut in two (steps 2 and 4 inside the windows 1-3 and 4-6): the resumed run logs the uninterrupted run's
    rows, its partial window carried over in the checkpoint."""
    config = workspace / "config.yaml"
    common = (f"train.train_iters={STEPS}", "train.save_interval=2", "train.eval_interval=2", "train.log_interval=3",
              "model.arch=gpt2", "model.dropout=0.1", "train.sample_prompts=[日本語の]", "train.sample_tokens=4")

    def rows(run: Path) -> list[dict]:
        return [{"step": r.step, "loss": r.loss, "grad_norm": r.grad_norm} for r in metrics(run, TrainRow)]

    full = run_train("--config", config, *QUICK_TRAIN, *common, f"train.output_model_dir={tmp_path / 'full'}")
    assert full.returncode == 0, full.stderr[-3000:]
    reference = rows(tmp_path / "full")
    assert [r["step"] for r in reference] == [3, 6, 8]
    assert "sample | 日本語の" in full.stderr

    killed_dir = tmp_path / "killed"
    process = start_train(config, *common, f"train.output_model_dir={killed_dir}")
    wait_for_step(killed_dir, 3, process)
    process.send_signal(signal.SIGKILL)
    process.wait()
    saved = [step for step, _ in complete_checkpoints(killed_dir / "checkpoints")]
    assert saved and max(saved) < 6  # step 2 or 4: inside a log window

    resumed = run_train("--config", config, *QUICK_TRAIN, *common, f"train.output_model_dir={killed_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {killed_dir / 'checkpoints'}/global_step{max(saved)}" in resumed.stderr
    done = rows(killed_dir)  # step 3 twice when the run resumed from step 2
    assert {r["step"] for r in done} == {3, 6, 8} and all(r in reference for r in done)


def test_sigterm_saves_within_one_step_and_exits_75(dataset_prefix: Path, workspace: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    # 4 micro-batches per step: the signal is honoured between micro-batches, not only at step ends.
    process = start_train(workspace / "config.yaml", "train.train_iters=1000", "train.save_interval=1000",
                          "train.micro_batch_size=2", f"train.output_model_dir={run}")
    wait_for_step(run, 2, process)
    logged = max(train_losses(run))
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == EXIT_PREEMPTED, stderr[-3000:]
    (step, folder), = complete_checkpoints(run / "checkpoints")
    assert logged <= step <= logged + 1  # the step in flight is finished or abandoned, nothing later
    assert json.loads((folder / STATE).read_text())["consumed_samples"] == step * QUICK.global_batch_size
    assert f"SIGTERM: stopped at step {step}, checkpoint at step {step}" in stderr


def test_non_finite_steps_are_skipped_counted_and_stop_the_run(dataset_prefix: Path, workspace: Path,
                                                               tmp_path: Path) -> None:
    run = tmp_path / "run"
    # An absurd learning rate: after the first update every loss and gradient is inf/NaN.
    done = run_train("--config", workspace / "config.yaml", *QUICK_TRAIN, "train.lr=1e30", "train.min_lr=1e29",
                     "train.warmup_fraction=0", "train.max_bad_steps=3", "train.train_iters=20",
                     "train.save_interval=1", f"train.output_model_dir={run}")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "3 non-finite steps in a row" in done.stderr
    rows = metrics(run, TrainRow)
    assert rows[-1].skipped_steps == 3 and rows[-1].loss is None
    # Only the finite state after step 1 was saved; no checkpoint of a non-finite state exists.
    assert [step for step, _ in complete_checkpoints(run / "checkpoints")] == [1]
    assert [p.name for p in (run / "checkpoints").glob("global_step*")] == ["global_step1"]
