"""train.eval_tasks: lm-eval's demo task (and a folder of llm-jp-eval files) scored on the live model at every
evaluation of a real `gptpipe train`, the first before step 1 as the reference, a warning line when a task falls
more than the tolerance below it, the reference kept across a resume, and the documents sharded over two CPU ranks
under ZeRO-3; and the tolerance in the direction lm-eval gives each metric (bits per byte: lower is better)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import QUICK_TRAIN, REPO, run_cli, run_train, train_losses
from test_evaluate_llmjp import TEST_DOCS, command_rows, write_llmjp

from gptpipe.train.eval_tasks import Scores, compare
from gptpipe.runtime.metrics_rows import EvalTasksRow, TrainRow, read_metrics

pytest.importorskip("lm_eval", reason="needs lm-eval (pip install 'lm-eval[hf]')")

STEPS, LIMIT = 4, 12
WARNING = "task manpage_section fell below its reference"


@pytest.fixture(scope="module")
def demo_task(workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo task (make-demo-task on the man pages) in a folder of this module's own: its task YAML."""
    folder = tmp_path_factory.mktemp("demo-task")
    shutil.copy(REPO / "evaluate_config.yaml", folder / "evaluate_config.yaml")
    run_cli("make-demo-task", "--config", folder / "evaluate_config.yaml", f"demo_task.output_dir={folder / 'task'}")
    return folder / "task" / "manpage_section.yaml"


def task_run(workspace: Path, task: Path, run: Path, *overrides: str, ranks: int = 1) -> str:
    done = run_train("--config", workspace / "config.yaml", *QUICK_TRAIN, f"train.train_iters={STEPS}",
                     "train.eval_interval=2", "train.save_interval=2", f"train.eval_task_yamls=[{task}]",
                     f"train.eval_tasks_limit={LIMIT}", f"train.output_model_dir={run}", *overrides, ranks=ranks)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def task_rows(run: Path) -> list[EvalTasksRow]:
    return [r for r in read_metrics(run / "metrics.jsonl") if isinstance(r, EvalTasksRow)]


@pytest.mark.slow
def test_task_rows_at_every_evaluation_with_the_first_as_reference(
        dataset_prefix: Path, workspace: Path, demo_task: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    llmjp = f"train.eval_task_dirs=[{write_llmjp(tmp_path / 'llm-jp-eval', command_rows())}]"
    # A negative tolerance: every evaluation after the reference falls "below" it, whatever the scores.
    stderr = task_run(workspace, demo_task, run, "train.eval_tasks_tolerance=-1", llmjp)
    rows = task_rows(run)
    assert [r.step for r in rows] == [0, 2, 4]
    first = read_metrics(run / "metrics.jsonl")
    assert first.index(rows[0]) < min(i for i, r in enumerate(first) if isinstance(r, TrainRow))  # before step 1
    for row in rows:
        assert row.documents == {"manpage_section": LIMIT, "llmjp_jnli": TEST_DOCS, "llmjp_jsquad": TEST_DOCS,
                                 "llmjp_jcommonsenseqa": TEST_DOCS}
        assert set(row.scores["manpage_section"]) == {"acc", "acc_norm"}
        assert 0 <= row.scores["manpage_section"]["acc"] <= 1 and row.seconds > 0
        assert set(row.scores["llmjp_jnli"]) == {"exact_match", "out_of_label"}
        assert 0 <= row.scores["llmjp_jsquad"]["char_f1"] <= 1
    assert "tasks  step 0  manpage_section acc " in stderr and "(reference)" in stderr
    assert "llmjp_jsquad char_f1 " in stderr and "llmjp_jnli exact_match " in stderr
    warnings = [line for line in stderr.splitlines() if WARNING in line]
    assert len(warnings) == 2 and "at step 2," in warnings[0] and "at step 4," in warnings[1]
    assert all("at step 0 (worse by" in w for w in warnings)

    # Resume from step 2 (the step-4 checkpoint gone) with a tolerance no score can exceed: the reference comes
    # from the checkpoint (compared "vs step 0", not scored anew), no warning, and the same model gives the same
    # losses and scores at step 4.
    shutil.rmtree(run / "checkpoints" / f"global_step{STEPS}")
    losses = train_losses(run)
    stderr = task_run(workspace, demo_task, run, "train.eval_tasks_tolerance=1", llmjp)
    assert "resumed from" in stderr and "(reference)" not in stderr and WARNING not in stderr
    assert "tasks  step 4  manpage_section acc " in stderr and "vs step 0)" in stderr
    again = task_rows(run)
    assert [r.step for r in again] == [0, 2, 4, 4] and again[-1].scores == rows[-1].scores
    assert train_losses(run) == losses


ROLLING_TASK = """task: pages_ja
dataset_path: json
dataset_kwargs:
  data_files:
    test: pages.jsonl
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
- metric: bits_per_byte
  aggregation: bits_per_byte
  higher_is_better: false
"""


@pytest.mark.slow
def test_two_ranks_shard_the_documents_under_zero3(dataset_prefix: Path, workspace: Path, demo_task: Path,
                                                    tmp_path: Path) -> None:
    """Multiple choice and whole documents (loglikelihood_rolling, 5 documents: the ranks' shares differ, so one is
    padded to keep the forwards of ZeRO-3 in step)."""
    rows = (demo_task.parent / "test.tsv").read_text(encoding="utf-8").splitlines()[:5]
    (tmp_path / "pages.jsonl").write_text("".join(json.dumps({"text": r.split("\t")[0] * 8}, ensure_ascii=False)
                                                  + "\n" for r in rows), encoding="utf-8")
    rolling = tmp_path / "pages_ja.yaml"
    rolling.write_text(ROLLING_TASK, encoding="utf-8")
    run = tmp_path / "run"
    stderr = task_run(workspace, demo_task, run, "train.zero_stage=3", "train.eval_tasks_tolerance=1",
                      f"train.eval_task_yamls=[{demo_task},{rolling}]", ranks=2)
    rows = task_rows(run)
    assert [r.step for r in rows] == [0, 2, 4]
    # each rank's share gathered on rank 0
    assert all(r.documents == {"manpage_section": LIMIT, "pages_ja": 5} for r in rows)
    assert all(r.scores["pages_ja"]["bits_per_byte"] > 0 for r in rows)
    assert "pages_ja bits_per_byte " in stderr and "on 2 ranks)" in stderr


def test_the_tolerance_follows_the_direction_lm_eval_says_is_better() -> None:
    """Bits per byte (lower is better) warns when it rises past the tolerance; accuracy when it falls past it."""

    def scores(step: int, bpb: float, acc: float) -> Scores:
        return Scores(EvalTasksRow(step, {"text": {"bits_per_byte": bpb}, "mc": {"acc": acc, "acc_norm": 0.0}},
                                   {"text": 4, "mc": 8}, 0.5), {"text": "bits_per_byte", "mc": "acc"},
                      {"text": False, "mc": True})

    reference: dict = {}
    line, warnings = compare(scores(0, 1.0, 0.5), reference, 0.05, 2)
    assert warnings == [] and line.count("(reference)") == 2 and "4/8 documents per task" in line
    assert reference["text"] == {"metric": "bits_per_byte", "value": 1.0, "step": 0, "higher_is_better": False}
    assert compare(scores(2, 1.04, 0.46), reference, 0.05, 2)[1] == []  # worse, within the tolerance
    assert compare(scores(4, 0.2, 0.9), reference, 0.05, 2)[1] == []  # better
    line, warnings = compare(scores(6, 1.06, 0.44), reference, 0.05, 2)
    assert [w.split(":")[0] for w in warnings] == [f"task {t} fell below its reference" for t in ("text", "mc")]
    assert "worse by +0.0600" in warnings[0] and "worse by +0.0600" in warnings[1] and "(+0.0600 vs step 0)" in line
