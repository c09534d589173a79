"""What task.kind classification and generation share: labelled rows (TSV or jsonl, finetune/data.py), the prompt
template around each input and the label after it, scored at validation by the gold label's loss and the
kind's `figures` of the answers (classification: every label scored, kinds/classification.py; generation:
decoded greedily, kinds/generation.py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gptpipe.data.jsonl import Reasons
from gptpipe.runtime.batching import Encoded, pad_id
from gptpipe.finetune.data import Encoder, Row, read_lines, read_rows
from gptpipe.runtime.scoring import decode, gather, generate, score, shard
from gptpipe.finetune.task_kind import TaskData, TaskFacts, TaskKind

if TYPE_CHECKING:
    from gptpipe.finetune.config import FinetuneConfig, FinetuneDataConfig
    from gptpipe.runtime.engine import Dist


class LabelledKind(TaskKind):
    """Rows of an input and a label, read from TSV or jsonl."""

    def read(self, path: Path, data: FinetuneDataConfig, skipped: Reasons, need_answer: bool = True) -> list[Row]:
        return read_rows(path, data.format, data.input_key, data.label_key, skipped, need_label=need_answer)[0]

    def read_lines(self, lines: list[str]) -> list[Row]:
        return read_lines(lines)

    def encoder(self, tokenizer: Any, facts: TaskFacts, too_long: str | None = None) -> Encoder:
        return Encoder(tokenizer, facts.prompt, facts.seq_len, facts.seq2seq, too_long or facts.too_long)

    def prompt(self, encoder: Encoder, row: Row, max_new_tokens: int, skipped: Reasons
               ) -> tuple[list[int] | None, dict[str, Any]]:
        ids = encoder.fit_prompt(row.input, max_new_tokens, row.where, skipped)
        if ids is None:  # counted as TOO_LONG by fit_prompt
            return None, {"too_long": f"the prompt template alone does not leave {max_new_tokens} new tokens "
                                      f"within seq_len {encoder.seq_len}"}
        return ids, {}

    def row_fields(self, row: Row) -> dict[str, Any]:
        return {"input": row.input}

    def encodings(self, encoder: Encoder, row: Row) -> tuple[list[int], list[int]]:
        return encoder.prompt_ids(row.input), encoder.label_ids(row.label)

    def texts(self, rows: list[Row]) -> list[str]:
        return [text for row in rows for text in (row.input, row.label)]

    def answer_room(self, encoder: Encoder, rows: list[Row], labels: list[str] | None) -> int:
        return max(len(encoder.label_ids(label)) for label in labels or [row.label for row in rows])

    @torch.no_grad()
    def validate(self, model: Any, task: TaskData, config: FinetuneConfig, dist: Dist) -> dict[str, Any]:
        """val_loss: the mean token loss of the gold labels. Classification scores each label's log-likelihood
        after the prompt and picks the best (and with task.generate_labels also generates, mapping the text onto
        the nearest label); generation decodes greedily."""
        encoder, batch, pad = task.encoder, config.train.micro_batch_size or 8, pad_id(task.tokenizer)
        synced = config.train.zero_stage == 3 and dist.world_size > 1
        mine = shard(task.validation, dist)
        results = []
        for start in range(0, len(mine), batch):
            chunk = mine[start:start + batch]
            scratch = Reasons()  # candidates cut or dropped here are not data problems
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
                    scores = [lp if e is not None else -math.inf
                              for lp, e in zip(row_lps[1:], items[k * width + 1:])]
                    o["pred"] = candidates[int(np.argmax(scores))]
                out.append(o)
            if not task.labels or config.task.generate_labels:
                prompts = [self.prompt(encoder, row, 0, scratch)[0] or [encoder.eos] for _, row in chunk]
                generated = generate(model, encoder, prompts, dist.device,
                                     max_new_tokens=self._max_new_tokens(task, config), synced_gpus=synced)
                for o, ids in zip(out, generated):
                    o["generated"] = decode(task.tokenizer, ids)
            results += [(i, o) for (i, _), o in zip(chunk, out)]
        scored = gather(results, dist)
        tokens = sum(o["gold_tokens"] for o in scored)
        metrics: dict[str, Any] = {"val_loss": -sum(o["gold_lp"] for o in scored if o["gold_tokens"])
                                   / max(tokens, 1)}
        return {**metrics, **self.figures([row.label for row in task.validation], scored, task, config)}

    def figures(self, gold: list[str], scored: list[dict[str, Any]], task: TaskData, config: FinetuneConfig
                ) -> dict[str, Any]:
        """The kind's metrics from the scored validation rows."""
        raise NotImplementedError

    def _max_new_tokens(self, task: TaskData, config: FinetuneConfig) -> int:
        """New tokens to generate at evaluation: the longest label (+ EOS) for classification."""
        if task.labels:
            return max(len(task.encoder.label_ids(label)) for label in task.labels)
        return config.predict.max_new_tokens
