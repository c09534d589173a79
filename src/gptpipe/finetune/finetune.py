"""Stage 7: `gptpipe finetune` (7_finetune.sh): a pretrained HF model fine-tuned on labelled, chat or preference
rows in stage 3's loop (runtime/loop.py), validated every eval_interval steps; the best checkpoint by
train.best_metric is marked (`checkpoints/best`) and never pruned. The task kind gives the loss (task_kind.py's
training hooks): on the label (assistant) tokens and the EOS after them, normalised by the label tokens of the
whole global batch, so every label token weighs the same wherever it lands; for preference pairs DPO's, the mean
over the global batch's pairs. train.group_by_length and train.packing only cut padding: a step's rows and loss
stay the same.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from gptpipe.config.core import to_plain
from gptpipe.finetune.baseline import (
    BASELINES_DIR,
    base_of,
    classical_baseline,
    comparison,
    format_comparison,
)
from gptpipe.finetune.chat_data import save_tokenizer
from gptpipe.finetune.config import FinetuneConfig
from gptpipe.runtime.batching import (IGNORE, Encoded, collate_packed, computed_positions, epoch_order, pad_id,
                                      row_positions, sample_positions)
from gptpipe.runtime.scoring import pretrained_factory, target_logprobs
from gptpipe.finetune.run_files import SUMMARY_FILE, TASK_FILE, TOKENIZER_DIR
from gptpipe.finetune.task import load_task
from gptpipe.finetune.task_kind import TaskData, TaskFacts
from gptpipe.log import get_logger
from gptpipe.stage import StageInputError, write_text_atomic
from gptpipe.artifacts import EXIT_BAD_INPUT, EXIT_OK
from gptpipe.runtime import checkpoint
from gptpipe.runtime.engine import Dist, EngineConfigError, build_engine, deepspeed_config
from gptpipe.runtime.lora import check_base, trainable_summary
from gptpipe.runtime.loop import LogWindow, TrainLoop, run_ranks
from gptpipe.runtime.metrics_rows import TaskEvalRow, TrainRow
from gptpipe.runtime.model import inference_config
from gptpipe.runtime.schedule import Schedule

log = get_logger("finetune")


def run(config: FinetuneConfig, args: argparse.Namespace) -> int:
    """`gptpipe finetune`: returns the exit code documented in the module doc."""
    return run_ranks(lambda dist: _finetune(config, dist))


def _finetune(config: FinetuneConfig, dist: Dist) -> int:
    try:
        base = base_of(config.model.path) if config.baseline.model == "base" else None
        task = load_task(config)
        # From here on train.seq_len is the number auto chose: the run trains, records and predicts with it.
        config = replace(config, train=replace(config.train, seq_len=task.encoder.seq_len))
        train = config.train
        micro = train.micro_batch_size or train.global_batch_size // dist.world_size
        if micro < 1 or train.global_batch_size % (micro * dist.world_size):
            raise StageInputError(f"train.global_batch_size {train.global_batch_size} is not a multiple of "
                                  f"micro_batch_size x ranks ({micro} x {dist.world_size})")
        accumulation = train.global_batch_size // (micro * dist.world_size)
        if train.packing and task.seq2seq:
            raise StageInputError(f"train.packing: {config.model.path} is an encoder-decoder, whose rows cannot "
                                  f"be packed into one sequence; set train.packing=false (train.group_by_length "
                                  f"cuts the padding of its batches)")
        ds_config, wandb_block = deepspeed_config(train, micro, accumulation, dist.world_size,
                                                  dist.device.type == "cuda")
    except (StageInputError, EngineConfigError) as exc:
        if dist.is_main:
            log.error(f"refused: {exc}")
        return EXIT_BAD_INPUT
    if dist.is_main:
        kinds = f"{len(task.labels)} labels" if task.labels else config.task.kind
        log.info(f"{config.model.path} ({'encoder-decoder' if task.seq2seq else 'causal LM'}); "
                 f"{len(task.train):,} training rows, {len(task.validation):,} validation rows; {kinds}"
                 + "".join(f"; {note}" for note in task.notes))
        if task.seq_len_note:
            log.info(task.seq_len_note)
        if task.skipped.counts:
            log.info(task.skipped.lines())
        if task.length_warning:
            log.warning(task.length_warning)
    try:
        tuner = FineTuner(config, task, micro, accumulation, ds_config, wandb_block, dist)
    except StageInputError as exc:  # the model does not keep packed rows apart
        if dist.is_main:
            log.error(f"refused: {exc}")
        return EXIT_BAD_INPUT
    code = tuner.fit()
    if code != EXIT_OK:
        return code
    return _baselines(config, task, tuner, micro, accumulation, ds_config, wandb_block, dist, base)


def _baselines(config: FinetuneConfig, task: TaskData, tuner: FineTuner, micro: int, accumulation: int,
               ds_config: dict[str, Any], wandb_block: dict[str, Any], dist: Dist, base: Path | None) -> int:
    """The baselines of finetune_config.yaml's `baseline:` after the model's own run (`base`: the folder
    baseline.model=base starts from), then the summary and the console comparison; returns the exit code (a
    baseline run stopped by a signal: 75, rerun to resume)."""
    baselines: dict[str, dict[str, Any]] = {}
    kind = config.baseline.model
    if kind != "none":
        tuner.engine = None  # the model's engine is done: its memory goes before the baseline model's comes
        model = replace(config.model, path=base) if base is not None else config.model
        baseline_config = replace(config, model=model, train=replace(
            config.train, output_model_dir=tuner.run_dir / BASELINES_DIR / kind))
        baseline = FineTuner(baseline_config, task, micro, accumulation, ds_config, wandb_block, dist,
                             from_scratch=kind == "scratch")
        code = baseline.fit()
        if code != EXIT_OK:
            return code
        assert baseline.best is not None
        baselines[kind] = baseline.best["metrics"]
    if config.baseline.classical and task.labels:
        baselines["classical"] = classical_baseline(task)
    if baselines and tuner.best is not None:
        tuner.write_summary(baselines)
        table = comparison(task.kind, tuner.best["metrics"], baselines)
        tuner.say(format_comparison(table, f"fine-tuned from {config.model.path}", task.kind,
                                    task.kind.best_metric(config.train.best_metric)))
    return EXIT_OK


class FineTuner(TrainLoop):
    """One fine-tuning process: engine, rows, position in the run, best checkpoint so far."""

    name = "finetune"

    def __init__(self, config: FinetuneConfig, task: TaskData, micro: int, accumulation: int,
                 ds_config: dict[str, Any], wandb_block: dict[str, Any], dist: Dist, from_scratch: bool = False):
        super().__init__(config, config.train, dist, ds_config, wandb_block)
        self.task, self.from_scratch = task, from_scratch
        resuming = checkpoint.newest_checkpoint(self.ckpt_root) is not None
        recorded = TaskFacts.read(self.run_dir / TASK_FILE, config.task.kind).lora if resuming else None
        if recorded:  # its checkpoints hold the adapters only: the base must be the one they were trained on
            check_base(recorded, config.model.path, str(self.run_dir / TASK_FILE))
        # task.json: what predict, chat and the export rebuild
        self.facts = task.facts(config, from_scratch, recorded_lora=recorded)
        train = config.train
        self.micro, self.accumulation = micro, accumulation
        self.pad = pad_id(task.tokenizer)
        self.lengths = [sum(row_positions(s, task.seq2seq) for s in task.kind.sequences(e)) for e in task.train]
        self.pack_capacity = train.seq_len if train.packing else None
        self.counted = [0, 0]  # real and computed positions of the steps since the last train line
        by_epochs = math.ceil(train.train_epochs * len(task.train) / train.global_batch_size)
        self.steps = train.train_iters or max(1, by_epochs)
        self.best_metric = task.kind.metric(task.kind.best_metric(train.best_metric))
        if dist.is_main:
            save_tokenizer(task.tokenizer, self.run_dir / TOKENIZER_DIR)  # checkpoints are usable without model.path
            self.facts.write(self.run_dir / TASK_FILE)
        from transformers import AutoConfig

        # As the model pretrained_factory builds: the router switch off, in this run's checkpoints too.
        self.hf_config = inference_config(AutoConfig.from_pretrained(config.model.path))
        self.engine, self.loss_kwargs = build_engine(
            train, self.hf_config.model_type, self.hf_config, ds_config, Schedule.for_run(train, self.steps),
            dist.device, make_model=pretrained_factory(config.model.path, task.seq2seq, dist.device,
                                                       scratch=from_scratch, lora=self.facts.lora))
        if self.facts.lora:
            lora = self.facts.lora
            self.say(f"LoRA adapters on {', '.join(lora['target_modules'])} ({lora['targets_from']}), rank "
                     f"{lora['rank']}, alpha {lora['alpha']:g}")
            self.say(trainable_summary(self.engine.module, train.precision, train.zero_stage, train.fp32_gradients,
                                       dist.world_size, train.offload_optimizer))
        if train.packing:
            self.engine.eval()
            leaks = packing_leaks(self.engine, [s for e in task.train[:8] for s in task.kind.sequences(e)],
                                  len(task.tokenizer), self.pad, dist.device)
            self.engine.train()
            if leaks:
                raise StageInputError(f"train.packing: {config.model.path} ({self.hf_config.model_type}) lets a "
                                      f"packed row attend to the row before it (its attention mask is not built "
                                      f"from restarting position ids); set train.packing=false")
        self.engine.eval()
        # With the starting weights, before a resumed run loads its checkpoint (a preference run's reference).
        self.task = task.kind.prepare_training(self.engine, task, config, self.run_dir, dist,
                                               resuming=resuming)
        self.engine.train()
        # The kind's step figures (task_kind.step_figures), summed: this step's, and the log window's so far.
        figures = len(task.kind.step_figures)
        self.step_figures = torch.zeros(figures, device=dist.device)
        self.window_figures = torch.zeros(figures, device=dist.device)
        self.best: dict[str, Any] | None = None  # {"step", "value", "metrics"} of the best evaluation
        self.last_eval: dict[str, Any] | None = None

    def model_origin(self) -> str:
        return f"model.path {self.config.model.path}"

    # --- data order and loss -------------------------------------------------------------------------
    def _row(self, position: int) -> int:
        """The training row at `position` of the endless stream of epochs, each a seeded permutation (grouped
        by length: data.epoch_order); a function of the position alone, so a resumed run reads exactly what the
        killed one would have."""
        epoch, offset = divmod(position, len(self.task.train))
        if getattr(self, "_order_epoch", None) != epoch:
            self._order_epoch = epoch
            self._order = epoch_order(self.lengths, self.train_cfg.seed, epoch, self.micro,
                                      self.train_cfg.group_by_length)
        return int(self._order[offset])

    def batches(self):
        """This rank's micro-batches of the current step, each carrying the loss scale of the window."""
        train, dist, kind, seq2seq = self.train_cfg, self.dist, self.task.kind, self.task.seq2seq
        start = self.step * train.global_batch_size
        window = [self.task.train[self._row(p)] for p in range(start, start + train.global_batch_size)]
        weight = sum(kind.loss_weight(e) for e in window)  # label tokens (pairs) of the whole global batch
        # DeepSpeed divides each micro-batch's loss by the accumulation steps and averages gradients over
        # ranks; this scale undoes both, so the step's gradient is that of sum(token losses) / tokens.
        scale = self.accumulation * dist.world_size / weight
        # Every rank's micro-batches are consecutive slices of the window: the step's figures for the train line.
        sequences = [[s for e in window[k:k + self.micro] for s in kind.sequences(e)]
                     for k in range(0, len(window), self.micro)]
        self.step_positions = (sum(row_positions(s, seq2seq) for seqs in sequences for s in seqs),
                               sum(computed_positions(seqs, seq2seq, self.pack_capacity) for seqs in sequences))
        self.step_figures.zero_()  # a step cut short by a signal is not counted
        for micro_step in range(self.accumulation):
            positions = sample_positions(start, micro_step, self.micro, dist.rank, dist.world_size)
            batch = kind.collate([window[p - start] for p in positions], self.pad, seq2seq, self.pack_capacity,
                                 dist.device)
            batch["scale"] = scale
            yield batch

    def forward(self, engine: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, None]:
        loss, figures = self.task.kind.loss(engine, batch, self.task.seq2seq, self.config.task)
        if figures is not None:
            self.step_figures += figures.detach()
        return loss * batch["scale"], None

    def after_step(self) -> None:
        self.counted = [c + n for c, n in zip(self.counted, self.step_positions)]
        self.window_figures += self.step_figures

    def log_train(self, window: LogWindow) -> None:
        seconds = max(window.seconds, 1e-9)
        rows_per_s = window.steps * self.train_cfg.global_batch_size / seconds
        (real, computed), self.counted = self.counted, [0, 0]
        # The kind's figures: the mean over the window's items, every rank's (a sync, on log steps only).
        means = self._window_figures() / (window.steps * self.train_cfg.global_batch_size)
        self.window_figures.zero_()
        figures = dict(zip(self.task.kind.step_figures, means.tolist()))
        row = TaskTrainRow(self.step, **window.row(), tokens_per_s=real / seconds,
                           epoch=self.step * self.train_cfg.global_batch_size / len(self.task.train),
                           rows_per_s=rows_per_s, padding=1 - real / max(computed, 1), figures=figures or None,
                           mem_gib=self.memory_gib())
        skipped = f"  skipped {self.skipped}" if self.skipped else ""
        shown = "".join(f"  {name} {value:.4f}" for name, value in figures.items())
        self.log.record(row, console=f"step {self.step}/{self.steps}  epoch {row.epoch:.2f}  {window.line()}{shown}  "
                                     f"{rows_per_s:,.1f} rows/s  {row.tokens_per_s:,.0f} tokens/s  "
                                     f"padding {row.padding:.0%}  mem {row.mem_gib:.2f} GiB{skipped}")

    def _window_figures(self) -> torch.Tensor:
        """The log window's figure sums over every rank (collective)."""
        sums = self.window_figures.clone()
        if len(sums):
            torch.distributed.all_reduce(sums)
        return sums

    # --- checkpoints ---------------------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        # The run record (the resolved finetune_config.yaml): stage 4 finds the validation rows it verifies on here.
        return {"best": self.best, "last_eval": self.last_eval, "task": self.facts.to_dict(),
                "log_positions": self.counted,  # the log window's positions so far, as the train line counts them
                "log_figures": self._window_figures().tolist(),  # and its figure sums (every rank's)
                "precision": self.train_cfg.precision, "zero_stage": self.train_cfg.zero_stage,
                "config": to_plain(self.config)}

    def restore(self, state: dict[str, Any]) -> None:
        self.best, self.last_eval = state.get("best"), state.get("last_eval")
        self.counted = state.get("log_positions", [0, 0])
        # Rank 0 holds the ranks' sums, the others none: the log step's all-reduce gives the sums back.
        saved = state.get("log_figures") or [0.0] * len(self.window_figures)
        self.window_figures = torch.tensor(saved if self.dist.is_main else [0.0] * len(saved),
                                           dtype=torch.float32, device=self.dist.device)
        best_folder = self.ckpt_root / checkpoint.tag_of(self.best["step"]) if self.best else None
        if self.dist.is_main and best_folder and best_folder.is_dir() and \
                checkpoint.best_tag(self.ckpt_root) != best_folder.name:  # killed between its save and its mark
            checkpoint.mark_best(self.ckpt_root, self.best["step"], self.train_cfg.keep_checkpoints)

    def after_save(self, step: int) -> None:
        if self.best and self.best["step"] == step and self.dist.is_main:  # a new best was just saved
            checkpoint.mark_best(self.ckpt_root, step, self.train_cfg.keep_checkpoints)

    # --- evaluation ----------------------------------------------------------------------------------
    def begin(self) -> None:
        if self.task.kind.evaluates_start and self.step == 0:  # the starting model, before the first step
            self.validate()

    def validate(self) -> bool:
        """Validation metrics; True (save now) when they are the best so far (never at step 0: the starting
        model, evaluated as the reference, has no checkpoint of this run)."""
        self.engine.eval()
        metrics = self.task.kind.validate(self.engine, self.task, self.config, self.dist)
        self.engine.train()
        metrics["step"] = self.step
        self.last_eval = metrics
        value = metrics[self.best_metric.key]
        improved = self.step > 0 and (self.best is None or (
            value > self.best["value"] if self.best_metric.higher_is_better else value < self.best["value"]))
        if improved:
            self.best = {"step": self.step, "value": value, "metrics": metrics}
        # Every figure goes to metrics.jsonl; TensorBoard and wandb take the numbers (RunLogger filters).
        self.log.record(TaskEvalRow(self.step, {k: v for k, v in metrics.items() if k != "step"}),
                        console=self._eval_console(metrics, improved))
        return improved

    def _eval_console(self, m: dict[str, Any], improved: bool) -> str:
        head = f"validation  step {self.step}  loss {m['val_loss']:.4f}  "
        body = self.task.kind.headline(m)
        best, chosen = self.best, self.best_metric
        if self.step == 0:
            tail = "\n    the starting model: what the tuning is read against"
        elif improved:
            tail = f"\n    new best {chosen.key} {chosen.show(m[chosen.key])}"
        else:
            tail = f"\n    best so far: step {best['step']} ({chosen.key} {chosen.show(best['value'])})"
        warnings = "".join(f"\n    WARNING: {w}" for w in self.task.kind.warnings(m, self.config.task))
        return head + body + tail + warnings

    def write_summary(self, baselines: dict[str, dict[str, Any]] | None = None) -> None:
        """<run>/finetune_summary.json; with `baselines` (their validation metrics), the comparison too."""
        if not self.dist.is_main:
            return
        summary = {"task": self.facts.to_dict(), "steps": self.step, "best": self.best, "final": self.last_eval,
                   "rows": {"train": len(self.task.train), "validation": len(self.task.validation)},
                   "data_problems": self.task.skipped.manifest_counts(), "config": to_plain(self.config)}
        if baselines and self.best:
            summary["baselines"] = baselines
            summary["comparison"] = comparison(self.task.kind, self.best["metrics"], baselines)
        write_text_atomic(self.run_dir / SUMMARY_FILE, json.dumps(summary, ensure_ascii=False, indent=2) + "\n")

    def finish(self) -> None:
        self.write_summary()
        best = self.best or {}
        self.say(f"finished {self.step} steps; best checkpoint: step {best.get('step')} "
                 f"({self.best_metric.key} {best.get('value', float('nan')):.4f}) in "
                 f"{self.ckpt_root / checkpoint.tag_of(best.get('step', 0))}")


@dataclass
class TaskTrainRow(TrainRow):
    """A fine-tune's train row: stage 3's figures and the task kind's step figures (task_kind.step_figures),
    logged under their own names beside the loss."""

    figures: dict[str, float] | None = None

    def to_json(self) -> dict[str, Any]:
        plain = super().to_json()
        return {**{k: v for k, v in plain.items() if k != "figures"}, **(self.figures or {})}


@torch.no_grad()
def packing_leaks(model: Any, rows: list[Encoded], vocab: int, pad: int, device: torch.device) -> bool:
    """Whether a packed row sees the row packed before it: the same row B after row A and after A with
    other ids must get the same log-probabilities. Transformers models that build their causal mask from
    the position ids pass; a model that ignores them would train on attention across rows."""
    a, b = (sorted(rows[:8], key=lambda e: -len(e.input_ids)) * 2)[:2]  # the longer first (one row: twice)
    other = Encoded([(t + 1) % vocab for t in a.input_ids], [IGNORE] * len(a.input_ids))
    lps = []
    for first in (Encoded(a.input_ids, other.labels), other):  # the longer row first: one sequence, A then B
        batch = collate_packed([first, b], pad, len(a.input_ids) + len(b.input_ids), device)
        lps.append(target_logprobs(model, batch, seq2seq=False))
    return not torch.allclose(lps[0], lps[1], rtol=1e-5, atol=1e-5)  # kept apart, B computes the same ops
