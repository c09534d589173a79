"""Labelled rows for fine-tuning: reading TSV/jsonl, the validation split, prompt masking, the length limit
(train.seq_len auto), the training order (optionally grouped by length), padded or packed batches.

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
from typing import TYPE_CHECKING, Any
from collections.abc import Iterable

import numpy as np

from gptpipe.data.jsonl import (CUT_TO_FIT, EMPTY, LONE_SURROGATE, MISSING_KEY, NOT_A_STRING, NOT_AN_OBJECT,
                                REPAIRS, TOO_LONG, UNDECODABLE, WRONG_COLUMNS, Reasons, field_text, parse_record)
from gptpipe.train.data import to_device

if TYPE_CHECKING:
    import torch

IGNORE = -100  # label id the loss skips (prompt tokens, padding)


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


def split_validation(rows: list[Row], proportion: float, seed: int) -> tuple[list[Row], list[Row]]:
    """(train, validation): a seeded random `proportion` of the rows (at least one) held out."""
    order = np.random.default_rng(seed).permutation(len(rows))
    count = max(1, round(proportion * len(rows)))
    held = set(order[:count].tolist())
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


def label_set(rows: list[Row]) -> list[str]:
    """Labels of the training rows, most frequent first (ties: alphabetical), so ties in mapping favour
    the more common label."""
    counts = Counter(r.label for r in rows)
    return sorted(counts, key=lambda label: (-counts[label], label))


# --- tokenization ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Encoded:
    """One row as ids. Causal: prompt + label + EOS in `input_ids`, `labels` = IGNORE on the prompt.
    Seq2seq: the prompt alone in `input_ids`, label + EOS as decoder `labels`."""

    input_ids: list[int]
    labels: list[int]

    @property
    def label_tokens(self) -> int:
        return sum(1 for t in self.labels if t != IGNORE)


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


def pad_id(tokenizer: Any) -> int:
    """The tokenizer's pad token (ours is distinct from EOS); EOS for tokenizers that have none."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def collate(items: list[Encoded], pad: int, seq2seq: bool, device: torch.device | str = "cpu") -> dict[str, Any]:
    """A right-padded training/scoring batch. `targets` are aligned with the model's logits: for a causal
    LM the next token's label (shifted here, so no token is lost to the model's own shift), for seq2seq
    the decoder labels themselves."""
    import torch

    width = max(len(e.input_ids) for e in items)
    input_ids = torch.full((len(items), width), pad, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for i, e in enumerate(items):
        input_ids[i, :len(e.input_ids)] = torch.tensor(e.input_ids)
        mask[i, :len(e.input_ids)] = 1
    label_width = max(len(e.labels) for e in items)
    labels = torch.full((len(items), label_width), IGNORE, dtype=torch.long)
    for i, e in enumerate(items):
        labels[i, :len(e.labels)] = torch.tensor(e.labels)
    if seq2seq:
        targets = labels
    else:
        targets = torch.full_like(labels, IGNORE)
        targets[:, :-1] = labels[:, 1:]
    batch = {"input_ids": input_ids, "attention_mask": mask, "targets": targets}
    if seq2seq:
        batch["labels"] = labels
    else:
        batch["target_columns"] = target_columns(targets)
    return to_device(batch, device)


def target_columns(targets: torch.Tensor) -> torch.Tensor:
    """The columns of a causal LM's batch that hold a target in some row, found here on the CPU: the model
    computes its vocabulary-sized output only there (model.logits), and no device sync is needed to know them."""
    return (targets != IGNORE).any(dim=0).nonzero().squeeze(1)


def row_positions(e: Encoded, seq2seq: bool) -> int:
    """Positions a row takes in a batch: its ids, and for seq2seq the decoder's label ids too."""
    return len(e.input_ids) + (len(e.labels) if seq2seq else 0)


# Rows sorted by length together: this many micro-batches' worth. Larger pools pad less; smaller ones leave
# more to chance which rows share a micro-batch.
GROUP_POOL = 64


def epoch_order(lengths: list[int], seed: int, epoch: int, micro: int, group_by_length: bool) -> np.ndarray:
    """The training rows of `epoch` in order: a permutation seeded by (seed, epoch).

    Grouped by length, the permutation is cut into pools of GROUP_POOL micro-batches, each pool sorted by
    length (equal lengths stay in random order) and cut into micro-batches of similar rows, and the order of
    those micro-batches is shuffled (seeded too). Training reads micro-batches at multiples of `micro` in the
    stream of epochs, so when the epoch does not start on one, its first rows finish the previous epoch's last
    micro-batch and are left ungrouped, as are the rows left over at its end.
    """
    rows = len(lengths)
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(rows)
    if not group_by_length:
        return order
    head = min((-epoch * rows) % micro, rows)
    body = order[head:]
    full = len(body) // micro * micro
    sizes = np.asarray(lengths)
    pools = [pool[np.argsort(sizes[pool], kind="stable")]
             for pool in np.split(body[:full], range(GROUP_POOL * micro, full, GROUP_POOL * micro))]
    groups = np.concatenate(pools).reshape(-1, micro)
    return np.concatenate([order[:head], groups[rng.permutation(len(groups))].ravel(), body[full:]])


def pack_plan(lengths: list[int], capacity: int) -> list[list[int]]:
    """The rows (indices into `lengths`) of each packed sequence: as few sequences of at most `capacity`
    tokens as the greedy finds, balanced so that the longest one (the batch's width) is short: longest row
    first, each into the emptiest sequence; when it does not fit there, one more sequence and start again."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    count = max(1, -(-sum(lengths) // capacity))
    while True:
        plan: list[list[int]] = [[] for _ in range(count)]
        fills = [0] * count
        for i in order:
            emptiest = min(range(count), key=fills.__getitem__)
            if fills[emptiest] + lengths[i] > capacity:
                break
            plan[emptiest].append(i)
            fills[emptiest] += lengths[i]
        else:
            return plan
        count += 1


def computed_positions(items: list[Encoded], seq2seq: bool, pack_capacity: int | None = None) -> int:
    """Positions one micro-batch computes, padding included: its rows padded to the longest (encoder and
    decoder apart for seq2seq), or with `pack_capacity` its packed sequences padded to the longest."""
    if pack_capacity is not None:
        plan = pack_plan([len(e.input_ids) for e in items], pack_capacity)
        return len(plan) * max(sum(len(items[i].input_ids) for i in seq) for seq in plan)
    width = max(len(e.input_ids) for e in items)
    return len(items) * (width + (max(len(e.labels) for e in items) if seq2seq else 0))


def collate_packed(items: list[Encoded], pad: int, capacity: int, device: torch.device | str = "cpu"
                   ) -> dict[str, Any]:
    """A causal LM's micro-batch packed (pack_plan): each sequence holds whole rows one after another, then
    padding. Position ids restart at 0 with every row and there is no attention mask: from the restarts
    transformers builds a causal mask that keeps each row to itself (the padding tail, numbered from 0 too,
    is a segment of its own, so no position attends to nothing). `targets` are shifted within each row, so no
    row predicts the next one's first token; `rows` holds each row's (sequence, start, length)."""
    import torch

    plan = pack_plan([len(e.input_ids) for e in items], capacity)
    width = max(sum(len(items[i].input_ids) for i in seq) for seq in plan)
    input_ids = torch.full((len(plan), width), pad, dtype=torch.long)
    position_ids = torch.zeros((len(plan), width), dtype=torch.long)
    targets = torch.full((len(plan), width), IGNORE, dtype=torch.long)
    rows: list[tuple[int, int, int]] = [(0, 0, 0)] * len(items)
    for s, seq in enumerate(plan):
        at = 0
        for i in seq:
            e = items[i]
            n = len(e.input_ids)
            input_ids[s, at:at + n] = torch.tensor(e.input_ids)
            position_ids[s, at:at + n] = torch.arange(n)
            targets[s, at:at + n - 1] = torch.tensor(e.labels[1:])
            rows[i] = (s, at, n)
            at += n
        position_ids[s, at:] = torch.arange(width - at)
    return to_device({"input_ids": input_ids, "position_ids": position_ids, "targets": targets,
                      "target_columns": target_columns(targets), "attention_mask": None, "rows": rows}, device)


def left_padded(prompts: list[list[int]], pad: int, device: torch.device | str = "cpu") -> dict[str, Any]:
    """Prompts for batched generation: left padding, so every row's next token comes at the same position."""
    import torch

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            input_ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
    return to_device({"input_ids": input_ids, "attention_mask": mask}, device)


# --- label mapping --------------------------------------------------------------------------------------
def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions of characters)."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def map_to_label(text: str, labels: list[str]) -> tuple[str, bool]:
    """(the label nearest to the generated `text` by edit distance, whether it needed mapping).
    Ties go to the label listed first (label_set lists the most frequent first)."""
    text = text.strip()
    if text in labels:
        return text, False
    return min(labels, key=lambda label: edit_distance(text, label)), True
