"""Stage-3 and stage-7 checkpoints as stage 4 sees them: find the one to export, consolidate it, rebuild the model.

A checkpoint folder ``<run>/checkpoints/global_step{N}/`` holds DeepSpeed's files, ``hf_config.json``
(the transformers config the model was trained with) and ``gptpipe_state.json`` (step, tokens, and the run
record: the resolved config.yaml the run trained with, from which stage 4 takes the tokenizer and the data).
Only folders with stage 3's completion marker count: a save killed half-way never does.
A fine-tune (stage 7) checkpoint has the same layout; its state also holds the task (``task``) and the best
evaluation so far (``best``), and its run folder has ``checkpoints/best`` and the tokenizer (``tokenizer/``).
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptpipe.config.core import ConfigError, config_from_plain
from gptpipe.log import get_logger
from gptpipe.pipeline import PipelineConfig
from gptpipe.stage import StageInputError
from gptpipe.stages import TRAIN
from gptpipe.storage import is_url
from gptpipe.train.checkpoint import COMPLETE_MARKER, HF_CONFIG, LATEST, STATE, best_tag, complete_checkpoints

log = get_logger("convert")

FINETUNE_SUMMARY = "finetune_summary.json"  # gptpipe.finetune.train.SUMMARY_FILE (importing it pulls the trainer)


@dataclass
class Checkpoint:
    """One complete stage-3 checkpoint folder and what it says about itself."""

    path: Path
    step: int
    hf_config: dict[str, Any]
    state: dict[str, Any]

    @property
    def training(self) -> PipelineConfig:
        """The run record: the config.yaml this checkpoint was trained with, as stage 3 resolved it."""
        record = self.state.get("config")
        if not isinstance(record, dict):
            raise StageInputError(f"{self.path / STATE} has no run record (written before gptpipe recorded the "
                                  "config.yaml of a run in its checkpoints); export it with that version or retrain")
        try:
            return config_from_plain(PipelineConfig, record, str(self.path / STATE))
        except ConfigError as exc:
            raise StageInputError(f"the run record in {self.path / STATE} does not fit this gptpipe: {exc}") from None

    @property
    def is_finetune(self) -> bool:
        """A stage-7 checkpoint: its state records the task it was fine-tuned for."""
        return isinstance(self.state.get("task"), dict)

    @property
    def seq2seq(self) -> bool:
        return bool(self.is_finetune and self.state["task"].get("seq2seq"))

    @property
    def finetuning(self) -> Any:
        """A fine-tune's run record: the finetune_config.yaml it trained with (FinetuneConfig), from the
        checkpoint's state, else from the run's finetune_summary.json (written at the end of a run)."""
        from gptpipe.finetune.config import FinetuneConfig

        record, where = self.state.get("config"), self.path / STATE
        summary = self.run_dir / FINETUNE_SUMMARY
        if not isinstance(record, dict) and summary.is_file():
            record, where = json.loads(summary.read_text(encoding="utf-8")).get("config"), summary
        if not isinstance(record, dict):
            raise StageInputError(f"{self.path / STATE} has no run record and {summary} does not exist: the "
                                  "validation rows the gate checks on are unknown. Let the fine-tune finish "
                                  "(bash 7_finetune.sh), then export")
        try:
            return config_from_plain(FinetuneConfig, record, str(where))
        except ConfigError as exc:
            raise StageInputError(f"the run record in {where} does not fit this gptpipe: {exc}") from None

    @property
    def run_dir(self) -> Path:
        """The run folder (metrics.jsonl, logs): ``<run>/checkpoints/global_stepN`` → ``<run>``."""
        return self.path.parent.parent


def find_checkpoint(input_dir: Path, step: int | None = None) -> Checkpoint:
    """The checkpoint to export: ``input_dir`` itself, ``global_step{step}``, the best one of a fine-tune
    (``checkpoints/best``), or the newest complete one.

    ``input_dir`` may be the run folder, its checkpoints/ folder or one checkpoint folder, or the URL of a run
    folder in a bucket (s3://..., gs://...).
    """
    if is_url(input_dir):  # a run folder in a bucket: its complete checkpoint, fetched into a local cache
        from gptpipe.train.mirror import fetch_checkpoint

        input_dir = fetch_checkpoint(str(input_dir), step)
    if not input_dir.exists():
        raise StageInputError(f"input_model_dir {input_dir} does not exist. {TRAIN.hint()}")
    if (input_dir / HF_CONFIG).is_file() or (input_dir / STATE).is_file():
        folder = input_dir
    else:
        root = input_dir / "checkpoints" if (input_dir / "checkpoints").is_dir() else input_dir
        complete = dict(complete_checkpoints(root))
        found = ", ".join(map(str, complete)) or "none"
        if step is not None:
            if step not in complete:
                raise StageInputError(f"no complete checkpoint for step {step} in {root} (complete steps: {found})")
            folder = complete[step]
        elif not complete:
            raise StageInputError(f"no complete checkpoint in {root} (a save that was interrupted has no "
                                  f"'{COMPLETE_MARKER}' marker). {TRAIN.hint()}")
        elif best_tag(root) in {f.name for f in complete.values()}:
            folder = root / best_tag(root)  # a fine-tune: the step that won on the validation metric
        else:
            folder = complete[max(complete)]
            latest = root / LATEST
            if latest.is_file() and latest.read_text().strip() != folder.name:
                log.info(f"{latest} names {latest.read_text().strip()!r}, which is not a complete "
                         f"checkpoint; using the newest complete one, {folder.name}")
    missing = [name for name in (COMPLETE_MARKER, HF_CONFIG, STATE) if not (folder / name).is_file()]
    if missing:
        raise StageInputError(f"checkpoint {folder} is incomplete (no {', '.join(missing)}): its save did not "
                              f"finish. Export another step (checkpoint_step=N), or {TRAIN.hint()}")
    state = json.loads((folder / STATE).read_text(encoding="utf-8"))
    hf_config = json.loads((folder / HF_CONFIG).read_text(encoding="utf-8"))
    return Checkpoint(folder, int(state["step"]), hf_config, state)


def _zero_stage(folder: Path) -> int:
    """The ZeRO stage recorded in the checkpoint's model-states file (DeepSpeed keeps its config there)."""
    import torch

    states = sorted(folder.glob("*model_states.pt"))
    if not states:
        raise StageInputError(f"{folder} has no DeepSpeed *model_states.pt file: not a DeepSpeed checkpoint")
    meta = torch.load(states[0], map_location="cpu", weights_only=False, mmap=True)
    return int(meta.get("ds_config", {}).get("zero_optimization", {}).get("stage", 0))


def consolidate(checkpoint: Checkpoint) -> dict[str, Any]:
    """The full fp32 state dict, gathered from every rank's shard by DeepSpeed's own zero_to_fp32.

    ZeRO stage 0 keeps no partitioned master weights: its model-states file holds the whole module.
    """
    import torch

    folder = checkpoint.path
    try:
        if _zero_stage(folder) == 0:
            module = torch.load(folder / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
            return {k: v.float() if v.is_floating_point() else v for k, v in module["module"].items()}
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with contextlib.redirect_stdout(sys.stderr):  # it prints progress; stdout stays for results
            return get_fp32_state_dict_from_zero_checkpoint(str(folder.parent), tag=folder.name)
    except StageInputError:
        raise
    except Exception as exc:  # truncated or missing shards surface as many different exception types
        raise StageInputError(f"checkpoint {folder} cannot be read ({type(exc).__name__}: {exc}). A shard is "
                              f"missing or corrupt: export another step (checkpoint_step=N) or retrain") from None


def hf_config_object(hf_config: dict[str, Any]) -> Any:
    """The transformers config object for a config dict (model_type picks the class)."""
    from transformers import AutoConfig

    values = dict(hf_config)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def tied_copies(model: Any) -> set[str]:
    """Names of weights tied to one listed before them (an output head or T5's per-stack embeddings, tied to
    the input embedding): tie_weights() fills them from that first one."""
    seen: set[int] = set()
    copies = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            copies.add(name)
        seen.add(id(tensor))
    return copies


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
