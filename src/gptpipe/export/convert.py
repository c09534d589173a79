"""Stage 4: a stage-3 checkpoint → a verified HuggingFace folder (4_convert_to_HF.sh, convert_config.yaml).

The folder holds safetensors weights, config.json (the tokenizer's vocabulary and special ids, the trained
context length), generation_config.json, the stage-1 fast tokenizer, a model card with a loss curve, and
manifest.json with the verification report. The gate (verify.py) runs before the folder replaces an
older one; a folder that fails it is still written, for inspection, but its manifest says
``verified: false`` and stage 6 refuses to upload it.

A run continued from a base model (model.init_from) is exported with the base's config, generation_config.json
and tokenizer files, byte for byte, once the base folder is checked to be the one the run recorded.

``input_model_dir`` may also be a fine-tune run (stage 7, `gptpipe finetune`): its best checkpoint (or
checkpoint_step) is exported the same way, as a causal LM or an encoder-decoder, with the run's tokenizer,
its task.json (what `gptpipe predict` needs) and a card holding the task, the label set, the validation
metrics beside the majority baseline and the curves; the gate (verify_finetune.py) checks it on the
validation rows of the fine-tune's data.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from gptpipe.config.core import to_plain
from gptpipe.export.card import (LOSS_CURVE, METRIC_CURVE, CardFacts, FinetuneCardFacts, final_val_loss,
                                 plot_loss_curve, plot_metric_curve, render_card, render_finetune_card)
from gptpipe.export.checkpoint import finetune_config, training_config
from gptpipe.finetune.metrics import TASK_METRICS
from gptpipe.finetune.run_files import SUMMARY_FILE, TASK_FILE, TOKENIZER_DIR
from gptpipe.train.bucket import local_checkpoint_source
from gptpipe.train.base_model import BaseModel, is_copied
from gptpipe.train.checkpoint import STATE, Checkpoint, consolidate, find_checkpoint, model_from_checkpoint
from gptpipe.export.config import ConvertConfig
from gptpipe.log import get_logger
from gptpipe.remote import staging
from gptpipe.stage import (Manifest, StageFailed, StageInputError, StageResult, atomic_dir, file_fingerprint,
                           tree_fingerprint, write_text_atomic)
from gptpipe.stages import (CONVERT, EXIT_OK, TOKENIZE, TRAIN_TOKENIZER, DatasetInfo, TokenizerInfo, read_dataset,
                            read_tokenizer)
from gptpipe.train.logging import read_metrics

log = get_logger("convert")

HELDOUT_DOCUMENTS = 32
VERIFY_ROWS = 8  # a fine-tune's validation rows the gate compares logits and tokenizers on
FINETUNE_CARD_KEYS = ("seq_len", "global_batch_size", "train_epochs", "train_iters", "lr", "min_lr", "lr_schedule",
                      "warmup_fraction", "weight_decay", "precision", "zero_stage", "seed", "best_metric")
# What the export depends on (the card names the repository); privacy and branch can change without a re-export.
EXPORT_KEYS = ("input_model_dir", "checkpoint_step", "output_tokenizer_and_model_dir", "dtype",
               "max_shard_size", "test_prompt_text", "huggingface_name", "hugging_face_name", "organization")
GENERATION_DEFAULTS = {"do_sample": True, "temperature": 0.8, "top_p": 0.95, "max_new_tokens": 128}


def _ids(value: Any) -> set[int]:
    return set(value) if isinstance(value, list) else {value}


def check_tokenizer_fits(checkpoint: Checkpoint, tokenizer: Any) -> None:
    """Refuse early when the tokenizer is not the one the model was trained with."""
    cfg = checkpoint.hf_config
    problems = []
    if not tokenizer.vocab_size <= cfg["vocab_size"] < tokenizer.vocab_size + 128:
        problems.append(f"the model has {cfg['vocab_size']} embedding rows, the tokenizer {tokenizer.vocab_size} "
                        "pieces (stage 3 pads the vocabulary by less than 128)")
    for name in ("bos", "eos", "pad"):
        trained, told = cfg.get(f"{name}_token_id"), getattr(tokenizer, f"{name}_id")
        if told not in _ids(trained):
            problems.append(f"{name} id is {trained} in the checkpoint, {told} in the tokenizer")
    if problems:
        raise StageInputError(f"tokenizer {tokenizer.hf_dir.parent} does not match checkpoint {checkpoint.path}: "
                              + "; ".join(problems))


def heldout_documents(prefix: Path, count: int, separator: int, split: str, seed: int) -> Any:
    """Up to `count` documents that training never saw: the first of the valid/test splits (gptpipe.data.split)."""
    from gptpipe.data.indexed import IndexedDataset
    from gptpipe.data.split import unseen_documents
    from gptpipe.export.verify import HeldOut

    reader = IndexedDataset(prefix)
    unseen = unseen_documents(split, len(reader), seed)[:count]
    docs = [[t for t in reader[int(i)].tolist() if t != separator] for i in unseen]
    return HeldOut([d for d in docs if d], f"{len(docs)} validation/test documents of {prefix.name}")


def _corpus_lines(training: dict[str, Any]) -> list[str]:
    return [" ".join(str(v) for k, v in s.items() if v not in (None, "") and k in ("type", "path", "name", "subset"))
            for s in training["corpus"]["sources"]]


def reference_models(checkpoint: Checkpoint, state_dict: dict[str, Any], dtype: str) -> tuple[Any, Any]:
    """(the checkpoint's model in the export dtype, the same in fp32): what the exported folder must match."""
    from gptpipe.export.verify import TORCH_DTYPES, cast_parameters

    reference_fp32 = model_from_checkpoint(checkpoint, state_dict)
    if dtype == "fp32":
        return reference_fp32, reference_fp32
    return cast_parameters(model_from_checkpoint(checkpoint, state_dict), TORCH_DTYPES[dtype]), reference_fp32


def export(config: ConvertConfig, checkpoint: Checkpoint, tokenizer: TokenizerInfo, datasets: list[DatasetInfo],
           heldout: Any, base: BaseModel | None = None) -> StageResult:
    """The stage-4 folder of a pretraining run; `base`: the base model a continued run started from, whose
    config, generation_config.json and tokenizer files the folder keeps (no padding to drop)."""
    from transformers import GenerationConfig

    from gptpipe.export.verify import TORCH_DTYPES, cast_parameters, verify_continued_export, verify_export

    out = staging(CONVERT, config.output_tokenizer_and_model_dir)
    dtype = TORCH_DTYPES[config.dtype]
    log.info(f"consolidating {checkpoint.path} (step {checkpoint.step}) with DeepSpeed's zero_to_fp32")
    state_dict = consolidate(checkpoint)
    reference, reference_fp32 = reference_models(checkpoint, state_dict, config.dtype)

    exported = model_from_checkpoint(checkpoint, state_dict)
    if base is None:
        # The padding rows past the tokenizer's vocabulary were never trained: drop them so sampling cannot pick
        # them.
        exported.resize_token_embeddings(tokenizer.vocab_size, mean_resizing=False)
        exported.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id,
            **GENERATION_DEFAULTS)
    cast_parameters(exported, dtype)
    parameters = exported.num_parameters()

    with atomic_dir(out) as tmp:
        log.info(f"writing {config.dtype} safetensors (shards above {config.max_shard_size}) to {out}")
        exported.save_pretrained(tmp, max_shard_size=config.max_shard_size)
        # A base's files replace what save_pretrained wrote (its generation_config.json), byte for byte.
        source = [base.folder / n for n in sorted(os.listdir(base.folder)) if is_copied(n)] if base else \
            sorted(tokenizer.hf_dir.iterdir())
        for f in source:
            if f.is_file():
                shutil.copy2(f, tmp / f.name)
        if base:
            report = verify_continued_export(tmp, reference, reference_fp32, base, heldout, config.test_prompt_text,
                                             config.dtype)
        else:
            report = verify_export(tmp, reference, reference_fp32, tokenizer, heldout, config.test_prompt_text,
                                   config.dtype)
        rows = read_metrics(checkpoint.run_dir / "metrics.jsonl", checkpoint.step)
        training = to_plain(training_config(checkpoint))
        facts = CardFacts(
            title=config.repo_name or out.name, model_config=exported.config, parameters=parameters,
            step=checkpoint.step, tokens_seen=checkpoint.state.get("tokens"), corpus=_corpus_lines(training),
            datasets=[d.card_facts() for d in datasets],
            tokenizer={"vocab_size": tokenizer.vocab_size,
                       "chars_per_token": getattr(tokenizer, "chars_per_token", None)},
            training_config={k: training[k] for k in ("model", "train", "data")},
            final_val_loss=final_val_loss(checkpoint.state, rows), verification=report,
            has_loss_curve=plot_loss_curve(rows, tmp / LOSS_CURVE),
            base_model={"name": base.folder.name, "model_type": base.model_type} if base else None)
        repo_id = f"{config.organization or 'YOUR_HF_USER'}/{config.repo_name or out.name}"
        write_text_atomic(tmp / "README.md", render_card(facts, repo_id))
        files = sorted(p.relative_to(tmp) for p in tmp.rglob("*") if p.is_file())
    counts = {"checkpoint": str(checkpoint.path), "step": checkpoint.step, "parameters": parameters,
              "final_val_loss": facts.final_val_loss, "files": len(files),
              "bytes": sum((out / f).stat().st_size for f in files), **report}
    return StageResult(outputs=files, counts=counts)


def convert_continued(config: ConvertConfig, checkpoint: Checkpoint, training: Any, args: Any) -> Manifest:
    """A run continued from a base model (model.init_from): the base folder must still hold the files the run
    recorded when it initialised from them."""
    from gptpipe.train.base_model import BASE_STATE_KEY, check_unchanged, open_base

    state_file = checkpoint.path / STATE
    record = checkpoint.state.get(BASE_STATE_KEY)
    if record is None:
        raise StageInputError(f"{state_file}: the run record names model.init_from {training.model.init_from} but "
                              "holds no record of its files")
    base = open_base(training.model.init_from)
    check_unchanged(record, base.folder, str(state_file))
    datasets = [read_dataset(p) for p in training.data.prefixes]
    inputs = {
        "checkpoint": {"path": str(checkpoint.path),
                       **tree_fingerprint([p for p in checkpoint.path.rglob("*") if p.is_file()])},
        "base_model": {"folder": str(base.folder), "sha256": {n: f["sha256"] for n, f in record["files"].items()}},
        "datasets": [TOKENIZE.fingerprint(d.prefix) for d in datasets],
    }
    settings = {k: getattr(config, k) for k in EXPORT_KEYS}
    heldout = heldout_documents(datasets[0].prefix, HELDOUT_DOCUMENTS, base.tokenizer.eod_id, training.data.split,
                                training.data.seed)
    return CONVERT.run(
        config.output_tokenizer_and_model_dir, settings, inputs,
        lambda: export(config, checkpoint, base.tokenizer, datasets, heldout, base),
        force=args.force, versions=("torch", "transformers", "deepspeed", "safetensors", "tokenizers"))


def convert_pretrained(config: ConvertConfig, checkpoint: Checkpoint, args: Any) -> Manifest:
    training = training_config(checkpoint)  # the run record, never the config.yaml on disk (it may have changed)
    if training.model.init_from is not None:
        return convert_continued(config, checkpoint, training, args)
    tokenizer = read_tokenizer(training.tokenize.tokenizer_dir)
    check_tokenizer_fits(checkpoint, tokenizer)
    datasets = [read_dataset(p) for p in training.data.prefixes]
    inputs = {
        "checkpoint": {"path": str(checkpoint.path),
                       **tree_fingerprint([p for p in checkpoint.path.rglob("*") if p.is_file()])},
        "tokenizer": TRAIN_TOKENIZER.fingerprint(tokenizer.hf_dir.parent),
        "datasets": [TOKENIZE.fingerprint(d.prefix) for d in datasets],
    }
    settings = {k: getattr(config, k) for k in EXPORT_KEYS}
    heldout = heldout_documents(datasets[0].prefix, HELDOUT_DOCUMENTS, tokenizer.eod_id, training.data.split,
                                training.data.seed)
    return CONVERT.run(
        config.output_tokenizer_and_model_dir, settings, inputs,
        lambda: export(config, checkpoint, tokenizer, datasets, heldout),
        force=args.force, versions=("torch", "transformers", "deepspeed", "safetensors", "tokenizers", "sentencepiece"))


# --- a fine-tune run (stage 7) -------------------------------------------------------------------------------
def validation_rows(checkpoint: Checkpoint) -> tuple[Any, Path]:
    """(the first validation rows of the fine-tune's data, the file they come from), as its run record says:
    data.validation, or the seeded share of data.train it split off."""
    from gptpipe.export.verify_finetune import TaskRows
    from gptpipe.finetune.data import read_rows, split_validation

    data = finetune_config(checkpoint).data
    path = data.validation or data.train
    if not path.is_file():
        key = "validation" if data.validation else "train"
        raise StageInputError(f"the fine-tune's validation rows are gone: {path} (data.{key} of the run record) "
                              "does not exist; the gate checks the export on them")
    rows, _ = read_rows(path, data.format, data.input_key, data.label_key)
    if data.validation is None:
        rows = split_validation(rows, data.validation_proportion, data.seed)[1]
        source = f"{min(VERIFY_ROWS, len(rows))} rows of the validation split of {path.name}"
    else:
        source = f"first {min(VERIFY_ROWS, len(rows))} rows of {path.name}"
    if not rows:
        raise StageInputError(f"{path} holds no usable validation row to verify the export on")
    return TaskRows(rows[:VERIFY_ROWS], checkpoint.state["task"], source), path


def shareable_task(task: dict[str, Any]) -> dict[str, Any]:
    """The task facts for task.json and the card: local paths cut to their names (the folder may go public)."""
    return {k: Path(v).name if k in ("pretrained_model", "train_file") and v else v for k, v in task.items()}


def step_metrics(state: dict[str, Any], step: int) -> dict[str, Any] | None:
    """The validation metrics of the checkpoint's own step (its best or last evaluation), if it was evaluated."""
    for record in (state.get("best") or {}).get("metrics"), state.get("last_eval"):
        if record and record.get("step") == step:
            return record
    return None


def export_finetune(config: ConvertConfig, checkpoint: Checkpoint, data: Any) -> StageResult:
    from transformers import AutoTokenizer, GenerationConfig

    from gptpipe.export.verify import TORCH_DTYPES, cast_parameters
    from gptpipe.export.verify_finetune import verify_finetune_export
    from gptpipe.finetune.data import pad_id

    out, run = staging(CONVERT, config.output_tokenizer_and_model_dir), checkpoint.run_dir
    tokenizer = AutoTokenizer.from_pretrained(run / TOKENIZER_DIR)
    log.info(f"consolidating fine-tune checkpoint {checkpoint.path} (step {checkpoint.step}) with zero_to_fp32")
    state_dict = consolidate(checkpoint)
    reference, reference_fp32 = reference_models(checkpoint, state_dict, config.dtype)
    # Same shape as the pretrained model: its embedding rows past the tokenizer (a hub model's padding) stay.
    exported = cast_parameters(model_from_checkpoint(checkpoint, state_dict), TORCH_DTYPES[config.dtype])
    task = checkpoint.state["task"]
    # Deterministic answers by default, as evaluation produced them: greedy, long enough for any label.
    exported.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=pad_id(tokenizer),
        decoder_start_token_id=getattr(exported.config, "decoder_start_token_id", None), do_sample=False,
        max_new_tokens=data.max_new_tokens(tokenizer) if task.get("labels")
        else finetune_config(checkpoint).predict.max_new_tokens)
    parameters = exported.num_parameters()

    with atomic_dir(out) as tmp:
        log.info(f"writing {config.dtype} safetensors (shards above {config.max_shard_size}) to {out}")
        exported.save_pretrained(tmp, max_shard_size=config.max_shard_size)
        for f in sorted((run / TOKENIZER_DIR).iterdir()):
            if f.is_file():
                shutil.copy2(f, tmp / f.name)
        public_task = shareable_task(task)
        write_text_atomic(tmp / TASK_FILE, json.dumps(public_task, ensure_ascii=False, indent=2) + "\n")
        report = verify_finetune_export(tmp, reference, reference_fp32, tokenizer, data, config.dtype)
        rows = read_metrics(run / "metrics.jsonl", checkpoint.step)
        summary_path = run / SUMMARY_FILE
        summary = json.loads(summary_path.read_text(encoding="utf-8")) if summary_path.is_file() else {}
        finetuning = to_plain(finetune_config(checkpoint))
        metrics = step_metrics(checkpoint.state, checkpoint.step)
        facts = FinetuneCardFacts(
            title=config.repo_name or out.name, model_config=exported.config, parameters=parameters,
            step=checkpoint.step, total_steps=checkpoint.state.get("total_steps"), task=public_task,
            best=checkpoint.state.get("best"), metrics=metrics,
            rows={**summary.get("rows", {}), "skipped": summary.get("data_problems", {}).get("skipped", {})},
            training_config={k: finetuning["train"][k] for k in FINETUNE_CARD_KEYS},
            verification=report, has_loss_curve=plot_loss_curve(rows, tmp / LOSS_CURVE),
            has_metric_curve=plot_metric_curve(rows, task["kind"], tmp / METRIC_CURVE),
            comparison=summary.get("comparison"))
        repo_id = f"{config.organization or 'YOUR_HF_USER'}/{config.repo_name or out.name}"
        write_text_atomic(tmp / "README.md", render_finetune_card(facts, repo_id))
        files = sorted(p.relative_to(tmp) for p in tmp.rglob("*") if p.is_file())
    headline = {m.key: metrics[m.key] for m in TASK_METRICS[task["kind"]]} if metrics else {}
    counts = {"checkpoint": str(checkpoint.path), "step": checkpoint.step, "task": task["kind"],
              "best_step": (checkpoint.state.get("best") or {}).get("step"), "parameters": parameters, **headline,
              "files": len(files), "bytes": sum((out / f).stat().st_size for f in files), **report}
    return StageResult(outputs=files, counts=counts)


def convert_finetune(config: ConvertConfig, checkpoint: Checkpoint, args: Any) -> Manifest:
    tokenizer_dir = checkpoint.run_dir / TOKENIZER_DIR
    if not tokenizer_dir.is_dir():
        raise StageInputError(f"{tokenizer_dir} not found: a fine-tune run keeps its tokenizer there "
                              "(bash 7_finetune.sh writes it when it starts)")
    data, data_file = validation_rows(checkpoint)
    inputs = {
        "checkpoint": {"path": str(checkpoint.path),
                       **tree_fingerprint([p for p in checkpoint.path.rglob("*") if p.is_file()])},
        "tokenizer": tree_fingerprint([p for p in tokenizer_dir.iterdir() if p.is_file()]),
        "validation": {"path": str(data_file), **file_fingerprint(data_file)},
    }
    settings = {k: getattr(config, k) for k in EXPORT_KEYS}
    return CONVERT.run(
        config.output_tokenizer_and_model_dir, settings, inputs,
        lambda: export_finetune(config, checkpoint, data), force=args.force,
        versions=("torch", "transformers", "deepspeed", "safetensors", "tokenizers"))


def run(config: ConvertConfig, args: Any) -> int:
    source = local_checkpoint_source(config.input_model_dir, config.checkpoint_step)
    checkpoint = find_checkpoint(source, config.checkpoint_step)
    convert = convert_finetune if checkpoint.is_finetune else convert_pretrained
    manifest = convert(config, checkpoint, args)
    out = config.output_tokenizer_and_model_dir
    counts = manifest.counts
    if not counts.get("verified"):
        raise StageFailed(f"{out} did not pass verification (marked verified: false in "
                          f"{CONVERT.manifest_path(staging(CONVERT, out))}; it will not be uploaded):\n  - "
                          + "\n  - ".join(counts.get("failures", [])))
    log.info(f"{out}: verified (logits max |Δ| {counts['logits_max_abs_diff']:.2g} in {counts['dtype']}, "
             f"{counts['tokenizer_texts']} texts tokenized identically). "
             f"Greedy sample: {counts.get('greedy_sample')!r}")
    print(out)
    return EXIT_OK
