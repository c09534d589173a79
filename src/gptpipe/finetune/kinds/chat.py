"""task.kind chat: conversations (finetune/chat_data.py) rendered through the run's chat template, the loss on
the assistant turns; validated by the assistant-token loss and the chrF of generated last answers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gptpipe.data.jsonl import CUT_TO_FIT, TOO_LONG, Reasons
from gptpipe.finetune.chat_data import (ChatEncoder, Conversation, conversations_from_lines, describe_template,
                                        distinct_pad, install_template, read_conversations, special_tokens_as_tokens)
from gptpipe.finetune.data import file_format
from gptpipe.runtime.batching import pad_id
from gptpipe.finetune.metrics import CHRF, VAL_LOSS, generation_metrics
from gptpipe.runtime.scoring import decode, gather, generate, score, shard
from gptpipe.finetune.task_kind import TaskData, TaskFacts, TaskKind
from gptpipe.stage import StageInputError

if TYPE_CHECKING:
    from gptpipe.finetune.config import FinetuneConfig, FinetuneDataConfig, TaskConfig
    from gptpipe.runtime.engine import Dist


class ChatKind(TaskKind):
    name = "chat"
    metrics = (CHRF,)
    default_best = VAL_LOSS.key  # a validation's answers are few and short: the loss is steadier than their chrF
    templated = False  # rows are conversations, rendered by the chat template
    converses = True
    encodes_validation = True  # a conversation the template cannot mask, or too long, is no validation row
    loss_scores = "the assistant turns: {:.4f} nats per assistant token"
    row_noun = "conversations"
    tuning = "chat tuning"  # what the refusals call the training
    row_keys = "messages, or instruction/input/output"  # the keys of a row, for the refusals

    def check(self, config: FinetuneConfig, seq2seq: bool) -> None:
        data = config.data
        if seq2seq:
            raise StageInputError(f"task.kind {self.name}: {config.model.path} is an encoder-decoder; {self.tuning} "
                                  f"needs a causal LM, which reads the whole conversation as one sequence")
        for name in ("train", "validation"):
            path = getattr(data, name)
            if path is not None and file_format(path, data.format) != "jsonl":
                raise StageInputError(f"task.kind {self.name} reads jsonl rows ({self.row_keys}); data.{name} "
                                      f"{path} is not .jsonl (set data.format=jsonl if it is)")

    def describe_template(self, template: str) -> str:
        return describe_template(template)

    def prepare_tokenizer(self, tokenizer: Any, task: TaskConfig) -> tuple[str, ...]:
        """The template installed, special tokens read as tokens, a pad distinct from EOS."""
        notes = (install_template(tokenizer, task.chat_template), special_tokens_as_tokens(tokenizer),
                 distinct_pad(tokenizer))
        return tuple(note for note in notes if note)

    def read(self, path: Path, data: FinetuneDataConfig, skipped: Reasons, need_answer: bool = True
             ) -> list[Conversation]:
        return read_conversations(path, skipped, data.messages_key, need_answer=need_answer)

    def read_lines(self, lines: list[str]) -> list[Conversation]:
        return conversations_from_lines(lines)

    def encoder(self, tokenizer: Any, facts: TaskFacts, too_long: str | None = None) -> ChatEncoder:
        """A conversation is never cut to train (too_long does not apply): the encoder stops generation at the
        end-of-turn tokens the run's training found."""
        encoder = ChatEncoder(tokenizer, facts.seq_len)
        encoder.stop_ids = facts.stop_ids or encoder.stop_ids
        return encoder

    def stop_ids(self, encoder: ChatEncoder) -> list[int]:
        return encoder.stop_ids

    def prompt(self, encoder: ChatEncoder, row: Conversation, max_new_tokens: int, skipped: Reasons
               ) -> tuple[list[int] | None, dict[str, Any]]:
        """The conversation before its last answer and the assistant's header, its oldest exchanges left out
        as `gptpipe chat` leaves them (`cut`: how many turns); None when even its last user turn does not leave
        max_new_tokens."""
        kept, ids = encoder.fit_turns(row.prompt, max_new_tokens)
        if len(ids) + max_new_tokens > encoder.seq_len:
            why = (f"{len(ids)} prompt tokens with only the last user turn; seq_len {encoder.seq_len} less "
                   f"max_new_tokens {max_new_tokens} leaves {encoder.seq_len - max_new_tokens}")
            skipped.add(TOO_LONG, f"{row.where}: {why}")
            return None, {"too_long": why}
        if len(kept) < len(row.prompt):
            skipped.add(CUT_TO_FIT, row.where)
            return ids, {"cut": len(row.prompt) - len(kept)}
        return ids, {}

    def row_fields(self, row: Conversation) -> dict[str, Any]:
        return {"messages": row.prompt}

    def cut_note(self) -> str:
        return "conversations cut (their oldest exchanges left out)"

    def encodings(self, encoder: ChatEncoder, row: Conversation) -> tuple[list[int], list[int]]:
        """The conversation's whole ids (as training encoded it) and its generation prompt."""
        encoded = encoder.encode(row, Reasons())
        return (encoded.input_ids if encoded else []), encoder.prompt_ids(row.prompt)

    def texts(self, rows: list[Conversation]) -> list[str]:
        return [turn["content"] for row in rows for turn in row.messages]

    def answer_room(self, encoder: ChatEncoder, rows: list[Conversation], labels: list[str] | None) -> int:
        return max(len(encoder.ids(row.label)) + 1 for row in rows)

    def scored_rows(self, model: Any, task: TaskData, config: FinetuneConfig, dist: Dist,
                    score_items: Callable[[list[Any]], list[dict[str, Any]]]) -> list[dict[str, Any]]:
        """Validation's pass over every validation row, in row order: `score_items` (a chunk of this rank's
        encoded items → one dict of figures each), and "generated", the greedy answer to the prompt, for the
        first task.chat_eval_rows rows. Each rank generates for the same number of its rows (ZeRO-3 keeps the
        ranks in step). Shared by the kinds whose rows are conversations (chat, preference)."""
        encoder, batch = task.encoder, config.train.micro_batch_size or 8
        assert task.validation_items is not None
        synced = config.train.zero_stage == 3 and dist.world_size > 1
        mine = shard(list(range(len(task.validation))), dist)
        asked = -(-min(config.task.chat_eval_rows, len(task.validation)) // dist.world_size)
        longest = self.answer_room(encoder, task.validation, None)
        results = []
        for start in range(0, len(mine), batch):
            chunk = mine[start:start + batch]
            out = score_items([task.validation_items[k] for _, k in chunk])
            wanted = chunk[:max(0, asked - start)]
            if wanted:
                prompts = [encoder.prompt_ids(task.validation[k].prompt) for _, k in wanted]
                for o, ids in zip(out, generate(model, encoder, prompts, dist.device, max_new_tokens=longest,
                                                synced_gpus=synced)):
                    o["generated"] = decode(task.tokenizer, ids)
            results += [(i, o) for (i, _), o in zip(chunk, out)]
        return gather(results, dist)

    @torch.no_grad()
    def validate(self, model: Any, task: TaskData, config: FinetuneConfig, dist: Dist) -> dict[str, Any]:
        """val_loss: the mean loss of the validation conversations' assistant tokens (the stop tokens included);
        chrf: the last answer of the first task.chat_eval_rows conversations generated greedily after the turns
        before it, against the gold answer."""
        batch, pad = config.train.micro_batch_size or 8, pad_id(task.tokenizer)

        def losses(items: list[Any]) -> list[dict[str, Any]]:
            lps = score(model, items, pad, False, dist.device, batch)
            return [{"lp": lp, "tokens": e.label_tokens} for lp, e in zip(lps, items)]

        scored = self.scored_rows(model, task, config, dist, losses)
        answered = [(row.label, o["generated"]) for row, o in zip(task.validation, scored) if "generated" in o]
        return {"val_loss": -sum(o["lp"] for o in scored) / max(sum(o["tokens"] for o in scored), 1),
                "chrf": generation_metrics([g for g, _ in answered], [p for _, p in answered])["chrf"],
                "generated": len(answered)}
