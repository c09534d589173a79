"""Batches of token ids for every stage that runs a model: padded and packed collation with aligned targets,
the epoch order of fine-tuning rows, the dataset positions a rank reads in a micro-step, and the move to the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

IGNORE = -100  # label id the loss skips (prompt tokens, padding)


@dataclass(frozen=True)
class Encoded:
    """One row as ids. Causal: prompt + label + EOS in `input_ids`, `labels` = IGNORE on the prompt.
    Seq2seq: the prompt alone in `input_ids`, label + EOS as decoder `labels`."""

    input_ids: list[int]
    labels: list[int]

    @property
    def label_tokens(self) -> int:
        return sum(1 for t in self.labels if t != IGNORE)


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


def sample_positions(consumed: int, micro_step: int, micro_batch: int, dp_rank: int, dp_size: int) -> range:
    """Dataset positions read by `dp_rank` in micro-step `micro_step` of the step starting at `consumed`.

    A global batch is the next global_batch_size positions; micro-steps take consecutive slices of it,
    interleaved across ranks. Only `consumed` carries over a resume.
    """
    start = consumed + (micro_step * dp_size + dp_rank) * micro_batch
    return range(start, start + micro_batch)


def to_device(batch: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """``batch`` with its tensors on ``device`` (other values as they are). A GPU gets them from pinned host
    memory without blocking, so the copy overlaps the work already queued instead of stalling the host."""
    import torch

    cuda = torch.device(device).type == "cuda"
    return {k: (v.pin_memory() if cuda else v).to(device, non_blocking=cuda) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()}
