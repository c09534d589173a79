"""The CUDA path's decisions, checked on CPU (bench/gpu_check.sh runs them on a GPU): DeepSpeed never synchronizes
the device in a training step (its throughput timer is off), Liger's kernels against transformers' for every model
type they patch (Triton's interpreter), the import that decides whether Liger runs, the fp32 sum of lm_head's
gradient under the fused loss, and torch.compile's fallback beside Liger."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, train_env

from gptpipe.train.config import TrainConfig
from gptpipe.runtime.devices import LIGER_ARCHS, liger_missing, loss_path
from gptpipe.runtime.engine import deepspeed_config, fused_loss_kwargs, uncompiled_because

COUNTED_STEPS = """
import json
from functools import partial
from types import SimpleNamespace

import torch
from deepspeed.accelerator import get_accelerator

from gptpipe.runtime.config import ModelConfig
from gptpipe.runtime.engine import build_engine, deepspeed_config, forward_loss, setup_distributed, train_step
from gptpipe.runtime.model import build_model_config
from gptpipe.train.config import TrainConfig
from gptpipe.runtime.schedule import Schedule


class Go:
    def agreed(self):
        return False


dist = setup_distributed()
accelerator, calls = get_accelerator(), [0]
synchronize = accelerator.synchronize


def counted(*args, **kwargs):
    calls[0] += 1
    return synchronize(*args, **kwargs)


accelerator.synchronize = counted
train = TrainConfig(precision="bf16", global_batch_size=4, micro_batch_size=2)
train.resolve_schedule(continued=False)
config = build_model_config(ModelConfig(preset="tiny"), SimpleNamespace(vocab_size=1000, bos_id=1, eos_id=2, pad_id=3),
                            32)
tokens = torch.randint(0, 1000, (2, 33))
batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
counts = {}
for name, timers in (("gptpipe", None), ("deepspeed's default", {})):
    ds_config, _ = deepspeed_config(train, 2, 2, 1, on_gpu=False)
    if timers is not None:
        ds_config["timers"] = timers  # DeepSpeed's own default: the throughput timer on, synchronized
    engine, loss_kwargs = build_engine(train, "llama", config, ds_config, Schedule.for_run(train, 10), dist.device)
    calls[0] = 0
    for _ in range(4):  # two micro-batches each
        train_step(engine, [batch, batch], Go(), partial(forward_loss, **loss_kwargs))
    counts[name] = calls[0]
print(json.dumps(counts))
"""


@pytest.mark.slow  # two DeepSpeed engines in a subprocess: ~30 s on 2 cores
def test_a_training_step_never_synchronizes_the_device() -> None:
    """DeepSpeed's throughput timer synchronized the device in every forward and step() (no dataloader is handed
    to it): two full syncs per micro-batch on GPUs. The counter is DeepSpeed's accelerator, which the CPU run uses
    too; with DeepSpeed's default the same steps synchronize, so the count can fail."""
    done = subprocess.run([sys.executable, "-c", COUNTED_STEPS], env=train_env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts["gptpipe"] == 0, counts
    assert counts["deepspeed's default"] >= 4, counts  # from its 3rd step on: 2 per micro-batch


def test_the_throughput_timer_is_off_unless_a_template_sets_it(tmp_path: Path) -> None:
    shipped, _ = deepspeed_config(TrainConfig(), 2, 1, 1, on_gpu=True)
    assert shipped["timers"] == {"throughput": {"enabled": False, "synchronized": False}}
    template = json.loads((REPO / "original_codes" / "ds_config_gpt_TEMPLATE.json").read_text(encoding="utf-8"))
    del template["timers"]  # a template written for the original pipeline has no timers block
    (tmp_path / "old.json").write_text(json.dumps(template), encoding="utf-8")
    old, _ = deepspeed_config(TrainConfig(ds_config_template=tmp_path / "old.json"), 2, 1, 1, on_gpu=True)
    assert old["timers"]["throughput"]["enabled"] is False
    template["timers"] = {"throughput": {"enabled": True, "synchronized": False}}
    (tmp_path / "own.json").write_text(json.dumps(template), encoding="utf-8")
    own, _ = deepspeed_config(TrainConfig(ds_config_template=tmp_path / "own.json"), 2, 1, 1, on_gpu=True)
    assert own["timers"]["throughput"]["enabled"] is True  # a user's own choice stays


def test_the_fused_loss_sums_lm_head_gradients_in_fp32_with_fp32_gradients() -> None:
    """Liger accumulated lm_head's gradient over its token chunks in bf16 (one rounding per chunk), against
    train.fp32_gradients."""
    assert fused_loss_kwargs(TrainConfig(precision="bf16", zero_stage=1)) == {"skip_logits": True,
                                                                             "accum_dtype": torch.float32}
    for train in (TrainConfig(precision="bf16", zero_stage=1, fp32_gradients=False),
                  TrainConfig(precision="bf16", zero_stage=0)):  # bf16 gradients: Liger's bf16 sum matches them
        assert fused_loss_kwargs(train) == {"skip_logits": True}


def test_liger_runs_only_where_the_import_it_uses_works(monkeypatch: pytest.MonkeyPatch) -> None:
    """`import liger_kernel` can work where `liger_kernel.transformers` (what apply_liger imports) raises, under a
    transformers it does not know: the plan said "fused" and the engine crashed."""
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)  # its import now fails
    reason = liger_missing("llama")
    assert reason and ("liger_kernel.transformers" in reason or "liger_kernel is not installed" in reason), reason
    path = loss_path("llama", on_gpu=True, liger_kernels=True)
    assert not path.fused and reason in path.why, path


def test_compile_leaves_liger_runs_uncompiled_and_says_why() -> None:
    compiled = TrainConfig(compile=True)
    assert "Liger" in uncompiled_because(compiled, on_gpu=True, liger=True)
    assert "CUDA only" in uncompiled_because(compiled, on_gpu=False, liger=False)
    assert uncompiled_because(TrainConfig(compile=True, compile_backend="aot_eager"), on_gpu=False, liger=False) is None


@pytest.mark.slow  # every patched type's model twice, the kernels interpreted: ~30 s on 2 cores
def test_liger_matches_transformers_for_every_type_it_patches() -> None:
    """Liger's kernels (RMSNorm, RoPE, SwiGLU/GeGLU, the fused linear cross-entropy, mixtral's router loss beside
    it) against transformers' eager model on the same weights and batch, as training applies and calls them,
    their Triton kernels interpreted on CPU (TRITON_INTERPRET=1): loss and every gradient within 1e-4."""
    missing = [m for m in ("triton", "liger_kernel") if not _installed(m)]
    if missing:
        message = f"{', '.join(missing)} not installed (the [gpu] extra): Liger's kernels are not checked on CPU"
        if os.environ.get("CI"):
            pytest.fail(message + "; CI's set-up installs them")
        pytest.skip(message)
    done = subprocess.run([sys.executable, str(REPO / "bench" / "bench_liger.py"), "--device", "cpu", "--precision",
                           "fp32", "--json", "--seq", "32"], env={**train_env(), "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=900)
    rows = {row["arch"]: row for row in map(json.loads, (line for line in done.stdout.splitlines()
                                                          if line.startswith("{")))}
    assert sorted(rows) == sorted(LIGER_ARCHS), done.stderr[-3000:]
    for row in rows.values():
        assert row["fused_loss"] and row["ok"], row  # no logits came out: Liger's loss ran
        assert row["loss_rel"] < 1e-4 and row["grad_rel"] < 1e-4, row
    assert "LigerSwiGLUMLP" in rows["llama"]["kernels"] and "LigerGEGLUMLP" in rows["gemma2"]["kernels"]
    assert done.returncode == 0, done.stderr[-3000:]


def _installed(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True
