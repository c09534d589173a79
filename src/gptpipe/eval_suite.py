"""Evaluation suites: a named set of lm-evaluation-harness registry tasks (`suite: ja`, the Japanese leaderboard)
whose hub datasets are saved once to a local folder (`gptpipe evaluate --fetch`) and read from there afterwards,
so that `gptpipe evaluate` runs them with no network.

The local layout, per hub dataset (what `store` writes, `fetch` through it, and what the tests' fixtures write):
``<suite_data_dir>/<dataset_path>/<dataset_name or "default">/<split>.parquet`` plus ``dataset.json`` (written
last: the dataset, its hub revision, each split's rows). A suite task is then the registry task's own config with
its dataset swapped for those parquet files (lm-eval loads them with the ``parquet`` builder); prompts, shot
counts, filters and metrics stay lm-eval's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptpipe.stage import StageFailed, StageInputError, atomic_dir, tree_fingerprint

SPLIT_KEYS = ("training_split", "validation_split", "test_split", "fewshot_split")
MANIFEST = "dataset.json"


@dataclass(frozen=True)
class Suite:
    """A group of lm-eval's shipped tasks: the folder under lm_eval/tasks and the group its YAML defines."""

    name: str
    folder: str
    group: str
    about: str


SUITES = {s.name: s for s in [
    # The Open Japanese LLM Leaderboard's lm-eval tasks, each at the shots its YAML sets (the leaderboard's
    # convention): JAQKET v2 1, JCommonsenseQA 3, JNLI 3, JSQuAD 2, MARC-ja 3, MGSM 5, XL-Sum 1, XWinograd 0.
    Suite("ja", "japanese_leaderboard", "japanese_leaderboard",
          "lm-eval's japanese_leaderboard: JAQKET v2, JCommonsenseQA, JNLI, JSQuAD, MARC-ja, MGSM, XL-Sum (ja), "
          "XWinograd (ja); needs the ja-eval extra"),
]}


def suite(name: str) -> Suite:
    """The suite called `name`, or an error listing the known ones."""
    if name not in SUITES:
        raise StageInputError(f"unknown suite {name!r} (known: {', '.join(SUITES)})")
    return SUITES[name]


def task_configs(name: str, only: list[str] | None = None) -> list[dict[str, Any]]:
    """The suite's task configs as lm-eval reads its YAMLs (their `!function`s imported: lm-eval's own package
    code), in the group's order; `only`: just those tasks. A task config without num_fewshot gets 0, written out,
    so that the shots are the task's own whatever the caller's default."""
    import lm_eval.tasks
    from lm_eval.tasks._yaml_loader import load_yaml

    s = suite(name)
    folder = Path(lm_eval.tasks.__file__).parent / s.folder
    group, tasks = None, {}
    for path in sorted(folder.glob("*.yaml")):
        try:
            config = load_yaml(path, resolve_func=True)
        except ModuleNotFoundError as exc:
            raise StageInputError(f"suite {name}: {path.name} needs the Python package {exc.name!r}: "
                                  "pip install -e '.[ja-eval]'") from None
        if config.get("group") == s.group:
            group = config
        elif isinstance(config.get("task"), str):
            tasks[config["task"]] = config
    if group is None:
        raise StageInputError(f"suite {name}: lm-eval's {folder} defines no group {s.group} (another lm-eval "
                              "version? tested 0.4.13)")
    names = list(group["task"])
    unknown = sorted(set(only or []) - set(names))
    if unknown:
        raise StageInputError(f"suite_tasks: {', '.join(unknown)} not in suite {name} ({', '.join(names)})")
    configs = []
    for task in names:
        if only and task not in only:
            continue
        config = dict(tasks[task])
        config["num_fewshot"] = config.get("num_fewshot") or 0
        configs.append(config)
    return configs


def splits(config: dict[str, Any]) -> list[str]:
    """The dataset splits a task reads."""
    return sorted({config[k] for k in SPLIT_KEYS if config.get(k)})


def dataset_folder(data_dir: Path, path: str, name: str | None) -> Path:
    """Where a hub dataset (path, config name) is kept locally."""
    return data_dir / path / (name or "default")


def datasets_needed(configs: list[dict[str, Any]]) -> dict[tuple[str, str | None], list[str]]:
    """(dataset_path, dataset_name) → the splits any of the tasks read of it."""
    needed: dict[tuple[str, str | None], set[str]] = {}
    for config in configs:
        needed.setdefault((config["dataset_path"], config.get("dataset_name")), set()).update(splits(config))
    return {key: sorted(v) for key, v in needed.items()}


def store(folder: Path, path: str, name: str | None, revision: str | None, data: dict[str, Any]) -> None:
    """Write `data` (split → datasets.Dataset) as the local copy of hub dataset (path, name): one parquet file per
    split, dataset.json last, the folder swapped in whole."""
    import datasets

    with atomic_dir(folder) as tmp:
        rows = {}
        for split, dataset in data.items():
            dataset.to_parquet(str(tmp / f"{split}.parquet"))
            rows[split] = dataset.num_rows
        (tmp / MANIFEST).write_text(json.dumps(
            {"dataset_path": path, "dataset_name": name, "revision": revision, "splits": rows,
             "datasets": datasets.__version__}, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """A local copy's dataset.json, None when there is none (not fetched, or a fetch that did not finish)."""
    path = folder / MANIFEST
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def fetch(name: str, data_dir: Path, only: list[str] | None = None, force: bool = False) -> dict[str, Any]:
    """Save the suite's hub datasets under `data_dir` (each split the tasks read), skipping those already there
    unless `force`. Needs the hub, or the datasets in the HF cache (then HF_DATASETS_OFFLINE=1 reads them there).
    A dataset that cannot be had does not stop the others; the error lists each. Returns {folder: dataset.json}."""
    import datasets

    configs = task_configs(name, only)
    saved, failed = {}, []
    for (path, config_name), wanted in datasets_needed(configs).items():
        folder = dataset_folder(data_dir, path, config_name)
        manifest = read_manifest(folder)
        if manifest and not force and set(wanted) <= set(manifest["splits"]):
            saved[str(folder)] = manifest
            continue
        try:
            builder = datasets.load_dataset_builder(path, config_name)
            builder.download_and_prepare()
            data = {split: builder.as_dataset(split=split) for split in wanted}
        except Exception as exc:  # hub, network and loading-script errors of every kind: name the dataset
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            failed.append(f"{path}" + (f" ({config_name})" if config_name else "") + f": {type(exc).__name__} {why}")
            continue
        store(folder, path, config_name, builder.hash, data)
        saved[str(folder)] = read_manifest(folder)
    if failed:
        raise StageFailed(f"suite {name}: {len(failed)} hub dataset(s) could not be fetched ("
                          f"{len(saved)} saved in {data_dir}):\n  - " + "\n  - ".join(failed) + "\nRun `gptpipe "
                          "evaluate --fetch` where the HuggingFace hub is reachable, or where the HF cache holds them "
                          "(with HF_DATASETS_OFFLINE=1), then copy suite_data_dir here" + _runnable(configs, data_dir))
    return saved


def absent_splits(config: dict[str, Any], manifest: dict[str, Any] | None) -> list[str]:
    """The splits a task reads that its dataset's local copy (`manifest`, None: no copy) does not hold."""
    return [s for s in splits(config) if not manifest or s not in manifest["splits"]]


def _runnable(configs: list[dict[str, Any]], data_dir: Path) -> str:
    """A sentence naming the suite_tasks value that runs the tasks whose data is saved, when some are and some
    are not (a dataset the hub no longer serves need not hold back the others); else ""."""
    ready = [c["task"] for c in configs if not absent_splits(c, read_manifest(
        dataset_folder(data_dir, c["dataset_path"], c.get("dataset_name"))))]
    if not ready or len(ready) == len(configs):
        return ""
    return f". The tasks whose data is here run alone with suite_tasks=[{','.join(ready)}]"


def offline_tasks(name: str, data_dir: Path, only: list[str] | None,
                  fetch_hint: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The suite's task configs reading the local copies under `data_dir`, and the copies' fingerprints (for the
    evaluate manifest). A task whose data is not there is an error naming the task, the dataset and `fetch_hint`
    (the command that fetches it), before any model work."""
    wanted = task_configs(name, only)
    configs, inputs, missing = [], {}, []
    for config in wanted:
        path, config_name = config["dataset_path"], config.get("dataset_name")
        folder = dataset_folder(data_dir, path, config_name)
        manifest = read_manifest(folder)
        absent = absent_splits(config, manifest)
        if absent:
            missing.append(f"{config['task']} ({path}" + (f" {config_name}" if config_name else "")
                           + f", split {', '.join(absent)}: {folder})")
            continue
        files = {s: str(folder / f"{s}.parquet") for s in splits(config)}
        inputs[str(folder)] = tree_fingerprint([folder / MANIFEST, *map(Path, files.values())])
        configs.append({**config, "dataset_path": "parquet", "dataset_name": None,
                        "dataset_kwargs": {**(config.get("dataset_kwargs") or {}), "data_files": files},
                        "metadata": {**(config.get("metadata") or {}), "dataset": path, "dataset_config": config_name,
                                     "dataset_revision": manifest["revision"]}})
    if missing:
        raise StageInputError(f"suite {name}: no local data for " + "; ".join(missing)
                              + f". Fetch it once where the HuggingFace hub is reachable: {fetch_hint}"
                              + _runnable(wanted, data_dir))
    return configs, inputs
