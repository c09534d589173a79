"""What a fine-tune's task is: its facts (task.json, typed) and the interface each task kind implements.

A kind (one module under kinds/, registered by name there, or named as `module:Class` in task.kind) says which
figures score it and which picks its best checkpoint, what its config must hold, how its rows are read and
encoded, what prompt a row is answered from, how a validation set is scored, and what the export's gate compares.
Loading the config, training, predict, chat, the gate and the card ask the kind instead of switching on its name.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from gptpipe.finetune.metrics import VAL_LOSS, Metric, generation_metrics, headline
from gptpipe.runtime.batching import collate, collate_packed
from gptpipe.runtime.lora import lora_record
from gptpipe.runtime.scoring import target_logprobs
from gptpipe.stage import StageInputError, write_text_atomic
from gptpipe.trust import TRUST_ENV, trusted

if TYPE_CHECKING:
    import torch

    from gptpipe.data.jsonl import Reasons
    from gptpipe.finetune.config import FinetuneConfig, FinetuneDataConfig, TaskConfig
    from gptpipe.runtime.batching import Encoded
    from gptpipe.runtime.engine import Dist

RowT = TypeVar("RowT")


@dataclass(frozen=True)
class TaskFacts:
    """task.json: what predict, chat, the export's gate and the card rebuild a fine-tune's task from. Written
    beside the run's checkpoints (and in their state), copied into every export with local paths cut."""

    kind: str  # task.kind: a name kinds/ registers, or module:Class
    seq2seq: bool  # an encoder-decoder: the prompt is the encoder's input, the answer the decoder's labels
    seq_len: int  # train.seq_len as the run resolved it (auto included)
    prompt: str = "{input}"  # task.prompt: the template around a row's input (not used by chat)
    too_long: str = "truncate"  # data.too_long: how training fitted a long input
    labels: list[str] | None = None  # classification: the label set, most frequent first
    majority_label: str | None = None  # classification: the most frequent training label
    stop_ids: list[int] | None = None  # chat: the tokens that end an assistant turn (generation stops there)
    best_metric: str | None = None  # the figure that picked the best checkpoint
    pretrained_model: str | None = None  # model.path (None for a from-scratch baseline)
    train_file: str | None = None  # data.train
    architecture_of: str | None = None  # a from-scratch baseline: the folder whose architecture it took
    # train.lora when on (runtime/lora.py's lora_record: rank, alpha, dropout, target_modules and where they came
    # from, the base's fingerprint): checkpoints hold adapters on pretrained_model
    lora: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, facts: dict[str, Any], source: str, own_kind: str | None = None) -> TaskFacts:
        """Facts read from `source` (a task.json, a checkpoint's state); unknown or missing keys name the file.
        A kind of the user's own (module:Class) is Python that every reader imports: one recorded in a folder
        from elsewhere is refused unless it is `own_kind` (the reader's config names it) or GPTPIPE_TRUST
        includes task-code."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(facts) - known)
        missing = [name for name in ("kind", "seq2seq", "seq_len") if name not in facts]
        if unknown or missing:
            hints = [f"{k}" + (f" (did you mean {close[0]}?)" if (close := difflib.get_close_matches(k, known, 1))
                               else "") for k in unknown]
            raise StageInputError(f"{source}: " + "; ".join(
                ([f"unknown key(s) {', '.join(hints)}"] if unknown else [])
                + ([f"missing key(s) {', '.join(missing)}"] if missing else [])))
        kind = str(facts["kind"])
        if ":" in kind and kind != own_kind and not trusted("task-code"):
            raise StageInputError(f"{source} names the task kind {kind}, Python code that would be imported to "
                                  f"read this run; set {TRUST_ENV}=task-code if you trust where it came from")
        return cls(**facts)

    @classmethod
    def read(cls, path: Path, own_kind: str | None = None) -> TaskFacts:
        try:
            facts = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise StageInputError(f"{path} is not a readable task.json: {exc}") from exc
        if not isinstance(facts, dict):
            raise StageInputError(f"{path}: a task.json holds one JSON object")
        return cls.from_dict(facts, str(path), own_kind)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object: every field, None included, so a reader sees the whole schema."""
        return asdict(self)

    def write(self, path: Path) -> None:
        write_text_atomic(path, json.dumps(self.to_dict(), ensure_ascii=False, indent=2) + "\n")

    def shareable(self) -> TaskFacts:
        """The facts an export carries: local paths cut to their names (the folder may go public)."""
        def name(value: str | None) -> str | None:
            return Path(value).name if value else value

        lora = self.lora and {**self.lora, "base": {**self.lora["base"], "folder": name(self.lora["base"]["folder"])}}
        return replace(self, pretrained_model=name(self.pretrained_model), train_file=name(self.train_file),
                       architecture_of=name(self.architecture_of), lora=lora)


@dataclass
class TaskData:
    """The rows of a run, encoded, and what was skipped reading them."""

    kind: TaskKind
    tokenizer: Any
    encoder: Any  # the kind's encoder (finetune/data.py's Encoder, chat_data.py's ChatEncoder)
    seq2seq: bool
    train_rows: list[Any]  # the kind's rows: finetune/data.py's Row, chat_data.py's Conversation
    train: list[Any]  # the training items, encoded: Encoded rows (a preference pair: two of them)
    validation: list[Any]
    labels: list[str] | None  # classification: the label set, most frequent first
    skipped: Reasons
    length_warning: str | None = None  # train.seq_len cut or dropped training rows: how many, what keeps them
    seq_len_note: str | None = None  # train.seq_len auto: what it chose and why
    validation_items: list[Any] | None = None  # kinds that encode validation rows: them, encoded
    notes: tuple[str, ...] = ()  # what the kind did to the tokenizer (a chat template, the pad token)

    @property
    def majority(self) -> str | None:
        return self.labels[0] if self.labels else None

    def facts(self, config: FinetuneConfig, from_scratch: bool = False,
              recorded_lora: dict[str, Any] | None = None) -> TaskFacts:
        """The task.json of a run of `config` on these rows (`from_scratch`: a baseline's random start;
        `recorded_lora`: a resumed LoRA run's record, whose hashes of unchanged base files are kept)."""
        return TaskFacts(kind=self.kind.name, seq2seq=self.seq2seq, seq_len=self.encoder.seq_len,
                         prompt=config.task.prompt, too_long=config.data.too_long, labels=self.labels,
                         majority_label=self.majority, stop_ids=self.kind.stop_ids(self.encoder),
                         best_metric=self.kind.best_metric(config.train.best_metric),
                         pretrained_model=None if from_scratch else str(config.model.path),
                         train_file=str(config.data.train),
                         architecture_of=str(config.model.path) if from_scratch else None,
                         lora=lora_record(asdict(config.train.lora), config.model.path, recorded_lora)
                         if config.train.lora.enabled else None)



def split_validation(rows: list[RowT], proportion: float, seed: int) -> tuple[list[RowT], list[RowT]]:
    """(train, validation): a seeded random `proportion` of the rows (at least one) held out."""
    order = np.random.default_rng(seed).permutation(len(rows))
    count = max(1, round(proportion * len(rows)))
    held = set(order[:count].tolist())
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


class TaskKind:
    """One task kind: rows, their encoding, prompts, validation and the gate's view of them. Subclasses
    override what differs; the defaults are a labelled-row task's where one exists."""

    name: str  # task.kind: the registry's name, or the module:Class it was named by
    metrics: tuple[Metric, ...] = ()  # validation figures beside val_loss, headline first (metrics.jsonl: val_<key>)
    default_best: str = VAL_LOSS.key  # train.best_metric auto: the figure that picks the best checkpoint
    templated: bool = True  # task.prompt wraps each row's input, so it must hold {input}
    converses: bool = False  # rows are conversations: `gptpipe chat` talks to the model, a chat template ships
    encodes_validation: bool = False  # the validation rows are encoded when the task loads (and dropped if unfit)
    labelled: bool = False  # a label set is read from the training rows and every label is scored
    loss_scores: str = "the gold labels: {:.4f} nats per label token"  # the card's words for val_loss
    row_noun: str = "rows"  # what the log calls its rows
    step_figures: tuple[str, ...] = ()  # training figures of each item that `loss` sums; the train line logs means
    evaluates_start: bool = False  # a fresh run validates the starting model before its first step (never a best)

    # --- its figures and its config ------------------------------------------------------------------------
    def best_metric(self, configured: str) -> str:
        """train.best_metric, auto resolved."""
        return self.default_best if configured == "auto" else configured

    @property
    def scored(self) -> tuple[Metric, ...]:
        """Every figure a validation of this kind gives: its metrics, then val_loss."""
        return (*self.metrics, VAL_LOSS)

    def metric(self, key: str) -> Metric:
        """The entry of one of this kind's figures, val_loss included."""
        return next(m for m in self.scored if m.key == key)

    def config_problems(self, config: FinetuneConfig) -> list[tuple[str, str]]:
        """(key, problem) for each setting this kind cannot run with; checked as the config loads."""
        problems = []
        if self.templated and "{input}" not in config.task.prompt:
            problems.append(("task.prompt", "must contain {input}"))
        allowed = tuple(m.key for m in self.scored)
        if self.best_metric(config.train.best_metric) not in allowed:
            problems.append(("train.best_metric", f"must be one of {', '.join(allowed)} (or auto) for a "
                                                  f"{self.name} task, got {config.train.best_metric!r}"))
        return problems

    def headline(self, m: dict[str, Any]) -> str:
        """The figures of `m` (a validation's, or predict's answers scored) on the console."""
        return headline(m, self.metrics)

    def warnings(self, m: dict[str, Any], task: TaskConfig) -> list[str]:
        """What a validation's figures `m` warn of (the console says each)."""
        return []

    def answer_metrics(self, gold: list[str], predicted: list[str], results: list[dict[str, Any]],
                       facts: TaskFacts) -> dict[str, Any]:
        """Predict's figures of the answers `predicted` to rows with a gold answer (`results`: their lines):
        as generated text."""
        return generation_metrics(gold, predicted)

    # --- reading and encoding --------------------------------------------------------------------------
    def check(self, config: FinetuneConfig, seq2seq: bool) -> None:
        """Refuse (StageInputError) a run this kind cannot train: its model or its data files."""

    def prepare_tokenizer(self, tokenizer: Any, task: TaskConfig) -> tuple[str, ...]:
        """Make the run's tokenizer fit the kind (a chat template, a pad token); returns what was done."""
        return ()

    def read(self, path: Path, data: FinetuneDataConfig, skipped: Reasons, need_answer: bool = True) -> list[Any]:
        """The good rows of `path` (bad ones counted in `skipped`); need_answer=False: prediction input."""
        raise NotImplementedError

    def read_lines(self, lines: list[str]) -> list[Any]:
        """Prediction input from stdin, one row a line."""
        raise NotImplementedError

    def label_set(self, rows: list[Any]) -> list[str] | None:
        """The labels every validation row is scored against (classification), else None."""
        return None

    def encoder(self, tokenizer: Any, facts: TaskFacts, too_long: str | None = None) -> Any:
        """The encoder of a run with these facts; `too_long` overrides how a long input is fitted (predict
        cuts every input so every row gets an answer)."""
        raise NotImplementedError

    def stop_ids(self, encoder: Any) -> list[int] | None:
        """The end-of-answer tokens task.json records (None: the tokenizer's EOS, nothing to record)."""
        return None

    def describe_template(self, template: str) -> str:
        """The model card's words for the chat template a conversing kind ships (converses)."""
        raise NotImplementedError

    # --- training -----------------------------------------------------------------------------------------
    def prepare_training(self, model: Any, task: TaskData, config: FinetuneConfig, run_dir: Path, dist: Dist,
                         resuming: bool) -> TaskData:
        """The task as training `model` needs it, called with the model's starting weights before its first
        step (`resuming`: a checkpoint will be loaded next); the default needs nothing more than the rows."""
        return task

    def sequences(self, item: Any) -> list[Encoded]:
        """The sequences one training item puts into a micro-batch, in order."""
        return [item]

    def loss_weight(self, item: Any) -> int:
        """What one item adds to the global batch's loss normaliser: its label tokens, so every label token of
        the global batch weighs the same wherever it lands."""
        return item.label_tokens

    def collate(self, items: list[Any], pad: int, seq2seq: bool, pack_capacity: int | None, device: Any
                ) -> dict[str, Any]:
        """A micro-batch of training items: their sequences padded, or packed into pack_capacity tokens."""
        sequences = [s for item in items for s in self.sequences(item)]
        if pack_capacity:
            return collate_packed(sequences, pad, pack_capacity, device)
        return collate(sequences, pad, seq2seq, device)

    def loss(self, model: Any, batch: dict[str, Any], seq2seq: bool, task: TaskConfig
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the micro-batch's loss summed over its items, before the batch's scale; its items' step_figures
        summed, or None): the label tokens' negative log-likelihood."""
        return -target_logprobs(model, batch, seq2seq).sum(), None

    # --- answering a row --------------------------------------------------------------------------------
    def prompt(self, encoder: Any, row: Any, max_new_tokens: int, skipped: Reasons
               ) -> tuple[list[int] | None, dict[str, Any]]:
        """(the ids `row` is answered from, leaving max_new_tokens within seq_len, or None when it cannot be;
        what the prediction line says about a cut). Cuts and drops are counted in `skipped`."""
        raise NotImplementedError

    def row_fields(self, row: Any) -> dict[str, Any]:
        """What a prediction or a greedy sample shows of the row it answered."""
        raise NotImplementedError

    def cut_note(self) -> str:
        """How predict's log names the rows cut to fit."""
        return "inputs cut"

    # --- validation ---------------------------------------------------------------------------------------
    def validate(self, model: Any, task: TaskData, config: FinetuneConfig, dist: Dist) -> dict[str, Any]:
        """The validation figures of `model` (a DeepSpeed engine or a bare model), on every rank: val_loss and
        the kind's `metrics`."""
        raise NotImplementedError

    # --- the export's gate ----------------------------------------------------------------------------------
    def encodings(self, encoder: Any, row: Any) -> tuple[list[int], list[int]]:
        """The two ways `row` becomes ids, for comparing two tokenizers."""
        raise NotImplementedError

    def texts(self, rows: list[Any]) -> list[str]:
        """Every text of the rows, for comparing a tokenizer with SentencePiece."""
        raise NotImplementedError

    def answer_room(self, encoder: Any, rows: list[Any], labels: list[str] | None) -> int:
        """New tokens the gate generates: room for the longest answer (+ its stop token)."""
        raise NotImplementedError

    def encode_all(self, encoder: Any, rows: list[Any], skipped: Reasons) -> list[Encoded]:
        """The rows encoded as training encodes them; rows it would drop are left out."""
        return [e for e in (encoder.encode(row, skipped) for row in rows) if e is not None]

    def __repr__(self) -> str:
        return f"task kind {self.name}"

