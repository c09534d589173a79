"""Labelled rows for fine-tuning: reading TSV/jsonl, the validation split, prompt masking, the length limit
(train.seq_len auto) and the mapping of generated text to a label; their batches are runtime/batching.py's.

Bad rows never stop a run: each is skipped and counted by data/jsonl.py's reasons (one set for every stage),
with the first file:line examples, and the counts are printed and kept in the run's summary. Prompt and label
are tokenized separately and their ids concatenated, so the loss mask is exact whatever the tokenizer does at
their boundary (searching for the label inside the tokenized whole fails with SentencePiece, whose pieces
depend on context).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Iterable


from gptpipe.data.jsonl import (CUT_TO_FIT, EMPTY, LONE_SURROGATE, MISSING_KEY, NOT_A_STRING, NOT_AN_OBJECT,
                                REPAIRS, TOO_LONG, UNDECODABLE, WRONG_COLUMNS, Reasons, field_text, parse_record)
from gptpipe.runtime.batching import IGNORE, Encoded


@dataclass(frozen=True)
class Row:
    input: str
    label: str | None  # None: an unlabelled row (prediction input)
    where: str  # "file:line", for messages


def file_format(path: Path, configured: str) -> str:
    if configured != "auto":
        return configured
    return "jsonl" if path.suffix.lower() in (".jsonl", ".json") else "tsv"


def _short(text: str | bytes, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def read_rows(path: Path, fmt: str, input_key: str = "input", label_key: str = "label",
              skipped: Reasons | None = None, need_label: bool = True) -> tuple[list[Row], Reasons]:
    """The good rows of a TSV (`input<TAB>label`, header optional) or jsonl file, and what was skipped.

    With need_label=False a TSV line may hold the input alone and a jsonl object may lack the label.
    """
    skipped = skipped if skipped is not None else Reasons()
    fmt = file_format(path, fmt)
    return list(_rows(path.read_bytes().split(b"\n"), str(path), fmt, input_key, label_key, skipped,
                      need_label)), skipped


def read_lines(lines: Iterable[str], source: str = "stdin") -> list[Row]:
    """Unlabelled inputs, one a line (blank lines skipped)."""
    return [Row(line.strip(), None, f"{source}:{n}") for n, line in enumerate(lines, 1) if line.strip()]


def _rows(lines: list[bytes], name: str, fmt: str, input_key: str, label_key: str, skipped: Reasons,
          need_label: bool) -> Iterable[Row]:
    for number, raw in enumerate(lines, 1):
        where = f"{name}:{number}"
        raw = raw.rstrip(b"\r")
        if not raw.strip():
            continue  # blank lines (and the end of the last line) hold no row
        if fmt == "tsv":
            row = _tsv_row(raw, number == 1, input_key, label_key, need_label)
        else:
            row = _jsonl_row(raw, input_key, label_key, need_label)
        if row is None:
            continue  # the TSV header
        if isinstance(row, Problem):
            skipped.add(row.reason, f"{where}: {row.detail}" if row.detail else where)
            continue
        text, label, repaired = row
        if repaired:
            skipped.add(repaired, where)
        text, label = text.strip(), label.strip()
        if not text:
            skipped.add(EMPTY, f"{where}: {input_key}")
        elif not label and need_label:
            skipped.add(EMPTY, f"{where}: {label_key}")
        else:
            yield Row(text, label or None, where)


@dataclass(frozen=True)
class Problem:
    """Why a line holds no row (one of data/jsonl.py's reasons) and what in it, for the examples."""

    reason: str
    detail: str = ""


def _tsv_row(raw: bytes, first: bool, input_key: str, label_key: str, need_label: bool
             ) -> tuple[str, str, None] | Problem | None:
    """(input, label, no repair) of a TSV line, the problem, or None for a header."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return Problem(UNDECODABLE, f"byte {exc.start}")
    columns = line.split("\t")
    if first and [c.strip() for c in columns] == [input_key, label_key]:
        return None
    if len(columns) == 1 and not need_label:
        columns.append("")
    if len(columns) != 2:
        return Problem(WRONG_COLUMNS, f"{len(columns)} columns, expected input<TAB>label")
    return columns[0], columns[1], None


def _jsonl_row(raw: bytes, input_key: str, label_key: str, need_label: bool
               ) -> tuple[str, str, str | None] | Problem:
    """(input, label, repair or None) of a jsonl line, or the problem; a numeric label (a class id) becomes
    its text."""
    obj, reason = parse_record(raw)
    if reason:
        return Problem(reason, _short(raw) if reason != UNDECODABLE else "")
    if not isinstance(obj, dict):
        return Problem(NOT_AN_OBJECT, _short(raw))
    texts, repaired = [], None
    for key, required in ((input_key, True), (label_key, need_label)):
        value = obj.get(key, "")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if key not in obj and required:
            return Problem(MISSING_KEY, repr(key))
        text, reason = field_text({key: value}, key)
        if reason in (NOT_A_STRING, LONE_SURROGATE):
            return Problem(reason, f"{key}: {_short(raw)}")
        repaired = repaired or (reason if reason in REPAIRS else None)
        texts.append(text or "")  # "" (EMPTY) is named by the caller, after stripping
    return texts[0], texts[1], repaired


def label_set(rows: list[Row]) -> list[str]:
    """Labels of the training rows, most frequent first (ties: alphabetical), so ties in mapping favour
    the more common label."""
    counts = Counter(r.label for r in rows)
    return sorted(counts, key=lambda label: (-counts[label], label))


# --- tokenization ---------------------------------------------------------------------------------------
class Encoder:
    """Prompt template + tokenizer + length limit → Encoded rows."""

    def __init__(self, tokenizer: Any, template: str, seq_len: int, seq2seq: bool, too_long: str = "truncate"):
        self.tokenizer, self.template, self.seq_len, self.seq2seq = tokenizer, template, seq_len, seq2seq
        self.too_long = too_long
        self.eos = tokenizer.eos_token_id
        if self.eos is None:
            raise ValueError("the tokenizer has no EOS token: the label's end cannot be marked")

    @property
    def stop_ids(self) -> list[int]:
        """The tokens that end an answer."""
        return [self.eos]

    def prompt_ids(self, text: str) -> list[int]:
        # The prompt gets the tokenizer's own special tokens (e.g. BOS); the label never does.
        return self.tokenizer(self.template.format(input=text))["input_ids"]

    def label_ids(self, label: str) -> list[int]:
        return self.tokenizer(label, add_special_tokens=False)["input_ids"] + [self.eos]

    def uncut_length(self, row: Row) -> int:
        """The train.seq_len that keeps ``row`` whole."""
        prompt, label = len(self.prompt_ids(row.input)), len(self.label_ids(row.label))
        return max(prompt, label) if self.seq2seq else prompt + label

    def _budget(self, label_len: int) -> int:
        """Tokens the prompt may take."""
        return self.seq_len if self.seq2seq else self.seq_len - label_len

    def fit_prompt(self, text: str, label_len: int, where: str, skipped: Reasons) -> list[int] | None:
        """The prompt's ids within the budget: the input cut at its end (the template's tail, which tells the
        model where to answer, stays) or None when dropped."""
        budget = self._budget(label_len)
        ids = self.prompt_ids(text)
        if len(ids) <= budget:
            return ids
        if self.too_long == "drop" or budget < len(self.prompt_ids("")):
            skipped.add(TOO_LONG, f"{where}: {len(ids) + (0 if self.seq2seq else label_len)} tokens, "
                                  f"train.seq_len {self.seq_len}")
            return None
        low, high = 0, len(text)  # the longest prefix of the input whose prompt fits
        while low < high:
            mid = (low + high + 1) // 2
            if len(self.prompt_ids(text[:mid])) <= budget:
                low = mid
            else:
                high = mid - 1
        skipped.add(CUT_TO_FIT, where)
        return self.prompt_ids(text[:low])

    def encode(self, row: Row, skipped: Reasons, label: str | None = None) -> Encoded | None:
        """The row (or `label` in place of its own, for scoring candidates) as ids; None when dropped."""
        label_ids = self.label_ids(label if label is not None else row.label)
        limit = self.seq_len if self.seq2seq else self.seq_len - 1
        if len(label_ids) > limit:
            skipped.add(TOO_LONG, f"{row.where}: label of {len(label_ids)} tokens, train.seq_len {self.seq_len}")
            return None
        prompt = self.fit_prompt(row.input, len(label_ids), row.where, skipped)
        if prompt is None:
            return None
        if self.seq2seq:
            return Encoded(prompt, label_ids)
        return Encoded(prompt + label_ids, [IGNORE] * len(prompt) + label_ids)


def model_positions(folder: Path) -> int | None:
    """The positions the model in `folder` takes (max_position_embeddings, GPT-2's n_positions); None when its
    config states no limit (T5's relative positions)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def auto_seq_len(lengths: list[int], percentile: float, positions: int | None) -> tuple[int, str]:
    """train.seq_len auto and the line that says what it chose and why: the length that keeps `percentile`% of
    the training rows whole (100: the longest row; `lengths` are their uncut_length), at most the model's
    `positions` (None: no limit)."""
    ordered = sorted(lengths)
    wanted = ordered[math.ceil(percentile * len(ordered) / 100) - 1]
    rows = f"{len(ordered):,} training rows"
    share = (f"the longest of {rows}" if percentile == 100 else
             f"{percentile:g}% of {rows} (train.seq_len_percentile; the longest needs {ordered[-1]})")
    if positions is not None and wanted > positions:
        return positions, (f"train.seq_len auto: {positions} tokens, the model's positions, not the {wanted} "
                           f"enough for {share}")
    limit = f"the model takes {positions:,} positions" if positions is not None else "the model has no position limit"
    return wanted, f"train.seq_len auto: {wanted} tokens, enough for {share}; {limit}"
