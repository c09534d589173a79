"""The rows of a run's metrics.jsonl: one dataclass per kind, built by the writers (stage 3 and stage 7 through
runtime/logging.py's RunLogger) and asked for by kind by every reader (the plan's measured speed, the model card,
the mirror, the tests). A row's JSON object carries its "kind" and the keys these files have always had; a row
written before "kind" existed gets its kind from `legacy_kind`, the one rule that tells rows apart by their keys.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

if TYPE_CHECKING:
    from gptpipe.runtime.model import Shape


@dataclass(frozen=True)
class SpeedSetup:
    """What a measured tokens/s depends on; a train row records it as text ("setup"), and the plan takes a
    speed only from rows measured under its own."""

    shape: Shape
    precision: str
    seq_len: int
    device_name: str
    ranks: int  # data-parallel ranks, each on one device_name

    def __str__(self) -> str:
        s = self.shape
        return (f"{s.arch} {s.num_layers}x{s.hidden_size} ffn {s.ffn_hidden_size} vocab {s.vocab_size} "
                f"experts {s.num_experts}/{s.experts_top_k}, {self.precision}, seq_len {self.seq_len}, "
                f"{self.ranks} x {self.device_name}")


@dataclass
class Row:
    """A metrics.jsonl row: the optimizer step it belongs to. An optional field set to None is left out of the
    JSON; a field without default is always there (null: a figure that was not finite)."""

    KIND: ClassVar[str]
    step: int

    def to_json(self) -> dict[str, Any]:
        """The JSON object: "kind", then the fields under their own names."""
        return {"kind": self.KIND, **{f.name: getattr(self, f.name) for f in fields(self)
                                      if getattr(self, f.name) is not None or _required(f)}}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Row | None:
        """The row `raw` holds, or None when a field without default is missing."""
        if any(f.name not in raw for f in fields(cls) if _required(f)):
            return None
        return cls(**{f.name: raw[f.name] for f in fields(cls) if f.name in raw})


def _required(f: Field[Any]) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def _experts_json(prefix: str, shares: list[float] | None, starved: int | None) -> dict[str, Any]:
    """A mixture of experts' routing as logged: each layer's smallest expert share, the experts starved."""
    if shares is None:
        return {}
    return {**{f"{prefix}expert_share_min/layer{i}": share for i, share in enumerate(shares)},
            f"{prefix}experts_starved": starved}


def _experts_of(raw: dict[str, Any], prefix: str) -> dict[str, Any]:
    key = f"{prefix}expert_share_min/layer"
    layers = sorted(int(k[len(key):]) for k in raw if k.startswith(key))
    if not layers:
        return {}
    return {"expert_share_min": [raw[f"{key}{i}"] for i in layers],
            "experts_starved": raw.get(f"{prefix}experts_starved")}


@dataclass
class MixtureRow(Row):
    """Stage 3's data mixture as megatron built it, logged once at the start."""

    KIND = "mixture"
    mixture: dict[str, dict[str, Any]]  # source → {"tokens", "share", "epochs"}
    validation_samples: dict[str, int] | None = None  # source → its validation samples, with several sources


@dataclass
class TrainRow(Row):
    """A log step's figures over the log window (stage 3 and stage 7); `loss` None: not finite."""

    KIND = "train"
    loss: float | None
    lr: float
    grad_norm: float | None
    tokens_per_s: float
    tokens: int | None = None  # stage 3: tokens consumed so far
    setup: str | None = None  # stage 3: the SpeedSetup tokens_per_s was measured under, as text
    aux_loss: float | None = None  # a mixture of experts' router load-balancing loss
    expert_share_min: list[float] | None = None  # per layer ("expert_share_min/layer<i>"), a fair share 1/experts
    experts_starved: int | None = None
    mfu: float | None = None  # on a GPU with known peak FLOP/s
    mem_gib: float | None = None
    skipped_steps: int | None = None
    epoch: float | None = None  # stage 7
    rows_per_s: float | None = None  # stage 7
    padding: float | None = None  # stage 7: the share of computed positions that were padding

    def to_json(self) -> dict[str, Any]:
        plain = super().to_json()
        plain.pop("expert_share_min", None), plain.pop("experts_starved", None)
        return {**plain, **_experts_json("", self.expert_share_min, self.experts_starved)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Row | None:
        return super().from_json({**raw, **_experts_of(raw, "")})


@dataclass
class ValidationRow(Row):
    """Stage 3's validation over the held-out samples; with several sources, each one's loss."""

    KIND = "validation"
    val_loss: float | None
    val_ppl: float
    per_source: dict[str, float] = field(default_factory=dict)  # source → loss, logged as "val_loss/<source>"
    expert_share_min: list[float] | None = None  # logged as "val_expert_share_min/layer<i>"
    experts_starved: int | None = None  # logged as "val_experts_starved"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.KIND, "step": self.step, "val_loss": self.val_loss, "val_ppl": self.val_ppl,
                **{f"val_loss/{name}": loss for name, loss in self.per_source.items()},
                **_experts_json("val_", self.expert_share_min, self.experts_starved)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Row | None:
        per_source = {k.removeprefix("val_loss/"): v for k, v in raw.items() if k.startswith("val_loss/")}
        return super().from_json({"step": raw["step"], **{k: raw[k] for k in ("val_loss", "val_ppl") if k in raw},
                                  "per_source": per_source, **_experts_of(raw, "val_")})


# An eval_tasks row's keys: "eval_task/<task>/<metric>" per figure, "eval_task_docs/<task>", "eval_tasks_s".
_TASK_SCORE, _TASK_DOCS, _TASKS_SECONDS = "eval_task/", "eval_task_docs/", "eval_tasks_s"


@dataclass
class EvalTasksRow(Row):
    """Stage 3's lm-eval tasks (train.eval_tasks) on the live model at an evaluation, beside its validation row."""

    KIND = "eval_tasks"
    scores: dict[str, dict[str, float]]  # task → metric → value
    documents: dict[str, int]  # task → documents scored
    seconds: float  # the wall time the task evaluation took

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.KIND, "step": self.step,
                **{f"{_TASK_SCORE}{task}/{metric}": value for task, metrics in self.scores.items()
                   for metric, value in metrics.items()},
                **{f"{_TASK_DOCS}{task}": n for task, n in self.documents.items()}, _TASKS_SECONDS: self.seconds}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Row | None:
        scores: dict[str, dict[str, float]] = {}
        for key, value in raw.items():
            if key.startswith(_TASK_SCORE):
                task, _, metric = key.removeprefix(_TASK_SCORE).rpartition("/")
                scores.setdefault(task, {})[metric] = value
        return cls(raw["step"], scores, {k.removeprefix(_TASK_DOCS): v for k, v in raw.items()
                                         if k.startswith(_TASK_DOCS)}, raw.get(_TASKS_SECONDS, 0.0))


# A fine-tune's figures are logged as val_<key>; its loss's own key already is.
_TASK_LOSS = "val_loss"


@dataclass
class TaskEvalRow(Row):
    """Stage 7's validation: the loss and the task's figures (the task kind's validate), each logged as
    val_<key>."""

    KIND = "task_eval"
    metrics: dict[str, Any]  # {"val_loss", "accuracy", "majority_accuracy", "chrf", ...} as computed

    @property
    def val_loss(self) -> float | None:
        return self.metrics.get(_TASK_LOSS)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.KIND, "step": self.step,
                **{k if k == _TASK_LOSS else f"val_{k}": v for k, v in self.metrics.items()}}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Row | None:
        return cls(raw["step"], {k if k == _TASK_LOSS else k.removeprefix("val_"): v for k, v in raw.items()
                                 if k.startswith("val_")})


@dataclass
class SamplesRow(Row):
    """Greedy continuations of train.sample_prompts at a validation (stage 3)."""

    KIND = "samples"
    samples: list[dict[str, str]]  # {"prompt", "text"}


ROW_KINDS: dict[str, type[Row]] = {cls.KIND: cls for cls in (MixtureRow, TrainRow, ValidationRow, EvalTasksRow,
                                                             TaskEvalRow, SamplesRow)}
EVALUATIONS = (ValidationRow, TaskEvalRow)  # the rows with a validation loss (`val_loss`)


def legacy_kind(raw: dict[str, Any]) -> str | None:
    """The kind of a row written without one, by the key only that kind has."""
    for key, kind in (("mixture", "mixture"), ("samples", "samples"), ("loss", "train"), ("val_ppl", "validation"),
                      (_TASK_LOSS, "task_eval")):
        if key in raw:
            return kind
    return None


def parse_row(raw: Any) -> Row | None:
    """The row a decoded JSON line holds; None for anything else (no step, a kind this version does not know)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("step"), int):
        return None
    kind = ROW_KINDS.get(raw.get("kind") or legacy_kind(raw) or "")
    return kind.from_json(raw) if kind else None


def parse_metrics(text: str, last_step: float = math.inf) -> list[Row]:
    """The rows of a metrics.jsonl's text up to `last_step` (a resumed run appends, so rows past a checkpoint
    may belong to a later segment); a line cut short by a kill is skipped."""
    rows = []
    for line in text.splitlines():
        try:
            row = parse_row(json.loads(line))
        except json.JSONDecodeError:
            continue
        if row is not None and row.step <= last_step:
            rows.append(row)
    return rows


def read_metrics(path: Path, last_step: float = math.inf) -> list[Row]:
    """`parse_metrics` of the file at `path`; none where it does not exist."""
    return parse_metrics(path.read_text(encoding="utf-8"), last_step) if path.is_file() else []


R = TypeVar("R", bound=Row)


def of_kind(rows: list[Row], kind: type[R] | tuple[type[R], ...]) -> list[R]:
    """The rows of `kind` (a row class, or a tuple of them), in order."""
    return [row for row in rows if isinstance(row, kind)]
