"""A LoRA fine-tune's adapter folder (convert_config.yaml `lora_export: adapter`): the export as peft saves it,
loaded onto its base model by peft and by vLLM (`enable_lora` and a LoRARequest), instead of merged weights.

The folder holds adapter_config.json (peft's: rank, alpha, target modules, and `base_model_name_or_path`, the
base folder the run fine-tuned, as an absolute path so the folder loads from anywhere on this machine),
adapter_model.safetensors (the adapters only), the run's tokenizer files and generation_config.json (the
fine-tune's stop ids, which the base's file does not have), task.json, the card and the manifest. Every reader of
an exported folder (the gate, the agreement checks of vLLM and llama.cpp, stage 6) loads it with `load_export`,
so a merged folder and an adapter folder go through the same checks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def is_adapter_folder(folder: str | Path) -> bool:
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def adapter_base(folder: Path) -> Path:
    """The base model folder an adapter folder names (adapter_config.json's base_model_name_or_path)."""
    config = json.loads((Path(folder) / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    return Path(config["base_model_name_or_path"])


def adapter_dtype(folder: Path) -> str:
    """The dtype the adapters were saved in (the export's dtype; the base is run in it too), e.g. "bfloat16"."""
    from safetensors import safe_open

    with safe_open(str(Path(folder) / ADAPTER_WEIGHTS), framework="pt") as weights:
        return SAFETENSORS_DTYPES[weights.get_slice(next(iter(weights.keys()))).get_dtype()]


def save_adapter(model: Any, folder: Path, base: Path) -> None:
    """Write `model` (a peft model, its weights in the export dtype) as an adapter folder on `base`."""
    model.peft_config["default"].base_model_name_or_path = str(Path(base).resolve())
    model.save_pretrained(folder)
    model.get_base_model().generation_config.save_pretrained(folder)


def load_export(folder: str | Path, seq2seq: bool, dtype: str = "auto") -> Any:
    """The model of an exported folder (or a hub id), as a user loads it: transformers' Auto class on a merged
    folder; on an adapter folder, its base in the adapters' dtype (or `dtype`) with peft's
    PeftModel.from_pretrained, and the folder's generation_config.json in place of the base's."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, GenerationConfig

    loader = AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM
    if not is_adapter_folder(folder):
        return loader.from_pretrained(folder, dtype=dtype).eval()
    from peft import PeftModel

    base = loader.from_pretrained(adapter_base(folder), dtype=adapter_dtype(folder) if dtype == "auto" else dtype)
    base.generation_config = GenerationConfig.from_pretrained(folder)
    return PeftModel.from_pretrained(base, folder).eval()
