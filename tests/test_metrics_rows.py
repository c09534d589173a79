"""metrics.jsonl's typed rows (runtime/metrics_rows.py): what the writers write, what every reader gets back."""

from __future__ import annotations

import json
import math
from pathlib import Path

from conftest import REPO, metrics

from gptpipe.config.core import load_config
from gptpipe.pipeline import PipelineConfig
from gptpipe.runtime.logging import RunLogger
from gptpipe.runtime.metrics_rows import (ROW_KINDS, EvalTasksRow, MixtureRow, SamplesRow, SpeedSetup, TaskEvalRow,
                                          TrainRow, ValidationRow, legacy_kind, parse_metrics, parse_row, read_metrics)
from gptpipe.runtime.model import Shape

MOE_TRAIN = TrainRow(10, loss=7.88, lr=0.003, grad_norm=0.99, tokens_per_s=4038.4, tokens=10240, setup="a setup",
                     aux_loss=1.04, expert_share_min=[0.09, 0.03], experts_starved=9, mem_gib=0.57, skipped_steps=0)
ROWS = [
    MixtureRow(0, {"ja": {"tokens": 300, "share": 0.75, "epochs": 0.1}, "en": {"tokens": 100, "share": 0.25,
                                                                             "epochs": 2.0}}, {"ja": 12, "en": 4}),
    MOE_TRAIN,
    TrainRow(11, loss=None, lr=0.003, grad_norm=None, tokens_per_s=10.0, skipped_steps=1),  # not finite
    TrainRow(10, loss=7.2, lr=0.001, grad_norm=7.7, tokens_per_s=1728.8, epoch=0.12, rows_per_s=151.6, padding=0.03),
    ValidationRow(50, val_loss=6.38, val_ppl=591.6, per_source={"ja": 6.1, "en": 7.0},
                  expert_share_min=[0.04, 0.0], experts_starved=5),
    TaskEvalRow(60, {"val_loss": 0.85, "accuracy": 0.33, "majority_accuracy": 0.33, "labels": ["a", "b"],
                     "per_class": {"a": {"f1": 0.49, "support": 54}}, "confusion_matrix": [[1, 0], [0, 1]]}),
    SamplesRow(50, [{"prompt": "日本の首都は", "text": "東京"}]),
    EvalTasksRow(50, {"manpage_section": {"acc": 0.31, "acc_norm": 0.19}, "group/sub": {"exact_match": 0.5}},
                 {"manpage_section": 16, "group/sub": 8}, 1.25),
]


def test_every_kind_round_trips_through_its_json_line() -> None:
    assert sorted(type(row).KIND for row in ROWS) == sorted([*ROW_KINDS, "train", "train"])
    text = "\n".join(json.dumps(row.to_json(), ensure_ascii=False) for row in ROWS)
    assert parse_metrics(text) == ROWS
    assert parse_metrics(text, last_step=10) == [ROWS[0], MOE_TRAIN, ROWS[3]]  # a resumed run's later segment
    # The keys the files have always had: figures flat, a fine-tune's under val_<key>, "kind" besides.
    assert MOE_TRAIN.to_json() == {"kind": "train", "step": 10, "loss": 7.88, "lr": 0.003, "grad_norm": 0.99,
                                   "tokens_per_s": 4038.4, "tokens": 10240, "setup": "a setup", "aux_loss": 1.04,
                                   "expert_share_min/layer0": 0.09, "expert_share_min/layer1": 0.03,
                                   "experts_starved": 9, "mem_gib": 0.57, "skipped_steps": 0}
    assert ROWS[2].to_json()["loss"] is None and "tokens" not in ROWS[2].to_json()
    assert set(ROWS[4].to_json()) == {"kind", "step", "val_loss", "val_ppl", "val_loss/ja", "val_loss/en",
                                      "val_expert_share_min/layer0", "val_expert_share_min/layer1",
                                      "val_experts_starved"}
    assert set(ROWS[5].to_json()) == {"kind", "step", "val_loss", "val_accuracy", "val_majority_accuracy",
                                      "val_labels", "val_per_class", "val_confusion_matrix"}
    assert ROWS[5].val_loss == 0.85
    assert ROWS[7].to_json() == {"kind": "eval_tasks", "step": 50, "eval_task/manpage_section/acc": 0.31,
                                 "eval_task/manpage_section/acc_norm": 0.19, "eval_task/group/sub/exact_match": 0.5,
                                 "eval_task_docs/manpage_section": 16, "eval_task_docs/group/sub": 8,
                                 "eval_tasks_s": 1.25}


def test_rows_written_before_kind_are_told_apart_by_their_keys() -> None:
    """Lines as stage 3 and stage 7 wrote them before rows carried a kind (from a mixtral and a fine-tune run)."""
    lines = [
        '{"step": 0, "mixture": {"data": {"tokens": 204800, "share": 1.0, "epochs": 0.17}}}',
        '{"step": 10, "tokens": 10240, "loss": 7.88, "lr": 0.003, "grad_norm": 0.99, "tokens_per_s": 4038.4, '
        '"setup": "a setup", "aux_loss": 1.04, "expert_share_min/layer0": 0.09, "expert_share_min/layer1": 0.03, '
        '"experts_starved": 9, "mem_gib": 0.57, "skipped_steps": 0}',
        '{"step": 10, "epoch": 0.12, "loss": 7.2, "lr": 0.001, "grad_norm": 7.7, "rows_per_s": 151.6, '
        '"tokens_per_s": 1728.8, "padding": 0.03}',
        '{"step": 50, "val_loss": 6.38, "val_ppl": 591.6, "val_expert_share_min/layer0": 0.04, '
        '"val_experts_starved": 5}',
        '{"step": 60, "val_loss": 0.85, "val_accuracy": 0.33, "val_confusion_matrix": [[1, 0], [0, 1]]}',
        '{"step": 50, "samples": [{"prompt": "日本の首都は", "text": "東京"}]}',
        '{"step": 70, "loss": 1.0, "lr": 0.1, "grad_n',  # cut short by a kill
        '{"step": 70, "kind": "from a later version", "loss": 1.0}',
        '{"note": "no step"}',
    ]
    rows = parse_metrics("\n".join(lines))
    assert [type(row) for row in rows] == [MixtureRow, TrainRow, TrainRow, ValidationRow, TaskEvalRow, SamplesRow]
    assert rows[1] == MOE_TRAIN
    assert rows[3].expert_share_min == [0.04] and rows[3].per_source == {}
    assert rows[4].metrics == {"val_loss": 0.85, "accuracy": 0.33, "confusion_matrix": [[1, 0], [0, 1]]}
    # Written again, each is its old line plus its kind.
    for line, row in zip(lines, rows):
        assert row.to_json() == {"kind": row.KIND, **json.loads(line)}
        assert legacy_kind(json.loads(line)) == row.KIND
    assert parse_row({"step": 1, "kind": "train", "loss": 1.0}) is None  # lr, grad_norm, tokens_per_s missing


def test_speed_setup_reads_as_the_run_folders_record_it() -> None:
    """The plan takes a measured speed only where a train row's setup is its own, text for text."""
    shape = Shape(arch="mixtral", num_layers=4, hidden_size=64, num_attn_heads=4, num_kv_heads=2,
                  ffn_hidden_size=128, vocab_size=3000, init_std=0.02, tie_word_embeddings=False, num_experts=8,
                  experts_top_k=2)
    assert str(SpeedSetup(shape, "fp32", 128, "CPU", 1)) == \
        "mixtral 4x64 ffn 128 vocab 3000 experts 8/2, fp32, seq_len 128, 1 x CPU"


def test_run_logger_writes_each_row_with_its_kind(tmp_path: Path) -> None:
    config = load_config(PipelineConfig, REPO / "config.yaml", ["logging.tensorboard=false", "logging.wandb=false"])
    log = RunLogger(tmp_path, config, total_steps=2, start_step=0, wandb_block={}, enabled=True)
    log.record(TrainRow(1, loss=math.nan, lr=0.1, grad_norm=math.inf, tokens_per_s=5.0), console="step 1")
    log.samples(1, [("prompt", "text")])
    log.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [line["kind"] for line in lines] == ["train", "samples"]
    assert lines[0]["loss"] is None and lines[0]["grad_norm"] is None  # JSON has no NaN
    assert read_metrics(tmp_path / "metrics.jsonl") == [
        TrainRow(1, loss=None, lr=0.1, grad_norm=None, tokens_per_s=5.0),
        SamplesRow(1, [{"prompt": "prompt", "text": "text"}])]


def assert_rows_of_their_kind(run: Path, kinds: set[str]) -> None:
    """Every line of a run's own metrics.jsonl a row of the kind it says, read back as written, and the same row
    by the key rule without its kind (what an older run folder gets)."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    rows = metrics(run)
    assert len(rows) == len(lines) and {row.KIND for row in rows} == kinds
    for line, row in zip(lines, rows):
        assert line["kind"] == row.KIND and row.to_json() == line
        assert parse_row({k: v for k, v in line.items() if k != "kind"}) == row


def test_a_pretraining_runs_rows_are_each_of_their_kind(trained_run: Path) -> None:
    assert_rows_of_their_kind(trained_run, {"mixture", "train", "validation", "samples"})


def test_a_finetunes_rows_are_each_of_their_kind(classifier_run) -> None:
    assert_rows_of_their_kind(classifier_run[0], {"train", "task_eval"})
