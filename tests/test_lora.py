"""Stage 7 with LoRA (train.lora): only the adapters train and are saved, a killed run resumes exactly, and the
export merges them into the base weights, or writes the adapter folder peft and vLLM load, through the same gate,
predicting what the checkpoint predicts; the base the adapters were trained on is checked by its files."""

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
from gptpipe.stage import StageInputError
from gptpipe.runtime.checkpoint import complete_checkpoints, consolidate, find_checkpoint, model_from_checkpoint
from gptpipe.runtime.lora import ADAPTER_MARK, lora_record
from gptpipe.runtime.memory import model_state_bytes

LORA = ("train.lora.rank=4", "train.lora.alpha=8", "train.lora.dropout=0")
RUN = ("train.global_batch_size=8", "train.train_iters=6", "train.eval_interval=3", "train.save_interval=3",
       "train.best_metric=val_loss", "baseline.classical=false", "train.lr=1e-2")


def checkpoint_bytes(run: Path) -> int:
    _, folder = complete_checkpoints(run / "checkpoints")[-1]
    return sum(f.stat().st_size for f in folder.glob("*.pt"))


def convert(workspace: Path, run: Path, out: Path, *overrides: str) -> int:
    return main(["convert", "--config", str(workspace / "convert_config.yaml"), f"input_model_dir={run}",
                 f"output_tokenizer_and_model_dir={out}", "dtype=fp32", "huggingface_name=lora-test", *overrides])


def check_adapter_folder(out: Path, base: Path) -> dict:
    """An adapter export: peft's two files (no merged weights) on `base`, verified, the manifest and the card
    saying so; its manifest counts."""
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert not (out / "model.safetensors").exists() and not (out / "config.json").exists()
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base.resolve())
    found = counts(out)
    assert found["verified"] is True, found["failures"]
    assert found["lora"]["export"] == "adapter" and found["lora"]["base"]["path"] == str(base.resolve())
    assert set(found["lora"]["base"]["files"]) >= {"config.json", "model.safetensors"}
    card = (out / "README.md").read_text()
    assert "## LoRA" in card and "holds the adapters only" in card and "library_name: peft" in card
    return found


@pytest.mark.slow
def test_lora_finetune_trains_adapters_only_and_exports_merged_through_the_gate(
        tiny_lm: Path, task_files: tuple[Path, Path], workspace: Path, tmp_path: Path) -> None:
    import shutil

    base_dir = shutil.copytree(tiny_lm, tmp_path / "base")  # changed at the end
    run = tmp_path / "lora"
    args = finetune_args(base_dir, task_files, run, *RUN, *LORA)
    done = gptpipe_command("finetune", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LoRA: " in done.stderr and "parameters trained" in done.stderr and "per rank" in done.stderr
    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert f"LoRA adapters on {', '.join(projections)} (the default for model_type llama)" in done.stderr
    losses = train_losses(run)
    assert losses[max(losses)] < losses[min(losses)]  # it learns
    task = json.loads((run / "task.json").read_text())
    recorded = task["lora"].pop("base")
    assert task["lora"] == {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": projections,
                            "targets_from": "the default for model_type llama"}
    assert recorded["folder"] == str(base_dir) and set(recorded["files"]) >= {"config.json", "model.safetensors"}

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
    assert convert(workspace, run, out) == 0
    assert counts(out)["verified"] is True and counts(out)["lora"]["export"] == "merged"
    assert "## LoRA" in (out / "README.md").read_text()
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

    # The adapter folder, in bf16: peft on the base gives the checkpoint's logits (the gate), and the model it
    # loads is the checkpoint's, adapters apart.
    adapter_out = tmp_path / "adapter"
    assert convert(workspace, run, adapter_out, "lora_export=adapter", "dtype=bf16") == 0
    assert check_adapter_folder(adapter_out, base_dir)["dtype"] == "bf16"

    # A changed base is refused by name: the adapters were trained on the files the run recorded.
    with (base_dir / "config.json").open("a") as changed:
        changed.write("\n")
    with pytest.raises(StageInputError, match=r"config\.json changed"):
        model_from_checkpoint(checkpoint, state, merge=False)


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
    """A short run of each other kind: adapters only in the checkpoint, the merged export and the adapter folder
    verified (a preference run's reference is its starting model's log-probabilities, stored before the first
    step: the adapters start as a no-op, so it is the base's)."""
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
    assert convert(workspace, run, out) == 0
    assert counts(out)["verified"] is True
    base = Path(json.loads((run / "task.json").read_text())["pretrained_model"])
    assert convert(workspace, run, tmp_path / "adapter", "lora_export=adapter") == 0
    check_adapter_folder(tmp_path / "adapter", base)


def test_lora_targets_default_by_model_type(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    record = lora_record({"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": None}, tmp_path)
    assert record["target_modules"] == ["c_attn", "c_proj", "c_fc"]
    assert record["targets_from"] == "the default for model_type gpt2" and "config.json" in record["base"]["files"]
    named = lora_record({"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["c_attn"]}, tmp_path)
    assert (named["target_modules"], named["targets_from"]) == (["c_attn"], "train.lora.target_modules")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(StageInputError, match=r"'bert' model, which has no default.*train\.lora\.target_modules"):
        lora_record({"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": None}, tmp_path)


def test_lora_memory_counts_gradients_and_optimizer_state_of_the_adapters_only() -> None:
    # bf16 at ZeRO-1 over 2 ranks: 2-byte weights everywhere, bf16 gradients and 12 bytes of AdamW state (m, v and
    # the fp32 master copy) per trained weight, the state divided over the ranks.
    assert model_state_bytes(1000, 10, "bf16", 2, 1, False, False) == (2000, 20, 60)
    assert model_state_bytes(1000, 1000, "bf16", 2, 1, False, False) == (2000, 2000, 6000)


def test_lora_settings_are_checked(tmp_path: Path) -> None:
    for override, key in (("train.lora.rank=-1", "train.lora.rank"), ("train.lora.dropout=1", "train.lora.dropout"),
                          ("train.lora.ranks=4", "train.lora.ranks"),
                          ("train.lora.target_modules=[]", "train.lora.target_modules")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(FinetuneConfig, None, [override])
    with pytest.raises(ConfigError, match="baseline.model"):
        load_config(FinetuneConfig, None, ["train.lora.rank=4", "baseline.model=scratch"])


@pytest.mark.ranks
def test_a_two_rank_zero3_lora_finetune_exports_through_the_gate(tiny_lm: Path, task_files: tuple[Path, Path],
                                                                 workspace: Path, tmp_path: Path) -> None:
    """ZeRO-3 partitions the frozen base over the ranks too: the checkpoint still holds the adapters only, and
    zero_to_fp32 gathers them into the export, which the gate verifies."""
    run = tmp_path / "run"
    done = gptpipe_command("finetune", *finetune_args(tiny_lm, task_files, run, *LORA, "train.global_batch_size=8",
                                                      "train.train_iters=2", "train.eval_interval=1000",
                                                      "train.zero_stage=3", "baseline.classical=false"), ranks=2)
    assert done.returncode == 0, done.stderr[-3000:]
    state = consolidate(find_checkpoint(run))
    assert state and all(ADAPTER_MARK in name for name in state)
    assert convert(workspace, run, tmp_path / "export") == 0
    assert counts(tmp_path / "export")["verified"] is True
