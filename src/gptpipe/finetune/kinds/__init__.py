"""The task kinds stage 7 trains (task.kind), by name: each is one module here, a TaskKind subclass that owns its
facts (its figures, its best metric, its config rules, its rows, loss and validation). A kind of your own needs
no edit here: task.kind names it as `module:Class` (importable where gptpipe runs: installed, or on PYTHONPATH),
and task.json records that name, so predict, chat and the export find it again."""

from __future__ import annotations

import difflib
import importlib
from functools import cache
from typing import TYPE_CHECKING

from gptpipe.finetune.kinds.chat import ChatKind
from gptpipe.finetune.kinds.classification import ClassificationKind
from gptpipe.finetune.kinds.generation import GenerationKind
from gptpipe.finetune.kinds.preference import PreferenceKind
from gptpipe.finetune.task_kind import TaskKind
from gptpipe.stage import StageInputError

if TYPE_CHECKING:
    from gptpipe.finetune.config import FinetuneConfig

BUILTIN: dict[str, type[TaskKind]] = {kind.name: kind for kind in (ClassificationKind, GenerationKind, ChatKind,
                                                                   PreferenceKind)}


@cache
def task_kind(name: str) -> TaskKind:
    """The kind called `name` (task.kind, task.json's kind): a built-in one, or `module:Class`."""
    if name in BUILTIN:
        return BUILTIN[name]()
    if ":" not in name:
        close = difflib.get_close_matches(name, list(BUILTIN), 1)
        raise StageInputError(f"task kind {name!r} is not one of {', '.join(BUILTIN)}"
                              + (f" (did you mean {close[0]}?)" if close else "")
                              + ", nor module:Class naming a TaskKind of your own")
    module_name, _, class_name = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise StageInputError(f"task kind {name!r}: module {module_name} cannot be imported ({exc}); install it "
                              "or put its folder on PYTHONPATH") from None
    kind_class = getattr(module, class_name, None)
    if not (isinstance(kind_class, type) and issubclass(kind_class, TaskKind)):
        raise StageInputError(f"task kind {name!r}: {module.__file__} has no TaskKind subclass {class_name} "
                              "(gptpipe.finetune.task_kind.TaskKind)")
    kind = kind_class()
    kind.name = name  # what task.json records, so every later stage imports the same class
    return kind


def config_problems(config: FinetuneConfig) -> list[tuple[str, str]]:
    """task.kind's checks of a config, as it loads (FinetuneConfig.checked_by)."""
    try:
        kind = task_kind(config.task.kind)
    except StageInputError as exc:
        return [("task.kind", str(exc))]
    return kind.config_problems(config)
