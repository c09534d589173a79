"""Stage 7: `gptpipe finetune` (7_finetune.sh): a pretrained HF model fine-tuned on labelled rows, on stage 3's
DeepSpeed engine, schedule, checkpoints and logger; evaluated on the validation rows every eval_interval steps
and at the end; the best checkpoint by train.best_metric is marked (`checkpoints/best`) and never pruned.

The loss is on the label tokens only (and the EOS after them), normalised by the label tokens of the whole
global batch: each micro-batch contributes sum(token losses) / tokens-in-the-window, so a row with one label
token weighs as much as one token of a long label, whatever micro-batch it lands in.

Exit codes as stage 3: 0 finished; 1 failed; 2 refused before starting; 75 stopped by SIGTERM/SIGINT after
saving a checkpoint (run the same command again to continue).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptpipe.stages import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_PREEMPTED
from gptpipe.config.core import to_plain
from gptpipe.finetune.config import FinetuneConfig
from gptpipe.finetune.data import (
    Encoded,
    Encoder,
    Row,
    Skipped,
    collate,
    label_set,
    map_to_label,
    pad_id,
    read_rows,
    split_validation,
)
from gptpipe.finetune.metrics import (
    classification_metrics,
    format_classification,
    generation_metrics,
)
from gptpipe.finetune.model import (
    decode,
    generate,
    is_seq2seq,
    pretrained_factory,
    score,
    target_logprobs,
)
from gptpipe.stage import StageInputError, say, write_text_atomic
from gptpipe.train import checkpoint
from gptpipe.train.data import sample_positions
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
from gptpipe.train.schedule import Schedule
from gptpipe.train.train import seed_everything

TASK_FILE = "task.json"  # what predict needs to rebuild prompts and labels
SUMMARY_FILE = "finetune_summary.json"
TOKENIZER_DIR = "tokenizer"


@dataclass
class TaskData:
    """The rows of a run, encoded, and what was skipped reading them."""

    tokenizer: Any
    encoder: Encoder
    seq2seq: bool
    train_rows: list[Row]
    train: list[Encoded]
    validation: list[Row]
    labels: list[str] | None  # classification: the label set, most frequent first
    skipped: Skipped

    @property
    def majority(self) -> str | None:
        return self.labels[0] if self.labels else None


def load_task(config: FinetuneConfig) -> TaskData:
    """Tokenizer, rows, validation split and encodings; StageInputError when nothing usable is left."""
    from transformers import AutoTokenizer

    model_dir, data = config.model.path, config.data
    if not (model_dir / "config.json").is_file():
        raise StageInputError(f"model.path {model_dir} is not a HuggingFace model folder (no config.json). "
                              f"Export the pretrained model first: bash 4_convert_to_HF.sh")
    for name in ("train", "validation"):
        path = getattr(data, name)
        if path is not None and not path.is_file():
            raise StageInputError(f"data.{name} {path} does not exist")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    seq2seq = is_seq2seq(model_dir, config.model.kind)
    encoder = Encoder(tokenizer, config.task.prompt, config.train.seq_len, seq2seq, data.too_long)
    skipped = Skipped()
    rows, _ = read_rows(data.train, data.format, data.input_key, data.label_key, skipped)
    if data.validation is not None:
        validation, _ = read_rows(data.validation, data.format, data.input_key, data.label_key, skipped)
    else:
        rows, validation = split_validation(rows, data.validation_proportion, data.seed)
    encoded = [(row, encoder.encode(row, skipped)) for row in rows]
    kept = [(row, e) for row, e in encoded if e is not None]
    if not kept or not validation:
        raise StageInputError(f"no usable {'training' if not kept else 'validation'} rows in {data.train}"
                              f"{'' if kept else ' (see the skipped rows above)'}:\n{skipped.report()}")
    labels = label_set([row for row, _ in kept]) if config.task.kind == "classification" else None
    return TaskData(tokenizer, encoder, seq2seq, [r for r, _ in kept], [e for _, e in kept], validation, labels,
                    skipped)


def run(config: FinetuneConfig, args: argparse.Namespace) -> int:
    """`gptpipe finetune`: returns the exit code documented in the module doc."""
    dist = setup_distributed()
    code = _finetune(config, dist)
    exit_file = os.environ.get("GPTPIPE_EXIT_FILE")
    if exit_file and dist.is_main:
        Path(exit_file).write_text(str(code), encoding="utf-8")  # torchrun reports every failure as 1
    return code


def _finetune(config: FinetuneConfig, dist: Dist) -> int:
    train = config.train
    try:
        task = load_task(config)
        micro = train.micro_batch_size or train.global_batch_size // dist.world_size
        if micro < 1 or train.global_batch_size % (micro * dist.world_size):
            raise StageInputError(f"train.global_batch_size {train.global_batch_size} is not a multiple of "
                                  f"micro_batch_size x ranks ({micro} x {dist.world_size})")
        accumulation = train.global_batch_size // (micro * dist.world_size)
        ds_config, wandb_block = deepspeed_config(train, micro, accumulation, dist.world_size,
                                                  dist.device.type == "cuda")
    except (StageInputError, EngineConfigError) as exc:
        if dist.is_main:
            say(f"gptpipe finetune: refused: {exc}")
        return EXIT_BAD_INPUT
    if dist.is_main:
        kinds = f"{len(task.labels)} labels" if task.labels else "generation"
        say(f"[finetune] {config.model.path} ({'encoder-decoder' if task.seq2seq else 'causal LM'}); "
            f"{len(task.train):,} training rows, {len(task.validation):,} validation rows; {kinds}")
        if task.skipped.total or task.skipped.truncated:
            say(task.skipped.report())
    return FineTuner(config, task, micro, accumulation, ds_config, wandb_block, dist).fit()


class FineTuner:
    """One fine-tuning process: engine, rows, position in the run, best checkpoint so far, logger."""

    def __init__(self, config: FinetuneConfig, task: TaskData, micro: int, accumulation: int,
                 ds_config: dict[str, Any], wandb_block: dict[str, Any], dist: Dist):
        self.config, self.task, self.dist = config, task, dist
        self.train_cfg = train = config.train
        self.micro, self.accumulation = micro, accumulation
        self.run_dir: Path = train.output_model_dir
        self.ckpt_root = self.run_dir / "checkpoints"
        self.pad = pad_id(task.tokenizer)
        rows = len(task.train)
        self.steps = train.train_iters or max(1, math.ceil(train.train_epochs * rows / train.global_batch_size))
        self.schedule = Schedule.for_run(train, self.steps)
        self.higher_is_better = train.best_metric != "val_loss"
        if dist.is_main:
            checkpoint.remove_stale(self.ckpt_root)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=2) + "\n")
            task.tokenizer.save_pretrained(self.run_dir / TOKENIZER_DIR)  # checkpoints are usable without model.path
            write_text_atomic(self.run_dir / TASK_FILE, json.dumps(self.task_facts(), ensure_ascii=False, indent=2))

        seed_everything(train.seed)
        from transformers import AutoConfig

        self.hf_config = AutoConfig.from_pretrained(config.model.path)
        self.engine, _ = build_engine(train, self.hf_config.model_type, self.hf_config, ds_config, self.schedule,
                                      dist.device, make_model=pretrained_factory(config.model.path, task.seq2seq,
                                                                                 dist.device))
        self.step = 0
        self.best: dict[str, Any] | None = None  # {"step", "value", "metrics"} of the best evaluation
        self.last_eval: dict[str, Any] | None = None
        self.last_loss: torch.Tensor | None = None
        self._resume()
        self.stop = StopFlag(dist.world_size)
        self.log = RunLogger(self.run_dir, config, self.steps, self.step, wandb_block, enabled=dist.is_main)

    def task_facts(self) -> dict[str, Any]:
        """The task as predict and the model card need it."""
        c = self.config
        return {"kind": c.task.kind, "prompt": c.task.prompt, "labels": self.task.labels,
                "majority_label": self.task.majority, "seq2seq": self.task.seq2seq, "seq_len": c.train.seq_len,
                "too_long": c.data.too_long, "pretrained_model": str(c.model.path), "train_file": str(c.data.train),
                "best_metric": c.train.best_metric}

    # --- data order ----------------------------------------------------------------------------------
    def _row(self, position: int) -> int:
        """The training row at `position` of the endless stream of epochs, each a seeded permutation; a
        function of the position alone, so a resumed run reads exactly what the killed one would have."""
        rows = len(self.task.train)
        epoch, offset = divmod(position, rows)
        if getattr(self, "_perm_epoch", None) != epoch:
            self._perm_epoch = epoch
            self._perm = np.random.default_rng([self.train_cfg.seed, epoch]).permutation(rows)
        return int(self._perm[offset])

    def _batches(self):
        """This rank's micro-batches of the current step, each carrying the loss scale of the window."""
        train, dist = self.train_cfg, self.dist
        start = self.step * train.global_batch_size
        window = [self.task.train[self._row(p)] for p in range(start, start + train.global_batch_size)]
        tokens = sum(e.label_tokens for e in window)  # label tokens of the whole global batch, every rank
        # DeepSpeed divides each micro-batch's loss by the accumulation steps and averages gradients over
        # ranks; this scale undoes both, so the step's gradient is that of sum(token losses) / tokens.
        scale = self.accumulation * dist.world_size / tokens
        for micro_step in range(self.accumulation):
            positions = sample_positions(start, micro_step, self.micro, dist.rank, dist.world_size)
            batch = collate([window[p - start] for p in positions], self.pad, self.task.seq2seq, dist.device)
            batch["scale"] = scale
            yield batch

    def _forward(self, engine: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, None]:
        return -target_logprobs(engine, batch, self.task.seq2seq).sum() * batch["scale"], None

    # --- resume --------------------------------------------------------------------------------------
    def _resume(self) -> None:
        folder = checkpoint.newest_checkpoint(self.ckpt_root)
        if folder is None:
            return
        saved = json.loads((folder / checkpoint.HF_CONFIG).read_text(encoding="utf-8"))
        current = json.loads(self.hf_config.to_json_string())
        if {**saved, "transformers_version": None} != {**current, "transformers_version": None}:
            raise StageInputError(f"{folder} holds a different model than model.path {self.config.model.path}; "
                                  f"set train.output_model_dir to a new folder")
        state = checkpoint.load(self.engine, folder, self.dist)
        self.step, self.best, self.last_eval = state["step"], state.get("best"), state.get("last_eval")
        best_folder = self.ckpt_root / checkpoint.tag_of(self.best["step"]) if self.best else None
        if self.dist.is_main and best_folder and best_folder.is_dir() and \
                checkpoint.best_tag(self.ckpt_root) != best_folder.name:  # killed between its save and its mark
            checkpoint.mark_best(self.ckpt_root, self.best["step"], self.train_cfg.keep_checkpoints)
        if self.dist.is_main:
            say(f"[finetune] resumed from {folder} (step {self.step})")

    # --- the loop ------------------------------------------------------------------------------------
    def fit(self) -> int:
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            return self._loop()
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
            self.log.close()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stop.set(signal.Signals(signum).name)

    def _loop(self) -> int:
        train = self.train_cfg
        window: list[torch.Tensor] = []
        window_start, window_steps, bad_in_a_row = time.perf_counter(), 0, 0
        saved_at = self.step
        while self.step < self.steps:
            lr = self.engine.get_lr()[0]
            result = train_step(self.engine, self._batches(), self.stop, forward=self._forward)
            if result is None:
                break  # a signal arrived mid-step: the state is that of the last finished step
            self.step += 1
            self.last_loss = result.loss
            self.log.advance()
            window.append(result.loss)
            window_steps += 1
            bad_in_a_row = 0 if result.applied else bad_in_a_row + 1
            if not result.applied:
                self.engine.lr_scheduler.step()
                self.log.say(f"[finetune] step {self.step}: non-finite loss or gradient norm, update skipped")
            if self.step % train.log_interval == 0 or self.step == self.steps:
                losses = torch.stack(window).float()
                torch.distributed.all_reduce(losses)  # each rank holds its share of sum(losses) / tokens
                losses = (losses / self.dist.world_size).cpu().tolist()
                self._log_train(losses, lr, time.perf_counter() - window_start, window_steps)
                window, window_steps, window_start = [], 0, time.perf_counter()
            if bad_in_a_row >= train.max_bad_steps:
                self.log.say(f"[finetune] stopping: {bad_in_a_row} non-finite steps in a row; lower train.lr")
                return EXIT_FAILED
            if self.step % train.eval_interval == 0 and self.step < self.steps:
                saved_at = self._evaluate() or saved_at
            if self.step % train.save_interval == 0 and self.step < self.steps and saved_at < self.step:
                saved_at = self._save() or saved_at
            if self.stop.agreed():
                break
        if self.stop.agreed():
            if self.step > saved_at:
                saved_at = self._save() or saved_at
            self.log.say(f"[finetune] {self.stop.signal_name}: stopped at step {self.step}, checkpoint at step "
                         f"{saved_at}; exit {EXIT_PREEMPTED}. Run the same command again to resume.")
            return EXIT_PREEMPTED
        if not self.last_eval or self.last_eval["step"] != self.step:
            saved_at = self._evaluate() or saved_at
        if self.step > saved_at:
            self._save()
        self._write_summary()
        best = self.best or {}
        self.log.say(f"[finetune] finished {self.step} steps; best checkpoint: step {best.get('step')} "
                     f"({self.train_cfg.best_metric} {best.get('value', float('nan')):.4f}) in "
                     f"{self.ckpt_root / checkpoint.tag_of(best.get('step', 0))}")
        return 0

    def _log_train(self, losses: list[float], lr: float, seconds: float, steps: int) -> None:
        finite = [x for x in losses if math.isfinite(x)]
        grad_norm = self.engine.get_global_grad_norm()
        rows_per_s = steps * self.train_cfg.global_batch_size / max(seconds, 1e-9)
        row = {"step": self.step, "epoch": self.step * self.train_cfg.global_batch_size / len(self.task.train),
               "loss": sum(finite) / len(finite) if finite else float("nan"), "lr": lr,
               "grad_norm": float(grad_norm) if grad_norm is not None else None, "rows_per_s": rows_per_s}
        self.log.record(row, console=(
            f"step {self.step}/{self.steps}  epoch {row['epoch']:.2f}  loss {row['loss']:.4f}  lr {lr:.3e}  "
            f"grad-norm {'-' if row['grad_norm'] is None else format(row['grad_norm'], '.3f')}  "
            f"{rows_per_s:,.1f} rows/s"))

    # --- evaluation ----------------------------------------------------------------------------------
    def _evaluate(self) -> int | None:
        """Validation metrics; a new best is saved and marked. Returns the step saved, if any."""
        self.engine.eval()
        metrics = evaluate(self.engine, self.task, self.config, self.dist)
        self.engine.train()
        metrics["step"] = self.step
        self.last_eval = metrics
        value = metrics[self.train_cfg.best_metric]
        improved = self.best is None or (value > self.best["value"] if self.higher_is_better
                                          else value < self.best["value"])
        if improved:
            self.best = {"step": self.step, "value": value, "metrics": metrics}
        # Every figure goes to metrics.jsonl; TensorBoard and wandb take the numbers (RunLogger filters).
        self.log.record({"step": self.step, **{k if k.startswith("val_") else f"val_{k}": v
                                               for k, v in metrics.items() if k != "step"}},
                        console=self._eval_console(metrics, improved))
        if not improved:
            return None
        saved = self._save()
        if saved is not None and self.dist.is_main:
            checkpoint.mark_best(self.ckpt_root, saved, self.train_cfg.keep_checkpoints)
        return saved

    def _eval_console(self, m: dict[str, Any], improved: bool) -> str:
        head = f"validation  step {self.step}  loss {m['val_loss']:.4f}  "
        body = format_classification(m) if "macro_f1" in m else \
            f"exact match {m['exact_match']:.4f}  chrF {m['chrf']:.2f}"
        best = self.best
        tail = (f"\n    new best {self.train_cfg.best_metric} {m[self.train_cfg.best_metric]:.4f}" if improved
                else f"\n    best so far: step {best['step']} ({self.train_cfg.best_metric} {best['value']:.4f})")
        return head + body + tail

    def _save(self) -> int | None:
        if self.last_loss is not None and not bool(torch.isfinite(self.last_loss)):
            self.log.say(f"[finetune] step {self.step}: loss not finite, checkpoint skipped")
            return None
        state = {"step": self.step, "total_steps": self.steps, "best": self.best, "last_eval": self.last_eval,
                 "task": self.task_facts(), "precision": self.train_cfg.precision,
                 "zero_stage": self.train_cfg.zero_stage}
        folder = checkpoint.save(self.engine, self.ckpt_root, self.step, state, self.hf_config.to_json_string(),
                                 self.dist, self.train_cfg.keep_checkpoints)
        self.log.say(f"[finetune] saved {folder}")
        return self.step

    def _write_summary(self) -> None:
        if not self.dist.is_main:
            return
        summary = {"task": self.task_facts(), "steps": self.step, "best": self.best, "final": self.last_eval,
                   "rows": {"train": len(self.task.train), "validation": len(self.task.validation)},
                   "data_problems": self.task.skipped.as_dict(), "config": to_plain(self.config)}
        write_text_atomic(self.run_dir / SUMMARY_FILE, json.dumps(summary, ensure_ascii=False, indent=2) + "\n")


# --- evaluation, shared with predict ------------------------------------------------------------------
def shard(items: list[Any], dist: Dist) -> list[tuple[int, Any]]:
    """This rank's (index, item) share; every rank gets the same count (the last item repeats, index -1),
    so ZeRO-3 ranks run the same number of forward passes."""
    per_rank = -(-len(items) // dist.world_size)
    mine = []
    for k in range(per_rank):
        i = k * dist.world_size + dist.rank
        mine.append((i, items[i]) if i < len(items) else (-1, items[-1]))
    return mine


def gather(results: list[tuple[int, Any]], dist: Dist) -> list[Any]:
    """Every rank's (index, result) pairs, in index order (padding dropped)."""
    if dist.world_size > 1:
        parts: list[Any] = [None] * dist.world_size
        torch.distributed.all_gather_object(parts, results)
        results = [pair for part in parts for pair in part]
    return [r for i, r in sorted((p for p in results if p[0] >= 0), key=lambda p: p[0])]


@torch.no_grad()
def evaluate(model: Any, task: TaskData, config: FinetuneConfig, dist: Dist) -> dict[str, Any]:
    """Validation metrics of `model` (a DeepSpeed engine or a bare model), on every rank.

    Classification scores each label's log-likelihood after the prompt and picks the best (and with
    task.generate_labels also generates, mapping the text onto the nearest label); generation decodes
    greedily. val_loss is the mean token loss of the gold labels.
    """
    encoder, batch, pad = task.encoder, config.train.micro_batch_size or 8, pad_id(task.tokenizer)
    synced = config.train.zero_stage == 3 and dist.world_size > 1
    mine = shard(task.validation, dist)
    results = []
    for start in range(0, len(mine), batch):
        chunk = mine[start:start + batch]
        scratch = Skipped()  # candidates cut or dropped here are not data problems
        # Each row's gold label, then (classification) every candidate label: one scoring pass for all.
        candidates = task.labels or []
        items = [encoder.encode(row, scratch, label=label)
                 for _, row in chunk for label in [row.label, *candidates]]
        empty = Encoded([encoder.eos], [encoder.eos])  # stands in for a dropped item: scores 0, no tokens
        lps = score(model, [e or empty for e in items], pad, task.seq2seq, dist.device, batch)
        out = []
        width = 1 + len(candidates)
        for k in range(len(chunk)):
            gold, row_lps = items[k * width], lps[k * width:(k + 1) * width]
            o = {"gold_lp": row_lps[0], "gold_tokens": gold.label_tokens if gold else 0}
            if candidates:
                scores = [lp if e is not None else -math.inf for lp, e in zip(row_lps[1:], items[k * width + 1:])]
                o["pred"] = candidates[int(np.argmax(scores))]
            out.append(o)
        if not task.labels or config.task.generate_labels:
            prompts = [encoder.fit_prompt(row.input, 0, row.where, scratch) or [encoder.eos] for _, row in chunk]
            generated = generate(model, encoder, prompts, dist.device,
                                 max_new_tokens=max_label_tokens(task, config), synced_gpus=synced)
            for o, ids in zip(out, generated):
                o["generated"] = decode(task.tokenizer, ids)
        results += [(i, o) for (i, _), o in zip(chunk, out)]
    scored = gather(results, dist)
    gold_labels = [row.label for row in task.validation]
    tokens = sum(o["gold_tokens"] for o in scored)
    metrics: dict[str, Any] = {"val_loss": -sum(o["gold_lp"] for o in scored if o["gold_tokens"]) / max(tokens, 1)}
    if task.labels:
        metrics.update(classification_metrics(gold_labels, [o["pred"] for o in scored], task.labels,
                                              task.majority))
        if config.task.generate_labels:
            mapped = [map_to_label(o["generated"], task.labels) for o in scored]
            metrics["mapped"] = sum(needed for _, needed in mapped)
            metrics["generated_accuracy"] = sum(m == g for (m, _), g in zip(mapped, gold_labels)) / len(gold_labels)
    else:
        metrics.update(generation_metrics(gold_labels, [o["generated"] for o in scored]))
    return metrics


def max_label_tokens(task: TaskData, config: FinetuneConfig) -> int:
    """New tokens to generate at evaluation: the longest label (+ EOS) for classification."""
    if task.labels:
        return max(len(task.encoder.label_ids(label)) for label in task.labels)
    return config.predict.max_new_tokens
