"""Task metrics: classification by scikit-learn (with the majority-class baseline beside them, since
imbalanced label sets are the norm), generated answers by exact match and chrF (sacrebleu, computed locally);
the Metric entry every reader of a figure shares (training's best checkpoint, the console, predict, the card;
which figures a task has is its kind's: TaskKind.metrics); and the mapping of a generated answer to the nearest
label."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Metric:
    """One validation figure of a fine-tune: its key (metrics.jsonl logs it as val_<key>), its name in text,
    which way is better and how it prints."""

    key: str
    label: str
    higher_is_better: bool = True
    digits: int = 4

    def show(self, value: float) -> str:
        return f"{value:.{self.digits}f}"


VAL_LOSS = Metric("val_loss", "loss", higher_is_better=False)  # every kind's: the loss of its validation rows
# Generated text against a gold answer: generation's figures, chat's chrF, and what predict reports for any kind
# whose answers are free text.
EXACT_MATCH, CHRF = Metric("exact_match", "exact match"), Metric("chrf", "chrF", digits=2)
ANSWER_METRICS = (EXACT_MATCH, CHRF)


def headline(m: dict[str, Any], figures: tuple[Metric, ...]) -> str:
    """`figures` of `m` on one console line (those it holds; else the answer figures, as predict scores them)."""
    shown = [x for x in figures if x.key in m] or [x for x in ANSWER_METRICS if x.key in m]
    return "  ".join(f"{x.label} {x.show(m[x.key])}" for x in shown)


def classification_metrics(gold: list[str], predicted: list[str], labels: list[str],
                           majority: str) -> dict[str, Any]:
    """accuracy, macro-F1, per-class precision/recall/F1/support, the confusion matrix (rows: gold, in
    `labels` order) and the same two figures for always predicting `majority`."""
    from sklearn.metrics import (
        accuracy_score,
        confusion_matrix,
        f1_score,
        precision_recall_fscore_support,
    )

    present = labels + sorted({g for g in gold if g not in labels})  # a validation label unseen in training
    precision, recall, f1, support = precision_recall_fscore_support(gold, predicted, labels=present,
                                                                     zero_division=0)
    baseline = [majority] * len(gold)
    return {
        "accuracy": float(accuracy_score(gold, predicted)),
        "macro_f1": float(f1_score(gold, predicted, labels=present, average="macro", zero_division=0)),
        "majority_accuracy": float(accuracy_score(gold, baseline)),
        "majority_macro_f1": float(f1_score(gold, baseline, labels=present, average="macro", zero_division=0)),
        "per_class": {label: {"precision": float(p), "recall": float(r), "f1": float(f), "support": int(s)}
                      for label, p, r, f, s in zip(present, precision, recall, f1, support)},
        "labels": present,
        "confusion_matrix": confusion_matrix(gold, predicted, labels=present).tolist(),
    }


def generation_metrics(gold: list[str], predicted: list[str]) -> dict[str, Any]:
    """exact match (after stripping whitespace) and corpus chrF (0-100)."""
    from sacrebleu.metrics import CHRF

    exact = sum(g.strip() == p.strip() for g, p in zip(gold, predicted)) / max(len(gold), 1)
    return {"exact_match": exact, "chrf": float(CHRF().corpus_score(predicted, [gold]).score)}


def format_classification(m: dict[str, Any], figures: tuple[Metric, ...]) -> str:
    """The console table: headline `figures` beside the baseline, then one line per class."""
    lines = ["  ".join(f"{x.label} {x.show(m[x.key])}" for x in figures) + "  (majority baseline: "
             + ", ".join(f"{x.label} {x.show(m['majority_' + x.key])}" for x in figures) + ")"]
    if "mapped" in m:
        lines[0] += f"  generated labels: accuracy {m['generated_accuracy']:.4f}, {m['mapped']} needed mapping"
    for label, c in m["per_class"].items():
        lines.append(f"    {label!s:>12}  P {c['precision']:.3f}  R {c['recall']:.3f}  F1 {c['f1']:.3f}  "
                     f"n {c['support']}")
    return "\n".join(lines)


# --- answers as labels --------------------------------------------------------------------------------------
def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions of characters)."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def map_to_label(text: str, labels: list[str]) -> tuple[str, bool]:
    """(the label nearest to the generated `text` by edit distance, whether it needed mapping).
    Ties go to the label listed first (label_set lists the most frequent first)."""
    text = text.strip()
    if text in labels:
        return text, False
    return min(labels, key=lambda label: edit_distance(text, label)), True
