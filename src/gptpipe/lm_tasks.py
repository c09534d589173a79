"""lm-evaluation-harness tasks as the pipeline names them: registry names and local task YAMLs (llm-jp-eval folders:
gptpipe.llmjp_eval), turned into what lm-eval is given, loaded with a clear error for an unknown or unreachable
task, and lm-eval's results summarised; a run whose tasks need nothing from the hub runs with the HF offline modes
set (hub_offline). `gptpipe evaluate` (stage 7) scores an exported folder with them, stage 3
(train.eval_tasks) the live model; both import this module, so neither stage imports the other.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gptpipe.stage import StageInputError
from gptpipe.trust import check_task_code


def local_task(path: Path) -> dict[str, Any]:
    """A task YAML as lm-eval reads it, with relative data_files/data_dir resolved against the YAML's folder
    (as our configs resolve paths), so a task folder works from any current directory."""
    from lm_eval.tasks._yaml_loader import load_yaml

    if not path.is_file():
        raise StageInputError(f"task YAML {path} not found")
    check_task_code(path)  # lm-eval imports a `!function`'s Python while it loads the YAML
    task = load_yaml(path, resolve_func=True)
    kwargs = task.get("dataset_kwargs") or {}

    def resolve(files: Any) -> Any:
        if isinstance(files, dict):
            return {k: resolve(v) for k, v in files.items()}
        if isinstance(files, list):
            return [resolve(v) for v in files]
        return str((path.parent / files).resolve()) if "://" not in str(files) else files

    for key in ("data_files", "data_dir"):
        if key in kwargs:
            kwargs[key] = resolve(kwargs[key])
    return task


def flatten(files: Any) -> list[str]:
    """The file names of a task's data_files (a name, a list, or a split → names mapping)."""
    if isinstance(files, dict):
        return [f for v in files.values() for f in flatten(v)]
    if isinstance(files, list):
        return [f for v in files for f in flatten(v)]
    return [files] if files else []


# datasets' packaged builders: they read local files (data_files), the hub holds nothing they need
LOCAL_BUILDERS = frozenset({"json", "csv", "parquet", "text", "arrow", "pandas"})


def needs_hub(spec: str | dict) -> bool:
    """Whether lm-eval would ask the hub for the task's dataset: a registry name, or a config whose dataset_path is
    neither a packaged builder nor a local folder (a custom_dataset reads none)."""
    if isinstance(spec, str):
        return True
    if spec.get("custom_dataset"):
        return False
    path = spec.get("dataset_path")
    return not path or (path not in LOCAL_BUILDERS and not Path(path).is_dir())


def spec_name(spec: str | dict) -> str:
    """The task's name: a registry name as it is, a local task by its `task` (or `group`) key."""
    return spec if isinstance(spec, str) else str(spec.get("task") or spec.get("group"))


def load_tasks(specs: list[str | dict], local_hint: str) -> Any:
    """Build the tasks one by one (lm-eval fetches their datasets here), so a task whose hub dataset cannot
    be fetched is named; the full registry is indexed only when a registry name is asked for (slow).
    `local_hint` says how the calling command takes local tasks instead."""
    return _built(specs, local_hint)[0]


def built_objects(specs: list[str | dict], local_hint: str) -> tuple[Any, list[Any], dict[str, Any]]:
    """(the task manager, what each spec built: a Task, or a Group holding its tasks, the Task objects by name),
    built as `load_tasks` builds them. The objects can be changed (their shots) and given to simple_evaluate,
    which then neither builds nor loads the tasks again."""
    return _built(specs, local_hint)


def built_tasks(specs: list[str | dict], local_hint: str) -> dict[str, Any]:
    """The lm-eval Task objects of `specs` by task name (a group's tasks each), built as `load_tasks` builds
    them: what stage 0's decontamination reads the evaluation documents from."""
    return _built(specs, local_hint)[2]


def _built(specs: list[str | dict], local_hint: str) -> tuple[Any, list[Any], dict[str, Any]]:
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_defaults=any(isinstance(s, str) for s in specs))
    unknown = [s for s in specs if isinstance(s, str) and not manager.match_tasks([s])]
    if unknown:
        raise StageInputError(f"unknown lm-eval task(s): {', '.join(unknown)} (`lm-eval ls tasks` lists them; "
                              f"a local task: {local_hint})")
    offline = any(os.environ.get(v, "0").lower() in ("1", "true", "yes")
                  for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    tasks: dict[str, Any] = {}
    top: list[Any] = []
    for spec in specs:
        try:
            loaded = manager.load([spec])
            tasks.update(loaded["tasks"])
            group = loaded["groups"].get(spec_name(spec))
            top += [group] if group is not None else loaded["tasks"].values()
        except ConnectionError as exc:
            why = ("HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set" if offline
                   else "the HuggingFace hub cannot be reached from here")
            raise StageInputError(
                f"task {spec_name(spec)}: its dataset is hosted on the HuggingFace hub and {why} ({exc}). "
                "Run where the network allows (the dataset is then cached under ~/.cache/huggingface), or "
                f"evaluate local tasks: {local_hint}") from None
    return manager, top, tasks


def summarize(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """lm-eval's ``results`` ("acc,none": 0.5, "acc_stderr,none": 0.1) → {task: {metric: {value, stderr}}}."""
    summary: dict[str, dict[str, Any]] = {}
    for task, metrics in raw["results"].items():
        # a task that puts its examples in its own prompt (llm-jp-eval's) says how many in its metadata
        in_prompt = ((raw.get("configs", {}).get(task) or {}).get("metadata") or {}).get("shots_in_prompt")
        row: dict[str, Any] = {"n_shot": in_prompt if in_prompt is not None else raw.get("n-shot", {}).get(task),
                               "samples": raw.get("n-samples", {}).get(task, {}).get("effective"), "metrics": {}}
        for key, value in metrics.items():
            name, _, filt = key.partition(",")
            if not filt or "_stderr" in name or not isinstance(value, (int, float)):
                continue
            stderr = metrics.get(f"{name}_stderr,{filt}")
            label = name if filt == "none" else f"{name} ({filt})"
            row["metrics"][label] = {"value": value, "stderr": stderr if isinstance(stderr, (int, float)) else None}
        summary[task] = row
    return summary


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """HF_HUB_OFFLINE and HF_DATASETS_OFFLINE set while the block runs, also in huggingface_hub's and datasets'
    module constants if they were imported already (they read the variables once), so nothing reaches the hub;
    restored afterwards."""
    env = {v: os.environ.get(v) for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    constants = [(m, attr) for m, attrs in (("huggingface_hub.constants", ("HF_HUB_OFFLINE",)),
                                            ("datasets.config", ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")))
                 if m in sys.modules for attr in attrs]
    saved = [(sys.modules[m], attr, getattr(sys.modules[m], attr)) for m, attr in constants]
    os.environ.update({v: "1" for v in env})
    for module, attr, _ in saved:
        setattr(module, attr, True)
    try:
        yield
    finally:
        for var, value in env.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        for module, attr, value in saved:
            setattr(module, attr, value)
