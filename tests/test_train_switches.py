"""The engine switches meant for GPUs, run on CPU ranks through the real `gptpipe train`: ZeRO-0 in bf16, fp32
gradient accumulation in bf16, optimizer offload, activation checkpointing (ZeRO-1 and ZeRO-3), torch.compile
(aot_eager: no code generated, so no GPU and no compiler), the deterministic switch; and Liger's fused loss under
TRITON_INTERPRET=1 where triton and liger-kernel are installed."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY_RUN, TINY_STEPS, run_train, train_env, train_losses

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


LIGER_ON_CPU = """
import torch
from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

torch.manual_seed(0)
hidden = torch.randn(64, 32, requires_grad=True)
weight = torch.randn(500, 32, requires_grad=True)
labels = torch.randint(0, 500, (64,))
fused = LigerFusedLinearCrossEntropyLoss()(weight, hidden, labels)
fused.backward()
grads = hidden.grad.clone(), weight.grad.clone()
hidden.grad = weight.grad = None
plain = torch.nn.functional.cross_entropy(hidden @ weight.t(), labels)
plain.backward()
print(abs(fused.item() - plain.item()), (grads[0] - hidden.grad).abs().max().item(),
      (grads[1] - weight.grad).abs().max().item())
"""


def test_liger_fused_loss_matches_transformers_loss_under_the_triton_interpreter() -> None:
    """Liger's fused linear cross-entropy (the GPU runs' loss for llama and mixtral) against the plain loss, its
    Triton kernels interpreted on CPU (TRITON_INTERPRET=1)."""
    for module in ("triton", "liger_kernel"):
        try:
            __import__(module)
        except ImportError:
            pytest.skip(f"{module} is not installed in this environment (pip install liger-kernel triton): "
                        "Liger's fused loss is not checked on CPU")
    done = subprocess.run([sys.executable, "-c", LIGER_ON_CPU], env={**train_env(), "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    loss_diff, input_grad_diff, weight_grad_diff = map(float, done.stdout.split()[-3:])
    assert loss_diff < 1e-4 and input_grad_diff < 1e-4 and weight_grad_diff < 1e-4, done.stdout
