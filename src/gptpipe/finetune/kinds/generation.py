"""task.kind generation: free-form answers after the prompt, decoded greedily at validation and scored by exact
match and chrF against the gold label."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gptpipe.finetune.kinds.labelled import LabelledKind
from gptpipe.finetune.metrics import ANSWER_METRICS, CHRF, generation_metrics

if TYPE_CHECKING:
    from gptpipe.finetune.config import FinetuneConfig
    from gptpipe.finetune.task_kind import TaskData


class GenerationKind(LabelledKind):
    name = "generation"
    metrics = ANSWER_METRICS
    default_best = CHRF.key  # graded: exact match stays 0 for long while answers improve

    def figures(self, gold: list[str], scored: list[dict[str, Any]], task: TaskData, config: FinetuneConfig
                ) -> dict[str, Any]:
        return generation_metrics(gold, [o["generated"] for o in scored])
