"""The engine switches meant for GPUs, run on CPU ranks through the real `gptpipe train`: ZeRO-0 in bf16, fp32
gradient accumulation in bf16, optimizer offload, activation checkpointing (ZeRO-1 and ZeRO-3), torch.compile
(aot_eager: no code generated, so no GPU and no compiler), the deterministic switch. Liger's kernels under Triton's
interpreter: test_gpu_path.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import TINY_RUN, TINY_STEPS, run_train, train_losses

SWITCHES = {
    "zero0-bf16": ("train.zero_stage=0", "train.precision=bf16"),
    "bf16-fp32-gradients-zero1": ("train.precision=bf16", "train.fp32_gradients=true"),
    "bf16-fp32-gradients-zero3": ("train.precision=bf16", "train.fp32_gradients=true", "train.zero_stage=3"),
    "offload": ("train.offload_optimizer=true",),
    "checkpointing-zero1": ("train.activation_checkpointing=true",),
    "checkpointing-zero3": ("train.activation_checkpointing=true", "train.zero_stage=3"),
    "compile-aot_eager": ("train.compile=true", "train.compile_backend=aot_eager"),
    "deterministic": ("train.deterministic=true",),
}
# fp32 switches that change nothing in the arithmetic of one CPU rank: the same losses as the plain run
SAME_LOSSES = {"offload", "checkpointing-zero1", "checkpointing-zero3", "compile-aot_eager", "deterministic"}


@pytest.mark.parametrize("switch", list(SWITCHES))
def test_gpu_switch_trains_on_cpu(switch: str, tiny_run, workspace: Path, tmp_path: Path) -> None:
    reference = train_losses(tiny_run())  # llama, fp32, ZeRO-1, no switch
    done = run_train("--config", workspace / "config.yaml", *TINY_RUN, *SWITCHES[switch],
                     f"train.output_model_dir={tmp_path}", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = train_losses(tmp_path)
    assert sorted(losses) == list(range(1, TINY_STEPS + 1)) and all(math.isfinite(v) for v in losses.values())
    if switch in SAME_LOSSES:
        assert losses == pytest.approx(reference, rel=1e-4), (losses, reference)
    else:  # bf16: the same run within bf16's rounding
        assert losses == pytest.approx(reference, rel=2e-2), (losses, reference)
    assert "not compiled" not in done.stderr


def test_document_masked_training_runs_compiled_and_says_so(dataset_prefix: Path, workspace: Path,
                                                           tmp_path: Path) -> None:
    """train.document_mask through the real `gptpipe train`, under torch.compile (aot_eager) too: the run
    trains, its losses differ from the one-mask run's (samples of 512 tokens hold several man pages, which no
    longer see each other), and the run record names the setting."""
    import json

    runs = {}
    for name, switches in (("plain", ()), ("masked", ("train.document_mask=true",
                                                      *SWITCHES["compile-aot_eager"]))):
        done = run_train("--config", workspace / "config.yaml", *TINY_RUN, "train.seq_len=512", *switches,
                         f"train.output_model_dir={tmp_path / name}", timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "not compiled" not in done.stderr
        runs[name] = train_losses(tmp_path / name)
    assert sorted(runs["masked"]) == list(range(1, TINY_STEPS + 1))
    assert all(math.isfinite(v) for v in runs["masked"].values())
    assert runs["masked"] != pytest.approx(runs["plain"], rel=1e-5)
    state = json.loads(next((tmp_path / "masked" / "checkpoints").glob("global_step*/gptpipe_state.json"))
                       .read_text())
    assert state["config"]["train"]["document_mask"] is True
