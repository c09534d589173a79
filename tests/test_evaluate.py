"""`gptpipe evaluate`: lm-evaluation-harness on the exported demo model, offline on the man-page task."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from conftest import REPO, run_cli
from gptpipe.cli import main
from gptpipe.stage import Manifest

pytest.importorskip("lm_eval", reason="needs lm-eval (pip install 'lm-eval[hf]')")

TEST_FRACTION = 0.05


@pytest.fixture(scope="module")
def eval_workspace(exported_model: Path, workspace: Path) -> Path:
    """The session workspace (stage 4's models/hf/demo beside convert_config.yaml) plus the demo task, with 5%
    of each section's pages in its test split (83 documents, not the shipped 166): the zero-shot run scores the
    whole split, and each document costs one forward pass per label."""
    shutil.copy(REPO / "evaluate_config.yaml", workspace / "evaluate_config.yaml")
    run_cli("make-demo-task", "--config", workspace / "evaluate_config.yaml",
            f"demo_task.test_fraction={TEST_FRACTION}")
    return workspace


@pytest.mark.slow
def test_zero_shot_on_the_demo_task_writes_accuracy_and_stderr(eval_workspace: Path, tmp_path: Path) -> None:
    config = eval_workspace / "evaluate_config.yaml"
    out = tmp_path / "evaluation"
    run_cli("evaluate", "--config", config, f"output_dir={out}")  # model: stage 4's exported folder (model_dir)

    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert results["model"] == str(eval_workspace / "models" / "hf" / "demo")
    task = results["tasks"]["manpage_section"]
    assert task["n_shot"] == 0
    test_rows = (eval_workspace / "data/finetune/manpage_section/test.tsv").read_text(encoding="utf-8").splitlines()
    assert task["samples"] == len(test_rows) > 50  # the whole test split: no limit unless one is set
    for metric in ("acc", "acc_norm"):
        value, stderr = task["metrics"][metric]["value"], task["metrics"][metric]["stderr"]
        assert 0 <= value <= 1
        # the standard error of a mean of 0/1 outcomes over n documents
        assert stderr == pytest.approx((value * (1 - value) / (len(test_rows) - 1)) ** 0.5, rel=1e-6)
    labels = Counter(row.split("\t")[1] for row in test_rows)
    assert task["majority_baseline"] == pytest.approx(max(labels.values()) / len(test_rows))
    table = (out / "results.md").read_text(encoding="utf-8")
    assert "| manpage_section | 0 | acc | " in table and "majority baseline" in table
    manifest = Manifest.read(out / "manifest.json")
    assert set(manifest.outputs) == {"results.json", "results.md"} and manifest.versions["lm_eval"] != "not installed"

    # Same model, task and settings: nothing to redo.
    before = (out / "results.json").stat().st_mtime_ns
    run_cli("evaluate", "--config", config, f"output_dir={out}")
    assert (out / "results.json").stat().st_mtime_ns == before


@pytest.mark.slow
def test_few_shot_from_a_local_task_yaml_elsewhere(eval_workspace: Path, tmp_path: Path) -> None:
    """A task YAML is read with its data_files relative to its own folder, from any current directory."""
    task_dir = tmp_path / "my_task"
    shutil.copytree(eval_workspace / "data/finetune/manpage_section", task_dir)
    out = tmp_path / "evaluation"
    run_cli("evaluate", "--config", eval_workspace / "evaluate_config.yaml", "tasks=[]",
            f"task_yamls=[{task_dir / 'manpage_section.yaml'}]", "num_fewshot=2", "limit=12", f"output_dir={out}")
    task = json.loads((out / "results.json").read_text(encoding="utf-8"))["tasks"]["manpage_section"]
    assert task["n_shot"] == 2 and task["samples"] == 12
    assert 0 <= task["metrics"]["acc"]["value"] <= 1


def test_missing_demo_task_or_model_says_what_to_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = REPO / "evaluate_config.yaml"
    assert main(["evaluate", "--config", str(config), f"model_dir={tmp_path}"]) == 2
    assert "gptpipe convert" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert main(["evaluate", "--config", str(config), f"model_dir={tmp_path}",
                 f"demo_task.output_dir={tmp_path / 'nothing'}"]) == 2
    assert "gptpipe make-demo-task" in capsys.readouterr().err
    assert not (tmp_path / "evaluation").exists()


@pytest.mark.slow  # lm-eval indexes its ~10,000 registry YAMLs before it can look a name up
def test_hub_task_without_network_says_so(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")  # the task fails before any model is loaded
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "gptpipe", "evaluate", "--config", str(REPO / "evaluate_config.yaml"),
                           f"model_dir={tmp_path}", "tasks=[arc_easy]"], check=False, env=env, capture_output=True,
                          text=True,
                          timeout=600)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "task arc_easy: its dataset is hosted on the HuggingFace hub and HF_HUB_OFFLINE" in done.stderr
    assert "tasks=[manpage_section]" in done.stderr
    assert not (tmp_path / "evaluation").exists()
