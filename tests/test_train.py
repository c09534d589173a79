"""Stage 3 end to end on the man pages: the tiny preset learns, and the run folder holds what stage 4 needs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import SHIPPED, TINY_STEPS, TRAINED, TRAINED_RUN, metrics, train_env

from gptpipe.config.core import load_config, to_plain
from gptpipe.data.indexed import IndexedDataset
from gptpipe.data.split import document_order, split_bounds
from gptpipe.pipeline import PipelineConfig
from gptpipe.artifacts import read_tokenizer
from gptpipe.runtime.checkpoint import COMPLETE_MARKER, HF_CONFIG, STATE, complete_checkpoints
from gptpipe.runtime.metrics_rows import SamplesRow, TrainRow, ValidationRow

# What TRAINED_RUN (conftest) makes: an evaluation and a checkpoint every eval/save interval and at the end,
# the newest keep_checkpoints kept.
LAST = TRAINED.train_iters
EVALUATIONS = len(range(TRAINED.eval_interval, LAST, TRAINED.eval_interval)) + 1
SAVED_STEPS = [*range(TRAINED.save_interval, LAST, TRAINED.save_interval), LAST][-TRAINED.keep_checkpoints:]
SAMPLES_PER_STEP, TOKENS_PER_STEP = TRAINED.global_batch_size, TRAINED.global_batch_size * TRAINED.seq_len


def unigram_entropy(prefix: Path, split: str, seed: int) -> float:
    """Entropy (nats/token) of the train split's token frequencies: what a model without context gets."""
    dataset = IndexedDataset(prefix)
    order = document_order(len(dataset), seed)
    begin, end = split_bounds(split, len(dataset))[0]
    counts = np.bincount(np.concatenate([dataset[i] for i in order[begin:end]])).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def test_tiny_model_learns_more_than_token_frequencies(trained_run: Path, dataset_prefix: Path) -> None:
    entropy = unigram_entropy(dataset_prefix, SHIPPED.data.split, seed=SHIPPED.data.seed)
    val = [r.val_loss for r in metrics(trained_run, ValidationRow)]
    assert len(val) == EVALUATIONS  # every eval_interval, the last at the end
    assert val[-1] < entropy - 0.4, f"validation loss {val[-1]:.3f} vs unigram entropy {entropy:.3f}"
    assert val[-1] < val[0]


def test_lr_is_min_lr_at_the_last_step_of_the_real_run(trained_run: Path) -> None:
    train = metrics(trained_run, TrainRow)
    log = TRAINED.log_interval
    assert [r.step for r in train] == list(range(log, LAST + 1, log))
    assert math.isclose(train[-1].lr, TRAINED.min_lr, rel_tol=1e-9)
    assert train[0].lr > train[-1].lr
    assert all(r.tokens == r.step * TOKENS_PER_STEP for r in train)
    assert all(math.isfinite(x) for r in train for x in (r.loss, r.grad_norm, r.tokens_per_s, r.mem_gib))


def test_checkpoints_hold_what_export_needs(trained_run: Path, tokenizer_dir: Path, dataset_prefix: Path,
                                            workspace: Path) -> None:
    root = trained_run / "checkpoints"
    assert [step for step, _ in complete_checkpoints(root)] == SAVED_STEPS
    assert (root / "latest").read_text() == f"global_step{LAST}"
    folder = root / f"global_step{LAST}"
    assert (folder / COMPLETE_MARKER).is_file() and not list(root.glob(".tmp-*"))
    state = json.loads((folder / STATE).read_text(encoding="utf-8"))
    assert (state["step"], state["consumed_samples"], state["tokens"]) == (LAST, LAST * SAMPLES_PER_STEP,
                                                                          LAST * TOKENS_PER_STEP)
    # The run record is the whole resolved config.yaml of the run, overrides included: stage 4 reads only this.
    resolved = to_plain(load_config(PipelineConfig, workspace / "config.yaml", list(TRAINED_RUN)))
    assert state["config"] == resolved
    assert Path(state["config"]["tokenize"]["tokenizer_dir"]) == tokenizer_dir
    assert [Path(p) for p in state["config"]["data"]["prefixes"]] == [dataset_prefix]
    val = [r.val_loss for r in metrics(trained_run, ValidationRow)]
    assert state["final_val_loss"] == val[-1]
    hf = json.loads((folder / HF_CONFIG).read_text(encoding="utf-8"))
    tokenizer = read_tokenizer(tokenizer_dir)
    assert hf["model_type"] == "llama" and hf["vocab_size"] % 128 == 0 and hf["vocab_size"] >= tokenizer.vocab_size
    assert (hf["bos_token_id"], hf["eos_token_id"]) == (tokenizer.bos_id, tokenizer.eos_id)
    assert list(folder.glob("*optim_states.pt")) and list(folder.glob("rng_state_rank0.pt"))


def test_run_is_observable(trained_run: Path) -> None:
    samples = metrics(trained_run, SamplesRow)
    assert len(samples) == EVALUATIONS  # generated at each evaluation
    assert all([s["prompt"] for s in r.samples] == TRAINED.sample_prompts for r in samples)
    assert list((trained_run / "tensorboard").glob("events.out.tfevents.*"))
    assert list((trained_run / "wandb").glob("offline-run-*"))  # no API key in tests: offline, in the run folder
    ds_config = json.loads((trained_run / "ds_config.json").read_text())
    assert ds_config["zero_optimization"]["stage"] == TRAINED.zero_stage


# The runs test_export exports (conftest's tiny_run): gpt2 in bf16 with ZeRO-2, mixtral with ZeRO-3 on two ranks.
OTHER_ARCHITECTURES = {"gpt2": ("gpt2", 2, True, 1), "mixtral": ("mixtral", 3, False, 2)}


@pytest.mark.parametrize("arch", list(OTHER_ARCHITECTURES))
def test_other_architectures_train(arch: str, tiny_run) -> None:
    run = tiny_run(*OTHER_ARCHITECTURES[arch])
    stderr = tiny_run.stderr[run]
    train = metrics(run, TrainRow)
    assert len(train) == TINY_STEPS and all(math.isfinite(r.loss) for r in train)
    if arch == "mixtral":  # the router's load-balancing loss and each layer's smallest expert share are logged
        assert all(r.aux_loss >= 1 for r in train) and "router-aux" in stderr
        assert all(len(r.expert_share_min) == 4 and all(0 <= s <= 1 / 8 for s in r.expert_share_min) for r in train)
        assert "expert-min" in stderr and all(isinstance(r.experts_starved, int) for r in train)
    hf = json.loads((run / "checkpoints" / f"global_step{TINY_STEPS}" / HF_CONFIG).read_text())
    assert hf["model_type"] == arch
    assert hf.get("output_router_logits", False) is False  # a training switch, off in every saved config


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mixtral"])
def test_a_document_masked_sample_gives_each_document_its_logits_alone(arch: str, dataset_prefix: Path,
                                                                       tokenizer_dir: Path, tmp_path: Path) -> None:
    """train.document_mask on stage 2's real data through megatron's dataset and the batch training makes
    (train/data.py's collate, runtime/model.py's lm_forward): every document of a packed sample gets the logits it
    gets alone from position 0 (fp32, 1e-5), and the token after an end-of-document token carries no loss, so no
    document's first token is predicted from the one before it. Off, the sample is one causal sequence."""
    import torch
    from transformers import AutoModelForCausalLM

    from gptpipe.data.config import DataConfig
    from gptpipe.data.count import count_dataset
    from gptpipe.runtime.config import ModelConfig
    from gptpipe.runtime.model import build_model_config, lm_forward
    from gptpipe.train.data import build_datasets, collate

    tokenizer = read_tokenizer(tokenizer_dir)
    seq_len, split, seed = 1024, "90,9,1", SHIPPED.data.seed  # room for several man pages
    data_cfg = DataConfig(prefixes=[dataset_prefix], split=split, seed=seed)
    counts = [count_dataset(dataset_prefix, split, seed)]
    masked, plain = (build_datasets(data_cfg, counts, seq_len, [64, 8, 8], tmp_path / str(on), tokenizer.vocab_size,
                                    tokenizer.eod_id, document_mask=on)[0] for on in (True, False))
    torch.manual_seed(0)
    config = build_model_config(ModelConfig(arch=arch, preset="tiny"), tokenizer, seq_len)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    # The sample with the most documents among the first 64 (a corpus of long pages packs few in 1,024 tokens).
    sample = max(range(64), key=lambda i: int((masked[i]["tokens"] == tokenizer.eod_id).sum()))
    batch, whole = collate(masked, [sample], "cpu"), collate(plain, [sample], "cpu")
    assert torch.equal(batch["input_ids"], whole["input_ids"]) and "position_ids" not in whole
    tokens, positions = batch["input_ids"][0], batch["position_ids"][0]
    starts = [0, *(torch.nonzero(tokens == tokenizer.eod_id)[:, 0] + 1).tolist()]
    spans = [(a, b) for a, b in zip(starts, [*starts[1:], seq_len]) if b > a]
    assert len(spans) >= 3 and all(positions[a:b].tolist() == list(range(b - a)) for a, b in spans)
    with torch.no_grad():
        packed = lm_forward(model, batch).logits[0]
        for a, b in spans:
            alone = model(input_ids=tokens[None, a:b]).logits[0]
            assert (packed[a:b] - alone).abs().max() <= 1e-5, (arch, a, b)
        assert (lm_forward(model, whole).logits[0, spans[1][0]:] - packed[spans[1][0]:]).abs().max() > 1e-3
    ended = tokens == tokenizer.eod_id
    assert (batch["labels"][0][ended] == -100).all() and (batch["labels"][0][~ended] != -100).all()
    assert (whole["labels"][0] != -100).all()


def test_per_layer_router_loss_revives_the_expert_the_pooled_loss_leaves_dead() -> None:
    """Two layers' routers on the same hidden states: expert 0 dead in layer 0 and busy in layer 1, expert 1
    the other way round. transformers' loss pools the layers by expert index, so both look fairly used and
    minimizing it leaves the dead ones dead; the per-layer losses (runtime/model.router_loss, what training
    adds) bring every expert of every layer to about a fair share."""
    import torch
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from gptpipe.runtime.model import expert_shares, router_loss

    experts, top_k = 8, 2

    def minimize(loss_of) -> tuple[list[float], int]:
        torch.manual_seed(0)
        common = torch.nn.functional.normalize(torch.randn(32), dim=0)
        hidden = 2 * common + torch.randn(1024, 32)  # a direction all tokens share, as in a residual stream
        routers = [torch.nn.Parameter(0.02 * torch.randn(experts, 32)) for _ in range(2)]
        with torch.no_grad():
            routers[0][0] -= 2 * common
            routers[1][1] -= 2 * common
        optimizer = torch.optim.AdamW(routers, lr=1e-2)
        for _ in range(100):
            loss = loss_of(tuple(hidden @ w.T for w in routers))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            return expert_shares(router_loss(tuple(hidden @ w.T for w in routers), top_k).counts)

    smallest, starved = minimize(lambda logits: load_balancing_loss_func(logits, experts, top_k))
    assert max(smallest) < 0.02 and starved == 2  # one expert per layer under a quarter of its fair share
    smallest, starved = minimize(lambda logits: router_loss(logits, top_k).losses.sum())
    assert min(smallest) > 0.75 / experts and starved == 0


BF16_ENGINE = """
from types import SimpleNamespace
import torch
from gptpipe.runtime.config import ModelConfig
from gptpipe.train.config import TrainConfig
from gptpipe.runtime.engine import build_engine, deepspeed_config, setup_distributed
from gptpipe.runtime.model import build_model, build_model_config
from gptpipe.runtime.schedule import Schedule

dist = setup_distributed()
train = TrainConfig(precision="bf16", global_batch_size=2, micro_batch_size=2)
train.resolve_schedule(continued=False)  # what loading config.yaml does: lr and warmup from their defaults
config = build_model_config(ModelConfig(preset="tiny"), SimpleNamespace(vocab_size=1000, bos_id=1, eos_id=2, pad_id=3),
                            2048)
exact = build_model(config).model.rotary_emb.inv_freq  # what from_pretrained builds at inference
ds_config, _ = deepspeed_config(train, 2, 1, 1, on_gpu=False)
engine, _ = build_engine(train, "llama", config, ds_config, Schedule.for_run(train, 10), dist.device)
trained = engine.module.model.rotary_emb.inv_freq
print(engine.module.model.embed_tokens.weight.dtype, trained.dtype, torch.equal(trained, exact))
"""


@pytest.mark.slow  # a DeepSpeed engine in a subprocess: about a minute on 2 cores
def test_bf16_training_keeps_rope_frequencies_fp32() -> None:
    """A blanket bf16 cast of the model (DeepSpeed before 0.19.2) rounds RoPE's inv_freq: positions far
    into the sequence then rotate differently in training than in the exported fp32-buffer model."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", BF16_ENGINE], env=train_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-3:] == ["torch.bfloat16", "torch.float32", "True"], done.stdout
