"""The verification gate: does the exported folder behave exactly like the checkpoint it came from?

The folder is reloaded with AutoModelForCausalLM (or AutoModelForSeq2SeqLM) and AutoTokenizer, as any user
would (an adapter folder: its base with peft's PeftModel on it, adapter.py), and checked on rows the model did
not train on: held-out documents of a pretraining run's data (`DocumentRows`), or validation rows of a
fine-tune's task, encoded as fine-tuning encodes them (`TaskRows`).
1. ids: dtype, vocabulary and special ids are the ones the model was trained with;
2. logits: against the model rebuilt from the checkpoint in the export dtype (bf16 compares like with like),
   max |Δ| within tolerance.py's tolerance; the difference to the fp32 model is recorded;
3. tokenizer: the same ids as the tokenizer the training data was encoded with (`TokenizerReference`); a
   SentencePiece tokenizer's model ships as tokenizer.model, byte-identical, with no space prefix stated; a
   chat model's template is the run's, the same in chat_template.jinja and tokenizer_config.json;
4. generation: greedy decoding through `generate` (the folder's generation_config.json, its KV cache) agrees
   with the checkpoint's fp32 model up to near-ties, as agreement.py judges every runtime: each token the
   folder chose within the near-tie allowance of the best logit, stopping where the model stops.
A continued run's export (`GateSpec.base`) also has every file copied from its base byte-identical and its
config.json the base's. The greedy text and whether it equals the checkpoint's own are recorded as
information only: after a near-tie the two may legitimately continue differently.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from gptpipe.data.jsonl import Reasons
from gptpipe.export.adapter import is_adapter_folder, load_export
from gptpipe.export.agreement import DEPARTS, EXACT, compare, greedy, plain, prompt_ids, stop_ids
from gptpipe.runtime.batching import IGNORE, collate, pad_id
from gptpipe.finetune.metrics import map_to_label
from gptpipe.finetune.kinds import task_kind
from gptpipe.runtime.scoring import decode, generate, logits, model_class
from gptpipe.finetune.task_kind import TaskFacts, TaskKind
from gptpipe.log import get_logger
from gptpipe.tolerance import logits_tolerance

log = get_logger("convert")

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BATCH_ROWS = 4
BATCH_TOKENS = 256
GENERATED_ROWS = 4  # validation prompts answered greedily by both models
# A merged LoRA export (W + s·BA, each weight rounded once) against the checkpoint's unmerged model (Wx + s·B(Ax)):
# the same function in another order of rounding, which a model with large activations amplifies (measured: 1.6e-5
# of the largest logit, 137 fp32 steps, on the vLLM tests' init_std 0.3 Llama); a wrong merge (scaling, a module
# missed) is off by the adapters' whole effect.
MERGE_RELATIVE = 2.0 ** -12


class GateRows(Protocol):
    """What the logits and generation checks run on."""

    source: str  # where the rows come from, for the report
    seq2seq: bool

    def logits_batch(self, model: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """(a batch of the ids the model trained on, the mask of its positions that carry a real token)."""

    def greedy(self, model: Any, tokenizer: Any) -> tuple[list[list[int]], list[list[int]]]:
        """(prompt ids, the ids `model` generates greedily after each)."""

    def record(self, report: dict[str, Any], tokenizer: Any, answers: list[list[int]]) -> None:
        """Put the greedy samples into the report (information only)."""

    def where(self, row: int) -> str:
        """Row `row`'s prompt, for a failure message."""

    def choosable(self, model: Any, tokenizer: Any) -> int:
        """How many ids greedy generation may choose from."""


@dataclass
class DocumentRows:
    """Held-out documents as token ids (separator removed), where they came from, and the prompt generated from."""

    documents: list[list[int]]
    source: str
    separator: int  # the id training put between documents
    prompt: str  # the text generation continues (convert_config.yaml's test_prompt_text)
    seq2seq = False  # a class constant: documents train causal language models

    def batch(self, max_positions: int) -> torch.Tensor:
        """Documents joined with the training separator and cut into rows, as the model saw data in training."""
        stream = [t for doc in self.documents for t in (*doc, self.separator)]
        length = min(BATCH_TOKENS, max_positions, len(stream))
        rows = min(BATCH_ROWS, len(stream) // length)
        return torch.tensor(stream[: rows * length], dtype=torch.long).view(rows, length)

    def logits_batch(self, model: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        ids = self.batch(model.config.max_position_embeddings)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, torch.ones_like(ids, dtype=torch.bool)

    def greedy(self, model: Any, tokenizer: Any) -> tuple[list[list[int]], list[list[int]]]:
        prompt = prompt_ids(tokenizer, self.prompt)
        return [prompt], [greedy(model, prompt)]

    def record(self, report: dict[str, Any], tokenizer: Any, answers: list[list[int]]) -> None:
        report["greedy_sample"] = self.prompt + tokenizer.decode(answers[0], skip_special_tokens=True)

    def where(self, row: int) -> str:
        return f"continuing {self.prompt!r}"

    def choosable(self, model: Any, tokenizer: Any) -> int:
        return model.config.vocab_size


@dataclass
class TaskRows:
    """Validation rows of a fine-tune's task, and how the run encoded them (with its own tokenizer): its task
    kind reads, encodes and answers them."""

    rows: list[Any]  # the kind's rows (finetune/data.py's Row, chat_data.py's Conversation)
    task: TaskFacts  # the checkpoint's task.json
    source: str
    tokenizer: Any  # the run's tokenizer: the ids the model was fine-tuned on

    @property
    def seq2seq(self) -> bool:
        return self.task.seq2seq

    @property
    def kind(self) -> TaskKind:
        return task_kind(self.task.kind)

    def encoder(self, tokenizer: Any) -> Any:
        return self.kind.encoder(tokenizer, self.task)

    def prompt_ids(self, encoder: Any, row: Any) -> list[int]:
        """What the model answers `row` from, cut to fit as training cut it."""
        return self.kind.prompt(encoder, row, 0, Reasons())[0] or [encoder.eos]

    def encodings(self, encoder: Any, row: Any) -> tuple[list[int], list[int]]:
        """The two ways `row` becomes ids, for comparing tokenizers."""
        return self.kind.encodings(encoder, row)

    def texts(self) -> list[str]:
        return self.kind.texts(self.rows)

    def max_new_tokens(self, tokenizer: Any) -> int:
        """Room for the longest answer (+ its stop token): of the label set, or of the rows answered."""
        return self.kind.answer_room(self.encoder(tokenizer), self.rows[:GENERATED_ROWS], self.task.labels)

    def logits_batch(self, model: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        # a row the run would drop is simply not compared
        encoded = self.kind.encode_all(self.encoder(self.tokenizer), self.rows, Reasons())
        batch = collate(encoded, pad_id(self.tokenizer), self.seq2seq)
        batch.pop("target_columns", None)  # logits at every position, not only the label columns training needs
        # The positions that carry a real token: every input token of a causal row, every label token of seq2seq.
        real = batch["labels"] != IGNORE if self.seq2seq else batch["attention_mask"].bool()
        return batch, real

    def greedy(self, model: Any, tokenizer: Any) -> tuple[list[list[int]], list[list[int]]]:
        encoder = self.encoder(tokenizer)
        prompts = [self.prompt_ids(encoder, row) for row in self.rows[:GENERATED_ROWS]]
        answers = generate(model, encoder, prompts, torch.device("cpu"), max_new_tokens=self.max_new_tokens(tokenizer))
        return prompts, answers

    def record(self, report: dict[str, Any], tokenizer: Any, answers: list[list[int]]) -> None:
        texts = [decode(tokenizer, ids) for ids in answers]
        labels = self.task.labels
        report["greedy_samples"] = [
            {**self.kind.row_fields(row), "label": row.label, "generated": text,
             **({"prediction": map_to_label(text, labels)[0]} if labels else {})}
            for row, text in zip(self.rows, texts)]
        report["greedy_sample"] = texts[0]

    def where(self, row: int) -> str:
        return f"answering {self.rows[row].where}"

    def choosable(self, model: Any, tokenizer: Any) -> int:
        return len(tokenizer)  # generate never emits ids past the tokenizer (a padded embedding's rows)


@dataclass
class TokenizerReference:
    """The tokenizer the folder's must agree with: its name and the comparison, folder tokenizer →
    (texts compared, texts that differ, up to three of them described)."""

    name: str
    compare: Callable[[Any], tuple[int, int, list[str]]]


@dataclass
class GateSpec:
    """What one export is checked against, besides the checkpoint's model."""

    rows: GateRows
    tokenizer: TokenizerReference
    special_ids: dict[str, int | None] = field(default_factory=dict)  # "eos" → the id trained with, ...
    vocab_size: int | None = None  # config.json's exact vocabulary (None: at least the tokenizer's)
    base: Any = None  # a continued run's runtime.base_model.BaseModel: its files copied byte for byte
    sentencepiece: Path | None = None  # the SentencePiece model the folder's tokenizer.model must be, byte for byte
    chat_template: str | None = None  # a chat model's template, as the run trained with it
    merged_adapters: bool = False  # a LoRA fine-tune merged into its weights: MERGE_RELATIVE more logits tolerance


def cast_parameters(model: Any, dtype: torch.dtype) -> Any:
    """Cast the weights only, like from_pretrained(dtype=...) does: buffers such as RoPE's inv_freq stay fp32, and
    so do the weights the class keeps in fp32 at `dtype` (its _keep_in_fp32_modules_strict, matched as transformers
    matches them: Ernie 4.5's router and selection bias, which a bf16 file then holds in fp32, as trained)."""
    from transformers.core_model_loading import build_glob_alternation

    kept = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    pattern = build_glob_alternation(list(kept))[0] if kept else None
    for name, param in model.named_parameters():
        if pattern is None or not pattern.search(name):
            param.data = param.data.to(dtype)
    return model


def greedy_continuation(model: Any, tokenizer: Any, prompt: str) -> tuple[list[int], str]:
    """(new token ids, prompt + their text; an encoder-decoder's "prompt → output"): deterministic, so two
    copies of one model must agree."""
    ids = greedy(model, prompt_ids(tokenizer, prompt))
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return ids, f"{prompt} → {text}" if model.config.is_encoder_decoder else prompt + text


def _check_ids(model: Any, tokenizer: Any, spec: GateSpec, dtype: str) -> list[str]:
    """dtype, vocabulary and special ids of the reloaded folder against what the model was trained with; a
    config.json may leave a special id unset (many hub models' do), one it states must agree."""
    failures = []
    if model.dtype != TORCH_DTYPES[dtype]:
        failures.append(f"the folder loads as {model.dtype}, expected {TORCH_DTYPES[dtype]}")
    vocab = model.config.get_text_config().vocab_size
    if spec.vocab_size is not None and not len(tokenizer) == vocab == spec.vocab_size:
        failures.append(f"tokenizer has {len(tokenizer)} tokens, config.json vocab_size is {vocab}, trained with "
                        f"{spec.vocab_size}")
    elif len(tokenizer) > vocab:
        failures.append(f"the tokenizer has {len(tokenizer)} tokens, more than the {vocab} embedding rows")
    for name, want in spec.special_ids.items():
        in_tokenizer = getattr(tokenizer, f"{name}_token_id")
        in_config = getattr(model.config, f"{name}_token_id", None)
        if in_tokenizer != want or (in_config is not None and in_config != want):
            failures.append(f"{name} id: tokenizer {in_tokenizer}, config.json {in_config}, trained with {want}")
    return failures


# config.json keys that may differ from the base's: the export's own dtype and the writer's version.
BASE_CONFIG_IGNORED = ("dtype", "torch_dtype", "transformers_version", "_name_or_path")


def _check_base_files(report: dict[str, Any], folder: Path, base: Any) -> list[str]:
    """A continued run's export against its base model: config.json the base's (vocabulary, tied embeddings,
    rope scaling, special ids: nothing padded or renamed; with an extended tokenizer, vocab_size its rows) and
    every file the export copies from the base (tokenizer files, generation_config.json) or from the tokenizer
    extension (its tokenizer files) byte-identical."""
    from transformers import AutoConfig

    from gptpipe.runtime.base_model import exported_files

    files = exported_files(base)
    names = sorted(files)
    differ = [n for n in names if not (folder / n).is_file() or (folder / n).read_bytes() != files[n].read_bytes()]
    report.update(base_files=names, base_files_differing=differ)
    source = f"the base model {base.folder}'s" + (f" and its extension {base.extension.folder}'s" if base.extension
                                                  else "")
    failures = [f"not byte-identical to {source}: {', '.join(differ)}"] if differ else []
    mine, theirs = AutoConfig.from_pretrained(folder).to_dict(), AutoConfig.from_pretrained(base.folder).to_dict()
    if base.extension is not None:
        theirs["vocab_size"] = base.export_rows
    keys = sorted(k for k in set(mine) | set(theirs) if k not in BASE_CONFIG_IGNORED and mine.get(k) != theirs.get(k))
    if keys:
        failures.append(f"config.json differs from the base model's in {', '.join(keys)}")
    return failures


def _check_sentencepiece(report: dict[str, Any], folder: Path, model_path: Path) -> list[str]:
    """The SentencePiece model ships beside tokenizer.json, byte-identical to the one the data was encoded with,
    and tokenizer_config.json says there is no space prefix (as that model was trained)."""
    from gptpipe.tokenizer.hf import NO_SPACE_PREFIX, SENTENCEPIECE_FILE

    shipped = folder / SENTENCEPIECE_FILE
    failures = []
    if not shipped.is_file():
        failures.append(f"no {SENTENCEPIECE_FILE} beside tokenizer.json")
    elif shipped.read_bytes() != model_path.read_bytes():
        failures.append(f"{SENTENCEPIECE_FILE} is not byte-identical to {model_path}")
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    unstated = {k: config.get(k) for k, v in NO_SPACE_PREFIX.items() if config.get(k) is not v}
    if unstated:
        failures.append(f"tokenizer_config.json does not state that there is no space prefix: {unstated}")
    report["sentencepiece_file"] = not failures
    return failures


def _check_chat_template(report: dict[str, Any], folder: Path, tokenizer: Any, template: str) -> list[str]:
    """The folder's tokenizer renders conversations with the run's template, and both files that carry it
    (chat_template.jinja, read by transformers 5; tokenizer_config.json's copy, read by older readers and
    servers) hold that template."""
    jinja = folder / "chat_template.jinja"
    copies = {"the loaded tokenizer": tokenizer.chat_template,
              "chat_template.jinja": jinja.read_text(encoding="utf-8") if jinja.is_file() else None,
              "tokenizer_config.json": json.loads((folder / "tokenizer_config.json").read_text(
                  encoding="utf-8")).get("chat_template")}
    differ = [name for name, text in copies.items() if text != template]
    report["chat_template_identical"] = not differ
    return [f"the chat template of {', '.join(differ)} is not the run's"] if differ else []


@torch.no_grad()
def _check_logits(report: dict[str, Any], model: Any, reference: Any, reference_fp32: Any, rows: GateRows,
                  dtype: str, merged_adapters: bool) -> list[str]:
    batch, real = rows.logits_batch(model)
    log.info(f"comparing logits on a batch {tuple(batch['input_ids'].shape)} ({rows.source})")
    exported = logits(model, batch, rows.seq2seq)[real].float()
    vocab = exported.shape[-1]  # a pretraining run's export drops the reference's padding rows
    expected = logits(reference, batch, rows.seq2seq)[real][..., :vocab].float()
    diff = (exported - expected).abs().max().item()
    largest = expected.abs().max().item()
    tolerance = logits_tolerance(largest, dtype) + (MERGE_RELATIVE * largest if merged_adapters else 0.0)
    report.update(logits_max_abs_diff=diff, logits_tolerance=tolerance, heldout_batch=list(batch["input_ids"].shape),
                  heldout_source=rows.source)
    if reference_fp32 is not reference:  # how far rounding to bf16 moved the logits, for the record
        fp32 = logits(reference_fp32, batch, rows.seq2seq)[real][..., :vocab].float()
        report["logits_max_abs_diff_vs_fp32"] = (exported - fp32).abs().max().item()
    return [] if diff <= tolerance else [f"logits differ from the checkpoint's by {diff:.3g} > {tolerance:.3g}"]


def _check_tokenizer(report: dict[str, Any], tokenizer: Any, reference: TokenizerReference) -> list[str]:
    texts, mismatches, examples = reference.compare(tokenizer)
    report.update(tokenizer_texts=texts, tokenizer_mismatches=mismatches, tokenizer_reference=reference.name)
    if not mismatches:
        return []
    return [f"tokenizer ids differ from {reference.name} on {mismatches}/{texts} texts: " + "; ".join(examples)]


def _check_generation(report: dict[str, Any], model: Any, reference_fp32: Any, tokenizer: Any, rows: GateRows,
                      dtype: str) -> list[str]:
    """The folder's greedy output against the checkpoint's fp32 model (agreement.py): a generation_config.json
    that changes the choice (a penalty, suppressed tokens, other stop ids) or a broken cached decoding fails."""
    prompts, answers = rows.greedy(model, tokenizer)
    log.info(f"greedy generation from {len(prompts)} prompt(s)")
    rows.record(report, tokenizer, answers)
    verdicts = compare(reference_fp32, prompts, answers, rows.greedy(reference_fp32, tokenizer)[1], dtype,
                       stop_ids(model), seq2seq=rows.seq2seq, choosable=rows.choosable(model, tokenizer))
    worst = max(verdicts, key=lambda v: v.max_gap / v.tolerance)
    report.update(greedy_matches_checkpoint=all(v.kind == EXACT for v in verdicts),
                  greedy_verdicts=[v.kind for v in verdicts], greedy_max_gap=worst.max_gap,
                  greedy_gap_tolerance=worst.tolerance)
    return [f"greedy generation is not greedy under the checkpoint's model: {rows.where(row)}, "
            f"{v.describe(tokenizer)}; check generation_config.json"
            for row, v in enumerate(verdicts) if v.kind == DEPARTS]


def verify_export(folder: Path, reference: Any, reference_fp32: Any, spec: GateSpec, dtype: str) -> dict[str, Any]:
    """Run the gate on ``folder``; ``reference`` is the checkpoint's model in the export dtype,
    ``reference_fp32`` the same in fp32.

    Returns the report stored in the manifest: ``verified``, the failures and every figure behind them. A
    check that crashes counts as failed, so a broken folder is marked failed instead of crashing the stage.
    """
    from transformers import AutoTokenizer

    loader = model_class(spec.rows.seq2seq).__name__ + (" and peft on its base" if is_adapter_folder(folder) else "")
    report: dict[str, Any] = {"dtype": dtype}
    log.info(f"verifying {folder}: reloading with {loader} / AutoTokenizer")
    try:
        model = load_export(folder, spec.rows.seq2seq)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as exc:
        failures = [f"the folder does not load with {loader}/AutoTokenizer: {type(exc).__name__}: {exc}"]
        return {**report, "verified": False, "failures": failures}
    # A base's generation_config.json is its author's (sampling settings, a repetition penalty), copied unchanged
    # and checked byte for byte: the generation check tests the cached decoding with nothing else changing it.
    generating = plain(model) if spec.base is not None else model
    checks: dict[str, Callable[[], list[str]]] = {
        "ids": lambda: _check_ids(model, tokenizer, spec, dtype),
        **({"base files": lambda: _check_base_files(report, folder, spec.base)} if spec.base is not None else {}),
        "logits": lambda: _check_logits(report, model, reference, reference_fp32, spec.rows, dtype,
                                        spec.merged_adapters),
        "tokenizer": lambda: _check_tokenizer(report, tokenizer, spec.tokenizer),
        **({"tokenizer.model": lambda: _check_sentencepiece(report, folder, spec.sentencepiece)}
           if spec.sentencepiece is not None else {}),
        **({"chat template": lambda: _check_chat_template(report, folder, tokenizer, spec.chat_template)}
           if spec.chat_template is not None else {}),
        "generation": lambda: _check_generation(report, generating, reference_fp32, tokenizer, spec.rows, dtype),
    }
    failures = []
    for name, check in checks.items():
        try:
            failures += check()
        except Exception as exc:
            failures.append(f"{name} check failed: {type(exc).__name__}: {exc}")
    return {**report, "verified": not failures, "failures": failures}
