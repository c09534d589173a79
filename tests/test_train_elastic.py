"""Elastic resume: a run saved by 2 ranks continues on 1 or 3 (a preempted job that comes back on another number
of machines) through DeepSpeed's universal checkpoint (ZeRO-0 loads natively), with the sample order and the
losses of the uninterrupted run. (Nodes without a shared disk: test_storage_multinode.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import QUICK_TRAIN, gptpipe_command, train_losses

from gptpipe.runtime.checkpoint import LATEST, STATE

STEPS = 5
SAVED = 3  # the step the resumed runs continue from
# A global batch that 1, 2 and 3 ranks split evenly.
ELASTIC_RUN = (*QUICK_TRAIN, "train.global_batch_size=6", f"train.train_iters={STEPS}", f"train.save_interval={SAVED}",
               "train.keep_checkpoints=2")


@pytest.fixture(scope="module")
def two_rank_runs(workspace: Path, dataset_prefix: Path, tmp_path_factory: pytest.TempPathFactory):
    """Factory: the folder of an uninterrupted 2-rank run of (zero_stage, precision), made once; read only."""
    made: dict[tuple[int, str], Path] = {}

    def make(zero_stage: int, precision: str) -> Path:
        if (zero_stage, precision) not in made:
            run = tmp_path_factory.mktemp(f"two-ranks-z{zero_stage}-{precision}")
            done = gptpipe_command("train", "--config", workspace / "config.yaml", *ELASTIC_RUN,
                                   f"train.zero_stage={zero_stage}", f"train.precision={precision}",
                                   f"train.output_model_dir={run}", ranks=2)
            assert done.returncode == 0, done.stderr[-3000:]
            made[zero_stage, precision] = run
        return made[zero_stage, precision]
    return make


@pytest.mark.parametrize("zero_stage,precision,ranks", [(2, "fp32", 1), (3, "fp32", 3), (1, "bf16", 1), (0, "bf16", 3)])
def test_a_two_rank_run_resumes_on_another_number_of_ranks(two_rank_runs, workspace: Path, tmp_path: Path,
                                                           zero_stage: int, precision: str, ranks: int) -> None:
    reference = two_rank_runs(zero_stage, precision)
    run = tmp_path / "run"  # the 2-rank run as preempted after step SAVED
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(reference / "checkpoints" / f"global_step{SAVED}", run / "checkpoints" / f"global_step{SAVED}")
    (run / "checkpoints" / LATEST).write_text(f"global_step{SAVED}")
    done = gptpipe_command("train", "--config", workspace / "config.yaml", *ELASTIC_RUN,
                           f"train.zero_stage={zero_stage}", f"train.precision={precision}",
                           f"train.output_model_dir={run}", ranks=ranks)
    assert done.returncode == 0, done.stderr[-3000:]
    # ZeRO-0 keeps the optimizer states whole in the model file, which DeepSpeed loads on any number of ranks
    converted = f"global_step{SAVED} was saved by 2 rank(s), this run has {ranks}: converted" in done.stderr
    assert converted == (zero_stage > 0), done.stderr[-3000:]
    assert not list((run / "checkpoints").glob("*universal*"))  # the copy (and DeepSpeed's pointer) go once loaded
    expected = {step: loss for step, loss in train_losses(reference).items() if step > SAVED}
    # Step 4's loss is the restored weights' (measured: equal to 1e-7); step 5's follows an update with the restored
    # optimizer moments (measured: 2e-5 apart at ZeRO-3 on 3 ranks, reduction order; 0.6% apart when a resume
    # drops the moments).
    assert train_losses(run) == pytest.approx(expected, rel=1e-4)
    final = json.loads((run / "checkpoints" / f"global_step{STEPS}" / STATE).read_text())
    want = json.loads((reference / "checkpoints" / f"global_step{STEPS}" / STATE).read_text())
    assert {k: final[k] for k in ("step", "consumed_samples")} == {k: want[k] for k in ("step", "consumed_samples")}
