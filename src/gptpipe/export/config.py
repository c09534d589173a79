"""Stages 4-6 settings: convert_config.yaml (flat keys, as in the original pipeline)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gptpipe.config.core import option


@dataclass
class ConvertConfig:
    """Stage 4 (export to HuggingFace), stage 5 (play) and stage 6 (upload to the hub)."""

    input_model_dir: Path = option(
        Path("runs/demo"), "stage-3 run folder (its newest complete checkpoint is used) or one checkpoint folder")
    checkpoint_step: int | None = option(None, "export this step instead of the newest complete checkpoint")
    pipeline_config: Path = option(Path("config.yaml"), "the config.yaml the model was trained with")
    output_tokenizer_and_model_dir: Path = option(Path("models/hf/demo"), "HuggingFace folder to write")
    dtype: Literal["bf16", "fp32"] = option("bf16", "dtype of the exported weights")
    max_shard_size: str = option("2GB", "safetensors files are split above this size")
    test_prompt_text: str = option("こんにちは、", "prompt generated from after export and after upload")
    huggingface_name: str | None = option(None, "hub repository name (the original's key; None: no upload)")
    hugging_face_name: str | None = option(
        None, "deprecated spelling of huggingface_name (the original README used it); still accepted")
    organization: str | None = option(None, "hub organization to upload into (None: your user)")
    private: bool = option(True, "create the hub repository as private")
    revision: str | None = option(None, "branch to upload to (None: main)")

    def check(self) -> list[tuple[str, str]]:
        problems = []
        if self.huggingface_name and self.hugging_face_name and self.huggingface_name != self.hugging_face_name:
            problems.append(("hugging_face_name", "differs from huggingface_name; keep only huggingface_name"))
        if self.checkpoint_step is not None and self.checkpoint_step < 0:
            problems.append(("checkpoint_step", "must be >= 0"))
        return problems

    @property
    def repo_name(self) -> str | None:
        """The hub repository name, whichever spelling the YAML used."""
        return self.huggingface_name or self.hugging_face_name
