"""The task kinds stage 7 trains (task.kind), by name: a new kind is a TaskKind module and one line here (and
its figures in metrics.TASK_METRICS)."""

from __future__ import annotations

from gptpipe.finetune.chat_task import ChatKind
from gptpipe.finetune.labelled import ClassificationKind, GenerationKind
from gptpipe.finetune.preference import PreferenceKind
from gptpipe.finetune.task_kind import TaskKind
from gptpipe.stage import StageInputError

KINDS: dict[str, TaskKind] = {kind.name: kind for kind in (ClassificationKind(), GenerationKind(), ChatKind(),
                                                            PreferenceKind())}


def task_kind(name: str) -> TaskKind:
    """The kind called `name` (task.kind, task.json's kind)."""
    if name not in KINDS:
        raise StageInputError(f"task kind {name!r} is not one of {', '.join(KINDS)}")
    return KINDS[name]

