"""Checkpoints that a kill at any moment cannot corrupt, and resume from the newest complete one.

Layout under `<run>/checkpoints/`:
    global_step{N}/   DeepSpeed's files (model, optimizer and scheduler states), one rng_state_rank{R}.pt per
                      rank, hf_config.json (the transformers config), gptpipe_state.json (step, consumed
                      samples, tokens, final validation loss, and the run record: the whole resolved
                      config.yaml the run trained with) and `complete`
    latest            the tag of the newest complete checkpoint (DeepSpeed's own format)
    best              (fine-tuning) the tag of the best checkpoint by the validation metric; keep-last-N
                      never removes it

A save goes to `.tmp-global_step{N}/`, is renamed into place, then gets its `complete` marker, then
`latest` moves to it and the oldest checkpoints beyond `keep_checkpoints` go. A folder without the marker
is ignored (and replaced) by everything: resume, export, the next save.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptpipe.stage import write_text_atomic
from gptpipe.train.engine import Dist

COMPLETE_MARKER = "complete"
HF_CONFIG = "hf_config.json"
STATE = "gptpipe_state.json"
LATEST = "latest"
BEST = "best"
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
    """Remove complete checkpoints older than the newest `keep`, except the one `best` names."""
    for _, old in complete_checkpoints(root)[:-keep]:
        if old.name != best_tag(root):
            shutil.rmtree(old, ignore_errors=True)


def newest_checkpoint(root: Path) -> Path | None:
    complete = complete_checkpoints(root)
    return complete[-1][1] if complete else None


def _barrier() -> None:
    torch.distributed.barrier()


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(engine: Any, root: Path, step: int, state: dict[str, Any], hf_config_json: str, dist: Dist,
         keep: int) -> Path:
    """Save the engine at `step` atomically (see the module doc); collective: call on every rank."""
    tag = tag_of(step)
    staging = root / f".tmp-{tag}"
    final = root / tag
    if dist.is_main:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    _barrier()
    engine.save_checkpoint(str(staging), tag=tag, client_state={"gptpipe": state}, save_latest=False)
    torch.save(rng_state(), staging / tag / f"rng_state_rank{dist.rank}.pt")
    _barrier()
    if dist.is_main:
        write_text_atomic(staging / tag / HF_CONFIG, hf_config_json)
        write_text_atomic(staging / tag / STATE, json.dumps(state, ensure_ascii=False, indent=2) + "\n")
        if final.exists():  # an incomplete leftover of a killed save, or this step saved before a resume
            shutil.rmtree(final)
        (staging / tag).rename(final)
        shutil.rmtree(staging, ignore_errors=True)  # DeepSpeed's zero_to_fp32.py copy
        write_text_atomic(final / COMPLETE_MARKER, f"{tag}\n")
        write_text_atomic(root / LATEST, tag)
        prune(root, keep)
    _barrier()
    return final


def remove_stale(root: Path) -> None:
    """Staging folders and unmarked checkpoints left by a killed save (main rank, before training)."""
    if not root.is_dir():
        return
    for folder in root.iterdir():
        if folder.name.startswith(".tmp-") or (_TAG.match(folder.name) and not (folder / COMPLETE_MARKER).exists()):
            shutil.rmtree(folder, ignore_errors=True)


def load(engine: Any, folder: Path, dist: Dist) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and this rank's RNG from `folder`; returns gptpipe_state.json."""
    load_path, _ = engine.load_checkpoint(str(folder.parent), tag=folder.name, load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint {folder}")
    rng_file = folder / f"rng_state_rank{dist.rank}.pt"
    if rng_file.is_file():  # absent when resuming on more ranks than saved: those keep their fresh seed
        set_rng_state(torch.load(rng_file, weights_only=False))
    return json.loads((folder / STATE).read_text(encoding="utf-8"))
