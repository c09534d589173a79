"""Continued pretraining (`model.init_from`): the open model a run starts from, and the checks that it is the one
trained.

A base model is a local HF folder: its config.json decides the architecture, its weights initialise a run that
has no checkpoint yet, and its tokenizer must be the one stage 2 encoded the data with. Before the first step:
the data's manifests name this tokenizer as transformers builds it (`check_data`), the engine's step-0 loss
equals transformers' own (`reference_loss`), the tokenizer re-encodes the data's documents (`tokenizer_problems`,
naming the likely cause when it does not); the folder's files are recorded (`fingerprint`), and a resumed run
or export refuses a folder that changed since (`folder_changes`).

The tokenizer may be the base's extended by stage 1 (tokenize.tokenizer_dir: its output_dir or hf/; see
data/base_tokenizer.py's Extension): the model then has the extended vocabulary's rows (padded to
model.VOCAB_MULTIPLE where it outgrows the base's; model.extend_vocabulary fills them) and the step-0 gate
compares what an extension leaves exact. On the first validation sample with each new id spelled in the base ids
it stands for (text the base reads as it always did), the engine's log-softmax over the base's own rows (all of
its rows but the spare ones new ids took) must give the loss the base's does over the same rows in transformers
in fp32: the new rows only add terms to the softmax's sum over the whole vocabulary, which this leaves out. And
each new row must be the mean of the base's rows for its ids (`new_row_problems`), as the engine computes them.
"""


from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptpipe.data.base_tokenizer import Extension, expand
from gptpipe.runtime.base_model import BaseModel, check_data, open_base
from gptpipe.stage import StageInputError

if TYPE_CHECKING:
    import torch

# The step-0 gate's sample: the first validation sample, cut to this many tokens (the fp32 reference runs on
# the host, where a long sample of a large model would take minutes).
GATE_TOKENS = 512
# Random hidden states the gate's output-row check passes through the output matrix (any wrong row shows).
PROBES = 8
# A probe's logit in bf16 is a sum of rounded products over the hidden size, the parts' logits averaged after:
# allowed four bf16 steps of the largest logit (measured: 1.5 on the tests' tiny models); a wrong row is off by
# the order of the logit itself.
PROBE_ROUNDINGS = 4
PROBE_CHUNK = 1024  # new ids whose input rows the gate checks at once (their base ids' rows gathered)


# --- the model ------------------------------------------------------------------------------------------------
def gate_batch(valid_data: Any, extension: Extension | None = None) -> dict[str, torch.Tensor]:
    """The step-0 gate's batch: the first validation sample (the first of every evaluation), cut to GATE_TOKENS;
    with a tokenizer extension, each new id spelled in the base ids it stands for (text the base reads)."""
    import torch

    from gptpipe.train.data import collate

    batch = collate(valid_data, range(1), "cpu")
    length = min(GATE_TOKENS, batch["input_ids"].shape[1])  # the re-spelled sample too: within seq_len's positions
    if extension is not None:
        # the sample's tokens (inputs and the last label) re-spelled, then shifted again as the dataset does
        stream = expand(batch["input_ids"][0].tolist() + batch["labels"][0, -1:].tolist(), extension.new_rows)
        tokens = torch.tensor([stream[:length + 1]])
        return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    return {k: v[:, :length] for k, v in batch.items()}


def old_rows_loss(logits: torch.Tensor, labels: torch.Tensor, old_rows: torch.Tensor) -> float:
    """The mean next-token loss of `logits` over the base's rows that `old_rows` marks (a bool mask of the base's
    rows), the softmax taken over those alone: an extended model's new and padding rows left out."""
    import torch

    rows = logits[..., :len(old_rows)].float().masked_fill(~old_rows.to(logits.device), float("-inf"))
    return float(torch.nn.functional.cross_entropy(rows.reshape(-1, rows.shape[-1]), labels.reshape(-1),
                                                   ignore_index=-100))


def reference_loss(folder: Path, batch: dict[str, torch.Tensor], old_rows: torch.Tensor | None = None) -> float:
    """The folder's loss on `batch` through transformers alone: from_pretrained in fp32 on the host, eager
    attention; `old_rows`: over those of its rows only (old_rows_loss). Call before Liger patches the model
    classes (build_engine), so the reference stays unpatched."""
    import torch
    from transformers import AutoModelForCausalLM

    from gptpipe.runtime.model import lm_forward

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        if old_rows is not None:
            return old_rows_loss(model(input_ids=batch["input_ids"], use_cache=False).logits, batch["labels"],
                                 old_rows)
        out = lm_forward(model, batch)
    return float(out.loss)


def new_row_problems(model: Any, extension: Extension, precision: str) -> tuple[list[str], str]:
    """(the problems, what was checked) of a model's new rows against the means of the base's rows for the ids
    each stands for, as the model's own modules compute them: its input embedding on the ids, its output matrix
    on PROBES random hidden states (each new id's logit must be the mean of its base ids' logits). Collective
    under ZeRO-3 (the modules gather their weights): every rank calls it."""
    import torch

    from gptpipe.tolerance import logits_tolerance

    dtype = "fp32" if precision == "fp32" else "bf16"  # fp16 rounds finer than bf16: its tolerance covers it
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    weight = embedding.weight
    device = weight.device
    hidden = getattr(weight, "ds_shape", weight.shape)[-1]
    probes = torch.randn(PROBES, hidden, generator=torch.Generator().manual_seed(0)).to(device, weight.dtype)
    logits = head(probes).float()
    new_ids = sorted(extension.new_rows)
    worst = {"input": (0.0, 0.0), "output": (0.0, 0.0)}  # (max |Δ|, largest magnitude compared)
    for start in range(0, len(new_ids), PROBE_CHUNK):
        chunk = new_ids[start:start + PROBE_CHUNK]
        parts = [extension.new_rows[i] for i in chunk]
        flat = torch.tensor([i for ids in parts for i in ids], device=device)
        owner = torch.repeat_interleave(torch.arange(len(chunk), device=device),
                                        torch.tensor([len(ids) for ids in parts], device=device))
        counts = torch.bincount(owner, minlength=len(chunk)).unsqueeze(-1).float()
        rows = embedding(torch.tensor(chunk, device=device)).float()
        means = torch.zeros_like(rows).index_add_(0, owner, embedding(flat).float()) / counts
        columns = logits[:, chunk]
        mean_columns = torch.zeros_like(columns).index_add_(1, owner, logits[:, flat]) / counts.T
        for name, got, want in (("input", rows, means), ("output", columns, mean_columns)):
            diff, scale = (got - want).abs().max().item(), want.abs().max().item()
            worst[name] = (max(worst[name][0], diff), max(worst[name][1], scale))
    problems, checked = [], []
    for name, (diff, scale) in worst.items():
        tolerance = logits_tolerance(scale if name == "input" else PROBE_ROUNDINGS * scale, dtype)
        where = ("input embedding rows" if name == "input" else f"output rows (logits of {PROBES} random hidden "
                 "states)")
        line = f"max |Δ| {diff:.2g} from the means of their base ids' {where} (tolerance {tolerance:.2g})"
        checked.append(line)
        if not diff <= tolerance:
            problems.append(f"the {len(new_ids):,} new rows are not the means of the base's: {line}")
    return problems, f"its {len(new_ids):,} new rows: " + "; ".join(checked)


def stage3_model(config: Any) -> tuple[Any, Any, BaseModel | None]:
    """(tokenizer facts, transformers config, base model or None) of the model stage 3 trains: model.init_from's
    folder, its data checked against its tokenizer; else a new model of model.arch/preset on the stage-1
    tokenizer."""
    from gptpipe.artifacts import read_dataset, read_tokenizer
    from gptpipe.runtime.model import build_model_config

    if config.model.init_from is not None:
        base = open_base(config.model.init_from, config.tokenize.tokenizer_dir)
        check_data(base, {str(p): read_dataset(p).manifest for p in config.data.prefixes})
        return base.tokenizer, base.config, base
    tokenizer = read_tokenizer(config.tokenize.tokenizer_dir)
    check_new_model_data(config.tokenize.tokenizer_dir,
                         {str(p): read_dataset(p).manifest for p in config.data.prefixes})
    return tokenizer, build_model_config(config.model, tokenizer, config.train.seq_len), None


def check_new_model_data(tokenizer_dir: Path | str, manifests: dict[str, Any]) -> None:
    """Refuse datasets (prefix → its stage-2 manifest) that the stage-1 tokenizer a new model is built for did not
    encode, or encoded before stage 1 last ran: the model's vocabulary and the export's tokenizer come from
    tokenize.tokenizer_dir, the ids from wherever data.prefixes points, and nothing else would notice."""
    from gptpipe.artifacts import TRAIN_TOKENIZER

    want = TRAIN_TOKENIZER.fingerprint(tokenizer_dir)
    problems = [f"{prefix}: encoded with {manifest.config.get('tokenizer_dir')}"
                + (" as it was before stage 1 last wrote it" if str(manifest.config.get("tokenizer_dir")) ==
                   str(tokenizer_dir) else "")
                for prefix, manifest in manifests.items() if manifest.inputs.get("tokenizer") != want]
    if problems:
        raise StageInputError(f"the data was not tokenized with tokenize.tokenizer_dir {tokenizer_dir}, the "
                              f"tokenizer the new model is built for (point tokenize.tokenizer_dir at the data's "
                              f"tokenizer, or rerun stage 2 with this one):\n  - " + "\n  - ".join(problems))
