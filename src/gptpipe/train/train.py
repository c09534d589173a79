"""Stage 3: `gptpipe train` (3_train_node1.sh) — plan, build, resume, then a thin loop over train_step.

Exit codes: 0 finished; 1 failed (e.g. too many non-finite steps in a row); 2 refused before starting
(config, inputs, or a plan that does not fit); 75 stopped by SIGTERM/SIGINT after saving a checkpoint —
run the same command again to continue from it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import yaml

from gptpipe.config.core import to_plain
from gptpipe.stage import StageInputError, say
from gptpipe.stages import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_PREEMPTED, read_tokenizer
from gptpipe.storage import is_url
from gptpipe.train import checkpoint
from gptpipe.train.data import DataError, build_datasets, collate, eval_batches, sample_positions
from gptpipe.train.engine import (
    Dist,
    EngineConfigError,
    StopFlag,
    build_engine,
    deepspeed_config,
    setup_distributed,
    train_step,
)
from gptpipe.train.logging import RunLogger
from gptpipe.train.mirror import SIDE_SYNC_SECONDS, open_mirror
from gptpipe.train.model import build_model_config
from gptpipe.train.plan import Plan, PlanError, check_parameter_count, make_plan
from gptpipe.train.plan_report import format_plan

if TYPE_CHECKING:
    from gptpipe.pipeline import PipelineConfig


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run(config: PipelineConfig, args: argparse.Namespace) -> int:
    """`gptpipe train`: returns the exit code documented in the module doc."""
    dist = setup_distributed()
    code = _train(config, dist)
    exit_file = os.environ.get("GPTPIPE_EXIT_FILE")
    if exit_file and dist.is_main:
        # torchrun reports any rank's non-zero exit as 1; 3_train_node1.sh reads the real code from here.
        Path(exit_file).write_text(str(code), encoding="utf-8")
    return code


def _train(config: PipelineConfig, dist: Dist) -> int:
    tokenizer = read_tokenizer(config.tokenize.tokenizer_dir)
    try:
        plan = make_plan(config, tokenizer.vocab_size, dp=dist.world_size)
        ds_config, wandb_block = deepspeed_config(config.train, plan.settings.micro_batch, plan.accumulation,
                                                  dist.world_size, dist.device.type == "cuda")
    except (PlanError, DataError, EngineConfigError) as exc:
        if dist.is_main:
            say(f"gptpipe train: refused: {exc}")
        return EXIT_BAD_INPUT
    hf_config = build_model_config(config.model, tokenizer, config.train.seq_len)
    if dist.is_main:
        check_parameter_count(plan, hf_config)
        say(f"[train] plan:\n{format_plan(plan, config)}")
    return Trainer(config, plan, ds_config, wandb_block, hf_config, tokenizer, dist).fit()


class Trainer:
    """The state of one training process: engine, data, position in the run, logger."""

    def __init__(self, config: PipelineConfig, plan: Plan, ds_config: dict[str, Any], wandb_block: dict[str, Any],
                 hf_config: Any, tokenizer: Any, dist: Dist):
        self.config, self.plan, self.dist, self.tokenizer = config, plan, dist, tokenizer
        self.train_cfg = train = config.train
        # A bucket run trains in a local staging folder that the mirror keeps in step with the bucket.
        self.mirror = open_mirror(train, config.storage, dist.is_main) if is_url(train.output_model_dir) else None
        self.run_dir: Path = self.mirror.local if self.mirror else train.output_model_dir
        self.ckpt_root = self.run_dir / "checkpoints"
        self.hf_config = hf_config
        self.on_gpu = dist.device.type == "cuda"
        if dist.is_main:
            if self.mirror:
                self.mirror.restore()  # the bucket's newest complete checkpoint, before anyone looks for one
            checkpoint.remove_stale(self.ckpt_root)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=2) + "\n")
            if self.mirror:  # the record of this run beside its checkpoints, in the bucket
                (self.run_dir / "config.yaml").write_text(yaml.safe_dump(to_plain(config), allow_unicode=True,
                                                                         sort_keys=False), encoding="utf-8")
                (self.run_dir / "plan.txt").write_text(format_plan(plan, config) + "\n", encoding="utf-8")
        if self.mirror:
            torch.distributed.barrier()
            self.mirror.check_shared()

        seed_everything(train.seed)
        self.engine, self.fused_loss = build_engine(train, config.model.arch, hf_config, ds_config, plan.schedule,
                                                    dist.device)

        sizes = [plan.train_samples, plan.eval_samples, plan.eval_samples]
        cache = config.data.cache_dir or self.run_dir / "data_cache"
        self.train_data, self.valid_data, _ = build_datasets(config.data, plan.stats, train.seq_len, sizes, cache,
                                                             tokenizer.vocab_size, tokenizer.eod_id)
        self.step, self.consumed, self.skipped = 0, 0, 0
        self.last_val_loss: float | None = None
        self.last_loss: torch.Tensor | None = None  # the last finished step's loss, on device
        self.final_loss_saved = False  # the checkpoint resumed from already records the final val loss
        self._resume()
        self.stop = StopFlag(dist.world_size)
        self.log = RunLogger(self.run_dir, config, plan.steps, self.step, wandb_block, enabled=dist.is_main,
                             rotate_tensorboard_s=SIDE_SYNC_SECONDS if self.mirror else None)

    # --- resume -------------------------------------------------------------------------------------
    def _resume(self) -> None:
        folder = checkpoint.newest_checkpoint(self.ckpt_root)
        if folder is None:
            return
        saved = json.loads((folder / checkpoint.HF_CONFIG).read_text(encoding="utf-8"))
        current = json.loads(self.hf_config.to_json_string())
        if {**saved, "transformers_version": None} != {**current, "transformers_version": None}:
            raise StageInputError(f"{folder} holds a different model than config.yaml describes; set "
                                  f"train.output_model_dir to a new folder (or restore the model settings)")
        state = checkpoint.load(self.engine, folder, self.dist)
        self.step, self.consumed = state["step"], state["consumed_samples"]
        self.skipped = state.get("skipped_steps", 0)
        self.last_val_loss = state.get("val_loss")
        self.final_loss_saved = state.get("final_val_loss") is not None
        if self.dist.is_main:
            say(f"[train] resumed from {folder} (step {self.step}, {self.consumed:,} samples consumed)")

    # --- the loop -----------------------------------------------------------------------------------
    def fit(self) -> int:
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            code = self._loop()
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
            self.log.close()
        return self.mirror.finish(code, EXIT_PREEMPTED) if self.mirror else code

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stop.set(signal.Signals(signum).name)

    def _batches(self):
        plan = self.plan
        for micro_step in range(plan.accumulation):
            positions = sample_positions(self.consumed, micro_step, plan.settings.micro_batch, self.dist.rank,
                                         self.dist.world_size)
            yield collate(self.train_data, positions, self.dist.device)

    def _loop(self) -> int:
        train, plan = self.train_cfg, self.plan
        bad_in_a_row = 0
        window: list[torch.Tensor] = []  # per-step losses since the last log step, on device
        window_start = time.perf_counter()
        window_steps = 0
        saved_at = self.step
        while self.step < plan.steps:
            lr = self.engine.get_lr()[0]  # the rate this step uses (a Python float: no sync)
            result = train_step(self.engine, self._batches(), self.stop)
            if result is None:
                break  # a signal arrived mid-step: the state is still that of the last finished step
            self.step += 1
            self.last_loss = result.loss
            self.consumed += train.global_batch_size
            self.log.advance()
            window.append(result.loss)
            window_steps += 1
            bad_in_a_row = 0 if result.applied else bad_in_a_row + 1
            self.skipped += 0 if result.applied else 1
            if not result.applied:
                self.engine.lr_scheduler.step()  # DeepSpeed does not advance it on a skipped step; keep in line
                self.log.say(f"[train] step {self.step}: non-finite loss or gradient norm, update skipped "
                             f"({bad_in_a_row} in a row, {self.skipped} in total)")
            if self.step % train.log_interval == 0 or self.step == plan.steps:
                losses = torch.stack(window).float()
                torch.distributed.all_reduce(losses)  # each rank saw its own share of the global batch
                losses = (losses / self.dist.world_size).cpu().tolist()  # the one host-device sync per log step
                if not math.isfinite(losses[-1]) and result.applied:
                    self.log.say(f"[train] stopping: the loss is {losses[-1]} but the update was applied: the "
                                 f"weights are no longer finite; nothing saved from this state.")
                    return EXIT_FAILED
                self._log_train(losses, lr, result, time.perf_counter() - window_start, window_steps)
                window, window_steps = [], 0
                window_start = time.perf_counter()
            if bad_in_a_row >= train.max_bad_steps:
                self.log.say(f"[train] stopping: {bad_in_a_row} non-finite steps in a row (train.max_bad_steps="
                             f"{train.max_bad_steps}); nothing saved from this state. Lower train.lr or raise "
                             f"train.warmup_fraction, then rerun: it resumes from the last checkpoint.")
                return EXIT_FAILED
            paused = time.perf_counter()
            if self.step % train.eval_interval == 0 and self.step < plan.steps:
                self._evaluate()
            if self.step % train.save_interval == 0 and self.step < plan.steps:
                saved_at = self._save() or saved_at
            window_start += time.perf_counter() - paused  # tokens/s and MFU count training time only
            if self.stop.agreed():
                break
        if self.stop.agreed():
            if self.step > saved_at:
                saved_at = self._save() or saved_at
            self.log.say(f"[train] {self.stop.signal_name}: stopped at step {self.step}, checkpoint at step "
                         f"{saved_at}; exit {EXIT_PREEMPTED}. Run the same command again to resume.")
            return EXIT_PREEMPTED
        self._evaluate()
        if self.step > saved_at or not self.final_loss_saved:
            self._save()
        self.log.say(f"[train] finished {self.step} steps, {self.consumed * train.seq_len:,} tokens; "
                     f"final validation loss {self.last_val_loss:.4f}; checkpoints in {self.ckpt_root}")
        return 0

    # --- pieces -------------------------------------------------------------------------------------
    def _log_train(self, losses: list[float], lr: float, result: Any, seconds: float, steps: int) -> None:
        train, plan = self.train_cfg, self.plan
        finite = [x for x in losses if math.isfinite(x)]
        tokens_per_s = steps * plan.tokens_per_step / max(seconds, 1e-9)
        grad_norm = self.engine.get_global_grad_norm()
        row: dict[str, Any] = {
            "step": self.step,
            "tokens": self.consumed * train.seq_len,
            "loss": sum(finite) / len(finite) if finite else float("nan"),
            "lr": lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "tokens_per_s": tokens_per_s,
        }
        if result.aux_loss is not None:
            row["aux_loss"] = float(result.aux_loss)
        if plan.peak_flops:
            row["mfu"] = plan.flops_per_token * tokens_per_s / (plan.peak_flops * self.dist.world_size)
        row["mem_gib"] = self._memory_gib()
        row["skipped_steps"] = self.skipped
        self.log.record(row, console=(
            f"step {self.step}/{plan.steps}  tokens {row['tokens']:,}  loss {row['loss']:.4f}  lr {row['lr']:.3e}  "
            f"grad-norm {row['grad_norm'] if row['grad_norm'] is None else format(row['grad_norm'], '.3f')}"
            + (f"  router-aux {row['aux_loss']:.3f}" if "aux_loss" in row else "")
            + f"  {tokens_per_s:,.0f} tok/s" + (f"  MFU {row['mfu']:.1%}" if "mfu" in row else "")
            + f"  mem {row['mem_gib']:.2f} GiB" + (f"  skipped {self.skipped}" if self.skipped else "")
            + (self.mirror.status() if self.mirror else "")))

    def _memory_gib(self) -> float:
        """Peak device memory since the last log step on GPU (evaluation included); the process's RSS on CPU."""
        if self.on_gpu:
            peak = torch.cuda.max_memory_allocated() / 1024**3
            torch.cuda.reset_peak_memory_stats()
            return peak
        import psutil

        return psutil.Process().memory_info().rss / 1024**3

    @torch.no_grad()
    def _evaluate(self) -> None:
        """Validation loss over the same eval_iters × global_batch_size samples every time, then samples."""
        engine, plan = self.engine, self.plan
        engine.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.dist.device)
        extra = {"output_router_logits": False} if hasattr(self.hf_config, "output_router_logits") else {}
        if self.fused_loss:  # Liger skips the logits only in training mode unless told: they would not fit
            extra["skip_logits"] = True
        for batch in eval_batches(self.valid_data, plan.eval_samples, plan.settings.micro_batch, self.dist.rank,
                                  self.dist.world_size, self.dist.device):
            out = engine(input_ids=batch["input_ids"], labels=batch["labels"], shift_labels=batch["labels"],
                         use_cache=False, **extra)
            count = (batch["labels"] != -100).sum()
            totals += torch.stack([out.loss.double() * count, count.double()])
        torch.distributed.all_reduce(totals)
        loss = (totals[0] / totals[1]).item()
        self.last_val_loss = loss
        self.log.record({"step": self.step, "val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))},
                        console=f"validation  step {self.step}  loss {loss:.4f}  perplexity {math.exp(min(loss, 50)):.2f}")
        self.log.samples(self.step, self._generate())
        engine.train()

    def _generate(self) -> list[tuple[str, str]]:
        """Greedy continuations of train.sample_prompts (every rank runs them: ZeRO-3 needs all in step)."""
        import sentencepiece as spm

        train, tok = self.train_cfg, self.tokenizer
        if not train.sample_prompts or train.sample_tokens < 1:
            return []
        sp = spm.SentencePieceProcessor(model_file=str(tok.model_path))
        padding = list(range(tok.vocab_size, self.plan.shape.vocab_size)) or None
        results = []
        # A compiled model would recompile for every new sequence length: generate eagerly.
        with torch.compiler.set_stance("force_eager") if train.compile else contextlib.nullcontext():
            for prompt in train.sample_prompts:
                ids = [tok.eod_id] + sp.encode(prompt)  # documents in the data start right after a separator
                out = self.engine.module.generate(
                    torch.tensor([ids], device=self.dist.device), max_new_tokens=train.sample_tokens,
                    do_sample=False, suppress_tokens=padding, eos_token_id=tok.eos_id, pad_token_id=tok.eos_id,
                    synced_gpus=train.zero_stage == 3 and self.dist.world_size > 1)
                results.append((prompt, sp.decode([i for i in out[0, len(ids):].tolist() if i < tok.vocab_size])))
        return results

    def _save(self) -> int | None:
        """Checkpoint the current step, unless its loss was non-finite. Returns the step saved."""
        if self.last_loss is not None and not bool(torch.isfinite(self.last_loss)):
            self.log.say(f"[train] step {self.step}: loss not finite, checkpoint skipped")
            return None
        state = {
            "step": self.step,
            "consumed_samples": self.consumed,
            "tokens": self.consumed * self.train_cfg.seq_len,
            "skipped_steps": self.skipped,
            "total_steps": self.plan.steps,
            "final_val_loss": self.last_val_loss if self.step >= self.plan.steps else None,
            "val_loss": self.last_val_loss,
            # The run record: the whole resolved config.yaml this run trained with. Stage 4 reads the tokenizer,
            # the data and its split from here, never from a config.yaml that may have changed since.
            "config": to_plain(self.config),
        }
        folder = checkpoint.save(self.engine, self.ckpt_root, self.step, state, self.hf_config.to_json_string(),
                                 self.dist, self.train_cfg.keep_checkpoints)
        self.log.say(f"[train] saved {folder}")
        if self.mirror:
            self.mirror.submit(self.step, folder)
        return self.step
