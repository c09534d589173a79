"""LoRA adapters (peft) on a pretrained model: applied before DeepSpeed wraps it, so its optimizer and checkpoints
hold only the adapters; and a LoRA checkpoint rebuilt as its pretrained base plus the trained adapters, merged
into plain weights (the export, `merge_and_unload`) or kept apart as trained (`gptpipe predict`, an adapter export).

The adapter settings travel as a plain dict (task.json's `lora`, `lora_record`: rank, alpha, dropout, the
target modules and where they came from, the base's file fingerprint), so the checkpoint code that rebuilds a
model needs no fine-tune config. Here rather than in finetune/: runtime/checkpoint.py rebuilds models for stage 4
and predict alike, and train/ imports nothing of finetune/.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gptpipe.stage import StageInputError, folder_fingerprint, folder_changes
from gptpipe.runtime.memory import model_state_bytes

ADAPTER_MARK = "lora_"  # peft's adapter weights are named ...lora_A.default.weight / ...lora_B.default.weight

# train.lora.target_modules null: the linear layers that get adapters, by the base's model_type. Every attention
# and MLP projection that is an nn.Linear (QLoRA found adapters on all of them needed to match a full fine-tune);
# Mixtral's experts are fused 3-D parameters in transformers 5, with no nn.Linear for peft to wrap, so its
# adapters sit on the attention; T5's attention only, as its MLP is named wi/wo in T5 and wi_0/wi_1/wo in v1.1.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"), PROJECTIONS),
    "mixtral": PROJECTIONS[:4], "ernie4_5_moe": PROJECTIONS[:4], "gpt2": ("c_attn", "c_proj", "c_fc"),
    **dict.fromkeys(("t5", "mt5", "umt5"), ("q", "k", "v", "o"))}


def lora_record(settings: dict[str, Any], base: Path, recorded: dict[str, Any] | None = None) -> dict[str, Any]:
    """task.json's `lora` of a run with train.lora `settings` on the pretrained `base` folder: the settings, the
    target modules resolved (null: DEFAULT_TARGETS of the base's model_type; `targets_from` says which) and the
    base's fingerprint (every file's size and sha256), which a LoRA checkpoint needs to be rebuilt on. A resumed
    run passes its `recorded` lora: files of unchanged size and mtime keep their hash (a base of many GB is not
    read again by every rank)."""
    targets, source = settings["target_modules"], "train.lora.target_modules"
    if targets is None:
        model_type = json.loads((base / "config.json").read_text(encoding="utf-8")).get("model_type")
        if model_type not in DEFAULT_TARGETS:
            raise StageInputError(f"train.lora.target_modules is null and {base} is a {model_type!r} model, which "
                                  f"has no default (known: {', '.join(sorted(DEFAULT_TARGETS))}): name the linear "
                                  "layers to adapt, e.g. train.lora.target_modules=[q_proj,v_proj]")
        targets, source = list(DEFAULT_TARGETS[model_type]), f"the default for model_type {model_type}"
    return {**settings, "target_modules": list(targets), "targets_from": source,
            "base": {"folder": str(base), "files": folder_fingerprint(base, recorded and recorded["base"]["files"])}}


def check_base(lora: dict[str, Any], base: Path, where: str) -> None:
    """Refuse a `base` folder whose files are not those the adapters were trained on (`lora`'s record, read
    from `where`): adapters on another base would load without complaint and compute something else."""
    changes = folder_changes(lora["base"], base)
    if changes:
        raise StageInputError(f"{base} is not the base model the LoRA adapters of {where} were trained on "
                              f"({lora['base']['folder']}): " + "; ".join(changes[:5])
                              + (f"; and {len(changes) - 5} more" if len(changes) > 5 else "")
                              + ". Restore that folder (model.path), or fine-tune again")


def apply_lora(model: Any, lora: dict[str, Any], seq2seq: bool) -> Any:
    """`model` with adapters on lora["target_modules"]: only they require gradients (peft freezes the rest)."""
    from peft import LoraConfig, TaskType, get_peft_model

    config = LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                        target_modules=list(lora["target_modules"]),
                        task_type=TaskType.SEQ_2_SEQ_LM if seq2seq else TaskType.CAUSAL_LM)
    try:
        return get_peft_model(model, config)
    except ValueError as exc:  # peft's "Target modules ... not found in the base model"
        raise StageInputError(f"train.lora.target_modules {lora['target_modules']}: {exc}") from None


def trainable_summary(model: Any, precision: str, zero_stage: int, fp32_gradients: bool, dp: int,
                      offload: bool) -> str:
    """The memory line of a LoRA run: parameters trained of all, and the weights, gradients and optimizer state
    per rank (memory.model_state_bytes, as the ZeRO stage divides them over `dp` ranks) against a full
    fine-tune's."""
    # ZeRO-3 leaves each rank an empty tensor of every weight: ds_numel is the whole weight's size.
    total = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    trained = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
    lora = model_state_bytes(total, trained, precision, dp, zero_stage, offload, fp32_gradients)
    full = model_state_bytes(total, total, precision, dp, zero_stage, offload, fp32_gradients)
    return (f"LoRA: {trained:,} of {total:,} parameters trained ({trained / total:.2%}, the adapters); per rank "
            f"weights {_size(lora[0])}, gradients {_size(lora[1])} and optimizer state {_size(lora[2])}: "
            f"{_size(sum(lora))} instead of a full fine-tune's {_size(sum(full))} ({_size(sum(full) - sum(lora))} "
            f"saved)")


def _size(count: float) -> str:
    if count < 2**20:
        return f"{count / 2**10:,.1f} KiB"
    return f"{count / 2**20:,.1f} MiB" if count < 2**30 else f"{count / 2**30:,.2f} GiB"


def rebuild(state_dict: dict[str, Any], lora: dict[str, Any], base: Path, seq2seq: bool, merge: bool,
            source: Path) -> Any:
    """The model of a LoRA checkpoint (`source`, its consolidated `state_dict`: the adapters only), in fp32:
    the pretrained `base` with those adapters, merged into its weights when `merge` (a plain transformers
    model, as the export saves it), else the peft model as it was trained."""
    from gptpipe.runtime.model import inference_config, load_pretrained

    if not (base / "config.json").is_file():
        raise StageInputError(f"checkpoint {source} holds LoRA adapters only: their base model, the run's "
                              f"model.path {base}, is needed to rebuild it and is not a model folder here")
    check_base(lora, base, str(source))
    model = load_pretrained(base, seq2seq)
    inference_config(model.config)  # as the fine-tune built it (runtime/scoring.py)
    model = apply_lora(model, lora, seq2seq)
    expected = set(model.state_dict())
    unexpected = sorted(set(state_dict) - expected)
    missing = sorted(k for k in expected - set(state_dict) if ADAPTER_MARK in k)
    if unexpected or missing:
        settings = {k: lora[k] for k in ("rank", "target_modules")}
        raise StageInputError(f"checkpoint {source} does not fit LoRA {settings} on {base}: missing adapters "
                              f"{missing[:3]}, unexpected {unexpected[:3]}")
    model.load_state_dict(state_dict, strict=False)
    return (model.merge_and_unload() if merge else model).eval()
