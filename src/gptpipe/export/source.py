"""What a run brings to its export (stage 4): a pretraining run, a run continued from a base model, or a fine-tune.

Each source supplies the inputs' fingerprint, the files copied beside the weights (tokenizer files; a base's
every non-weight file; a fine-tune's task.json), the generation config, the gate's rows and the tokenizer its
ids must equal, and the card's source-specific blocks. `convert.export` does everything else the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from gptpipe.config.core import to_plain
from gptpipe.export.card import (METRIC_CURVE, BaseBlock, CardBlocks, CorpusBlock, TaskBlock, final_val_loss,
                                 plot_metric_curve)
from gptpipe.export.checkpoint import finetune_config, training_config
from gptpipe.export.config import ConvertConfig
from gptpipe.export.verify import DocumentRows, GateSpec, TaskRows, TokenizerReference
from gptpipe.finetune.run_files import SUMMARY_FILE, TASK_FILE, TOKENIZER_DIR
from gptpipe.finetune.task_kind import TaskFacts
from gptpipe.stage import StageInputError, file_fingerprint, tree_fingerprint
from gptpipe.artifacts import (TOKENIZE, TRAIN_TOKENIZER, DatasetInfo, TokenizerInfo, read_dataset,
                               read_tokenizer)
from gptpipe.tokenizer.hf import SENTENCEPIECE_FILE, exported_config
from gptpipe.runtime.checkpoint import STATE, Checkpoint
from gptpipe.runtime.metrics_rows import Row

if TYPE_CHECKING:
    from gptpipe.data.base_tokenizer import PretrainedTokenizer
    from gptpipe.pipeline import PipelineConfig
    from gptpipe.runtime.base_model import BaseModel

HELDOUT_DOCUMENTS = 32
VERIFY_ROWS = 8  # a fine-tune's validation rows the gate compares logits and tokenizers on
FINETUNE_CARD_KEYS = ("seq_len", "global_batch_size", "train_epochs", "train_iters", "lr", "min_lr", "lr_schedule",
                      "warmup_fraction", "weight_decay", "precision", "zero_stage", "seed", "best_metric")
GENERATION_DEFAULTS = {"do_sample": True, "temperature": 0.8, "top_p": 0.95, "max_new_tokens": 128}
VERSIONS = ("torch", "transformers", "deepspeed", "safetensors", "tokenizers")


class ExportSource(Protocol):
    """One kind of run, as the export pipeline reads it."""

    checkpoint: Checkpoint
    versions: tuple[str, ...]  # packages whose versions the manifest records
    vocab_size: int | None  # embedding rows the export keeps (None: all of the checkpoint's)

    def inputs(self) -> dict[str, Any]:
        """The fingerprint of everything the export reads: a change re-exports."""

    def copied_files(self) -> dict[str, Path]:
        """Files copied into the folder unchanged, by their name there (after save_pretrained: they replace
        its files)."""

    def written_files(self) -> dict[str, str]:
        """Further files of the folder: name → text."""

    def generation_config(self, model_config: Any) -> Any:
        """The folder's GenerationConfig (None: the copied generation_config.json stands)."""

    def gate(self) -> GateSpec:
        """The gate's rows, the tokenizer to compare against, the ids the model was trained with."""

    def card(self, folder: Path, metrics: list[Row]) -> tuple[CardBlocks, dict[str, Any]]:
        """(the card's source-specific blocks, the manifest counts they give); curves are drawn into `folder`."""


def _checkpoint_inputs(checkpoint: Checkpoint) -> dict[str, Any]:
    return {"path": str(checkpoint.path), **tree_fingerprint([p for p in checkpoint.path.rglob("*") if p.is_file()])}


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


def heldout_documents(prefix: Path, count: int, separator: int, split: str, seed: int, prompt: str) -> DocumentRows:
    """Up to `count` documents that training never saw: the first of the valid/test splits (gptpipe.data.split)."""
    from gptpipe.data.split import unseen_document_ids

    docs = unseen_document_ids(prefix, count, split, seed, frozenset({separator}))
    return DocumentRows(docs, f"{len(docs)} validation/test documents of {prefix.name}", separator, prompt)


# --- a pretraining run (stage 3) ---------------------------------------------------------------------------
@dataclass
class PretrainSource:
    """A stage-3 run trained from scratch on the stage-1 SentencePiece tokenizer."""

    checkpoint: Checkpoint
    training: PipelineConfig  # the run record, never the config.yaml on disk (it may have changed)
    tokenizer: TokenizerInfo  # stage 1's (a continued run: the base's, ContinuedSource)
    datasets: list[DatasetInfo]
    rows: DocumentRows
    versions: ClassVar[tuple[str, ...]] = (*VERSIONS, "sentencepiece")

    @property
    def vocab_size(self) -> int | None:
        # The padding rows past the tokenizer's vocabulary were never trained: dropped, sampling cannot pick them.
        return self.tokenizer.vocab_size

    def inputs(self) -> dict[str, Any]:
        return {"checkpoint": _checkpoint_inputs(self.checkpoint),
                "tokenizer": TRAIN_TOKENIZER.fingerprint(self.tokenizer.hf_dir.parent),
                "datasets": [TOKENIZE.fingerprint(d.prefix) for d in self.datasets]}

    def copied_files(self) -> dict[str, Path]:
        # The SentencePiece model too: converters (llama.cpp's) build their vocabulary from it.
        return {**{p.name: p for p in sorted(self.tokenizer.hf_dir.iterdir()) if p.is_file()},
                SENTENCEPIECE_FILE: self.tokenizer.model_path}

    def written_files(self) -> dict[str, str]:
        return {"tokenizer_config.json": exported_config(self.tokenizer.hf_dir)}

    def generation_config(self, model_config: Any) -> Any:
        from transformers import GenerationConfig

        t = self.tokenizer
        return GenerationConfig(bos_token_id=t.bos_id, eos_token_id=t.eos_id, pad_token_id=t.pad_id,
                                **GENERATION_DEFAULTS)

    def compare_tokenizer(self, tokenizer: Any) -> tuple[int, int, list[str]]:
        """The folder's ids against SentencePiece's on the held-out documents' text and the test prompt."""
        import sentencepiece

        from gptpipe.tokenizer.hf import compare

        sp = sentencepiece.SentencePieceProcessor(model_file=str(self.tokenizer.model_path))
        texts = [sp.decode(doc) for doc in self.rows.documents] + [self.rows.prompt]
        failures, examples = compare(sp, tokenizer, texts, round_trip=False)
        return len(texts), failures, examples

    def gate(self) -> GateSpec:
        t = self.tokenizer
        return GateSpec(self.rows, TokenizerReference("SentencePiece", self.compare_tokenizer),
                        special_ids={"bos": t.bos_id, "eos": t.eos_id, "pad": t.pad_id}, vocab_size=t.vocab_size,
                        sentencepiece=t.model_path)

    def corpus(self, metrics: list[Row]) -> CorpusBlock:
        sources = to_plain(self.training)["corpus"]["sources"]
        return CorpusBlock(
            corpus=[" ".join(str(v) for k, v in s.items() if v not in (None, "") and k in ("type", "path", "name",
                                                                                           "subset"))
                    for s in sources],
            datasets=[d.card_facts() for d in self.datasets], tokens_seen=self.checkpoint.state.get("tokens"),
            tokenizer={"vocab_size": self.tokenizer.vocab_size,
                       "chars_per_token": self.tokenizer.chars_per_token},
            final_val_loss=final_val_loss(self.checkpoint.state, metrics))

    def card(self, folder: Path, metrics: list[Row]) -> tuple[CardBlocks, dict[str, Any]]:
        plain = to_plain(self.training)
        corpus = self.corpus(metrics)
        return (CardBlocks(training_config={k: plain[k] for k in ("model", "train", "data")}, corpus=corpus),
                # the rate of the checkpoint's last step: a run continued from this export re-warms from it
                {"final_val_loss": corpus.final_val_loss, "final_lr": self.checkpoint.state.get("lr")})


@dataclass
class ContinuedSource(PretrainSource):
    """A stage-3 run continued from a base model (model.init_from): exported with the base's config,
    generation_config.json and tokenizer files, byte for byte; with the base's tokenizer extended by stage 1,
    that tokenizer's files instead of the base's, and config.json's vocab_size the rows it needs."""

    tokenizer: PretrainedTokenizer  # the base's, as stage 2 encoded with it (an extension's where stage 1 made one)
    base: BaseModel
    record: dict[str, Any]  # what the run recorded of the base's files (its checkpoint state)
    versions: ClassVar[tuple[str, ...]] = VERSIONS

    @property
    def vocab_size(self) -> int | None:
        # The base's vocabulary, as its config.json has it: nothing padded, nothing to drop; or an extension's rows
        # without the padding stage 3 added (BaseModel.export_rows).
        return self.base.export_rows if self.base.extension else None

    def inputs(self) -> dict[str, Any]:
        extension = self.record.get("extension")
        return {"checkpoint": _checkpoint_inputs(self.checkpoint),
                "base_model": {"folder": str(self.base.folder), "files": self.record["files"]},
                **({"extension": extension} if extension else {}),
                "datasets": [TOKENIZE.fingerprint(d.prefix) for d in self.datasets]}

    def copied_files(self) -> dict[str, Path]:
        from gptpipe.runtime.base_model import exported_files

        return exported_files(self.base)

    def written_files(self) -> dict[str, str]:
        return {}

    def generation_config(self, model_config: Any) -> Any:
        return None  # the base's generation_config.json, copied

    def compare_tokenizer(self, tokenizer: Any) -> tuple[int, int, list[str]]:
        """The held-out documents decoded and re-encoded by the folder's tokenizer give the data's ids."""
        from gptpipe.data.tokenizer_check import round_trip_problems

        problems = round_trip_problems(tokenizer, self.rows.documents, self.tokenizer.bos_id, self.tokenizer.eod_id)
        return len(self.rows.documents), len(problems), problems[:3]

    def gate(self) -> GateSpec:
        # config.json must be the base's whole (the base-files check), so no ids of its own are checked
        return GateSpec(self.rows, TokenizerReference("the training data", self.compare_tokenizer), base=self.base)

    def card(self, folder: Path, metrics: list[Row]) -> tuple[CardBlocks, dict[str, Any]]:
        blocks, counts = super().card(folder, metrics)
        blocks.base = BaseBlock(self.base.folder.name, self.base.model_type)
        return blocks, counts


def pretrain_source(config: ConvertConfig, checkpoint: Checkpoint) -> PretrainSource:
    """The source of a stage-3 checkpoint: from scratch, or continued from the base its run record names (the
    base folder must still hold the files the run recorded when it initialised from them)."""
    from gptpipe.runtime.base_model import BASE_STATE_KEY, check_unchanged, open_base

    training = training_config(checkpoint)
    base = record = None
    if training.model.init_from is not None:
        state_file = checkpoint.path / STATE
        record = checkpoint.state.get(BASE_STATE_KEY)
        if record is None:
            raise StageInputError(f"{state_file}: the run record names model.init_from {training.model.init_from} "
                                  "but holds no record of its files")
        base = open_base(training.model.init_from, training.tokenize.tokenizer_dir)
        check_unchanged(record, base, str(state_file))
        tokenizer = base.tokenizer
    else:
        tokenizer = read_tokenizer(training.tokenize.tokenizer_dir)
        check_tokenizer_fits(checkpoint, tokenizer)
    datasets = [read_dataset(p) for p in training.data.prefixes]
    rows = heldout_documents(datasets[0].prefix, HELDOUT_DOCUMENTS, tokenizer.eod_id, training.data.split,
                             training.data.seed, config.test_prompt_text)
    if base is None:
        return PretrainSource(checkpoint, training, tokenizer, datasets, rows)
    return ContinuedSource(checkpoint, training, tokenizer, datasets, rows, base, record)


# --- a fine-tune run (stage 7) -----------------------------------------------------------------------------
def validation_rows(checkpoint: Checkpoint, tokenizer: Any) -> tuple[TaskRows, Path]:
    """(the first validation rows of the fine-tune's data, the file they come from), as its run record says:
    data.validation, or the seeded share of data.train it split off; `tokenizer`: the run's."""
    from gptpipe.data.jsonl import Reasons
    from gptpipe.finetune.task_kind import split_validation
    from gptpipe.finetune.kinds import task_kind

    data = finetune_config(checkpoint).data
    path = data.validation or data.train
    if not path.is_file():
        key = "validation" if data.validation else "train"
        raise StageInputError(f"the fine-tune's validation rows are gone: {path} (data.{key} of the run record) "
                              "does not exist; the gate checks the export on them")
    task = task_facts(checkpoint)
    rows = task_kind(task.kind).read(path, data, Reasons())
    if data.validation is None:
        rows = split_validation(rows, data.validation_proportion, data.seed)[1]
        source = f"{min(VERIFY_ROWS, len(rows))} rows of the validation split of {path.name}"
    else:
        source = f"first {min(VERIFY_ROWS, len(rows))} rows of {path.name}"
    if not rows:
        raise StageInputError(f"{path} holds no usable validation row to verify the export on")
    return TaskRows(rows[:VERIFY_ROWS], task, source, tokenizer), path


def task_facts(checkpoint: Checkpoint) -> TaskFacts:
    """The task.json a fine-tune's checkpoint records in its state."""
    return TaskFacts.from_dict(checkpoint.state["task"], f"the task of {checkpoint.path}")


def step_metrics(state: dict[str, Any], step: int) -> dict[str, Any] | None:
    """The validation metrics of the checkpoint's own step (its best or last evaluation), if it was evaluated."""
    for record in (state.get("best") or {}).get("metrics"), state.get("last_eval"):
        if record and record.get("step") == step:
            return record
    return None


@dataclass
class FinetuneSource:
    """A stage-7 run: its best checkpoint (or checkpoint_step), a causal LM or an encoder-decoder, with the
    run's tokenizer folder (every file, a chat template included), its task.json and its validation rows."""

    checkpoint: Checkpoint
    tokenizer: Any  # the run's tokenizer (<run>/tokenizer)
    rows: TaskRows
    data_file: Path
    sentencepiece: Path | None  # the SentencePiece model of the export fine-tuned (`export_sentencepiece`)
    lora_export: str = "merged"  # convert_config.yaml's: a LoRA run's adapters merged, or an adapter folder
    versions: ClassVar[tuple[str, ...]] = VERSIONS
    vocab_size: ClassVar[int | None] = None  # the pretrained model's shape: a hub model's padding rows stay

    @property
    def tokenizer_dir(self) -> Path:
        return self.checkpoint.run_dir / TOKENIZER_DIR

    def inputs(self) -> dict[str, Any]:
        return {"checkpoint": _checkpoint_inputs(self.checkpoint),
                "tokenizer": tree_fingerprint([p for p in self.tokenizer_dir.iterdir() if p.is_file()]),
                "validation": {"path": str(self.data_file), **file_fingerprint(self.data_file)},
                **({"sentencepiece": file_fingerprint(self.sentencepiece)} if self.sentencepiece else {})}

    def copied_files(self) -> dict[str, Path]:
        files = {p.name: p for p in sorted(self.tokenizer_dir.iterdir()) if p.is_file()}  # a chat template too
        return {**files, SENTENCEPIECE_FILE: self.sentencepiece} if self.sentencepiece else files

    def written_files(self) -> dict[str, str]:
        task = json.dumps(self.rows.task.shareable().to_dict(), ensure_ascii=False, indent=2) + "\n"
        if self.sentencepiece is None:
            return {TASK_FILE: task}
        return {TASK_FILE: task, "tokenizer_config.json": exported_config(self.tokenizer_dir)}

    def generation_config(self, model_config: Any) -> Any:
        """Deterministic answers by default, as evaluation produced them: greedy, long enough for any label (a
        chat model's: `gptpipe chat`'s answer length), stopping where training taught the model to stop (a chat
        model: at the end of an assistant turn, so HF generate and servers end the answer there)."""
        from transformers import GenerationConfig

        from gptpipe.runtime.batching import pad_id

        t, task, finetuning = self.tokenizer, self.rows.task, finetune_config(self.checkpoint)
        if task.labels:
            max_new_tokens = self.rows.max_new_tokens(t)
        else:
            max_new_tokens = (finetuning.chat if self.rows.kind.converses else finetuning.predict).max_new_tokens
        return GenerationConfig(
            bos_token_id=t.bos_token_id, eos_token_id=task.stop_ids or t.eos_token_id, pad_token_id=pad_id(t),
            decoder_start_token_id=getattr(model_config, "decoder_start_token_id", None), do_sample=False,
            max_new_tokens=max_new_tokens)

    def compare_tokenizer(self, tokenizer: Any) -> tuple[int, int, list[str]]:
        """The folder's tokenizer gives the run's ids on every row's two encodings: prompt (with special
        tokens) and label, or a conversation whole (through its chat template) and its generation prompt."""
        ours, theirs = self.rows.encoder(tokenizer), self.rows.encoder(self.tokenizer)
        differ = [row.where for row in self.rows.rows
                  if any(mine != run for mine, run in zip(self.rows.encodings(ours, row),
                                                          self.rows.encodings(theirs, row)))]
        if self.sentencepiece is None:
            return 2 * len(self.rows.rows), len(differ), differ[:3]
        import sentencepiece

        from gptpipe.tokenizer.hf import compare

        # and the SentencePiece model it ships gives the same ids on every text of the rows
        sp = sentencepiece.SentencePieceProcessor(model_file=str(self.sentencepiece))
        texts = self.rows.texts()
        failures, examples = compare(sp, tokenizer, texts, round_trip=False)
        return 2 * len(self.rows.rows) + len(texts), len(differ) + failures, (differ + examples)[:3]

    def gate(self) -> GateSpec:
        t = self.tokenizer
        reference = "the fine-tune's tokenizer" + (" and SentencePiece" if self.sentencepiece else "")
        return GateSpec(self.rows, TokenizerReference(reference, self.compare_tokenizer),
                        special_ids={"eos": t.eos_token_id, "pad": t.pad_token_id}, sentencepiece=self.sentencepiece,
                        chat_template=t.chat_template if self.rows.kind.converses else None,
                        merged_adapters=bool(self.checkpoint.lora) and self.lora_export == "merged")

    def card(self, folder: Path, metrics: list[Row]) -> tuple[CardBlocks, dict[str, Any]]:
        state, step = self.checkpoint.state, self.checkpoint.step
        task = self.rows.task
        summary_path = self.checkpoint.run_dir / SUMMARY_FILE
        summary = json.loads(summary_path.read_text(encoding="utf-8")) if summary_path.is_file() else {}
        finetuning = to_plain(finetune_config(self.checkpoint))
        evaluated = step_metrics(state, step)
        block = TaskBlock(
            task=task.shareable(), total_steps=state.get("total_steps"), best=state.get("best"),
            metrics=evaluated,
            rows={**summary.get("rows", {}), "skipped": summary.get("data_problems", {}).get("skipped", {})},
            comparison=summary.get("comparison"),
            has_metric_curve=plot_metric_curve(metrics, self.rows.kind, folder / METRIC_CURVE),
            chat_template=self.tokenizer.chat_template if self.rows.kind.converses else None,
            lora_export=self.lora_export if task.lora else None)
        headline = {m.key: evaluated[m.key] for m in self.rows.kind.metrics} if evaluated else {}
        counts = {"task": task.kind, "best_step": (state.get("best") or {}).get("step"), **headline}
        if self.checkpoint.lora:
            counts["lora"] = self.lora_counts()
        return CardBlocks(training_config={k: finetuning["train"][k] for k in FINETUNE_CARD_KEYS}, task=block), counts

    def lora_counts(self) -> dict[str, Any]:
        """The manifest's record of a LoRA run's export: merged or an adapter folder, the adapters' settings and
        the base they were trained on (its path, and the sha256 of each of its files, as the run recorded)."""
        lora = self.checkpoint.lora
        return {"export": self.lora_export, **{k: lora[k] for k in ("rank", "alpha", "target_modules")},
                "base": {"path": str(self.checkpoint.lora_base.resolve()),
                         "files": {name: f["sha256"] for name, f in lora["base"]["files"].items()}}}


def export_sentencepiece(folder: Path, tokenizer: Any) -> Path | None:
    """The SentencePiece model a fine-tune ships: tokenizer.model of the model it fine-tuned when that is a
    verified stage-4 export that shipped one (its ids proved identical there) and the run's `tokenizer` has
    exactly its pieces (nothing added); else None."""
    import sentencepiece

    from gptpipe.artifacts import read_export

    model = folder / SENTENCEPIECE_FILE
    try:
        shipped = model.is_file() and read_export(folder).manifest.counts.get("sentencepiece_file") is True
    except StageInputError:
        return None
    if not shipped or sentencepiece.SentencePieceProcessor(model_file=str(model)).vocab_size() != len(tokenizer):
        return None
    return model


def finetune_source(checkpoint: Checkpoint, lora_export: str = "merged") -> FinetuneSource:
    from transformers import AutoTokenizer

    tokenizer_dir = checkpoint.run_dir / TOKENIZER_DIR
    if not tokenizer_dir.is_dir():
        raise StageInputError(f"{tokenizer_dir} not found: a fine-tune run keeps its tokenizer there "
                              "(bash 7_finetune.sh writes it when it starts)")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows, data_file = validation_rows(checkpoint, tokenizer)
    pretrained = task_facts(checkpoint).pretrained_model
    return FinetuneSource(checkpoint, tokenizer, rows, data_file,
                          export_sentencepiece(Path(pretrained), tokenizer) if pretrained else None, lora_export)


def open_source(config: ConvertConfig, checkpoint: Checkpoint) -> ExportSource:
    """The source of `checkpoint`: a fine-tune's or a pretraining run's (from scratch or continued)."""
    if checkpoint.is_finetune:
        return finetune_source(checkpoint, config.lora_export)
    return pretrain_source(config, checkpoint)
