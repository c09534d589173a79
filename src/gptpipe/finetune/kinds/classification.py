"""task.kind classification: every label of the training rows' label set is scored after the prompt and the
likeliest is the answer (task.generate_labels: one is also generated, mapped onto the nearest label); scored by
accuracy and macro-F1 beside the majority-class baseline."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gptpipe.finetune.data import Row, label_set
from gptpipe.finetune.kinds.labelled import LabelledKind
from gptpipe.finetune.metrics import Metric, classification_metrics, format_classification, map_to_label

if TYPE_CHECKING:
    from gptpipe.finetune.config import FinetuneConfig
    from gptpipe.finetune.task_kind import TaskData, TaskFacts


class ClassificationKind(LabelledKind):
    name = "classification"
    metrics = (Metric("accuracy", "accuracy"), Metric("macro_f1", "macro-F1"))
    default_best = "macro_f1"  # label sets are mostly imbalanced: accuracy would favour the majority label
    labelled = True

    def label_set(self, rows: list[Row]) -> list[str]:
        return label_set(rows)

    def figures(self, gold: list[str], scored: list[dict[str, Any]], task: TaskData, config: FinetuneConfig
                ) -> dict[str, Any]:
        assert task.labels is not None and task.majority is not None
        metrics = classification_metrics(gold, [o["pred"] for o in scored], task.labels, task.majority)
        if config.task.generate_labels:
            mapped = [map_to_label(o["generated"], task.labels) for o in scored]
            metrics["mapped"] = sum(needed for _, needed in mapped)
            metrics["generated_accuracy"] = sum(m == g for (m, _), g in zip(mapped, gold)) / len(gold)
        return metrics

    def headline(self, m: dict[str, Any]) -> str:
        return format_classification(m, self.metrics)

    def answer_metrics(self, gold: list[str], predicted: list[str], results: list[dict[str, Any]],
                       facts: TaskFacts) -> dict[str, Any]:
        """Predict's answers are labels already (a generated one mapped onto the nearest): scored as labels."""
        assert facts.labels is not None
        metrics = classification_metrics(gold, predicted, facts.labels, facts.majority_label or facts.labels[0])
        metrics["mapped"] = sum(r["mapped"] for r in results)
        metrics["generated_accuracy"] = sum(r["generated"] == r["label"] for r in results) / len(results)
        return metrics
