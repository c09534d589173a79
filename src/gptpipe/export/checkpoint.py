"""Stage-3 and stage-7 checkpoints as stage 4 sees them: their run records (finding a checkpoint, and the
model rebuilt from it, are gptpipe.runtime.checkpoint's, which owns the format).

A checkpoint folder ``<run>/checkpoints/global_step{N}/`` holds DeepSpeed's files, ``hf_config.json``
(the transformers config the model was trained with) and ``gptpipe_state.json`` (step, tokens, and the run
record: the resolved config.yaml the run trained with, from which stage 4 takes the tokenizer and the data).
Only folders with stage 3's completion marker count: a save killed half-way never does.
A fine-tune (stage 7) checkpoint has the same layout; its state also holds the task (``task``) and the best
evaluation so far (``best``), and its run folder has ``checkpoints/best`` and the tokenizer (``tokenizer/``).
"""

from __future__ import annotations

import json
from typing import Any

from gptpipe.config.core import ConfigError, config_from_plain
from gptpipe.pipeline import PipelineConfig
from gptpipe.stage import StageInputError
from gptpipe.finetune.run_files import SUMMARY_FILE
from gptpipe.runtime.checkpoint import STATE, Checkpoint


def training_config(checkpoint: Checkpoint) -> PipelineConfig:
    """The run record: the config.yaml this checkpoint was trained with, as stage 3 resolved it."""
    record = checkpoint.state.get("config")
    if not isinstance(record, dict):
        raise StageInputError(f"{checkpoint.path / STATE} has no run record (written before gptpipe recorded the "
                              "config.yaml of a run in its checkpoints); export it with that version or retrain")
    try:
        return config_from_plain(PipelineConfig, record, str(checkpoint.path / STATE))
    except ConfigError as exc:
        raise StageInputError(f"the run record in {checkpoint.path / STATE} does not fit this gptpipe: {exc}") from None


def finetune_config(checkpoint: Checkpoint) -> Any:
    """A fine-tune's run record: the finetune_config.yaml it trained with (FinetuneConfig), from the
    checkpoint's state, else from the run's finetune_summary.json (written at the end of a run)."""
    from gptpipe.finetune.config import FinetuneConfig

    record, where = checkpoint.state.get("config"), checkpoint.path / STATE
    summary = checkpoint.run_dir / SUMMARY_FILE
    if not isinstance(record, dict) and summary.is_file():
        record, where = json.loads(summary.read_text(encoding="utf-8")).get("config"), summary
    if not isinstance(record, dict):
        raise StageInputError(f"{checkpoint.path / STATE} has no run record and {summary} does not exist: the "
                              "validation rows the gate checks on are unknown. Let the fine-tune finish "
                              "(bash 7_finetune.sh), then export")
    try:
        return config_from_plain(FinetuneConfig, record, str(where))
    except ConfigError as exc:
        raise StageInputError(f"the run record in {where} does not fit this gptpipe: {exc}") from None
