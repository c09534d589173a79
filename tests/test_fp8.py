"""train.precision fp8 (runtime/fp8.py): the keys, the refusals, which linears of the real presets convert, the
float8 model's numerics against the bf16 one on the man pages (torchao's Float8Linear runs on CPU through
torch._scaled_mm, slowly: the model here is small), and the plan's fp8 rows. The speed is a GPU's question:
bench/gpu_check.sh."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import REPO, run_train

from gptpipe.config.core import ConfigError, load_config
from gptpipe.finetune.config import FinetuneConfig
from gptpipe.pipeline import PipelineConfig
from gptpipe.runtime import fp8
from gptpipe.runtime.config import ModelConfig
from gptpipe.runtime.engine import deepspeed_config
from gptpipe.runtime.memory import fp8_cast_bytes
from gptpipe.runtime.model import build_model, build_model_config, lm_forward

TOKENIZER = SimpleNamespace(vocab_size=32000, bos_id=1, eos_id=2, pad_id=3)


def _problems(config_class: type, yaml: Path, *overrides: str) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(config_class, yaml, list(overrides))
    return str(caught.value)


def test_fp8_keys_parse_and_what_cannot_work_is_refused_by_key() -> None:
    config = load_config(PipelineConfig, REPO / "config.yaml", ["train.precision=fp8", "train.fp8_recipe=rowwise"])
    assert (config.train.precision, config.train.fp8_recipe, config.train.engine_precision) == ("fp8", "rowwise",
                                                                                                  "bf16")
    assert load_config(PipelineConfig, REPO / "config.yaml", ["train.precision=fp8"]).train.fp8_recipe == "tensorwise"
    err = _problems(PipelineConfig, REPO / "config.yaml", "train.precision=fp8", "train.fp8_recipe=rowwize")
    assert "train.fp8_recipe" in err and "did you mean 'rowwise'?" in err, err
    err = _problems(PipelineConfig, REPO / "config.yaml", "train.precision=fp8", "train.zero_stage=3",
                    "train.seq_len=100")
    assert "train.precision: fp8 with zero_stage 3 is not supported" in err, err
    assert "train.seq_len: 100: precision fp8 needs a multiple of 16" in err, err
    err = _problems(FinetuneConfig, REPO / "finetune_config.yaml", "train.precision=fp8")
    assert "train.precision: fp8 is for pretraining (gptpipe train) only" in err, err
    # The engine is a bf16 one, with fp32 gradient accumulation as a bf16 run's
    ds, _ = deepspeed_config(config.train, 2, 1, 1, on_gpu=True)
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"] and ds["data_types"]["grad_accum_dtype"] == "fp32"


def _preset_choice(arch: str, preset: str, recipe: str) -> dict[str, set[str]]:
    """The linear kinds (q_proj, up_proj, ...) each decision gets on the meta-device model of a preset."""
    hf_config = build_model_config(ModelConfig(arch=arch, preset=preset), TOKENIZER, 2048)
    kinds: dict[str, set[str]] = {"fp8": set(), "bf16": set()}
    for c in fp8.model_choice(hf_config, recipe):
        kinds["fp8" if c.converted else "bf16"].add(c.name.rsplit(".", 1)[-1])
    return kinds


def test_the_presets_convert_the_linears_torchao_finds_large_enough() -> None:
    """torchao's own size filter (H100 measurements) on the real presets; lm_head is never converted."""
    assert _preset_choice("llama", "1b", "tensorwise") == {
        "fp8": {"q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}, "bf16": {"k_proj", "v_proj", "lm_head"}}
    assert _preset_choice("llama", "1b", "rowwise")["fp8"] == {"gate_proj", "up_proj"}
    assert _preset_choice("llama", "125m", "tensorwise") == {
        "fp8": {"gate_proj", "up_proj"}, "bf16": {"q_proj", "k_proj", "v_proj", "o_proj", "down_proj", "lm_head"}}
    hf_config = build_model_config(ModelConfig(arch="llama", preset="1b"), TOKENIZER, 2048)
    choice = fp8.model_choice(hf_config, "tensorwise")
    assert sum(c.converted for c in choice) == 22 * 5 and fp8.largest_converted(choice) in ((5632, 2048),
                                                                                               (2048, 5632))
    head = next(c for c in choice if c.name == "lm_head")
    assert "output head" in head.why and "fused loss" in head.why
    # Where nothing converts the run is refused, saying why: GPT-2's Conv1D, or layers too small
    for arch, preset, recipe, why in [("gpt2", "1b", "tensorwise", "Conv1D"),
                                      ("llama", "tiny", "tensorwise", "large enough"),
                                      ("llama", "125m", "rowwise", "large enough")]:
        config = build_model_config(ModelConfig(arch=arch, preset=preset), TOKENIZER, 2048)
        assert why in fp8.nothing_converts(fp8.model_choice(config, recipe), arch)


def test_a_converted_model_keeps_its_state_dict_and_trains_close_to_bf16(dataset_prefix: Path) -> None:
    """A small llama whose MLP up-projections torchao's tensorwise filter converts (1040 outputs: above its
    1024), on real man-page tokens: the same state_dict (keys, dtypes, values), so checkpoints, resume and stage 4
    see a bf16 model; loss and logits close to the bf16 model's, gradients pointing the same way; the layers
    compiled on their own (compile_converted, aot_eager here) compute what the eager ones do."""
    import torch

    from gptpipe.data.indexed import IndexedDataset

    dataset = IndexedDataset(dataset_prefix)
    tokens = np.concatenate([dataset[i] for i in range(len(dataset))][:50])[:64]
    ids = torch.from_numpy(tokens.astype(np.int64))[None]
    batch = {"input_ids": ids, "labels": ids}
    torch.manual_seed(0)
    config = build_model_config(ModelConfig(preset="custom", num_layers=1, hidden_size=64, num_attn_heads=4,
                                            ffn_hidden_size=1040), SimpleNamespace(
        vocab_size=int(tokens.max()) + 1, bos_id=1, eos_id=2, pad_id=3), 64)
    bf16 = build_model(config).to(torch.bfloat16)
    model = copy.deepcopy(bf16)
    choice = fp8.convert(model, "tensorwise")
    assert {c.name for c in choice if c.converted} == {"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"}
    assert type(model.model.layers[0].mlp.up_proj).__name__ == "Float8Linear"
    before, after = bf16.state_dict(), model.state_dict()
    assert list(before) == list(after)
    assert all(after[k].dtype == before[k].dtype and torch.equal(after[k], before[k]) for k in before)

    want, got = lm_forward(bf16, batch), lm_forward(model, batch)
    want.loss.backward()
    got.loss.backward()
    assert abs(got.loss.item() / want.loss.item() - 1) < 0.01, (got.loss.item(), want.loss.item())
    assert (got.logits - want.logits).abs().max() < 0.05 * want.logits.abs().max()
    for name, weight in model.named_parameters():
        grad, reference = weight.grad.float().flatten(), dict(bf16.named_parameters())[name].grad.float().flatten()
        assert torch.isfinite(grad).all() and weight.grad.dtype == torch.bfloat16
        assert torch.nn.functional.cosine_similarity(grad, reference, dim=0) > 0.98, name

    assert fp8.compile_converted(model, "aot_eager") == 2
    with torch.no_grad():
        compiled = lm_forward(model, batch)
    assert torch.equal(compiled.logits, got.logits.detach())


def test_gptpipe_train_refuses_fp8_on_cpu_before_any_work(tmp_path: Path) -> None:
    """The real command: exit 2 with what is needed, and no run folder."""
    run = tmp_path / "run"
    done = run_train("--config", REPO / "config.yaml", "train.precision=fp8", f"train.output_model_dir={run}",
                     timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "train.precision fp8 cannot run here: this machine has no CUDA GPU" in done.stderr, done.stderr[-2000:]
    assert "compute capability >= 8.9" in done.stderr and "train.precision=bf16" in done.stderr
    assert "Traceback" not in done.stderr and not run.exists()


def test_without_torchao_fp8_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao", None)  # what `import torchao` finds when it is not installed
    why = fp8.unavailable()
    assert "torchao is not installed (pip install -e .[fp8])" in why and "no CUDA GPU" in why


def test_the_plan_shows_the_fp8_choice_its_casts_and_the_bf16_peak(dataset_prefix: Path, workspace: Path) -> None:
    """The 1b preset planned for an H100: the fp8 row, a bf16 engine, the same weights/gradients/optimizer as
    bf16, activations larger by the largest converted linear's casts, and the same expected speed (MFU against
    the dense bf16 peak). gpt2 is refused: nothing would convert."""
    from gptpipe.train.continued import stage3_model
    from gptpipe.train.plan import PlanError, make_plan
    from gptpipe.train.plan_report import format_plan

    def plan(*overrides: str):
        config = load_config(PipelineConfig, workspace / "config.yaml",
                             ["model.preset=1b", "train.seq_len=2048", "train.micro_batch_size=4", "data.split=90,9,1",
                              "train.global_batch_size=8", *overrides])
        tokenizer, hf_config, _ = stage3_model(config)
        return config, make_plan(config, tokenizer.vocab_size, dp=1, device_memory_gib=80, device_name="H100",
                                 model_config=hf_config)

    config, fp8_plan = plan("train.precision=fp8")
    _, bf16_plan = plan("train.precision=bf16")
    table = format_plan(fp8_plan, config)
    assert "fp8 (a bf16 engine)" in table and "tensorwise scaling, 110 of 155 linears in FP8" in table, table
    assert "MFU counts against the dense bf16 peak" in table and "of FP8 casts" in table, table
    a, b = fp8_plan.memory, bf16_plan.memory
    assert (a.weights, a.gradients, a.optimizer, a.logits) == (b.weights, b.gradients, b.optimizer, b.logits)
    assert a.activations - b.activations == fp8_cast_bytes(4 * 2048, 5632, 2048)
    assert fp8_plan.peak_flops == bf16_plan.peak_flops == 989e12
    assert fp8_plan.expected_tokens_per_s == bf16_plan.expected_tokens_per_s
    assert fp8_plan.checkpoint_bytes == bf16_plan.checkpoint_bytes
    assert "fp8 tensorwise" in str(fp8_plan.setup)  # speeds measured in bf16 are not taken for fp8's
    with pytest.raises(PlanError, match="train.precision fp8: model.arch gpt2 has no nn.Linear"):
        plan("train.precision=fp8", "model.arch=gpt2")


FP8_ENGINE = """
import sys
from types import SimpleNamespace
import torch
from gptpipe.runtime.config import ModelConfig
from gptpipe.train.config import TrainConfig
from gptpipe.runtime.engine import build_engine, deepspeed_config, forward_loss, setup_distributed
from gptpipe.runtime.model import build_model_config
from gptpipe.runtime.schedule import Schedule

dist = setup_distributed()
ids = torch.load(sys.argv[1])
for precision in ("bf16", "fp8"):
    train = TrainConfig(precision=precision, global_batch_size=1, micro_batch_size=1, seq_len=64, lr=1e-3)
    train.resolve_schedule(continued=False)
    config = build_model_config(ModelConfig(preset="custom", num_layers=1, hidden_size=64, num_attn_heads=4,
                                            ffn_hidden_size=1040),
                                SimpleNamespace(vocab_size=int(ids.max()) + 1, bos_id=1, eos_id=2, pad_id=3), 64)
    ds_config, _ = deepspeed_config(train, 1, 1, 1, on_gpu=False)
    torch.manual_seed(0)
    engine, kwargs = build_engine(train, "llama", config, ds_config, Schedule.for_run(train, 10), dist.device)
    losses = []
    for _ in range(4):
        loss, _ = forward_loss(engine, {"input_ids": ids, "labels": ids}, **kwargs)
        engine.backward(loss)
        engine.step()
        losses.append(round(loss.item(), 4))
    engine.save_checkpoint(sys.argv[2] + "/" + precision, tag="step4")
    print(precision, type(engine.module.model.layers[0].mlp.up_proj).__name__, *losses)
"""


@pytest.mark.slow  # two DeepSpeed engines in a subprocess: about a minute on 2 cores
def test_the_fp8_engine_trains_and_saves_a_bf16_runs_checkpoint(dataset_prefix: Path, tmp_path: Path) -> None:
    """build_engine with train.precision fp8 (on CPU, which `gptpipe train` refuses but torchao runs): the MLP
    up-projections are Float8Linear inside the DeepSpeed bf16 engine at ZeRO-1, the loss falls with the bf16
    engine's from the same weights, and the checkpoint's model states have the bf16 run's keys, dtypes and shapes
    (what resume and stage 4 read)."""
    import subprocess

    import torch

    from conftest import train_env
    from gptpipe.data.indexed import IndexedDataset

    dataset = IndexedDataset(dataset_prefix)
    tokens = np.concatenate([dataset[i] for i in range(50)])[:64]
    torch.save(torch.from_numpy(tokens.astype(np.int64))[None], tmp_path / "ids.pt")
    done = subprocess.run([sys.executable, "-c", FP8_ENGINE, str(tmp_path / "ids.pt"), str(tmp_path)],
                          env=train_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines() if line.split()[:1] in (["bf16"],
                                                                                                      ["fp8"])}
    assert rows["bf16"][0] == "Linear" and rows["fp8"][0] == "Float8Linear", done.stdout
    bf16, fp8_losses = [float(x) for x in rows["bf16"][1:]], [float(x) for x in rows["fp8"][1:]]
    assert fp8_losses[-1] < fp8_losses[0] and abs(fp8_losses[-1] / bf16[-1] - 1) < 0.02, (bf16, fp8_losses)
    assert "fp8: tensorwise scaling, 2 of 8 linears in FP8" in done.stderr, done.stderr[-3000:]

    def states(precision: str) -> dict[str, tuple[torch.dtype, torch.Size]]:
        saved = torch.load(tmp_path / precision / "step4" / "mp_rank_00_model_states.pt", weights_only=False)
        return {k: (v.dtype, v.shape) for k, v in saved["module"].items()}

    assert states("fp8") == states("bf16")
