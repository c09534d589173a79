"""`gptpipe predict`: greedy or beam-search outputs of a fine-tuned model, one jsonl line per input row.

The model is a fine-tune run folder (its best checkpoint), one of its checkpoint folders, or an exported HF
folder. Each line holds the input, the prediction, the label when the row has one, and the score: the
prediction's log-likelihood given the prompt (a teacher-forced pass, comparable between greedy and beam).
For classification the generated text is mapped onto the nearest label by edit distance and the line says
whether it had to be. With labels present the metrics go to the console and beside the output
(`<output>.metrics.json`). Several ranks split the rows; under ZeRO-3 they hold one partitioned model and
generate in lockstep (synced_gpus), since every rank must run the same number of forward passes.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gptpipe.data.jsonl import CUT_TO_FIT, TOO_LONG, Reasons
from gptpipe.log import get_logger
from gptpipe.artifacts import EXIT_BAD_INPUT
from gptpipe.finetune.config import AUTO, FinetuneConfig
from gptpipe.finetune.metrics import map_to_label
from gptpipe.finetune.data import model_positions
from gptpipe.runtime.batching import pad_id
from gptpipe.finetune.kinds import task_kind
from gptpipe.runtime.scoring import as_scored, decode, gather, generate, is_seq2seq, score, shard
from gptpipe.finetune.run_files import TASK_FILE, TOKENIZER_DIR
from gptpipe.finetune.task_kind import TaskFacts, TaskKind
from gptpipe.stage import StageInputError, write_text_atomic
from gptpipe.runtime import checkpoint
from gptpipe.runtime.engine import Dist
from gptpipe.runtime.loop import run_ranks
from gptpipe.runtime.model import inference_config, load_pretrained

log = get_logger("predict")


@dataclass
class Predictor:
    """A model ready to generate, with the task it was fine-tuned for."""

    model: Any
    tokenizer: Any
    task: TaskFacts  # task.json
    source: str

    @property
    def kind(self) -> TaskKind:
        return task_kind(self.task.kind)

    @property
    def encoder(self) -> Any:
        # Every input gets a prediction: a long one is cut (at its end), never dropped.
        return self.kind.encoder(self.tokenizer, self.task, too_long="truncate")


def resolve_checkpoint(path: Path) -> Path | None:
    """The checkpoint folder `path` names: itself, or a run folder's best (else newest) checkpoint; None
    for anything else (an exported HF folder)."""
    if (path / checkpoint.STATE).is_file():
        return path
    root = path / "checkpoints"
    best = checkpoint.best_tag(root)
    if best and (root / best / checkpoint.COMPLETE_MARKER).is_file():
        return root / best
    return checkpoint.newest_checkpoint(root)


def load_predictor(config: FinetuneConfig, source: Path, device: torch.device) -> Predictor:
    """The fine-tuned model (fp32) and its task from a checkpoint, run folder or exported folder."""
    from transformers import AutoTokenizer

    if not source.exists():
        raise StageInputError(f"predict.model {source} does not exist. Fine-tune first: bash 7_finetune.sh")
    folder = resolve_checkpoint(source)
    if folder is None:
        if not (source / "config.json").is_file():
            raise StageInputError(f"{source} is neither a fine-tune run/checkpoint nor a HF model folder")
        task_file = source / TASK_FILE
        task = TaskFacts.read(task_file, config.task.kind) if task_file.is_file() else _task_from_config(config, source)
        model = load_pretrained(source, task.seq2seq)
        inference_config(model.config)  # an export made before its config left the router switch off
        return Predictor(model.to(device).eval(), AutoTokenizer.from_pretrained(source), task, str(source))

    found = checkpoint.find_checkpoint(folder)
    model = checkpoint.model_from_checkpoint(found, merge=False)  # LoRA: as trained, the export's merge apart
    tokenizer = AutoTokenizer.from_pretrained(found.run_dir / TOKENIZER_DIR)
    task = TaskFacts.from_dict(found.state["task"], str(found.path), config.task.kind)
    return Predictor(model.to(device), tokenizer, task, str(folder))


def _task_from_config(config: FinetuneConfig, folder: Path) -> TaskFacts:
    """An exported folder without task.json: the task as finetune_config.yaml describes it."""
    kind, labels = task_kind(config.task.kind), None
    if kind.labelled:
        if not config.data.train.is_file():
            raise StageInputError(f"{folder} has no {TASK_FILE} and data.train {config.data.train} (the label set) "
                                  f"does not exist")
        labels = kind.label_set(kind.read(config.data.train, config.data, Reasons()))
    return TaskFacts(kind.name, is_seq2seq(folder, config.model.kind), _seq_len_from_config(config, folder),
                     config.task.prompt, config.data.too_long, labels, labels[0] if labels else None)


def _seq_len_from_config(config: FinetuneConfig, folder: Path) -> int:
    """train.seq_len for a folder without task.json; auto, which no fine-tune resolved for it, is the model's
    positions (its training rows are unknown)."""
    if config.train.seq_len != AUTO:
        return config.train.seq_len
    positions = model_positions(folder)
    if positions is None:
        raise StageInputError(f"{folder} has no {TASK_FILE} and its config states no position limit: set "
                              f"train.seq_len to the tokens an input may take")
    log.info(f"train.seq_len auto: {positions} tokens, the model's positions ({folder} has no {TASK_FILE} "
             f"recording a fine-tune's)")
    return positions


def read_input(config: FinetuneConfig, args: argparse.Namespace, kind: TaskKind) -> tuple[list[Any], Reasons, str]:
    """(rows, skipped rows, name for the output file) from --input, predict.input or data.test, read as the
    model's task kind reads them, labels optional (a chat model reads conversations, stdin one user turn a line;
    a row ending in an assistant turn has it as its label)."""
    chosen = getattr(args, "input", None)
    if chosen == "-":
        return kind.read_lines(list(sys.stdin)), Reasons(), "stdin"
    path = Path(chosen) if chosen else (config.predict.input or config.data.test)
    if path is None or not path.is_file():
        raise StageInputError(f"no input to predict: {path} does not exist (give --input PATH, or - for stdin)")
    skipped = Reasons()
    return kind.read(path, config.data, skipped, need_answer=False), skipped, path.stem


def run(config: FinetuneConfig, args: argparse.Namespace) -> int:
    return run_ranks(lambda dist: _predict(config, args, dist))


def _predict(config: FinetuneConfig, args: argparse.Namespace, dist: Dist) -> int:
    settings = config.predict
    try:
        predictor = load_predictor(config, settings.model or config.train.output_model_dir, dist.device)
        rows, skipped, name = read_input(config, args, predictor.kind)
        if not rows:
            raise StageInputError(f"no usable rows to predict in {name}:\n{skipped.lines()}")
    except StageInputError as exc:
        if dist.is_main:
            log.error(f"refused: {exc}")
        return EXIT_BAD_INPUT
    output = getattr(args, "output", None) or settings.output or (
        config.train.output_model_dir / "predictions" / f"{name}.jsonl")
    if dist.is_main:
        search = f"beam {settings.num_beams}" if settings.num_beams > 1 else "greedy"
        log.info(f"{predictor.source}: {len(rows):,} rows, {search}"
                 + (f"\n{skipped.lines()}" if skipped.counts else ""))
    model, synced = predictor.model, config.train.zero_stage == 3 and dist.world_size > 1
    if synced:
        model = _zero3(model, config, dist)
    results = predict_rows(model, predictor, rows, config, dist, synced)
    if not dist.is_main:
        return 0
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(output, lines)
    log.info(f"wrote {len(results):,} predictions to {output}")
    metrics = prediction_metrics(results, predictor)
    if metrics:
        write_text_atomic(output.with_suffix(".metrics.json"), json.dumps(metrics, ensure_ascii=False, indent=2))
        log.info(predictor.kind.headline(metrics))
    return 0


def _zero3(model: Any, config: FinetuneConfig, dist: Dist) -> Any:
    """The model partitioned over the ranks by ZeRO-3 (no optimizer): each rank holds a share of it."""
    import deepspeed

    ds_config = {"train_micro_batch_size_per_gpu": config.predict.batch_size, "zero_optimization": {"stage": 3},
                 "bf16": {"enabled": config.train.precision == "bf16" and dist.device.type == "cuda"}}
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    engine.eval()
    return engine


@torch.no_grad()
def predict_rows(model: Any, predictor: Predictor, rows: list[Any], config: FinetuneConfig, dist: Dist,
                 synced: bool) -> list[dict[str, Any]]:
    """One result per row, in input order, on the main rank (every rank gets them). Each row is answered from
    the prompt its kind gives (kind.prompt) leaving max_new_tokens within seq_len: an input cut at its end, a
    conversation's oldest exchanges left out as `gptpipe chat` leaves them (`cut`: how many turns); a row that
    cannot leave them gets no answer (prediction null, `too_long` says why)."""
    settings, encoder, task, kind = config.predict, predictor.encoder, predictor.task, predictor.kind
    pad = pad_id(predictor.tokenizer)
    scratch = Reasons()
    mine = shard(rows, dist)
    results = []
    for start in range(0, len(mine), settings.batch_size):
        chunk = mine[start:start + settings.batch_size]
        prompts, notes = [], []
        for i, row in chunk:
            counted = scratch if i >= 0 else Reasons()  # a rank's padding repeats a row: not counted twice
            prompt, note = kind.prompt(encoder, row, settings.max_new_tokens, counted)
            # A row without a prompt still takes its place in the batch: ZeRO-3 ranks generate in lockstep.
            prompts.append(prompt or [encoder.eos])
            notes.append(note)
        generated = generate(model, encoder, prompts, dist.device, num_beams=settings.num_beams,
                             max_new_tokens=settings.max_new_tokens, length_penalty=settings.length_penalty,
                             synced_gpus=synced)
        scores = score(model, [as_scored(p, g, encoder.seq2seq) for p, g in zip(prompts, generated)], pad,
                       encoder.seq2seq, dist.device, settings.batch_size)
        for (i, row), ids, lp, note in zip(chunk, generated, scores, notes):
            text = decode(predictor.tokenizer, ids)
            result: dict[str, Any] = {**kind.row_fields(row), "prediction": text}
            if task.labels:
                result["prediction"], result["mapped"] = map_to_label(text, task.labels)
                result["generated"] = text
            if row.label is not None:
                result["label"] = row.label
            result["score"] = lp
            if "too_long" in note:
                result["prediction"], result["score"] = None, None
            results.append((i, {**result, **note}))
    limit = f"to leave predict.max_new_tokens {settings.max_new_tokens} within seq_len {task.seq_len}"
    if scratch.counts[CUT_TO_FIT]:
        log.info(f"rank {dist.rank}: {scratch.counts[CUT_TO_FIT]} {kind.cut_note()} {limit}")
    if scratch.counts[TOO_LONG]:
        log.warning(f"rank {dist.rank}: {scratch.counts[TOO_LONG]} {kind.row_noun} too long {limit} even cut: no "
                    f"answer (prediction null), e.g. {'; '.join(scratch.examples[TOO_LONG])}")
    return gather(results, dist)


def prediction_metrics(results: list[dict[str, Any]], predictor: Predictor) -> dict[str, Any] | None:
    """The kind's figures of the rows that have a label (None when none has); a conversation too long to answer
    counts as an empty answer."""
    labelled = [r for r in results if "label" in r]
    if not labelled:
        return None
    gold, predicted = [r["label"] for r in labelled], [r["prediction"] or "" for r in labelled]
    return predictor.kind.answer_metrics(gold, predicted, labelled, predictor.task)
