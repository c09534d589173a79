"""Stage 7's rows: a run's training and validation rows read, split and encoded, train.seq_len auto resolved,
and what the rows lost to it; the fine-tune, its baselines and their validation read them from here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gptpipe.data.jsonl import CUT_TO_FIT, TOO_LONG, Reasons
from gptpipe.finetune.chat_data import (ChatEncoder, Conversation, distinct_pad, install_template, read_conversations,
                                        special_tokens_as_tokens)
from gptpipe.finetune.config import AUTO, FinetuneConfig
from gptpipe.finetune.data import (Encoded, Encoder, Row, auto_seq_len, file_format, label_set, model_positions,
                                   read_rows, split_validation)
from gptpipe.finetune.model import is_seq2seq
from gptpipe.stage import StageInputError


@dataclass
class TaskData:
    """The rows of a run, encoded, and what was skipped reading them."""

    tokenizer: Any
    encoder: Encoder | ChatEncoder
    seq2seq: bool
    train_rows: list[Row] | list[Conversation]
    train: list[Encoded]
    validation: list[Row] | list[Conversation]
    labels: list[str] | None  # classification: the label set, most frequent first
    skipped: Reasons
    length_warning: str | None = None  # train.seq_len cut or dropped training rows: how many, what keeps them
    seq_len_note: str | None = None  # train.seq_len auto: what it chose and why
    validation_items: list[Encoded] | None = None  # chat: the validation conversations encoded
    notes: tuple[str, ...] = ()  # chat: which template, what became of the pad token

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
    if config.task.kind == "chat":
        return _load_chat_task(config, tokenizer, seq2seq)
    encoder = Encoder(tokenizer, config.task.prompt, config.train.seq_len, seq2seq, data.too_long)
    skipped = Reasons()
    rows, _ = read_rows(data.train, data.format, data.input_key, data.label_key, skipped)
    if data.validation is not None:
        validation, _ = read_rows(data.validation, data.format, data.input_key, data.label_key, skipped)
    else:
        rows, validation = split_validation(rows, data.validation_proportion, data.seed)
    encoder.seq_len, seq_len_note = _seq_len(config, encoder, rows)
    encoded = [(row, encoder.encode(row, skipped)) for row in rows]
    kept = [(row, e) for row, e in encoded if e is not None]
    if not kept or not validation:
        raise StageInputError(f"no usable {'training' if not kept else 'validation'} rows in {data.train}"
                              f"{'' if kept else ' (see the skipped rows above)'}:\n{skipped.lines()}")
    labels = label_set([row for row, _ in kept]) if config.task.kind == "classification" else None
    return TaskData(tokenizer, encoder, seq2seq, [r for r, _ in kept], [e for _, e in kept], validation, labels,
                    skipped, _length_warning(config, encoder, rows, skipped), seq_len_note=seq_len_note)


def _load_chat_task(config: FinetuneConfig, tokenizer: Any, seq2seq: bool) -> TaskData:
    """task.kind chat: the template installed into the tokenizer, a pad distinct from EOS, the conversations
    read and every one encoded (a template that cannot mask a row exactly is refused here, naming it)."""
    data = config.data
    if seq2seq:
        raise StageInputError(f"task.kind chat: {config.model.path} is an encoder-decoder; chat tuning needs a "
                              f"causal LM, which reads the whole conversation as one sequence")
    for name in ("train", "validation"):
        path = getattr(data, name)
        if path is not None and file_format(path, data.format) != "jsonl":
            raise StageInputError(f"task.kind chat reads jsonl rows (messages, or instruction/input/output); "
                                  f"data.{name} {path} is not .jsonl (set data.format=jsonl if it is)")
    notes = (install_template(tokenizer, config.task.chat_template), special_tokens_as_tokens(tokenizer),
             distinct_pad(tokenizer))
    encoder = ChatEncoder(tokenizer, config.train.seq_len)
    skipped = Reasons()
    rows = read_conversations(data.train, skipped, data.messages_key)
    if data.validation is not None:
        validation = read_conversations(data.validation, skipped, data.messages_key)
    else:
        rows, validation = split_validation(rows, data.validation_proportion, data.seed)
    encoder.seq_len, seq_len_note = _seq_len(config, encoder, rows)
    kept = [(row, e) for row in rows if (e := encoder.encode(row, skipped)) is not None]
    length_warning = _length_warning(config, encoder, rows, skipped)  # before the validation rows count too
    held = [(row, e) for row in validation if (e := encoder.encode(row, skipped)) is not None]
    if not kept or not held:
        raise StageInputError(f"no usable {'training' if not kept else 'validation'} conversations in "
                              f"{data.train if not kept else data.validation or data.train}:\n{skipped.lines()}")
    return TaskData(tokenizer, encoder, False, [r for r, _ in kept], [e for _, e in kept], [r for r, _ in held],
                    None, skipped, length_warning, seq_len_note, [e for _, e in held], tuple(n for n in notes if n))


def _row_lengths(encoder: Encoder | ChatEncoder, rows: list[Row] | list[Conversation]) -> list[int]:
    """The train.seq_len that keeps each row whole (uncut_length), as encode counts the row against it."""
    from jinja2 import TemplateError as JinjaError

    lengths = []
    for row in rows:
        try:
            lengths.append(encoder.uncut_length(row))
        except JinjaError:  # a conversation the chat template refuses: encode counts and skips it
            continue
    return lengths


def _seq_len(config: FinetuneConfig, encoder: Encoder | ChatEncoder, rows: list[Row] | list[Conversation]
             ) -> tuple[int, str | None]:
    """train.seq_len, auto resolved from the training rows (a resumed run reads the same rows, so resolves to the
    same number), and the line that says what auto chose and why (None for a number, kept as it is)."""
    if config.train.seq_len != AUTO:
        return config.train.seq_len, None
    lengths, positions = _row_lengths(encoder, rows), model_positions(config.model.path)
    if not lengths:  # no row to measure: load_task refuses the run, naming why each row was skipped
        return positions or 1, None
    return auto_seq_len(lengths, config.train.seq_len_percentile, positions)


def _length_warning(config: FinetuneConfig, encoder: Encoder | ChatEncoder, rows: list[Row] | list[Conversation],
                    skipped: Reasons) -> str | None:
    """What train.seq_len cost the training rows (only they are encoded so far), and the value that keeps
    every row within the model's positions; None when it cost nothing."""
    dropped, cut = skipped.counts[TOO_LONG], skipped.counts[CUT_TO_FIT]
    if not cut + dropped:
        return None
    longest, positions = max(_row_lengths(encoder, rows)), model_positions(config.model.path)
    keep = (f"train.seq_len={longest} keeps every row" if positions is None or longest <= positions else
            f"the longest needs {longest} tokens, the model takes {positions}"
            + ("" if encoder.seq_len == positions else f": train.seq_len={positions} cuts the fewest"))
    auto = " (auto)" if config.train.seq_len == AUTO else ""
    return (f"train.seq_len {encoder.seq_len}{auto} is too short for {cut + dropped:,} of {len(rows):,} training "
            f"rows ({(cut + dropped) / len(rows):.0%}: {cut:,} cut, {dropped:,} dropped); {keep}")
