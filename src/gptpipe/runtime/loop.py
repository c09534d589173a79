"""The training loop of stage 3 (`gptpipe train`) and stage 7 (`gptpipe finetune`): a thin loop over train_step.

Exit codes: 0 finished; 1 failed (non-finite weights, or train.max_bad_steps non-finite steps in a row); 2
refused before starting; 75 stopped by SIGTERM/SIGINT after saving a checkpoint (run the same command again).
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from gptpipe.config.core import to_plain
from gptpipe.lock import FolderLock
from gptpipe.log import get_logger
from gptpipe.stage import StageInputError
from gptpipe.artifacts import EXIT_FAILED, EXIT_OK, EXIT_PREEMPTED
from gptpipe.storage import StorageConfig, is_url
from gptpipe.runtime import checkpoint
from gptpipe.runtime.config import LoopConfig
from gptpipe.runtime.engine import Dist, StepResult, StopFlag, forward_loss, setup_distributed, train_step
from gptpipe.runtime.logging import RunLogger
from gptpipe.runtime.model import ExpertBias
from gptpipe.runtime.mirror import open_mirror
from gptpipe.runtime.uploader import SIDE_SYNC_SECONDS


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run_ranks(work: Callable[[Dist], int]) -> int:
    """Join the process group, run `work` on this rank and return its exit code; each node's first local rank
    also writes it to $GPTPIPE_EXIT_FILE, because torchrun reports any rank's non-zero exit as 1 and the
    launch scripts (scripts/launch_ranks.sh, 3_train_multi_node.sh, examples/slurm_train.sbatch) read the real
    one (2, 75) from there."""
    dist = setup_distributed()
    code = work(dist)
    if torch.distributed.is_initialized():
        # Left to interpreter exit, the process group's threads were torn down in no set order, and a rank
        # that had finished its work could still abort ("terminate called without an active exception").
        torch.distributed.destroy_process_group()
    exit_file = os.environ.get("GPTPIPE_EXIT_FILE")
    if exit_file and dist.local_rank == 0:
        Path(exit_file).write_text(str(code), encoding="utf-8")
    return code


@dataclass
class LogWindow:
    """The steps since the previous log step, as a train line reports them."""

    loss: float  # mean of the finite per-step losses, averaged over ranks (nan: none was finite)
    lr: float  # the rate the log step used
    grad_norm: float | None
    seconds: float  # training time only: evaluations and saves are not counted
    steps: int
    last: StepResult  # the log step's own result (its aux loss)

    def row(self) -> dict[str, Any]:
        return {"loss": self.loss, "lr": self.lr, "grad_norm": self.grad_norm}

    def line(self) -> str:
        norm = "-" if self.grad_norm is None else format(self.grad_norm, ".3f")
        return f"loss {self.loss:.4f}  lr {self.lr:.3e}  grad-norm {norm}"


class TrainLoop(ABC):
    """One training process: resume from the newest complete checkpoint (of the configured model), signal
    handlers, optimizer steps, the loss window all-reduced and logged every log_interval steps, non-finite
    steps skipped and counted, validation and checkpoints at their intervals, the stop agreed across ranks,
    the final validation and save, and the exit code.

    A subclass's __init__ calls this one first (it cleans the checkpoint folder and seeds every RNG), then
    sets `engine` and `loss_kwargs` (build_engine's), `hf_config` and `steps`, and fills in:

        batches()                this rank's micro-batches of the current step
        forward(engine, batch)   (loss, aux loss) of one micro-batch (default: the pretraining LM loss)
        log_train(window)        the train row and console line of a log step
        validate()               validation; True asks for a checkpoint of this step now (a new best)
        begin()                  anything to show or do before the first step (default: nothing)
        checkpoint_state()       the stage's part of gptpipe_state.json; restore(state) reads it back on resume
        finish()                 the last word of a finished run
    """

    name = "train"  # the logger: status lines read "[train] ..."
    engine: Any
    loss_kwargs: dict[str, Any]  # build_engine's: what every forward with labels passes (Liger's fused loss)
    hf_config: Any  # the transformers config; a checkpoint of another model is refused on resume
    steps: int  # optimizer steps of the whole run
    balance: ExpertBias | None = None  # a selection bias that balances the experts (model.moe_balance bias)

    def __init__(self, config: Any, train_cfg: LoopConfig, dist: Dist, ds_config: dict[str, Any],
                 wandb_block: dict[str, Any]):
        self.config, self.train_cfg, self.dist, self.wandb_block = config, train_cfg, dist, wandb_block
        # A run folder in a bucket trains in a local staging folder that the mirror keeps in step with the bucket.
        storage = getattr(config, "storage", None) or StorageConfig()
        self.mirror = open_mirror(train_cfg, storage, dist) if is_url(train_cfg.output_model_dir) else None
        self.run_dir: Path = self.mirror.local if self.mirror else train_cfg.output_model_dir
        self.ckpt_root = self.run_dir / "checkpoints"
        self.status = get_logger(self.name)
        # One writer per run folder: a second run on it exits here, before it touches a file.
        self.lock = FolderLock(self.run_dir, f"gptpipe {self.name}") if dist.is_main else None
        if self.mirror:  # collective: the bucket's newest complete checkpoint, before anyone looks for one
            self.mirror.restore()
        if dist.is_main:
            checkpoint.remove_stale(self.ckpt_root)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=2) + "\n")
            if self.mirror:  # the record of this run beside its checkpoints, in the bucket
                (self.run_dir / f"{self.name}.resolved.yaml").write_text(
                    yaml.safe_dump(to_plain(config), allow_unicode=True, sort_keys=False), encoding="utf-8")
        seed_everything(train_cfg.seed)
        self.step, self.skipped = 0, 0
        self.finished = False  # the checkpoint resumed from was saved after the final evaluation
        self.save_seconds: float | None = None  # the last save's stall (its wall time on this rank)
        self.last_loss: torch.Tensor | None = None  # the last finished step's loss, on device
        # the rate of the last finished step: checkpoints record it, so an export tells a continued run where the
        # decay ended (stage 4's final_lr, the re-warm's start)
        self.last_lr: float | None = None
        # The log window: per-step losses since the last log step (on device) and the training seconds they
        # took before window_start; both go into a checkpoint, so a resumed run logs the same rows.
        self.window: list[torch.Tensor] = []
        self.window_seconds = 0.0
        self.window_start = self.paused_at = time.perf_counter()  # paused_at: when evaluating/saving began

    # --- the stage's part -------------------------------------------------------------------------------
    @abstractmethod
    def batches(self) -> Iterator[dict[str, Any]]:
        """This rank's micro-batches of the step about to run."""

    def forward(self, engine: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(loss to backpropagate, aux loss or None) of one micro-batch."""
        return forward_loss(engine, batch, **self.loss_kwargs)

    def after_step(self) -> None:
        """Called once a step has finished (e.g. to count the samples consumed)."""

    @abstractmethod
    def log_train(self, window: LogWindow) -> None:
        """Record the train row of a log step (self.log.record)."""

    @abstractmethod
    def validate(self) -> bool:
        """Validate (every rank); True asks for a checkpoint of this step now."""

    def checkpoint_state(self) -> dict[str, Any]:
        """The stage's keys of gptpipe_state.json."""
        return {}

    def restore(self, state: dict[str, Any]) -> None:
        """Read the stage's keys back from the gptpipe_state.json resumed from."""

    def after_save(self, step: int) -> None:
        """Called on every rank once the checkpoint of `step` is complete."""

    def begin(self) -> None:
        """Called once the run's logger is open (self.log), before the first step of this process."""

    def finish(self) -> None:
        """The last word of a finished run, after its final evaluation and save."""

    def position(self) -> str:
        """Where the run stands, for the resume line."""
        return f"step {self.step}"

    def model_origin(self) -> str:
        """What a checkpoint's model must match, for the resume error."""
        return "config.yaml describes"

    def memory_gib(self) -> float:
        """Peak device memory since the last call on GPU (evaluation included); the process's RSS on CPU. For the
        train rows of log steps: a query of the allocator's counters, no device sync."""
        if self.dist.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated() / 1024**3
            torch.cuda.reset_peak_memory_stats()
            return peak
        import psutil

        return psutil.Process().memory_info().rss / 1024**3

    # --- resume and save ----------------------------------------------------------------------------------
    def say(self, message: str) -> None:
        if self.dist.is_main:
            self.status.info(message)

    def _resume(self) -> None:
        folder = checkpoint.newest_checkpoint(self.ckpt_root)
        if folder is None:
            return
        saved = json.loads((folder / checkpoint.HF_CONFIG).read_text(encoding="utf-8"))
        current = json.loads(self.hf_config.to_json_string())
        # output_router_logits is no property of the model (older checkpoints recorded it on)
        ignored = {"transformers_version": None, "output_router_logits": None}
        if {**saved, **ignored} != {**current, **ignored}:
            raise StageInputError(f"{folder} holds a different model than {self.model_origin()}; set "
                                  f"train.output_model_dir to a new folder (or restore the model settings)")
        # The ranks that see a staging folder of their own convert a checkpoint saved by another number of ranks.
        state = checkpoint.load(self.engine, folder, self.dist, converts=self.mirror.uploads if self.mirror else None)
        self.step, self.skipped = state["step"], state.get("skipped_steps", 0)
        self.finished = state.get("finished", False)
        self.last_lr = state.get("lr")
        window = state.get("log_window") or {"losses": [], "seconds": 0.0}
        # Rank 0 holds the saved rank-average times the ranks, the others 0: the log step's all-reduce and
        # division give the saved average back.
        scale = self.dist.world_size if self.dist.is_main else 0
        self.window = [torch.tensor(x * scale, dtype=torch.float32, device=self.dist.device)
                       for x in window["losses"]]
        self.window_seconds = window["seconds"]
        self.restore(state)
        self.say(f"resumed from {folder} ({self.position()})")

    def _save(self, finished: bool = False) -> int | None:
        """Checkpoint the current step, unless its loss was non-finite. Returns the step saved."""
        if self.last_loss is not None and not bool(torch.isfinite(self.last_loss)):
            self.say(f"step {self.step}: loss not finite, checkpoint skipped")
            return None
        state = {"step": self.step, "total_steps": self.steps, "skipped_steps": self.skipped, "finished": finished,
                 "lr": self.last_lr,
                 "world_size": self.dist.world_size,
                 "log_window": {"losses": self._window_losses(), "seconds": self.window_seconds + self.paused_at
                                - self.window_start},
                 **self.checkpoint_state()}
        started = time.perf_counter()
        folder = checkpoint.save(self.engine, self.ckpt_root, self.step, state, self.hf_config.to_json_string(),
                                 self.dist, self.train_cfg.keep_checkpoints)
        # The stall: training waits for every rank's local save (the bucket's upload runs beside the steps).
        self.save_seconds = time.perf_counter() - started
        self.say(f"saved {folder} in {self.save_seconds:.1f} s")
        if self.mirror:
            self.mirror.submit(self.step, folder)
        self.after_save(self.step)
        return self.step

    def _grace_left(self) -> float | None:
        """Seconds left of a bucket run's train.preempt_grace_seconds since the stop signal (None: no grace)."""
        if self.mirror is None or self.stop.at is None:
            return None
        return self.train_cfg.preempt_grace_seconds - (time.monotonic() - self.stop.at)

    def _save_fits(self) -> bool:
        """Whether a save after a stop signal fits in what is left of the grace, judged by the last save's stall
        (every rank judges the same: the stall is measured across the save's barriers and agreed by the max)."""
        left = self._grace_left()
        if left is None or self.save_seconds is None:
            return True
        needed = torch.tensor([self.save_seconds, -left], dtype=torch.float64)
        if self.dist.world_size > 1:
            torch.distributed.all_reduce(needed, op=torch.distributed.ReduceOp.MAX, group=self.stop.group)
        stall, left = float(needed[0]), -float(needed[1])
        if stall <= left:
            return True
        self.say(f"{self.stop.signal_name}: step {self.step} is not saved: a save takes ~{stall:.1f} s (the last "
                 f"one) and {max(left, 0.0):.1f} s of train.preempt_grace_seconds="
                 f"{self.train_cfg.preempt_grace_seconds:g} are left")
        return False

    def _window_losses(self) -> list[float]:
        """The log window's per-step losses averaged over the ranks (collective; a sync, on log and save steps)."""
        if not self.window:
            return []
        losses = torch.stack(self.window).float()
        torch.distributed.all_reduce(losses)  # each rank saw its own share of the global batch
        return (losses / self.dist.world_size).cpu().tolist()

    # --- the loop -----------------------------------------------------------------------------------------
    def fit(self) -> int:
        """Resume, train to `steps` (or a stop signal), validate and save; returns the exit code."""
        self._resume()
        # from_pretrained returns a model in eval mode: without this, a fine-tune would train without dropout
        # until its first evaluation switched it over, and a resumed run again until its next one.
        self.engine.train()
        self.stop = StopFlag(self.dist.world_size)
        self.log = RunLogger(self.run_dir, self.config, self.steps, self.step, self.wandb_block,
                             enabled=self.dist.is_main, rotate_tensorboard_s=SIDE_SYNC_SECONDS if self.mirror else None)
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

        def restore_handlers() -> None:
            for s, h in handlers.items():
                signal.signal(s, h)

        try:
            try:
                self.begin()
                code = self._loop()
            finally:
                self.log.close()
            if code != EXIT_PREEMPTED:  # Ctrl-C may still cut a finished run's final upload wait short
                restore_handlers()
            # A bucket run: the last save's upload must land (within the grace time on a signal) before exiting;
            # after a signal the handlers stay until it has, so a launcher's SIGTERM to the ranks it stops (once
            # one exits 75) cannot cut it off.
            if self.mirror is None:
                return code
            left = self._grace_left() if code == EXIT_PREEMPTED else None
            return self.mirror.finish(code, EXIT_PREEMPTED, None if left is None else max(left, 0.0))
        finally:
            restore_handlers()
            if self.lock is not None:  # the folder is free for the next run in this process too
                self.lock.release()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stop.set(signal.Signals(signum).name)

    def _loop(self) -> int:
        train = self.train_cfg
        bad_in_a_row = 0
        self.window_start = time.perf_counter()
        saved_at = self.step
        while self.step < self.steps:
            lr = self.engine.get_lr()[0]  # the rate this step uses (a Python float: no sync)
            result = train_step(self.engine, self.batches(), self.stop, forward=self.forward)
            if result is None:
                break  # a signal arrived mid-step: the state is still that of the last finished step
            if self.balance is not None and result.applied:
                # After the optimizer step, from the whole step's choices; a skipped step leaves it, as the weights.
                self.balance.update(result.aux_loss.counts)
            self.step += 1
            self.last_loss, self.last_lr = result.loss, lr
            self.after_step()
            self.log.advance()
            self.window.append(result.loss)
            bad_in_a_row = 0 if result.applied else bad_in_a_row + 1
            if not result.applied:
                self.skipped += 1
                self.engine.lr_scheduler.step()  # DeepSpeed does not advance it on a skipped step; keep in line
                self.say(f"step {self.step}: non-finite loss or gradient norm, update skipped "
                         f"({bad_in_a_row} in a row, {self.skipped} in total)")
            if self.step % train.log_interval == 0 or self.step == self.steps:
                losses = self._window_losses()
                if not math.isfinite(losses[-1]) and result.applied:
                    self.say(f"stopping: the loss is {losses[-1]} but the update was applied: the weights are "
                             f"no longer finite; nothing saved from this state.")
                    return EXIT_FAILED
                finite = [x for x in losses if math.isfinite(x)]
                grad_norm = self.engine.get_global_grad_norm()
                self.log_train(LogWindow(sum(finite) / len(finite) if finite else float("nan"), lr,
                                         None if grad_norm is None else float(grad_norm),
                                         self.window_seconds + time.perf_counter() - self.window_start,
                                         len(losses), result))
                self.window, self.window_seconds, self.window_start = [], 0.0, time.perf_counter()
            if bad_in_a_row >= train.max_bad_steps:
                self.say(f"stopping: {bad_in_a_row} non-finite steps in a row (train.max_bad_steps="
                         f"{train.max_bad_steps}); nothing saved from this state. Lower train.lr or raise "
                         f"train.warmup_fraction, then rerun: it resumes from the last checkpoint.")
                return EXIT_FAILED
            self.paused_at = time.perf_counter()
            if self.step % train.eval_interval == 0 and self.step < self.steps and self.validate():
                saved_at = self._save() or saved_at
            if self.step % train.save_interval == 0 and self.step < self.steps and self.step > saved_at:
                saved_at = self._save() or saved_at
            self.window_start += time.perf_counter() - self.paused_at  # throughput counts training time only
            if self.stop.agreed():
                break
        if self.stop.agreed():
            self.paused_at = time.perf_counter()
            if self.step > saved_at and self._save_fits():
                saved_at = self._save() or saved_at
            self.say(f"{self.stop.signal_name}: stopped at step {self.step}, checkpoint at step {saved_at}; "
                     f"exit {EXIT_PREEMPTED}. Run the same command again to resume.")
            return EXIT_PREEMPTED
        # The final evaluation; its checkpoint is marked finished (a rerun then only validates again).
        self.paused_at = time.perf_counter()
        if self.validate() or self.step > saved_at or not self.finished:
            self._save(finished=True)
        self.finish()
        return EXIT_OK
