"""Stage 7's rows: a run's training and validation rows read, split and encoded, train.seq_len auto resolved,
and what the rows lost to it; the fine-tune, its baselines and their validation read them from here."""

from __future__ import annotations

from typing import Any

from gptpipe.data.jsonl import CUT_TO_FIT, TOO_LONG, Reasons
from gptpipe.finetune.config import AUTO, FinetuneConfig
from gptpipe.finetune.data import auto_seq_len, model_positions
from gptpipe.finetune.task_kind import split_validation, TaskData, TaskFacts
from gptpipe.finetune.kinds import task_kind
from gptpipe.runtime.scoring import is_seq2seq
from gptpipe.stage import StageInputError


def load_task(config: FinetuneConfig) -> TaskData:
    """Tokenizer, rows, validation split and encodings, as task.kind reads and encodes them; StageInputError
    when nothing usable is left."""
    from transformers import AutoTokenizer

    model_dir, data = config.model.path, config.data
    if not (model_dir / "config.json").is_file():
        raise StageInputError(f"model.path {model_dir} is not a HuggingFace model folder (no config.json). "
                              f"Export the pretrained model first: bash 4_convert_to_HF.sh")
    for name in ("train", "validation"):
        path = getattr(data, name)
        if path is not None and not path.is_file():
            raise StageInputError(f"data.{name} {path} does not exist")
    kind = task_kind(config.task.kind)
    seq2seq = is_seq2seq(model_dir, config.model.kind)
    kind.check(config, seq2seq)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    notes = kind.prepare_tokenizer(tokenizer, config.task)
    seq_len = 1 if config.train.seq_len == AUTO else config.train.seq_len  # auto: resolved from the rows below
    encoder = kind.encoder(tokenizer, TaskFacts(kind.name, seq2seq, seq_len, config.task.prompt, data.too_long))
    skipped = Reasons()
    rows = kind.read(data.train, data, skipped)
    if data.validation is not None:
        validation = kind.read(data.validation, data, skipped)
    else:
        rows, validation = split_validation(rows, data.validation_proportion, data.seed)
    encoder.seq_len, seq_len_note = _seq_len(config, encoder, rows)
    kept = [(row, e) for row in rows if (e := encoder.encode(row, skipped)) is not None]
    length_warning = _length_warning(config, encoder, rows, skipped)  # before the validation rows count too
    held = [(row, e) for row in validation if (e := encoder.encode(row, skipped)) is not None] \
        if kind.encodes_validation else [(row, None) for row in validation]
    if not kept or not held:
        what = "training" if not kept else "validation"
        raise StageInputError(f"no usable {what} rows in {data.train if not kept else data.validation or data.train}"
                              f"{'' if kept else ' (see the skipped rows above)'}:\n{skipped.lines()}")
    return TaskData(kind, tokenizer, encoder, seq2seq, [r for r, _ in kept], [e for _, e in kept],
                    [r for r, _ in held], kind.label_set([r for r, _ in kept]), skipped, length_warning, seq_len_note,
                    [e for _, e in held] if kind.encodes_validation else None, notes)


def _row_lengths(encoder: Any, rows: list[Any]) -> list[int]:
    """The train.seq_len that keeps each row whole (uncut_length), as encode counts the row against it."""
    from jinja2 import TemplateError as JinjaError

    lengths = []
    for row in rows:
        try:
            lengths.append(encoder.uncut_length(row))
        except JinjaError:  # a conversation the chat template refuses: encode counts and skips it
            continue
    return lengths


def _seq_len(config: FinetuneConfig, encoder: Any, rows: list[Any]) -> tuple[int, str | None]:
    """train.seq_len, auto resolved from the training rows (a resumed run reads the same rows, so resolves to the
    same number), and the line that says what auto chose and why (None for a number, kept as it is)."""
    if config.train.seq_len != AUTO:
        return config.train.seq_len, None
    lengths, positions = _row_lengths(encoder, rows), model_positions(config.model.path)
    if not lengths:  # no row to measure: load_task refuses the run, naming why each row was skipped
        return positions or 1, None
    return auto_seq_len(lengths, config.train.seq_len_percentile, positions)


def _length_warning(config: FinetuneConfig, encoder: Any, rows: list[Any], skipped: Reasons) -> str | None:
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
