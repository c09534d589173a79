"""Task metrics: classification by scikit-learn (with the majority-class baseline beside them, since
imbalanced label sets are the norm), generation by exact match and chrF (sacrebleu, computed locally)."""

from __future__ import annotations

from typing import Any


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


def format_classification(m: dict[str, Any]) -> str:
    """The console table: headline figures beside the baseline, then one line per class."""
    lines = [f"accuracy {m['accuracy']:.4f}  macro-F1 {m['macro_f1']:.4f}  (majority baseline: accuracy "
             f"{m['majority_accuracy']:.4f}, macro-F1 {m['majority_macro_f1']:.4f})"]
    if "mapped" in m:
        lines[0] += f"  generated labels: accuracy {m['generated_accuracy']:.4f}, {m['mapped']} needed mapping"
    for label, c in m["per_class"].items():
        lines.append(f"    {label!s:>12}  P {c['precision']:.3f}  R {c['recall']:.3f}  F1 {c['f1']:.3f}  "
                     f"n {c['support']}")
    return "\n".join(lines)
