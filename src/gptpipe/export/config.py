"""Stages 4-6 settings: convert_config.yaml (flat keys, as in the original pipeline)."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gptpipe.config.core import Url, option
from gptpipe.storage import url_problems


@dataclass
class ConvertConfig:
    """Stage 4 (export to HuggingFace), stage 5 (play) and stage 6 (upload to the hub)."""

    input_model_dir: Url | Path = option(
        Path("runs/demo"), "stage-3 run folder (its newest complete checkpoint is used) or one checkpoint folder; "
                           "or a run folder in a bucket (s3://..., gs://...; credentials from the environment)")
    checkpoint_step: int | None = option(None, "export this step instead of the newest complete checkpoint")
    output_tokenizer_and_model_dir: Url | Path = option(
        Path("models/hf/demo"), "HuggingFace folder to write; or a URL (s3://..., gs://...): exported and verified "
                                "locally, then uploaded with its manifest last (stage 6 uploads from there)")
    dtype: Literal["bf16", "fp32"] = option("bf16", "dtype of the exported weights")
    max_shard_size: str = option("2GB", "safetensors files are split above this size")
    lora_export: Literal["merged", "adapter"] = option(
        "merged", "a LoRA fine-tune's export: merged (the adapters merged into the base's weights: a plain model "
                  "folder) or adapter (adapter_config.json + adapter_model.safetensors on the base the run tuned, "
                  "named there and in the manifest: loaded by peft, served by vLLM with --enable-lora); other "
                  "runs must leave it merged")
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
        problems += url_problems(self, ("input_model_dir", "output_tokenizer_and_model_dir"))
        if self.checkpoint_step is not None and self.checkpoint_step < 0:
            problems.append(("checkpoint_step", "must be >= 0"))
        if not re.fullmatch(r"\d+\s*[KMGT]i?B", self.max_shard_size, re.IGNORECASE):
            problems.append(("max_shard_size", f"must look like 2GB or 500MB, got {self.max_shard_size!r}"))
        for key in ("huggingface_name", "hugging_face_name", "organization"):
            value = getattr(self, key)
            if value is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}", value):
                problems.append((key, f"{value!r} is not a valid hub name (letters, digits, '-', '_', '.'; "
                                      "no '/': put the namespace in organization)"))
        return problems

    @property
    def repo_name(self) -> str | None:
        """The hub repository name, whichever spelling the YAML used."""
        return self.huggingface_name or self.hugging_face_name


def generate_arguments(parser: argparse.ArgumentParser) -> None:
    """`gptpipe generate`: sampling settings are arguments, not config keys, so playing never edits the YAML."""
    parser.add_argument("--model", type=Path,
                        help="HuggingFace folder or hub id (default: output_tokenizer_and_model_dir)")
    parser.add_argument("--prompt", action="append", help="prompt to continue (repeatable; default: test_prompt_text)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling: keep this probability mass")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed, for repeatable output")
    parser.add_argument("--interactive", action="store_true", help="read prompts from the terminal until EOF/Ctrl-D")


def upload_arguments(parser: argparse.ArgumentParser) -> None:
    """`gptpipe upload`: there is deliberately no --token; it comes from HF_TOKEN or `hf auth login`."""
    parser.add_argument("--dry-run", action="store_true", help="list the files and the destination; upload nothing")
