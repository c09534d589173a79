"""Checkpoints that a kill at any moment cannot corrupt, and resume from the newest complete one.

Layout under `<run>/checkpoints/`:
    global_step{N}/   DeepSpeed's files (model, optimizer and scheduler states), one rng_state_rank{R}.pt per
                      rank, hf_config.json (the transformers config), gptpipe_state.json (step, consumed
                      samples, tokens, final validation loss, and the run record: the whole resolved
                      config.yaml the run trained with) and `complete`
    latest            the tag of the newest complete checkpoint (DeepSpeed's own format)
    best              (fine-tuning) the tag of the best checkpoint by the validation metric; keep-last-N
                      never removes it

A save goes to `.tmp-global_step{N}/`. A checkpoint already at that step (a re-save: a signal at the last step,
a lowered train_iters) first loses its `complete` marker (and `latest`, if it named it, falls back to the newest
other complete one), then moves aside to `.old-global_step{N}/`; the new folder is renamed into place, gets its
marker, `latest` moves to it, the old one is deleted, and the oldest checkpoints beyond `keep_checkpoints` go,
each losing its marker before its files. A folder without the marker is ignored (and replaced) by everything:
resume, export, the next save; so a kill at any point leaves every marked folder whole and `latest` naming a
marked one. GPTPIPE_KILL_AT=<point>@<step> kills the process at one of those points (`fault`; runtime/bucket.py
has the bucket's): the tests' fault injection.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptpipe.log import get_logger
from gptpipe.stage import StageInputError, write_text_atomic
from gptpipe.artifacts import TRAIN
from gptpipe.storage import is_url
from gptpipe.trust import check_checkpoint

if TYPE_CHECKING:  # torch is imported where it is used: the uploader process (runtime/uploader.py) needs none
    from gptpipe.runtime.engine import Dist

COMPLETE_MARKER = "complete"
HF_CONFIG = "hf_config.json"
STATE = "gptpipe_state.json"
LATEST = "latest"
BEST = "best"
UNIVERSAL_PREFIX = ".tmp-universal-"  # remove_stale clears a leftover copy
UNIVERSAL_LATEST = "latest_universal"  # what ds_to_universal writes beside the copy it makes
_TAG = re.compile(r"^global_step(\d+)$")


def tag_of(step: int) -> str:
    return f"global_step{step}"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for folder in root.iterdir():
        match = _TAG.match(folder.name)
        if match and folder.is_dir() and (folder / COMPLETE_MARKER).is_file():
            found.append((int(match.group(1)), folder))
    return sorted(found)


def best_tag(root: Path) -> str | None:
    """The tag `best` names (fine-tuning marks it), or None."""
    marker = root / BEST
    return marker.read_text(encoding="utf-8").split()[0] if marker.is_file() else None


def mark_best(root: Path, step: int, keep: int) -> None:
    """Name global_step{step} (already saved and complete) the best checkpoint, and drop the previous best
    if keep-last-N no longer holds it (main rank)."""
    write_text_atomic(root / BEST, f"{tag_of(step)}\n")
    prune(root, keep)


def prune(root: Path, keep: int) -> None:
    """Remove complete checkpoints older than the newest `keep`, except the one `best` names: each loses its
    marker first, so a kill inside the removal leaves a folder every reader ignores."""
    for step, old in complete_checkpoints(root)[:-keep]:
        if old.name != best_tag(root):
            (old / COMPLETE_MARKER).unlink()
            fault("prune-unmarked", step)
            shutil.rmtree(old, ignore_errors=True)


def fault(point: str, step: int, machine: bool = False) -> None:
    """Fault injection for the tests: GPTPIPE_KILL_AT=<point>@<step> kills this process here, as a preemption
    or the OOM killer would (no handler runs); `machine`: its whole process group (the training process and its
    uploader), as a lost machine."""
    if os.environ.get("GPTPIPE_KILL_AT") == f"{point}@{step}":
        if machine:
            os.killpg(0, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


def _point_latest_elsewhere(root: Path, tag: str) -> None:
    """Before global_step's marker goes: `latest` names the newest other complete checkpoint (or is removed)."""
    latest = root / LATEST
    if latest.is_file() and latest.read_text(encoding="utf-8").strip() == tag:
        others = [folder for _, folder in complete_checkpoints(root) if folder.name != tag]
        if others:
            write_text_atomic(latest, others[-1].name)
        else:
            latest.unlink()


def newest_checkpoint(root: Path) -> Path | None:
    complete = complete_checkpoints(root)
    return complete[-1][1] if complete else None


def _barrier() -> None:
    import torch

    torch.distributed.barrier()


def rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(engine: Any, root: Path, step: int, state: dict[str, Any], hf_config_json: str, dist: Dist,
         keep: int) -> Path:
    """Save the engine at `step` atomically (see the module doc); collective: call on every rank."""
    import torch

    tag = tag_of(step)
    staging = root / f".tmp-{tag}"
    final = root / tag
    if dist.is_main:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    _barrier()
    # Frozen weights (a LoRA run's base) are the starting model's, which the run records: saved again they would
    # make every checkpoint as large as a full fine-tune's.
    engine.save_checkpoint(str(staging), tag=tag, client_state={"gptpipe": state}, save_latest=False,
                           exclude_frozen_parameters=has_frozen(engine))
    torch.save(rng_state(), staging / tag / f"rng_state_rank{dist.rank}.pt")
    _barrier()
    if dist.is_main:
        write_text_atomic(staging / tag / HF_CONFIG, hf_config_json)
        write_text_atomic(staging / tag / STATE, json.dumps(state, ensure_ascii=False, indent=2) + "\n")
        old = root / f".old-{tag}"
        if final.exists():  # this step saved before a resume, or an incomplete leftover of a killed save
            _point_latest_elsewhere(root, tag)
            (final / COMPLETE_MARKER).unlink(missing_ok=True)
            fault("save-unmarked-old", step)
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            fault("save-old-aside", step)
        (staging / tag).rename(final)
        fault("save-new-in", step)
        shutil.rmtree(staging, ignore_errors=True)  # DeepSpeed's zero_to_fp32.py copy
        write_text_atomic(final / COMPLETE_MARKER, f"{tag}\n")
        fault("save-marked", step)
        write_text_atomic(root / LATEST, tag)
        shutil.rmtree(old, ignore_errors=True)
        prune(root, keep)
    _barrier()
    return final


def has_frozen(engine: Any) -> bool:
    """Whether some of the engine's weights are not trained (LoRA's base): `save` leaves them out."""
    return any(not p.requires_grad for p in engine.module.parameters())


def remove_stale(root: Path) -> None:
    """Staging folders, old folders moved aside and unmarked checkpoints left by a killed save or prune (main rank,
    before training)."""
    if not root.is_dir():
        return
    for folder in root.iterdir():
        if folder.name.startswith((".tmp-", ".old-")) or (_TAG.match(folder.name)
                                                           and not (folder / COMPLETE_MARKER).exists()):
            shutil.rmtree(folder, ignore_errors=True)


def saved_ranks(folder: Path) -> int:
    """The number of ranks that saved `folder` (checkpoints before the state recorded it: one RNG file each)."""
    state = json.loads((folder / STATE).read_text(encoding="utf-8"))
    return int(state.get("world_size") or len(list(folder.glob("rng_state_rank*.pt"))) or 1)


def partitioned(folder: Path) -> bool:
    """Whether `folder` holds optimizer states cut into one file per rank (ZeRO 1-3, and bf16's optimizer at ZeRO
    0), which DeepSpeed loads only on the number of ranks that saved them."""
    return any(folder.glob("*optim_states.pt"))


def universal_copy(folder: Path, dist: Dist, converts: bool) -> Path:
    """DeepSpeed's universal checkpoint of `folder` (every parameter's fp32 weights and optimizer states whole,
    loadable on any number of ranks), made by DeepSpeed's ds_to_universal beside it; collective: call on every
    rank. `converts`: this rank makes it for the ranks that see its folder (rank 0, or each node's first rank
    when the nodes stage on disks of their own). The copy is named like a staging folder, so a killed
    conversion's leftover is removed before the next start (remove_stale) and the caller deletes a loaded one."""
    import subprocess

    target = folder.parent / f"{UNIVERSAL_PREFIX}{folder.name}"
    failed: str | None = None
    if converts:
        shutil.rmtree(target, ignore_errors=True)
        done = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                               str(folder), "--output_folder", str(target), "--inject_missing_state"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            shutil.rmtree(target, ignore_errors=True)
            failed = (done.stderr or done.stdout)[-2000:]
    _barrier()
    if failed is not None:
        raise StageInputError(f"{folder} was saved by {saved_ranks(folder)} rank(s) and this run has "
                              f"{dist.world_size}; DeepSpeed's ds_to_universal could not convert it for the new "
                              f"number:\n{failed}\n"
                              "Resume on the number of ranks that saved it")
    return target


@contextlib.contextmanager
def _loading_universal(engine: Any) -> Iterator[None]:
    """DeepSpeed reads its `checkpoint.load_universal` switch when it loads (engine.load_universal_checkpoint()),
    not when it builds the engine: turned on for this one load, the same engine resumes a native checkpoint or a
    universal one."""
    config = engine._config
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = True
    try:
        yield
    finally:
        config.load_universal_checkpoint = before


def load(engine: Any, folder: Path, dist: Dist, converts: bool | None = None) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and this rank's RNG from `folder`; returns gptpipe_state.json.

    Collective. A checkpoint whose optimizer states were cut for another number of ranks is loaded through
    DeepSpeed's universal checkpoint (`universal_copy`; `converts`: as there, default rank 0): the weights and
    optimizer states are the same, re-cut for this run's ranks."""
    import torch

    check_checkpoint(folder)  # DeepSpeed unpickles every file whole
    ranks = saved_ranks(folder)
    elastic = ranks != dist.world_size and partitioned(folder)
    converts = dist.is_main if converts is None else converts
    source, switch = folder, contextlib.nullcontext()
    if elastic:
        started = time.perf_counter()
        source = universal_copy(folder, dist, converts)
        switch = _loading_universal(engine)
        if dist.is_main:
            get_logger("checkpoint").info(
                f"{folder.name} was saved by {ranks} rank(s), this run has {dist.world_size}: converted to "
                f"DeepSpeed's universal checkpoint in {time.perf_counter() - started:.1f} s, loaded from it")
    with switch:
        load_path, _ = engine.load_checkpoint(str(source.parent), tag=source.name, load_optimizer_states=True,
                                              load_lr_scheduler_states=True,
                                              load_module_strict=not has_frozen(engine))  # frozen: not saved
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint {folder}")
    if elastic:
        _barrier()  # every rank has read the copy
        if converts:
            shutil.rmtree(source, ignore_errors=True)
            (source.parent / UNIVERSAL_LATEST).unlink(missing_ok=True)  # ds_to_universal's pointer to the copy
    rng_file = folder / f"rng_state_rank{dist.rank}.pt"
    if rng_file.is_file():  # absent when resuming on more ranks than saved: those keep their fresh seed
        set_rng_state(torch.load(rng_file, weights_only=False))
    return json.loads((folder / STATE).read_text(encoding="utf-8"))


# --- reading a checkpoint back: stage 4 (export) and stage 7 (predict) -----------------------------------

@dataclass
class Checkpoint:
    """One complete stage-3 or stage-7 checkpoint folder and what it says about itself."""

    path: Path
    step: int
    hf_config: dict[str, Any]
    state: dict[str, Any]

    @property
    def is_finetune(self) -> bool:
        """A stage-7 checkpoint: its state records the task it was fine-tuned for."""
        return isinstance(self.state.get("task"), dict)

    @property
    def seq2seq(self) -> bool:
        return bool(self.is_finetune and self.state["task"].get("seq2seq"))

    @property
    def lora(self) -> dict[str, Any] | None:
        """A LoRA fine-tune's adapter settings (runtime/lora.py): its checkpoints hold the adapters only."""
        return self.state["task"].get("lora") if self.is_finetune else None

    @property
    def lora_base(self) -> Path:
        """The pretrained model a LoRA checkpoint's adapters sit on (the run's model.path)."""
        return Path(self.state["task"]["pretrained_model"])

    @property
    def run_dir(self) -> Path:
        """The run folder (metrics.jsonl, logs): ``<run>/checkpoints/global_stepN`` → ``<run>``."""
        return self.path.parent.parent


def find_checkpoint(input_dir: Path, step: int | None = None) -> Checkpoint:
    """The checkpoint to export: ``input_dir`` itself, ``global_step{step}``, the best one of a fine-tune
    (``checkpoints/best``), or the newest complete one.

    ``input_dir`` is a local run folder, its checkpoints/ folder or one checkpoint folder (a run folder in a
    bucket: its checkpoint fetched first by ``bucket.local_checkpoint_source``).
    """
    if is_url(input_dir):
        raise ValueError(f"find_checkpoint takes a local folder, not {input_dir}: fetch it first")
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
                # Read by stage 4, predict and chat alike: the message names the checkpoint code, not a stage.
                get_logger("checkpoint").info(f"{latest} names {latest.read_text().strip()!r}, which is not a "
                                              f"complete checkpoint; using the newest complete one, {folder.name}")
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


def _bf16_optimizer_fp32(folder: Path) -> dict[str, Any]:
    """The fp32 master weights in the bf16_zero_pp_rank_* files of DeepSpeed's BF16_Optimizer (bf16 at ZeRO-1
    with fp32 gradient accumulation, train.fp32_gradients), which zero_to_fp32 refuses as "not a zero
    checkpoint".

    Their single_partition_of_fp32_groups are laid out as ZeRO-1/2's: per parameter group, the parameters of
    param_shapes flattened in order, padded at the end to a multiple of 2 x ranks and cut into one equal slice
    per rank. So zero_to_fp32's own ZeRO-2 merge reassembles them (shared weights, buffers and its padding
    check included); only the reading of the files is ours.
    """
    import torch
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, PARTITION_COUNT, SINGLE_PARTITION_OF_FP32_GROUPS
    from deepspeed.utils import zero_to_fp32

    model_states = zero_to_fp32.parse_model_states(zero_to_fp32.get_model_state_files(str(folder)))
    files = zero_to_fp32.get_optim_files(str(folder))  # in rank order (natural sort: rank_10 after rank_9)
    shards = [torch.load(f, map_location="cpu", mmap=True, weights_only=False)[OPTIMIZER_STATE_DICT] for f in files]
    ranks = max(shards[0][PARTITION_COUNT])
    if ranks != len(shards):
        raise StageInputError(f"checkpoint {folder} was saved by {ranks} ranks but has {len(shards)} optimizer "
                              f"files: a shard is missing. Export another step (checkpoint_step=N) or retrain")
    partitions = [shard[SINGLE_PARTITION_OF_FP32_GROUPS] for shard in shards]
    return zero_to_fp32._get_fp32_state_dict_from_zero2_checkpoint(ranks, partitions, model_states,
                                                                   exclude_frozen_parameters=False)


def consolidate(checkpoint: Checkpoint) -> dict[str, Any]:
    """The full fp32 state dict (the optimizer's master weights), gathered from every rank's shard by
    DeepSpeed's own zero_to_fp32.

    ZeRO stage 0 keeps no partitioned master weights: its model-states file holds the whole module.
    """
    import torch

    folder = checkpoint.path
    check_checkpoint(folder)  # zero_to_fp32 and the loads below unpickle every file whole
    try:
        if _zero_stage(folder) == 0:
            module = torch.load(folder / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
            return {k: v.float() if v.is_floating_point() else v for k, v in module["module"].items()}
        from deepspeed.checkpoint.constants import BF16_ZERO_FILE_PREFIX
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with contextlib.redirect_stdout(sys.stderr):  # it prints progress; stdout stays for results
            if any(folder.glob(f"{BF16_ZERO_FILE_PREFIX}*_optim_states.pt")):
                return _bf16_optimizer_fp32(folder)
            return get_fp32_state_dict_from_zero_checkpoint(str(folder.parent), tag=folder.name)
    except StageInputError:
        raise
    except Exception as exc:  # truncated or missing shards surface as many different exception types
        raise StageInputError(f"checkpoint {folder} cannot be read ({type(exc).__name__}: {exc}). A shard is "
                              f"missing or corrupt: export another step (checkpoint_step=N) or retrain") from None


def hf_config_object(hf_config: dict[str, Any]) -> Any:
    """The transformers config object for a config dict (model_type picks the class), for inference: the
    training switch output_router_logits off (model.inference_config), whatever the checkpoint recorded."""
    from transformers import AutoConfig

    from gptpipe.runtime.model import inference_config

    values = dict(hf_config)
    return inference_config(AutoConfig.for_model(values.pop("model_type"), **values))


def model_from_checkpoint(checkpoint: Checkpoint, state_dict: dict[str, Any] | None = None,
                          merge: bool = True) -> Any:
    """The trained model in fp32, exactly as the checkpoint holds it (vocab still padded): a causal LM, or
    an encoder-decoder for a seq2seq fine-tune.

    The parameters are the state dict's own tensors (``assign``), so several models built from one
    consolidated checkpoint (``state_dict``; None: consolidated here) cost no extra memory until one of them
    is cast or resized. Stage 4 and `gptpipe predict` load checkpoints with it. A LoRA fine-tune's checkpoint
    holds its adapters only: the model is its base with them, merged into the weights unless `merge` is False
    (predict keeps the model as trained, so the export's merge is checked against it).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM
    from transformers.initialization import no_init_weights

    if state_dict is None:
        state_dict = consolidate(checkpoint)
    if checkpoint.lora:
        from gptpipe.runtime.lora import rebuild

        return rebuild(state_dict, checkpoint.lora, checkpoint.lora_base, checkpoint.seq2seq, merge, checkpoint.path)
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
