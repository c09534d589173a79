"""What gptpipe runs of the files it reads: nothing, unless the user says they trust where the files came from.

A pickle (torch's .pt, numpy's object arrays) can call any Python function while it loads, and a local lm-eval
task's `!function` imports Python from the task's folder. A run folder from a colleague or a bucket others can
write, or a downloaded task folder, must not get to run code on convert, predict, chat, resume or evaluate. So:
- every .pt file is read for the globals its pickle would call before anything loads it (gptpipe's own loads and
  DeepSpeed's, which unpickle fully); one outside the types gptpipe's checkpoints hold (SAFE_GLOBALS) is refused;
- numpy index caches (megatron-core loads them with allow_pickle) must hold plain arrays;
- a task YAML (or one it includes) with `!function` is refused, and so is a fine-tune's task.json naming a task
  kind of its own (module:Class) that the reader's config does not name (finetune/task_kind.py's TaskFacts).
GPTPIPE_TRUST names what the user trusts anyway (comma-separated): `checkpoints` (any pickle), `task-code`.
"""

from __future__ import annotations

import os
from pathlib import Path

from gptpipe.stage import StageInputError

TRUST_ENV = "GPTPIPE_TRUST"
# The globals beyond torch's own weights_only set that DeepSpeed's and gptpipe's checkpoint files hold: numpy's
# array reconstruction (the RNG state), DeepSpeed's loss scaler, ZeRO stage enum and fragment addresses. Each only
# builds data; none calls anything it is given.
SAFE_GLOBALS = frozenset({
    "numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype",
    "numpy._core.multiarray.scalar", "numpy.core.multiarray.scalar",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.utils.tensor_fragment.fragment_address",
})
# numpy ≥ 1.25 pickles a dtype through its class (numpy.dtypes.UInt32DType, ...): data too.
SAFE_PREFIXES = ("numpy.dtypes.",)


def trusted(what: str) -> bool:
    """Whether the user set GPTPIPE_TRUST to include `what` (checkpoints, task-code)."""
    return what in {part.strip() for part in os.environ.get(TRUST_ENV, "").split(",")}


def pickle_problems(path: Path) -> list[str]:
    """The globals that loading `path` (a torch .pt file) would call beyond SAFE_GLOBALS."""
    from torch.serialization import get_unsafe_globals_in_checkpoint

    try:
        names = get_unsafe_globals_in_checkpoint(path)
    except Exception as exc:  # a truncated or foreign file surfaces as many exception types
        raise StageInputError(f"{path} is missing or corrupt: not a readable torch checkpoint file "
                              f"({type(exc).__name__}: {exc}). Export another step (checkpoint_step=N) or retrain") \
            from None
    return sorted(n for n in names if n not in SAFE_GLOBALS and not n.startswith(SAFE_PREFIXES))


def check_checkpoint(folder: Path) -> None:
    """Refuse a checkpoint folder whose .pt files would call anything but data constructors when loaded (unless
    GPTPIPE_TRUST includes `checkpoints`): call before any torch.load or DeepSpeed load of it."""
    if trusted("checkpoints"):
        return
    found = {path: names for path in sorted(Path(folder).glob("*.pt")) if (names := pickle_problems(path))}
    if found:
        what = "; ".join(f"{path.name}: {', '.join(names)}" for path, names in found.items())
        raise StageInputError(f"checkpoint {folder} would run code when loaded ({what}): a pickle can call any "
                              "function, and gptpipe's own checkpoints hold only tensors, numpy arrays and "
                              f"DeepSpeed's data types. If you trust where it came from, set {TRUST_ENV}=checkpoints "
                              "to load it anyway")


def check_index_cache(folder: Path) -> None:
    """Refuse numpy files in `folder` (megatron-core's index cache, which it loads with allow_pickle) whose
    arrays hold Python objects, i.e. a pickle (unless GPTPIPE_TRUST includes `checkpoints`)."""
    import numpy as np

    if trusted("checkpoints") or not Path(folder).is_dir():
        return
    for path in sorted(Path(folder).rglob("*.npy")):
        with open(path, "rb") as fh:
            try:
                major, _ = np.lib.format.read_magic(fh)
                read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
                dtype = read_header(fh)[2]
            except ValueError as exc:
                raise StageInputError(f"{path}: not a numpy array file ({exc}); delete it (data.cache_dir is a "
                                      "cache, rebuilt when missing)") from None
        if dtype.hasobject:
            raise StageInputError(f"{path} holds Python objects, which loading would unpickle (it can run code); "
                                  "megatron-core's index caches are plain integer arrays. Delete it (data.cache_dir "
                                  f"is rebuilt when missing), or set {TRUST_ENV}=checkpoints if you trust it")


def task_code(path: Path, seen: frozenset[Path] = frozenset()) -> list[str]:
    """The `!function` references of a task YAML and of the YAMLs it includes: Python lm-eval would import."""
    import yaml

    path = Path(path).resolve()
    if path in seen or not path.is_file():
        return []
    root = yaml.compose(path.read_text(encoding="utf-8"), Loader=yaml.SafeLoader)  # nodes only: nothing runs
    found, todo, includes = [], [root], []
    while todo:
        node = todo.pop()
        if node is None:
            continue
        if node.tag == "!function":
            found.append(f"{path}: !function {node.value}")
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if node is root and getattr(key, "value", None) == "include":
                    includes += [v.value for v in value.value] if isinstance(value, yaml.SequenceNode) \
                        else [value.value]
                todo += [key, value]
        elif isinstance(node, yaml.SequenceNode):
            todo += node.value
    for include in includes:
        found += task_code(path.parent / include, seen | {path})
    return found


def check_task_code(path: Path) -> None:
    """Refuse a local task YAML that would import Python (unless GPTPIPE_TRUST includes `task-code`)."""
    found = [] if trusted("task-code") else task_code(path)
    if found:
        raise StageInputError(f"task YAML {path} imports Python when loaded ({'; '.join(found[:3])}): lm-eval "
                              f"runs it. If you trust this task folder, set {TRUST_ENV}=task-code")
