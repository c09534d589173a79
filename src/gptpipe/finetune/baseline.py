"""Stage 7's "did it help?": the fine-tuned model beside baselines on the same rows (finetune_config.yaml
`baseline:`), in the summary, the console and the exported card.

- scratch: model.path's architecture from random initialisation, fine-tuned with the same settings and rows in
  <run>/baselines/scratch. A pretrained start that does not beat it did not help the task.
- base: the base model a continued-pretraining export started from (its manifest records the folder and the
  hashes of its files), fine-tuned alike in <run>/baselines/base. Continued pretraining that does not beat it
  did not help the task.
- classical (classification): character 1-4-gram TF-IDF and logistic regression (scikit-learn), fitted on the
  training rows the model trained on and scored on the same validation rows, with the same metrics.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any


from gptpipe.finetune.run_files import BASELINE_DESCRIPTIONS
from gptpipe.finetune.metrics import classification_metrics

if TYPE_CHECKING:
    from gptpipe.finetune.task_kind import TaskData, TaskKind

BASELINES_DIR = Path("baselines")  # <run>/baselines/<scratch|base>: the baseline fine-tunes' run folders



def base_of(model_path: Path) -> Path:
    """The base folder a continued-pretraining export (model.path) started from, as stage 4's manifest records
    it; refused when model.path is no such export or the base's files changed since."""
    from gptpipe.stage import Manifest, StageInputError
    from gptpipe.artifacts import CONVERT
    from gptpipe.stage import folder_changes

    manifest = CONVERT.manifest_path(model_path)
    record = Manifest.read(manifest).inputs.get("base_model") if manifest.is_file() else None
    if record is None:
        raise StageInputError(f"baseline.model=base: {model_path} is not a gptpipe export of a continued-"
                              f"pretraining run ({manifest} records no base model); use baseline.model=scratch")
    folder = Path(record["folder"])
    changed = folder_changes(record, folder)  # the check a resume and stage 4 make of the same folder
    if changed:
        raise StageInputError(f"baseline.model=base: the base folder {folder} recorded in {manifest} is gone or "
                              f"changed since the export ({'; '.join(changed[:5])})")
    return folder


def classical_baseline(task: TaskData) -> dict[str, Any]:
    """Validation metrics of char n-gram TF-IDF + logistic regression fitted on the training rows."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline

    assert task.labels and task.majority
    inputs, labels = [r.input for r in task.train_rows], [str(r.label) for r in task.train_rows]
    validation = [r.input for r in task.validation]
    if len(set(labels)) < 2:  # logistic regression needs two classes; one label is all it could answer
        predicted = [labels[0]] * len(validation)
    else:
        model = make_pipeline(TfidfVectorizer(analyzer="char_wb", ngram_range=(1, 4), sublinear_tf=True),
                              LogisticRegression(max_iter=2000))
        predicted = [str(p) for p in model.fit(inputs, labels).predict(validation)]
    return classification_metrics([str(r.label) for r in task.validation], predicted, task.labels, task.majority)


def comparison(kind: TaskKind, model: dict[str, Any], baselines: dict[str, dict[str, Any]]
               ) -> dict[str, dict[str, float]]:
    """{"model": figures, <baseline>: figures, "majority": ...}: the headline validation figures side by side."""
    # The task's figures, and val_loss where the baseline is a language model.
    keys = [m.key for m in kind.scored]
    table = {name: {k: float(m[k]) for k in keys if k in m} for name, m in {"model": model, **baselines}.items()}
    majority = {m.key: model[f"majority_{m.key}"] for m in kind.metrics if f"majority_{m.key}" in model}
    if majority:  # a labelled kind's figures of always answering the most frequent label
        table["majority"] = majority
    return table


def format_comparison(table: dict[str, dict[str, float]], model_origin: str, kind: TaskKind, best_metric: str
                      ) -> str:
    """The console lines: one per model, then whether the pretrained start beat each baseline."""
    lines = [f"did it help? validation figures of the best checkpoint (by {best_metric}) beside the baselines:"]
    for name, figures in table.items():
        what = model_origin if name == "model" else BASELINE_DESCRIPTIONS[name]
        lines.append(f"  {name:<9} " + "  ".join(f"{k} {kind.metric(k).show(v)}" for k, v in figures.items())
                     + f"  ({what})")
    mine, chosen = table["model"].get(best_metric), kind.metric(best_metric)
    for name, figures in table.items():
        theirs = figures.get(best_metric)
        if name == "model" or mine is None or theirs is None:
            continue
        better = mine > theirs if chosen.higher_is_better else mine < theirs
        verdict = "beats" if better else "ties with" if mine == theirs else "does NOT beat"
        lines.append(f"  {verdict} {name}: {best_metric} {chosen.show(mine)} vs {chosen.show(theirs)}")
    return "\n".join(lines)
