"""The verification gate for a fine-tune export: does the folder answer exactly like the best checkpoint?

Stage 4's gate (verify.py) checks a pretrained model on held-out documents of its Megatron dataset; a
fine-tuned model is checked the same four ways on what it was fine-tuned for: validation rows of its task,
encoded as fine-tuning encodes them (the task's prompt template, prompt + gold label + EOS, right-padded).
The folder is reloaded with AutoModelForCausalLM or AutoModelForSeq2SeqLM and AutoTokenizer, as a user would:
1. ids: dtype; the tokenizer fits the embedding; eos/pad ids of tokenizer, config.json and the run's tokenizer agree;
2. logits: against the model rebuilt from the checkpoint in the export dtype, on the rows' real tokens
   (stage 4's tolerances);
3. tokenizer: the same ids as the run's tokenizer (`<run>/tokenizer`) on every prompt and label;
4. generation: greedy answers to validation prompts through `generate` (the folder's generation_config.json,
   its KV cache) pick, at every step, a token the checkpoint's model also ranks first, up to a near-tie
   (stage 4's `GREEDY_GAP_FACTOR`). The answers, decoded (and, for classification, mapped onto the label set),
   and whether they equal the checkpoint's own are recorded as information only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

import torch

from gptpipe.data.jsonl import Reasons
from gptpipe.export.verify import GREEDY_GAP_FACTOR, TORCH_DTYPES, run_gate
from gptpipe.finetune.data import IGNORE, Encoded, Encoder, Row, collate, map_to_label, pad_id
from gptpipe.finetune.model import as_scored, decode, generate, logits, model_class
from gptpipe.log import get_logger
from gptpipe.tolerance import logits_tolerance

log = get_logger("convert")

GENERATED_ROWS = 4  # validation prompts answered greedily by both models


@dataclass
class TaskRows:
    """Validation rows of the fine-tune's task, and how the run encoded them."""

    rows: list[Row]
    task: dict[str, Any]  # the checkpoint's task facts (task.json)
    source: str

    def encoder(self, tokenizer: Any) -> Encoder:
        t = self.task
        return Encoder(tokenizer, t["prompt"], t["seq_len"], t["seq2seq"], t["too_long"])

    def encoded(self, tokenizer: Any) -> list[Encoded]:
        scratch = Reasons()  # a row the run would drop is simply not compared
        return [e for e in (self.encoder(tokenizer).encode(row, scratch) for row in self.rows) if e is not None]

    def max_new_tokens(self, tokenizer: Any) -> int:
        """Room for the longest label (+ EOS): of the label set, or of the rows answered (generation)."""
        labels = self.task.get("labels") or [row.label for row in self.rows[:GENERATED_ROWS]]
        return max(len(self.encoder(tokenizer).label_ids(label)) for label in labels)


def _check_ids(model: Any, tokenizer: Any, reference_tokenizer: Any, dtype: str) -> list[str]:
    failures = []
    if model.dtype != TORCH_DTYPES[dtype]:
        failures.append(f"the folder loads as {model.dtype}, expected {TORCH_DTYPES[dtype]}")
    vocab = model.config.get_text_config().vocab_size
    if len(tokenizer) > vocab:
        failures.append(f"the tokenizer has {len(tokenizer)} tokens, more than the {vocab} embedding rows")
    for name in ("eos", "pad"):
        want, in_tokenizer = getattr(reference_tokenizer, f"{name}_token_id"), getattr(tokenizer, f"{name}_token_id")
        in_config = getattr(model.config, f"{name}_token_id", None)
        if in_tokenizer != want or (in_config is not None and in_config != want):
            failures.append(f"{name} id: tokenizer {in_tokenizer}, config.json {in_config}, fine-tuned with {want}")
    return failures


def _check_logits(report: dict[str, Any], model: Any, reference: Any, reference_fp32: Any, data: TaskRows,
                  reference_tokenizer: Any, dtype: str) -> list[str]:
    seq2seq = data.task["seq2seq"]
    batch = collate(data.encoded(reference_tokenizer), pad_id(reference_tokenizer), seq2seq)  # the trained ids
    batch.pop("target_columns", None)  # logits at every position, not only the label columns training needs
    # The positions that carry a real token: every input token of a causal row, every label token of seq2seq.
    real = batch["labels"] != IGNORE if seq2seq else batch["attention_mask"].bool()
    log.info(f"comparing logits on {batch['input_ids'].shape[0]} validation rows ({data.source})")
    with torch.no_grad():
        exported = logits(model, batch, seq2seq)[real].float()
        expected = logits(reference, batch, seq2seq)[real].float()
        diff = (exported - expected).abs().max().item()
        tolerance = logits_tolerance(expected.abs().max().item(), dtype)
        report.update(logits_max_abs_diff=diff, logits_tolerance=tolerance,
                      heldout_batch=list(batch["input_ids"].shape), heldout_source=data.source)
        if reference_fp32 is not reference:  # how far rounding to bf16 moved the logits, for the record
            fp32 = logits(reference_fp32, batch, seq2seq)[real].float()
            report["logits_max_abs_diff_vs_fp32"] = (exported - fp32).abs().max().item()
    return [] if diff <= tolerance else [f"logits differ from the checkpoint's by {diff:.3g} > {tolerance:.3g}"]


def _check_tokenizer(report: dict[str, Any], tokenizer: Any, reference_tokenizer: Any, data: TaskRows) -> list[str]:
    """The folder's tokenizer must give the run's ids on every prompt (with special tokens) and label."""
    ours, theirs = data.encoder(tokenizer), data.encoder(reference_tokenizer)
    texts = [(row.input, row.label) for row in data.rows]
    differ = [f"{text!r}" for text, label in texts
              if ours.prompt_ids(text) != theirs.prompt_ids(text) or ours.label_ids(label) != theirs.label_ids(label)]
    report.update(tokenizer_texts=2 * len(texts), tokenizer_mismatches=len(differ))
    if not differ:
        return []
    return [f"tokenizer ids differ from the run's tokenizer on {len(differ)}/{len(texts)} validation rows: "
            + "; ".join(differ[:3])]


def _answers(model: Any, tokenizer: Any, data: TaskRows) -> tuple[list[list[int]], list[list[int]]]:
    """(the prompts' ids, the greedy answers' ids) of the first GENERATED_ROWS validation rows."""
    encoder = data.encoder(tokenizer)
    prompts = [encoder.fit_prompt(row.input, 0, row.where, Reasons()) or [encoder.eos]
               for row in data.rows[:GENERATED_ROWS]]
    answers = generate(model, encoder, prompts, torch.device("cpu"), max_new_tokens=data.max_new_tokens(tokenizer))
    return prompts, answers


def _check_generation(report: dict[str, Any], model: Any, reference: Any, tokenizer: Any, data: TaskRows,
                      dtype: str) -> list[str]:
    """The folder's greedy answers must be greedy under the checkpoint's model, step by step, as stage 4's
    check (verify.py) asks of its continuation: the reference reads the folder's own answers, so a near-tie
    never derails the comparison."""
    log.info(f"greedy answers to {min(GENERATED_ROWS, len(data.rows))} validation prompts")
    prompts, ids = _answers(model, tokenizer, data)
    texts = [decode(tokenizer, i) for i in ids]
    labels = data.task.get("labels")
    report["greedy_samples"] = [
        {"input": row.input, "label": row.label, "generated": text,
         **({"prediction": map_to_label(text, labels)[0]} if labels else {})}
        for row, text in zip(data.rows, texts)]
    report["greedy_sample"] = texts[0]
    report["greedy_matches_checkpoint"] = ids == _answers(reference, tokenizer, data)[1]
    seq2seq = data.task["seq2seq"]
    batch = collate([as_scored(p, i, seq2seq) for p, i in zip(prompts, ids)], pad_id(tokenizer), seq2seq)
    batch.pop("target_columns", None)
    with torch.no_grad():  # the reference's logits at the positions that chose each answer token
        chosen_logits = logits(reference, batch, seq2seq)[..., :len(tokenizer)].float()  # generate's id range
    targets = batch["targets"]
    gaps = chosen_logits.max(dim=-1).values - chosen_logits.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    gaps = gaps.masked_fill(targets == IGNORE, 0.0)
    tolerance = GREEDY_GAP_FACTOR * logits_tolerance(chosen_logits.abs().max().item(), dtype)
    worst = gaps.max().item()
    report.update(greedy_max_gap=worst, greedy_gap_tolerance=tolerance)
    if worst <= tolerance:
        return []
    row, step = divmod(int(gaps.argmax()), gaps.shape[1])
    token = int(targets[row, step])
    return [f"greedy generation is not greedy under the checkpoint's model: answering {data.rows[row].where}, "
            f"token {tokenizer.decode([token])!r} is {worst:.3g} below its best logit (> {tolerance:.3g}); check "
            f"generation_config.json"]


def verify_finetune_export(folder: Path, reference: Any, reference_fp32: Any, reference_tokenizer: Any,
                           data: TaskRows, dtype: str) -> dict[str, Any]:
    """Run the gate on ``folder``; ``reference`` is the checkpoint's model in the export dtype. Returns the
    manifest's report (``verified`` and every figure behind it); a check that crashes counts as failed."""
    def checks(model: Any, tokenizer: Any, report: dict[str, Any]) -> dict[str, Callable[[], list[str]]]:
        return {
            "ids": lambda: _check_ids(model, tokenizer, reference_tokenizer, dtype),
            "logits": lambda: _check_logits(report, model, reference, reference_fp32, data, reference_tokenizer,
                                            dtype),
            "tokenizer": lambda: _check_tokenizer(report, tokenizer, reference_tokenizer, data),
            "generation": lambda: _check_generation(report, model, reference, tokenizer, data, dtype),
        }

    return run_gate(folder, model_class(data.task["seq2seq"]), dtype, checks)
