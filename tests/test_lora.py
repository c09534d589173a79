"""Stage 7 with LoRA (train.lora): only the adapters train and are saved, a killed run resumes exactly, and the
export merges them into the base weights through the same gate, predicting what the checkpoint predicts."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from prewarmed import Forked
from conftest import chat_args, finetune_args, gptpipe_command, train_env, train_losses, wait_for_step
from conftest import manifest_counts as counts
from test_preference import pair_args, pair_files, pair_lm, pair_rows  # noqa: F401 (its fixtures)

from gptpipe.cli import main
from gptpipe.config.core import ConfigError, load_config
from gptpipe.finetune.config import FinetuneConfig
from gptpipe.train.checkpoint import complete_checkpoints, consolidate, find_checkpoint, model_from_checkpoint
from gptpipe.train.lora import ADAPTER_MARK

LORA = ("train.lora.rank=4", "train.lora.alpha=8", "train.lora.dropout=0")
RUN = ("train.global_batch_size=8", "train.train_iters=6", "train.eval_interval=3", "train.save_interval=3",
       "train.best_metric=val_loss", "baseline.classical=false", "train.lr=1e-2")


def checkpoint_bytes(run: Path) -> int:
    _, folder = complete_checkpoints(run / "checkpoints")[-1]
    return sum(f.stat().st_size for f in folder.glob("*.pt"))


@pytest.mark.slow
def test_lora_finetune_trains_adapters_only_and_exports_merged_through_the_gate(
        tiny_lm: Path, task_files: tuple[Path, Path], workspace: Path, tmp_path: Path) -> None:
    run = tmp_path / "lora"
    args = finetune_args(tiny_lm, task_files, run, *RUN, *LORA)
    done = gptpipe_command("finetune", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LoRA: " in done.stderr and "parameters trained" in done.stderr
    losses = train_losses(run)
    assert losses[max(losses)] < losses[min(losses)]  # it learns
    task = json.loads((run / "task.json").read_text())
    assert task["lora"] == {"rank": 4, "alpha": 8.0, "dropout": 0.0,
                            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"]}

    # The checkpoint holds the adapters only, each moved from peft's start (lora_B starts at zero).
    checkpoint = find_checkpoint(run)
    state = consolidate(checkpoint)
    assert state and all(ADAPTER_MARK in name for name in state)
    assert checkpoint_bytes(run) < (tiny_lm / "model.safetensors").stat().st_size / 4  # optimizer state included
    assert any(name.endswith("lora_B.default.weight") and t.abs().max() > 0 for name, t in state.items())

    # Rebuilt as base + adapters, the frozen weights are the pretrained ones, bit for bit.
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_lm, dtype=torch.float32).state_dict()
    adapted = model_from_checkpoint(checkpoint, state, merge=False)
    frozen = {n.removeprefix("base_model.model.").replace(".base_layer", ""): t
              for n, t in adapted.state_dict().items() if ADAPTER_MARK not in n}
    assert set(base) <= set(frozen) and all(torch.equal(base[n], frozen[n]) for n in base)

    # Export: merged into plain weights, verified against the checkpoint's model; predicts as the checkpoint does
    # (predict keeps the adapters apart, so this checks the merge too).
    out = tmp_path / "export"
    assert main(["convert", "--config", str(workspace / "convert_config.yaml"), f"input_model_dir={run}",
                 f"output_tokenizer_and_model_dir={out}", "dtype=fp32", "huggingface_name=lora-test"]) == 0
    assert counts(out)["verified"] is True
    assert not any(ADAPTER_MARK in n for n in AutoModelForCausalLM.from_pretrained(out).state_dict())
    predictions = {}
    for name, model in (("run", run), ("export", out)):
        predicted = tmp_path / f"{name}.jsonl"
        answered = gptpipe_command("predict", "--input", task_files[1], "--output", predicted, *args,
                                   f"predict.model={model}")
        assert answered.returncode == 0, answered.stderr[-3000:]
        predictions[name] = [json.loads(line) for line in predicted.read_text().splitlines()]
    assert len(predictions["run"]) == 12
    for merged, adapted in zip(predictions["export"], predictions["run"]):  # W + BA rounds apart from Wx + BAx
        assert merged == {**adapted, "score": pytest.approx(adapted["score"], abs=1e-4)}


@pytest.mark.slow
def test_a_killed_lora_finetune_resumes_with_identical_losses(tiny_lm: Path, task_files: tuple[Path, Path],
                                                              tmp_path: Path) -> None:
    """The checkpoint leaves the frozen base out: the resumed engine takes it from model.path again."""
    common = ("train.global_batch_size=8", "train.micro_batch_size=4", "train.train_iters=6", "train.save_interval=2",
              "train.eval_interval=1000", "baseline.classical=false", *LORA, "train.lora.dropout=0.1")
    full = gptpipe_command("finetune", *finetune_args(tiny_lm, task_files, tmp_path / "full", *common))
    assert full.returncode == 0, full.stderr[-3000:]
    killed = tmp_path / "killed"
    process = Forked(["finetune", *finetune_args(tiny_lm, task_files, killed, *common)], train_env())
    wait_for_step(killed, 3, process, timeout=600)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert max(step for step, _ in complete_checkpoints(killed / "checkpoints")) < 6
    resumed = gptpipe_command("finetune", *finetune_args(tiny_lm, task_files, killed, *common))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    assert train_losses(killed) == train_losses(tmp_path / "full")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["chat", "preference", "seq2seq-generation"])
def test_every_kind_trains_adapters_and_exports_merged_through_the_gate(
        kind: str, tiny_lm: Path, tiny_t5: Path, task_files: tuple[Path, Path], chat_files: tuple[Path, Path],
        workspace: Path, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """A short run of each other kind: adapters only in the checkpoint, the merged export verified (a preference
    run's reference is its starting model's log-probabilities, stored before the first step: the adapters start
    as a no-op, so it is the base's)."""
    run = tmp_path / "run"
    short = (*LORA, "train.train_iters=4", "train.eval_interval=2", "train.save_interval=2")
    if kind == "chat":
        args = chat_args(tiny_lm, chat_files, run, *short)
    elif kind == "preference":
        args = pair_args(request.getfixturevalue("pair_lm"), request.getfixturevalue("pair_files"), run, *short)
    else:
        args = finetune_args(tiny_t5, task_files, run, *short, "train.lora.target_modules=[q,v]",
                             "task.kind=generation", "train.seq_len=64", "train.global_batch_size=8",
                             "baseline.classical=false")
    done = gptpipe_command("finetune", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert all(ADAPTER_MARK in name for name in consolidate(find_checkpoint(run)))
    out = tmp_path / "export"
    assert main(["convert", "--config", str(workspace / "convert_config.yaml"), f"input_model_dir={run}",
                 f"output_tokenizer_and_model_dir={out}", "dtype=fp32", "huggingface_name=lora-test"]) == 0
    assert counts(out)["verified"] is True


def test_lora_settings_are_checked(tmp_path: Path) -> None:
    for override, key in (("train.lora.rank=-1", "train.lora.rank"), ("train.lora.dropout=1", "train.lora.dropout"),
                          ("train.lora.ranks=4", "train.lora.ranks")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(FinetuneConfig, None, [override])
    with pytest.raises(ConfigError, match="baseline.model"):
        load_config(FinetuneConfig, None, ["train.lora.rank=4", "baseline.model=scratch"])
