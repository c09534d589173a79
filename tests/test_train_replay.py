"""Stage 3 on a blend of two sources (continued pretraining's new corpus and replay of the old language): the
mixture printed and recorded in tokens and shares, each source's validation loss from step 0, and an exact
resume after SIGKILL."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from conftest import QUICK_TRAIN, metrics, run_cli, run_train, start_train, train_losses, wait_for_step

from gptpipe.runtime.checkpoint import complete_checkpoints
from gptpipe.runtime.metrics_rows import MixtureRow, ValidationRow

STEPS, BATCH, EVAL_ITERS = 8, 8, 2  # QUICK_TRAIN's global batch
WEIGHTS = (3, 1)


@pytest.fixture(scope="module")
def english_prefix(dataset_prefix: Path, workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second source, tokenized by stage 2 with the same tokenizer: the Python standard library's modules
    (English docstrings and code), one document per file."""
    folder = tmp_path_factory.mktemp("english")
    stdlib = sorted(Path(os.__file__).parent.glob("*.py"))
    assert len(stdlib) > 150
    with open(folder / "english.jsonl", "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps({"text": p.read_text(encoding="utf-8", errors="replace")}) + "\n" for p in stdlib)
    run_cli("tokenize", "--config", workspace / "config.yaml", f"tokenize.input=[{folder / 'english.jsonl'}]",
            f"tokenize.output_prefix={folder / 'en'}")
    return folder / "en_text_document"


def blended(dataset_prefix: Path, english_prefix: Path) -> tuple[str, ...]:
    # 90,9,1: the small English source still puts a full sample into each split
    return (*QUICK_TRAIN, f"data.prefixes=[{dataset_prefix},{english_prefix}]",
            f"data.weights=[{WEIGHTS[0]},{WEIGHTS[1]}]", "data.split=90,9,1", f"train.train_iters={STEPS}",
            "train.save_interval=2", "train.eval_interval=2", f"train.eval_iters={EVAL_ITERS}")


def validation_rows(run: Path) -> dict[int, ValidationRow]:
    """Each evaluated step's validation figures; a step evaluated twice (a resume) must repeat them exactly."""
    seen: dict[int, ValidationRow] = {}
    for row in metrics(run, ValidationRow):
        assert seen.setdefault(row.step, row) == row, f"step {row.step} differs"
    return seen


@pytest.fixture(scope="module")
def blended_run(dataset_prefix: Path, english_prefix: Path, workspace: Path,
                tmp_path_factory: pytest.TempPathFactory):
    run = tmp_path_factory.mktemp("blended")
    done = run_train("--config", workspace / "config.yaml", *blended(dataset_prefix, english_prefix),
                     f"train.output_model_dir={run}")
    assert done.returncode == 0, done.stderr[-3000:]
    return run, done.stderr


def test_mixture_is_printed_and_recorded_in_tokens_and_shares(blended_run) -> None:
    run, stderr = blended_run
    share = WEIGHTS[0] / sum(WEIGHTS)
    # The plan's expectation from the weights, then megatron's blend index over the samples the run reads.
    assert f"ja: {round(STEPS * BATCH * share) * 64:,} tokens ({share:.1%})" in stderr
    assert "data.weights as given, normalised" in stderr
    assert "data mixture of the run (megatron's blend index):" in stderr
    (row,) = metrics(run, MixtureRow)
    mixture = row.mixture
    assert list(mixture) == ["ja", "en"] and row.step == 0
    assert sum(m["tokens"] for m in mixture.values()) == STEPS * BATCH * 64
    assert abs(mixture["ja"]["share"] - share) <= 1 / (STEPS * BATCH)
    assert f"  ja: {mixture['ja']['tokens']:,} tokens ({mixture['ja']['share']:.1%})" in stderr
    assert 0 < mixture["en"]["epochs"]
    # The validation budget of eval_iters global batches, shared by the sources as the blend draws them.
    eval_samples = EVAL_ITERS * BATCH
    assert row.validation_samples == {"ja": eval_samples * WEIGHTS[0] // sum(WEIGHTS),
                                       "en": eval_samples * WEIGHTS[1] // sum(WEIGHTS)}
    assert "validation samples per source: ja 12, en 4" in stderr


def test_each_source_has_its_validation_loss_from_step_0(blended_run) -> None:
    run, stderr = blended_run
    rows = validation_rows(run)
    assert sorted(rows) == [0, 2, 4, 6, 8]  # one before the first step, then every eval_interval
    for step, row in rows.items():
        ja, en = row.per_source["ja"], row.per_source["en"]
        assert ja != en
        # The overall loss is the blend's, over the same samples: between its sources', nearer the larger one.
        assert min(ja, en) < row.val_loss < max(ja, en)
        assert abs(row.val_loss - ja) < abs(row.val_loss - en)
        assert f"validation  step {step}  loss {row.val_loss:.4f}  (ja {ja:.4f}, en {en:.4f})" in stderr
    assert all(rows[STEPS].per_source[name] < rows[0].per_source[name] for name in ("ja", "en"))


def test_sigkilled_blended_run_resumes_with_identical_losses(blended_run, dataset_prefix: Path,
                                                             english_prefix: Path, workspace: Path,
                                                             tmp_path: Path) -> None:
    reference, _ = blended_run
    killed = tmp_path / "killed"
    overrides = [o for o in blended(dataset_prefix, english_prefix) if o not in QUICK_TRAIN]
    process = start_train(workspace / "config.yaml", *overrides, f"train.output_model_dir={killed}")
    wait_for_step(killed, 3, process)
    process.send_signal(signal.SIGKILL)
    process.wait()
    saved = [step for step, _ in complete_checkpoints(killed / "checkpoints")]
    assert saved and max(saved) < STEPS

    resumed = run_train("--config", workspace / "config.yaml", *blended(dataset_prefix, english_prefix),
                        f"train.output_model_dir={killed}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {killed / 'checkpoints'}/global_step{max(saved)}" in resumed.stderr
    assert train_losses(killed) == train_losses(reference)
    assert validation_rows(killed) == validation_rows(reference)


@pytest.mark.ranks
def test_two_zero3_ranks_evaluate_each_source_as_one_rank_does(blended_run, dataset_prefix: Path,
                                                               english_prefix: Path, workspace: Path,
                                                               tmp_path: Path) -> None:
    """Each rank takes its share of every source's validation samples and runs as many forward passes as the
    other (ZeRO-3 gathers weights in step): the figures are the one-rank run's."""
    reference, _ = blended_run
    run = tmp_path / "run"
    done = run_train("--config", workspace / "config.yaml", *blended(dataset_prefix, english_prefix),
                     "train.zero_stage=3", f"train.output_model_dir={run}", ranks=2)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = validation_rows(reference)
    got = validation_rows(run)
    assert sorted(got) == sorted(expected)
    for step, row in expected.items():  # the figures as logged: the overall and each source's val_loss, val_ppl
        figures = {k: v for k, v in row.to_json().items() if k.startswith("val_")}
        assert {k: v for k, v in got[step].to_json().items() if k.startswith("val_")} == pytest.approx(
            figures, rel=1e-4), step
