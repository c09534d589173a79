"""task.kind preference: pairs of a preferred (chosen) and a dispreferred (rejected) answer to one prompt,
trained with DPO (Rafailov et al. 2023, the sigmoid loss) against a frozen reference: the run's starting model.

Rows are jsonl objects in the shape of TRL's preference datasets: `prompt` (a string, or a message list), `chosen`
and `rejected` (a string, or a list of assistant messages). Every sequence goes through the run's chat template
exactly as a chat run renders it (chat_data.py's ChatEncoder): a string prompt is one user turn and a string
answer one assistant turn. A chat-tuned model has learnt to answer after the template's assistant header, and
`gptpipe chat` and predict ask it that way, so the preference is taught in the context the model is used in
(TRL would concatenate a string prompt and answer as raw text, a context a chat model never sees). A pair is the
prompt's ids followed by the chosen answer's (its end-of-turn token included), and the same prompt followed by the
rejected one; the log-probabilities are summed over the answer tokens only.

The reference log-probabilities (each training and validation pair's chosen and rejected sums under the starting
weights) are computed once, before the first step, and stored in the run folder (REFERENCE_FILE) with what they
were derived from: the model folder's files (sha256), the precision and the encoded pairs. A resumed run reuses
them; no second model is kept, so training takes the memory of a chat run. The loss per pair is

    -(1 - ε) log σ(β Δ) - ε log σ(-β Δ),
    Δ = (log π(chosen) - log π_ref(chosen)) - (log π(rejected) - log π_ref(rejected))

(ε: task.label_smoothing, the conservative DPO of TRL's earlier sigmoid loss; β: task.beta), plus α times the
chosen answer's negative log-likelihood per token (α: task.rpo_alpha; RPO, Pang et al. 2024, TRL's "sft" loss
term): DPO alone only widens the margin, and lowers the chosen answer's likelihood while it does (the rejected one's
falls faster), until the model's own greedy answers get worse; the NLL term holds the chosen answers up. Averaged
over the pairs of the global batch. A pair's rewards are β (log π - log π_ref) of each answer.

A run evaluates the starting model before its first step (the reference every later evaluation is read against),
picks its best checkpoint by greedy_chosen (the answers the model gives, not the margin it learnt), and warns
when the chosen answers' likelihood has fallen by more than CHOSEN_FALL_NATS since the start.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gptpipe.data.jsonl import (EMPTY, IDENTICAL_ANSWERS, INVALID_JSON, MISSING_KEY, NO_CHOSEN, NOT_A_MESSAGE_LIST,
                                NOT_AN_OBJECT, TEMPLATE_ERROR, TOO_LONG, UNDECODABLE, Reasons, parse_record)
from gptpipe.finetune.chat_data import ChatEncoder, Conversation, message_list, text_problem
from gptpipe.finetune.kinds.chat import ChatKind
from gptpipe.runtime.batching import IGNORE, Encoded, pad_id
from gptpipe.finetune.data import Problem
from gptpipe.finetune.metrics import Metric, edit_distance
from gptpipe.runtime.scoring import gather, score, shard, target_logprobs
from gptpipe.finetune.task_kind import TaskData, TaskFacts
from gptpipe.log import get_logger
from gptpipe.stage import StageInputError, write_text_atomic, folder_fingerprint
from gptpipe.runtime.mirror import REFERENCE_LOGPROBS_FILE

if TYPE_CHECKING:
    from gptpipe.finetune.config import FinetuneConfig, FinetuneDataConfig, TaskConfig
    from gptpipe.runtime.engine import Dist

log = get_logger("finetune")

REFERENCE_FILE = REFERENCE_LOGPROBS_FILE  # in the run folder: the starting model's log-prob sums of every pair
# A pair's figures, in this order: logged per step (means over the log window's pairs) and at validation.
FIGURES = ("reward_chosen", "reward_rejected", "reward_accuracy", "reward_margin", "logp_chosen", "logp_rejected",
           "nll_chosen")
# A warning when the chosen answers' mean log-ratio to the start falls below -this: each half as likely or less.
CHOSEN_FALL_NATS = math.log(2)


# --- rows ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PreferenceRow:
    """One preference row: the prompt's turns, the chosen and rejected answers (assistant turns; None in
    prediction input without them) and "file:line"."""

    turns: tuple[dict[str, str], ...]
    chosen: tuple[dict[str, str], ...] | None
    rejected: tuple[dict[str, str], ...] | None
    where: str

    @property
    def prompt(self) -> list[dict[str, str]]:
        """The turns the model answers (as a chat row's prompt)."""
        return list(self.turns)

    @property
    def label(self) -> str | None:
        """The preferred answer's text: what predict and the export's gate compare a generated answer with."""
        return self.chosen[-1]["content"] if self.chosen else None

    def conversation(self, answer: tuple[dict[str, str], ...]) -> Conversation:
        return Conversation(self.turns + answer, self.where)


def read_pairs(path: Path, skipped: Reasons, need_answer: bool = True) -> list[PreferenceRow]:
    """The good preference rows of a jsonl file, bad ones counted in `skipped`; need_answer=False (prediction
    input): a row may hold its prompt alone."""
    rows = []
    for number, raw in enumerate(path.read_bytes().split(b"\n"), 1):
        if not raw.strip():
            continue
        where = f"{path}:{number}"
        found = preference_row(raw, need_answer)
        if isinstance(found, Problem):
            skipped.add(found.reason, f"{where}: {found.detail}" if found.detail else where)
        else:
            rows.append(PreferenceRow(*found, where))
    return rows


Turns = tuple[dict[str, str], ...]


def preference_row(raw: bytes, need_answer: bool) -> tuple[Turns, Turns | None, Turns | None] | Problem:
    """(prompt turns, chosen turns, rejected turns) of one jsonl line, or why it holds no pair."""
    obj, reason = parse_record(raw)
    if reason:
        return Problem(reason, "" if reason in (UNDECODABLE, INVALID_JSON) else repr(raw[:60]))
    if not isinstance(obj, dict):
        return Problem(NOT_AN_OBJECT, "")
    if "prompt" not in obj:
        return Problem(MISSING_KEY, "'prompt' (a row without one, TRL's implicit prompt, is not read)")
    prompt = _turns(obj["prompt"], "prompt", "user")
    if isinstance(prompt, Problem):
        return prompt
    answers: list[Turns | None] = []
    for key in ("chosen", "rejected"):
        value = obj.get(key)
        if value is None or value == []:
            if need_answer:
                return Problem(NO_CHOSEN, "") if key == "chosen" else Problem(MISSING_KEY, repr(key))
            answers.append(None)
            continue
        answer = _turns(value, key, "assistant")
        if isinstance(answer, Problem):
            return answer
        roles = [turn["role"] for turn in answer]
        if any(role != "assistant" for role in roles):
            return Problem(NOT_A_MESSAGE_LIST, f"{key} holds {roles}: an answer is assistant turns")
        answers.append(answer)
    if need_answer and answers[0] == answers[1]:
        return Problem(IDENTICAL_ANSWERS, "")
    return prompt, answers[0], answers[1]


def _turns(value: Any, key: str, role: str) -> Turns | Problem:
    """A string as one `role` turn, or a message list's turns."""
    if isinstance(value, str):
        problem = text_problem(value, key)
        return problem or ({"role": role, "content": value.strip()},)
    turns = message_list(value, key)
    if isinstance(turns, Problem):
        return turns
    return tuple(turns) if turns else Problem(EMPTY, key)


# --- ids ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PairEncoded:
    """A pair as ids: the prompt and the chosen answer, the prompt and the rejected one (labels on the answer
    only), and the reference log-prob sums of both once prepare_training has them."""

    chosen: Encoded
    rejected: Encoded
    reference: tuple[float, float] | None = None


class PreferenceEncoder(ChatEncoder):
    """Pairs as ids through the chat template: each answer rendered after the prompt as a chat run renders an
    assistant turn, the loss (and the log-prob sums) on that answer and its end-of-turn token only."""

    def uncut_length(self, row: PreferenceRow) -> int:
        return max(len(self._ids(row, answer)) for answer in self._answers(row))

    def encode(self, row: PreferenceRow, skipped: Reasons) -> PairEncoded | None:
        """The pair's ids; None (counted) when either sequence is longer than seq_len (the pair is dropped:
        cutting would cut an answer or its context) or when the template raises on it."""
        from jinja2 import TemplateError as JinjaError

        try:
            answers = self._answers(row)
            full = [self._ids(row, answer) for answer in answers]
            if max(map(len, full)) > self.seq_len:
                skipped.add(TOO_LONG, f"{row.where}: {max(map(len, full))} tokens, train.seq_len {self.seq_len}")
                return None
            start = len(self.prompt_ids(row.prompt))  # masked checks it is where the answer's turn starts
            chosen, rejected = (self.masked(row.conversation(answer), ids) for answer, ids in zip(answers, full))
        except JinjaError as exc:
            skipped.add(TEMPLATE_ERROR, f"{row.where}: {exc}")
            return None
        return PairEncoded(*(Encoded(e.input_ids, [IGNORE] * start + e.labels[start:]) for e in (chosen, rejected)))

    @staticmethod
    def _answers(row: PreferenceRow) -> tuple[Turns, Turns]:
        assert row.chosen is not None and row.rejected is not None, f"{row.where}: a training row has both answers"
        return row.chosen, row.rejected

    def _ids(self, row: PreferenceRow, answer: Turns) -> list[int]:
        return self.tokenizer.apply_chat_template(list(row.turns + answer), tokenize=True, return_dict=False)


# --- the loss -------------------------------------------------------------------------------------------------
def dpo(policy: torch.Tensor, reference: torch.Tensor, beta: float, label_smoothing: float = 0.0
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the DPO loss of each pair, [pairs]; each pair's FIGURES but nll_chosen, [pairs, 6], detached) from the
    policy's and the reference's log-prob sums, [pairs, 2] (chosen, rejected)."""
    ratios = policy - reference  # log π/π_ref of the chosen and the rejected answer
    logits = beta * (ratios[:, 0] - ratios[:, 1])
    losses = (-torch.nn.functional.logsigmoid(logits) * (1 - label_smoothing)
              - torch.nn.functional.logsigmoid(-logits) * label_smoothing)
    rewards, logps = beta * ratios.detach(), policy.detach()
    figures = torch.stack([rewards[:, 0], rewards[:, 1], (rewards[:, 0] > rewards[:, 1]).float(),
                           rewards[:, 0] - rewards[:, 1], logps[:, 0], logps[:, 1]], dim=1)
    return losses, figures


def chosen_nll(policy: torch.Tensor, chosen_tokens: torch.Tensor) -> torch.Tensor:
    """Each pair's chosen answer's negative log-likelihood per token (its end-of-turn token included), [pairs]."""
    return -policy[:, 0] / chosen_tokens


def sequence_logprobs(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """Each sequence's sum of target log-probs, in the order the batch was collated (padded, or packed: its
    `rows` say where each sequence lies)."""
    token = target_logprobs(model, batch, seq2seq=False)
    if "rows" not in batch:
        return token.sum(dim=1)
    return torch.stack([token[s, at:at + n].sum() for s, at, n in batch["rows"]])


# --- the reference ----------------------------------------------------------------------------------------------
@torch.no_grad()
def pair_logprobs(model: Any, pairs: list[PairEncoded], pad: int, device: torch.device, batch: int, dist: Dist
                  ) -> list[tuple[float, float]]:
    """The (chosen, rejected) log-prob sums of every pair under `model`, on every rank: each rank scores its
    share (the same number of forwards on every rank, as ZeRO-3 needs)."""
    mine = shard(pairs, dist)
    sums = score(model, [e for _, pair in mine for e in (pair.chosen, pair.rejected)], pad, False, device, batch)
    return gather([(i, (sums[2 * k], sums[2 * k + 1])) for k, (i, _) in enumerate(mine)], dist)


def _digest(pairs: list[PairEncoded]) -> str:
    """The encoded pairs' fingerprint: their ids and labels."""
    text = json.dumps([[p.chosen.input_ids, p.chosen.labels, p.rejected.input_ids, p.rejected.labels] for p in pairs])
    return hashlib.sha256(text.encode()).hexdigest()


def _same_start(stored: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """How the start a reference was derived from differs from this run's (empty: the same)."""
    def files(record: dict[str, Any]) -> dict[str, str]:
        return {name: f["sha256"] for name, f in record["files"].items()}

    changes = [f"{key} {stored.get(key)} -> {now[key]}" for key in ("precision", "train_pairs", "validation_pairs")
               if stored.get(key) != now[key]]
    if files(stored) != files(now):
        changed = sorted(set(files(stored).items()) ^ set(files(now).items()))
        changes.append(f"the model folder's files ({', '.join(sorted({name for name, _ in changed}))})")
    return changes


def reference(model: Any, task: TaskData, config: FinetuneConfig, run_dir: Path, dist: Dist, resuming: bool
              ) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(training pairs', validation pairs') reference log-prob sums: the run folder's REFERENCE_FILE when it
    was derived from this start (the model folder's files, the precision, the same encoded pairs), else
    computed with `model` (the starting weights) and stored. A resumed run whose file was derived from another
    start is refused: its checkpoints trained against that one."""
    path = run_dir / REFERENCE_FILE
    stored, problem = None, None
    if dist.is_main:
        stored = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
        previous = stored["derived_from"]["files"] if stored else None
        derived = {"model": str(config.model.path), "files": folder_fingerprint(config.model.path, previous),
                   "precision": config.train.precision, "train_pairs": _digest(task.train),
                   "validation_pairs": _digest(task.validation_items or [])}
        changes = _same_start(stored["derived_from"], derived) if stored else []
        if changes and resuming:
            problem = (f"{path} was derived from another start than this run's ({'; '.join(changes)}), and the "
                       f"checkpoints in {run_dir} trained against it; set train.output_model_dir to a new folder "
                       f"(or restore model.path and the data)")
        if changes or not stored:
            stored = None
    if dist.world_size > 1:  # every rank takes the main rank's decision (and values)
        shared = [stored, problem]
        torch.distributed.broadcast_object_list(shared, src=0)
        stored, problem = shared
    if problem:
        raise StageInputError(problem)
    if stored is not None:
        if dist.is_main:
            log.info(f"reference log-probs of the starting model: {path} (reused)")
        return [tuple(x) for x in stored["train"]], [tuple(x) for x in stored["validation"]]
    batch, pad = config.train.micro_batch_size or 8, pad_id(task.tokenizer)
    train = pair_logprobs(model, task.train, pad, dist.device, batch, dist)
    validation = pair_logprobs(model, task.validation_items or [], pad, dist.device, batch, dist)
    if dist.is_main:
        write_text_atomic(path, json.dumps({"derived_from": derived, "train": train, "validation": validation}) + "\n")
        log.info(f"reference log-probs of the starting model computed for {len(train):,} training and "
                 f"{len(validation):,} validation pairs, stored in {path}; no reference model is kept (memory as "
                 f"for a chat run)")
    return train, validation


# --- the kind -------------------------------------------------------------------------------------------------
class PreferenceKind(ChatKind):
    """Preference pairs, DPO against the starting model; a chat model that converses like a chat run's."""

    name = "preference"
    metrics = (Metric("reward_accuracy", "reward accuracy"), Metric("reward_margin", "reward margin"),
               Metric("greedy_chosen", "greedy answers nearer the chosen"))
    # The answers the model gives: the DPO loss and the reward accuracy keep improving while the chosen answers'
    # likelihood falls and greedy answers get worse (issue 46's hidden set: accuracy 0.85, greedy right 0.35 → 0.01).
    default_best = "greedy_chosen"
    evaluates_start = True  # the starting model's figures: what every evaluation of the tuning is read against
    converses = True
    encodes_validation = True
    loss_scores = "the held-out preference pairs: {:.4f} (DPO loss per pair; log 2 = 0.6931 before training)"
    row_noun = "pairs"
    tuning = "preference tuning"
    row_keys = "prompt, chosen and rejected"
    step_figures = FIGURES

    def read(self, path: Path, data: FinetuneDataConfig, skipped: Reasons, need_answer: bool = True
             ) -> list[PreferenceRow]:
        return read_pairs(path, skipped, need_answer=need_answer)

    def encoder(self, tokenizer: Any, facts: TaskFacts, too_long: str | None = None) -> PreferenceEncoder:
        encoder = PreferenceEncoder(tokenizer, facts.seq_len)
        encoder.stop_ids = facts.stop_ids or encoder.stop_ids
        return encoder

    # --- training ---------------------------------------------------------------------------------------------
    def prepare_training(self, model: Any, task: TaskData, config: FinetuneConfig, run_dir: Path, dist: Dist,
                         resuming: bool) -> TaskData:
        """The pairs with their reference log-prob sums (see `reference`)."""
        train, validation = reference(model, task, config, run_dir, dist, resuming)
        return replace(task, train=[replace(p, reference=r) for p, r in zip(task.train, train)],
                       validation_items=[replace(p, reference=r)
                                         for p, r in zip(task.validation_items or [], validation)])

    def sequences(self, item: PairEncoded) -> list[Encoded]:
        return [item.chosen, item.rejected]

    def loss_weight(self, item: PairEncoded) -> int:
        return 1  # the loss is the mean over the global batch's pairs

    def collate(self, items: list[PairEncoded], pad: int, seq2seq: bool, pack_capacity: int | None, device: Any
                ) -> dict[str, Any]:
        batch = super().collate(items, pad, seq2seq, pack_capacity, device)
        batch["reference"] = torch.tensor([p.reference for p in items], dtype=torch.float32).to(device)
        batch["chosen_tokens"] = torch.tensor([p.chosen.label_tokens for p in items], dtype=torch.float32).to(device)
        return batch

    def loss(self, model: Any, batch: dict[str, Any], seq2seq: bool, task: TaskConfig
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """The DPO loss (with task.rpo_alpha times the chosen answer's NLL per token) summed over the micro-batch's
        pairs, and their FIGURES summed."""
        policy = sequence_logprobs(model, batch).view(-1, 2)
        losses, figures = dpo(policy, batch["reference"], task.beta, task.label_smoothing)
        nll = chosen_nll(policy, batch["chosen_tokens"])
        if task.rpo_alpha:
            losses = losses + task.rpo_alpha * nll
        return losses.sum(), torch.cat([figures, nll.detach()[:, None]], dim=1).sum(dim=0)

    def warnings(self, m: dict[str, Any], task: TaskConfig) -> list[str]:
        """The chosen answers fallen in likelihood since the start by more than CHOSEN_FALL_NATS (mean)."""
        fallen = -m["reward_chosen"] / task.beta
        if fallen <= CHOSEN_FALL_NATS:
            return []
        return [f"the chosen answers are {fallen:.2f} nats less likely than at the start (mean over the validation "
                f"pairs; rpo_alpha {task.rpo_alpha:g}): DPO is widening the margin by pushing both answers down. "
                "Raise task.rpo_alpha or lower train.lr, and read greedy_chosen, not the reward accuracy"]

    # --- the export's gate --------------------------------------------------------------------------------------
    def encodings(self, encoder: PreferenceEncoder, row: PreferenceRow) -> tuple[list[int], list[int]]:
        """The chosen and the rejected sequence's ids, as training encoded them."""
        pair = encoder.encode(row, Reasons())
        return (pair.chosen.input_ids, pair.rejected.input_ids) if pair else ([], [])

    def texts(self, rows: list[PreferenceRow]) -> list[str]:
        return [turn["content"] for row in rows for turns in (row.turns, row.chosen or (), row.rejected or ())
                for turn in turns]

    def encode_all(self, encoder: PreferenceEncoder, rows: list[PreferenceRow], skipped: Reasons) -> list[Encoded]:
        return [e for pair in (encoder.encode(row, skipped) for row in rows) if pair for e in self.sequences(pair)]

    # --- validation ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def validate(self, model: Any, task: TaskData, config: FinetuneConfig, dist: Dist) -> dict[str, Any]:
        """val_loss: the mean DPO loss of the validation pairs against their reference (the NLL term apart: it is
        nll_chosen); the means of FIGURES (reward_accuracy: the share of pairs whose chosen reward is the higher);
        greedy_chosen: the share of the
        first task.chat_eval_rows prompts whose greedy answer is nearer (by edit distance) the chosen answer
        than the rejected one (a tie counts half)."""
        batch, pad = config.train.micro_batch_size or 8, pad_id(task.tokenizer)

        def policy_sums(pairs: list[Any]) -> list[dict[str, Any]]:
            sums = score(model, [e for p in pairs for e in self.sequences(p)], pad, False, dist.device, 2 * batch)
            return [{"policy": sums[2 * j:2 * j + 2]} for j in range(len(pairs))]

        scored = self.scored_rows(model, task, config, dist, policy_sums)
        policy = torch.tensor([o["policy"] for o in scored])
        reference_sums = torch.tensor([p.reference for p in task.validation_items])
        losses, figures = dpo(policy, reference_sums, config.task.beta, config.task.label_smoothing)
        tokens = torch.tensor([float(p.chosen.label_tokens) for p in task.validation_items])
        figures = torch.cat([figures, chosen_nll(policy, tokens)[:, None]], dim=1)
        nearer = [_nearer_chosen(o["generated"], row) for row, o in zip(task.validation, scored) if "generated" in o]
        return {"val_loss": losses.mean().item(), **dict(zip(FIGURES, figures.mean(dim=0).tolist())),
                "greedy_chosen": sum(nearer) / len(nearer) if nearer else math.nan, "generated": len(nearer)}


def _nearer_chosen(text: str, row: PreferenceRow) -> float:
    """1 when `text` is nearer the chosen answer than the rejected one by edit distance, 0 when farther, 0.5 for
    a tie."""
    assert row.chosen is not None and row.rejected is not None
    chosen, rejected = (edit_distance(text, answer[-1]["content"]) for answer in (row.chosen, row.rejected))
    return 1.0 if chosen < rejected else 0.0 if chosen > rejected else 0.5
