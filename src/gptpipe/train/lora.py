"""LoRA adapters (peft) on a pretrained model: applied before DeepSpeed wraps it, so its optimizer and checkpoints
hold only the adapters; and a LoRA checkpoint rebuilt as its pretrained base plus the trained adapters, merged
into plain weights (the export, `merge_and_unload`) or kept apart as trained (`gptpipe predict`).

The adapter settings travel as a plain dict (task.json's `lora`: rank, alpha, dropout, target_modules), so the
checkpoint code that rebuilds a model needs no fine-tune config. Here rather than in finetune/: train/checkpoint.py
rebuilds models for stage 4 and predict alike, and train/ imports nothing of finetune/.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gptpipe.stage import StageInputError
from gptpipe.train.memory import gradient_bytes, optimizer_bytes_per_parameter

ADAPTER_MARK = "lora_"  # peft's adapter weights are named ...lora_A.default.weight / ...lora_B.default.weight


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


def trainable_summary(model: Any, precision: str, zero_stage: int, fp32_gradients: bool) -> str:
    """The plan line of a LoRA run: parameters trained of all, and the optimizer state and gradients they need
    against a full fine-tune's (whole model, before ZeRO divides it over the ranks)."""
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    per_parameter = optimizer_bytes_per_parameter(precision, zero_stage) + gradient_bytes(precision, zero_stage,
                                                                                         fp32_gradients)
    return (f"LoRA: {trained:,} of {total:,} parameters trained ({trained / total:.2%}, the adapters); optimizer "
            f"state and gradients {_size(trained * per_parameter)} instead of {_size(total * per_parameter)} "
            f"({_size((total - trained) * per_parameter)} saved)")


def _size(count: float) -> str:
    if count < 2**20:
        return f"{count / 2**10:,.1f} KiB"
    return f"{count / 2**20:,.1f} MiB" if count < 2**30 else f"{count / 2**30:,.2f} GiB"


def rebuild(state_dict: dict[str, Any], lora: dict[str, Any], base: Path, seq2seq: bool, merge: bool,
            source: Path) -> Any:
    """The model of a LoRA checkpoint (`source`, its consolidated `state_dict`: the adapters only), in fp32:
    the pretrained `base` with those adapters, merged into its weights when `merge` (a plain transformers
    model, as the export saves it), else the peft model as it was trained."""
    from gptpipe.train.model import inference_config, load_pretrained

    if not (base / "config.json").is_file():
        raise StageInputError(f"checkpoint {source} holds LoRA adapters only: their base model, the run's "
                              f"model.path {base}, is needed to rebuild it and is not a model folder here")
    model = load_pretrained(base, seq2seq)
    inference_config(model.config)  # as the fine-tune built it (finetune/model.py)
    model = apply_lora(model, lora, seq2seq)
    expected = set(model.state_dict())
    unexpected = sorted(set(state_dict) - expected)
    missing = sorted(k for k in expected - set(state_dict) if ADAPTER_MARK in k)
    if unexpected or missing:
        raise StageInputError(f"checkpoint {source} does not fit LoRA {lora} on {base}: missing adapters "
                              f"{missing[:3]}, unexpected {unexpected[:3]}")
    model.load_state_dict(state_dict, strict=False)
    return (model.merge_and_unload() if merge else model).eval()
