"""The verification gate: does the exported folder behave exactly like the trained checkpoint?

The folder is reloaded with AutoModelForCausalLM/AutoTokenizer, as any user would, and checked on data the
model did not train on (documents of its validation/test split, cut from the seeded shuffle training used):
1. ids: dtype, vocabulary size and bos/eos/pad ids are the ones the model was trained with;
2. logits: against the model rebuilt from the checkpoint, both in the export dtype (bf16
   compares like with like), max |Δ| within a tolerance;
3. tokenizer: the same ids as the SentencePiece model the training data was encoded with;
4. generation: greedy decoding through `generate` (the folder's generation_config.json, its KV cache) picks,
   at every step, a token the checkpoint's model also ranks first, up to a near-tie (`GREEDY_GAP_FACTOR`).
A continued run's export (model.init_from) checks the base model's files and tokenizer instead of 1 and 3
(`verify_continued_export`). The report also records, as information only, the greedy text and whether it
equals the checkpoint's own greedy text: after a near-tie the two may legitimately continue differently.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

import torch

from gptpipe.log import get_logger
from gptpipe.tokenizer.hf import compare
from gptpipe.tolerance import logits_tolerance

log = get_logger("convert")

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BATCH_ROWS = 4
BATCH_TOKENS = 256
GREEDY_TOKENS = 24
# Logits that agree within a tolerance t can swap their argmax only where the best two are within 2·t of each
# other (a near-tie); the generation check allows that gap between the reference's best logit and its logit of
# the token the folder chose.
GREEDY_GAP_FACTOR = 2.0


@dataclass
class HeldOut:
    """Held-out documents as token ids (separator removed) and where they came from."""

    documents: list[list[int]]
    source: str

    def batch(self, separator: int, max_positions: int) -> torch.Tensor:
        """Documents joined with the training separator and cut into rows, as the model saw data in training."""
        stream = [t for doc in self.documents for t in (*doc, separator)]
        length = min(BATCH_TOKENS, max_positions, len(stream))
        rows = min(BATCH_ROWS, len(stream) // length)
        return torch.tensor(stream[: rows * length], dtype=torch.long).view(rows, length)


def cast_parameters(model: Any, dtype: torch.dtype) -> Any:
    """Cast the weights only, like from_pretrained(dtype=...) does; buffers such as RoPE's inv_freq stay fp32."""
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model


@torch.no_grad()
def _logits(model: Any, batch: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return model(input_ids=batch).logits[..., :vocab_size].float()


@torch.no_grad()
def greedy_continuation(model: Any, tokenizer: Any, prompt: str) -> tuple[list[int], str]:
    """(new token ids, prompt + their text; an encoder-decoder's "prompt → output"): deterministic, so two
    copies of one model must agree."""
    prompt_ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]], dtype=torch.long)
    out = model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), do_sample=False,
                         max_new_tokens=GREEDY_TOKENS, pad_token_id=tokenizer.pad_token_id)
    if model.config.is_encoder_decoder:  # the output is the decoder's alone (it starts with its start token)
        ids = out[0, 1:].tolist()
        return ids, f"{prompt} → {tokenizer.decode(ids, skip_special_tokens=True)}"
    ids = out[0, prompt_ids.shape[1]:].tolist()
    return ids, prompt + tokenizer.decode(ids, skip_special_tokens=True)


def _check_ids(model: Any, tokenizer: Any, tokenizer_info: Any, dtype: str) -> list[str]:
    """dtype, vocabulary and special ids of the reloaded folder against what the model was trained with."""
    failures = []
    if model.dtype != TORCH_DTYPES[dtype]:
        failures.append(f"the folder loads as {model.dtype}, expected {TORCH_DTYPES[dtype]}")
    if len(tokenizer) != model.config.vocab_size:
        failures.append(f"tokenizer has {len(tokenizer)} tokens, config.json vocab_size is {model.config.vocab_size}")
    for name in ("bos", "eos", "pad"):
        want, in_tokenizer = getattr(tokenizer_info, f"{name}_id"), getattr(tokenizer, f"{name}_token_id")
        in_config = getattr(model.config, f"{name}_token_id")
        if in_tokenizer != want or in_config != want:
            failures.append(f"{name} id: tokenizer {in_tokenizer}, config.json {in_config}, trained with {want}")
    return failures


def _check_logits(report: dict[str, Any], model: Any, reference: Any, reference_fp32: Any, heldout: HeldOut,
                  separator: int, dtype: str) -> list[str]:
    batch = heldout.batch(separator, model.config.max_position_embeddings)
    log.info(f"comparing logits on a held-out batch {tuple(batch.shape)} ({heldout.source})")
    vocab = model.config.vocab_size
    exported = _logits(model, batch, vocab)
    expected = _logits(reference, batch, vocab)
    diff = (exported - expected).abs().max().item()
    tolerance = logits_tolerance(expected.abs().max().item(), dtype)
    report.update(logits_max_abs_diff=diff, logits_tolerance=tolerance, heldout_batch=list(batch.shape),
                  heldout_source=heldout.source)
    if reference_fp32 is not reference:  # how far rounding to bf16 moved the logits, for the record
        report["logits_max_abs_diff_vs_fp32"] = (exported - _logits(reference_fp32, batch, vocab)).abs().max().item()
    return [] if diff <= tolerance else [f"logits differ from the checkpoint's by {diff:.3g} > {tolerance:.3g}"]


def _check_tokenizer(report: dict[str, Any], tokenizer: Any, sp_model_path: Path, heldout: HeldOut,
                     prompt: str) -> list[str]:
    """HF ids must equal SentencePiece ids on the held-out documents' text (and the test prompt)."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_model_path))
    texts = [sp.decode(doc) for doc in heldout.documents] + [prompt]
    failures, examples = compare(sp, tokenizer, texts, round_trip=False)
    report.update(tokenizer_texts=len(texts), tokenizer_mismatches=failures)
    if not failures:
        return []
    return [f"tokenizer ids differ from SentencePiece on {failures}/{len(texts)} held-out texts: "
            + "; ".join(examples)]


def _check_generation(report: dict[str, Any], model: Any, reference: Any, tokenizer: Any, prompt: str,
                      dtype: str) -> list[str]:
    """The folder's greedy continuation must be greedy under the checkpoint's model, step by step: a
    generation_config.json that changes the choice (a penalty, suppressed tokens) or a broken cached decoding
    fails. The reference reads the folder's own continuation, so a near-tie can never derail the comparison."""
    log.info("greedy generation from the test prompt")
    generated, report["greedy_sample"] = greedy_continuation(model, tokenizer, prompt)
    report["greedy_matches_checkpoint"] = generated == greedy_continuation(reference, tokenizer, prompt)[0]
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt_ids + generated], dtype=torch.long)
    # The reference's logits at the positions that chose each generated token.
    logits = _logits(reference, ids, model.config.vocab_size)[0, len(prompt_ids) - 1:-1]
    gaps = logits.max(dim=-1).values - logits.gather(-1, ids[0, len(prompt_ids):, None])[:, 0]
    tolerance = GREEDY_GAP_FACTOR * logits_tolerance(logits.abs().max().item(), dtype)
    step = int(gaps.argmax())
    worst = gaps[step].item()
    report.update(greedy_max_gap=worst, greedy_gap_tolerance=tolerance)
    if worst <= tolerance:
        return []
    return [f"greedy generation is not greedy under the checkpoint's model: new token {step + 1} "
            f"({tokenizer.decode([generated[step]])!r}) is {worst:.3g} below its best logit (> {tolerance:.3g}); "
            "check generation_config.json"]


def verify_export(folder: Path, reference: Any, reference_fp32: Any, tokenizer_info: Any, heldout: HeldOut,
                  prompt: str, dtype: str) -> dict[str, Any]:
    """Run the gate on ``folder``; ``reference`` is the checkpoint's model in the export dtype.

    Returns the report stored in the manifest: ``verified`` plus every figure behind it. A check that
    crashes counts as failed, so a broken folder is marked failed instead of crashing the stage.
    """
    from transformers import AutoModelForCausalLM

    def checks(model: Any, tokenizer: Any, report: dict[str, Any]) -> dict[str, Callable[[], list[str]]]:
        return {
            "ids": lambda: _check_ids(model, tokenizer, tokenizer_info, dtype),
            "logits": lambda: _check_logits(report, model, reference, reference_fp32, heldout, tokenizer_info.eod_id,
                                            dtype),
            "tokenizer": lambda: _check_tokenizer(report, tokenizer, tokenizer_info.model_path, heldout, prompt),
            "generation": lambda: _check_generation(report, model, reference, tokenizer, prompt, dtype),
        }

    return run_gate(folder, AutoModelForCausalLM, dtype, checks)


# config.json keys that may differ from the base's: the export's own dtype and the writer's version.
BASE_CONFIG_IGNORED = ("dtype", "torch_dtype", "transformers_version", "_name_or_path")


def _check_base_files(report: dict[str, Any], model: Any, folder: Path, base: Any, dtype: str) -> list[str]:
    """A continued run's export against its base model: the dtype, config.json the base's (vocabulary, tied
    embeddings, rope scaling, special ids: nothing padded or renamed) and every file the export copies from the
    base (tokenizer files, generation_config.json) byte-identical."""
    from transformers import AutoConfig

    from gptpipe.train.base_model import is_copied

    failures = []
    if model.dtype != TORCH_DTYPES[dtype]:
        failures.append(f"the folder loads as {model.dtype}, expected {TORCH_DTYPES[dtype]}")
    names = sorted(p.name for p in base.folder.iterdir() if p.is_file() and is_copied(p.name))
    differ = [n for n in names if not (folder / n).is_file()
              or (folder / n).read_bytes() != (base.folder / n).read_bytes()]
    report.update(base_files=names, base_files_differing=differ)
    if differ:
        failures.append(f"not byte-identical to the base model {base.folder}'s: {', '.join(differ)}")
    mine, theirs = AutoConfig.from_pretrained(folder).to_dict(), AutoConfig.from_pretrained(base.folder).to_dict()
    keys = sorted(k for k in set(mine) | set(theirs) if k not in BASE_CONFIG_IGNORED and mine.get(k) != theirs.get(k))
    if keys:
        failures.append(f"config.json differs from the base model's in {', '.join(keys)}")
    return failures


def _check_base_tokenizer(report: dict[str, Any], tokenizer: Any, base: Any, heldout: HeldOut) -> list[str]:
    """The folder's tokenizer gives the training data's ids on the held-out documents' text."""
    from gptpipe.train.base_model import round_trip_problems

    failures = round_trip_problems(tokenizer, heldout.documents, base.tokenizer.bos_id, base.tokenizer.eod_id)
    report.update(tokenizer_texts=len(heldout.documents), tokenizer_mismatches=len(failures))
    return failures


def verify_continued_export(folder: Path, reference: Any, reference_fp32: Any, base: Any, heldout: HeldOut,
                            prompt: str, dtype: str) -> dict[str, Any]:
    """The gate of a continued run's export (`base`: its train.base_model.BaseModel): verify_export's logits and
    generation checks, with the base's files and tokenizer in place of the stage-1 tokenizer's."""
    from transformers import AutoModelForCausalLM

    def checks(model: Any, tokenizer: Any, report: dict[str, Any]) -> dict[str, Callable[[], list[str]]]:
        return {
            "base files": lambda: _check_base_files(report, model, folder, base, dtype),
            "logits": lambda: _check_logits(report, model, reference, reference_fp32, heldout,
                                            base.tokenizer.eod_id, dtype),
            "tokenizer": lambda: _check_base_tokenizer(report, tokenizer, base, heldout),
            "generation": lambda: _check_generation(report, _plain_greedy(model), reference, tokenizer, prompt,
                                                    dtype),
        }

    return run_gate(folder, AutoModelForCausalLM, dtype, checks)


def _plain_greedy(model: Any) -> Any:
    """`model` generating with its special ids only: a base's generation_config.json is its author's (sampling
    settings, a repetition penalty), copied unchanged and checked byte for byte, so the generation check tests
    the cached decoding with nothing else changing the choice."""
    from transformers import GenerationConfig

    own = model.generation_config
    model.generation_config = GenerationConfig(bos_token_id=own.bos_token_id, eos_token_id=own.eos_token_id,
                                               pad_token_id=own.pad_token_id)
    return model


def run_gate(folder: Path, loader: Any, dtype: str,
             checks: Callable[[Any, Any, dict[str, Any]], dict[str, Callable[[], list[str]]]]) -> dict[str, Any]:
    """Reload ``folder`` with ``loader`` (an AutoModel class) and AutoTokenizer, run every check on them and
    return the manifest's report: ``verified``, the failures and the figures the checks record. A check that
    crashes counts as failed, so a broken folder is marked failed instead of crashing the stage."""
    from transformers import AutoTokenizer

    report: dict[str, Any] = {"dtype": dtype}
    log.info(f"verifying {folder}: reloading with {loader.__name__} / AutoTokenizer")
    try:
        model = loader.from_pretrained(folder, dtype="auto").eval()
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as exc:
        failures = [f"the folder does not load with {loader.__name__}/AutoTokenizer: {type(exc).__name__}: {exc}"]
        return {**report, "verified": False, "failures": failures}
    failures = []
    for name, check in checks(model, tokenizer, report).items():
        try:
            failures += check()
        except Exception as exc:
            failures.append(f"{name} check failed: {type(exc).__name__}: {exc}")
    return {**report, "verified": not failures, "failures": failures}
