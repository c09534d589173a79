"""Stage-3 and stage-7 checkpoints as stage 4 sees them: their run records, and the model rebuilt from them
(finding and consolidating a checkpoint is gptpipe.train.checkpoint's, which owns the format).

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
from gptpipe.train.checkpoint import HF_CONFIG, STATE, Checkpoint, hf_config_object, tied_copies

FINETUNE_SUMMARY = "finetune_summary.json"  # gptpipe.finetune.train.SUMMARY_FILE (importing it pulls the trainer)


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
    summary = checkpoint.run_dir / FINETUNE_SUMMARY
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


def build_model(checkpoint: Checkpoint, state_dict: dict[str, Any]) -> Any:
    """The trained model in fp32, exactly as the checkpoint holds it (vocab still padded): a causal LM, or
    an encoder-decoder for a seq2seq fine-tune.

    The parameters are the state dict's own tensors (``assign``), so several models built from one
    consolidated checkpoint cost no extra memory until one of them is cast or resized.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM
    from transformers.initialization import no_init_weights

    model_class = AutoModelForSeq2SeqLM if checkpoint.seq2seq else AutoModelForCausalLM
    with no_init_weights():  # every weight is replaced below: skip the random init (minutes at 3B)
        model = model_class.from_config(hf_config_object(checkpoint.hf_config), dtype=torch.float32)
    expected = set(model.state_dict())
    missing = sorted(expected - set(state_dict))
    unexpected = sorted(set(state_dict) - expected)
    # Tied weights appear under one name or all, depending on how DeepSpeed recorded the sharing.
    missing = [k for k in missing if k not in tied_copies(model)]
    if missing or unexpected:
        raise StageInputError(
            f"checkpoint {checkpoint.path} does not fit its {HF_CONFIG} ({checkpoint.hf_config.get('model_type')}): "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
    try:
        model.load_state_dict(state_dict, strict=False, assign=True)
    except RuntimeError as exc:  # shape mismatches
        raise StageInputError(f"checkpoint {checkpoint.path} does not fit its {HF_CONFIG}: {exc}") from None
    model.tie_weights()
    return model.eval()
