"""Stage 3 preflight, in-process and fast: parameter count, refusal with a fix, the empty-split guard,
the LR schedule's end point and the DeepSpeed config generated from the template."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import QUICK_TRAIN, SHIPPED, TRAINED_RUN, metrics, run_train

from gptpipe.artifacts import TOKENIZE
from gptpipe.cli import main
from gptpipe.runtime.config import ModelConfig
from gptpipe.train.config import TrainConfig
from gptpipe.runtime.engine import TEMPLATE, EngineConfigError, deepspeed_config
from gptpipe.runtime.metrics_rows import TrainRow
from gptpipe.runtime.model import PRESETS, build_model_config, count_parameters, padded_vocab_size, resolve_shape
from gptpipe.runtime.schedule import Schedule

TOKENIZER = SimpleNamespace(vocab_size=32000, bos_id=1, eos_id=2, pad_id=3)
# Every model a from-scratch run builds: model.arch, and mixtral balanced by a selection bias (Ernie 4.5's class).
BUILT = {"llama": {"arch": "llama"}, "gpt2": {"arch": "gpt2"}, "mixtral": {"arch": "mixtral"},
         "mixtral-bias": {"arch": "mixtral", "moe_balance": "bias"}}


@pytest.mark.parametrize("arch", list(BUILT))
@pytest.mark.parametrize("preset", list(PRESETS))
def test_planner_parameter_count_equals_the_model(arch: str, preset: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model_cfg = ModelConfig(**BUILT[arch], preset=preset)
    with torch.device("meta"):  # no memory, even for the 1b and the mixtral presets
        model = AutoModelForCausalLM.from_config(build_model_config(model_cfg, TOKENIZER, 2048))
    assert count_parameters(resolve_shape(model_cfg, TOKENIZER.vocab_size), 2048) == model.num_parameters()


@pytest.mark.parametrize("arch", list(BUILT))
@pytest.mark.parametrize("preset", list(PRESETS))
def test_planned_flops_per_token_are_what_the_model_multiplies(arch: str, preset: str) -> None:
    """The plan's FLOPs per token in both MFU conventions against torch's own count of every matrix product a
    training step runs (FlopCounterMode over forward and backward, eager attention so that the scores are products
    too, its aten.bmm, and eager experts, whose products it sees): "full" (6·N plus 12·L·h·s, the headline) within
    0.5% of the whole count, "causal" (6·N plus 6·L·h·s) of the count less half the score products (the lower
    triangle causal flash attention computes), and the scores exactly. Every preset of every architecture: llama
    on the meta device (no memory), whole; GPT-2 and Mixtral need values (GPT-2's mask, Mixtral's routing: the
    tokens each expert really gets), so they run on the CPU, the small presets whole and the big ones' widths with
    one layer at a short sequence (per-layer terms are the same in every layer; the small presets check the sum
    over layers)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    from gptpipe.runtime.model import flops_per_token

    whole = arch == "llama" or preset in ("tiny", "125m")
    seq_len = 256 if whole else 32
    model_cfg = ModelConfig(**BUILT[arch], preset=preset, **({} if whole else {"num_layers": 1}))
    config = build_model_config(model_cfg, TOKENIZER, seq_len)
    device = "meta" if arch == "llama" else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        experts = {} if arch in ("llama", "gpt2") else {"experts_implementation": "eager"}
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", **experts)
        tokens = torch.randint(0, TOKENIZER.vocab_size, (1, seq_len))
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=tokens, labels=tokens).loss.backward()
    counted = counter.get_total_flops() / seq_len
    scores = counter.get_flop_counts()["Global"][torch.ops.aten.bmm] / seq_len  # q·kᵀ and ·v, both passes
    shape = resolve_shape(model_cfg, TOKENIZER.vocab_size)
    full, causal = flops_per_token(shape, seq_len), flops_per_token(shape, seq_len, causal=True)
    assert full == pytest.approx(counted, rel=0.005), (counted, full)
    assert causal == pytest.approx(counted - scores / 2, rel=0.005), (counted - scores / 2, causal)
    assert 2 * (full - causal) == scores  # 12·L·h·s: the attention term alone, exactly


def test_model_config_uses_the_tokenizer_ids_and_a_padded_vocab() -> None:
    tokenizer = SimpleNamespace(vocab_size=32003, bos_id=1, eos_id=2, pad_id=3)
    for settings in BUILT.values():
        config = build_model_config(ModelConfig(**settings), tokenizer, 256)
        assert config.vocab_size == 32128 and config.vocab_size % 128 == 0
        assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 3)


def _plan(workspace: Path, capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["plan", "--config", str(workspace / "config.yaml"), *argv])
    return code, capsys.readouterr().err


def test_plan_prints_the_run(dataset_prefix: Path, workspace: Path, capsys: pytest.CaptureFixture) -> None:
    code, err = _plan(workspace, capsys, "train.train_tokens=null")
    assert code == 0, err
    for row in ("parameters", "FLOPs per token", "memory/process", "activations", "host RAM", "disk", "lr"):
        assert row in err
    assert "without checkpointing" in err


def test_plan_gives_the_speed_measured_in_the_run_folder(trained_run: Path, workspace: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    import statistics

    speed = statistics.median([r.tokens_per_s for r in metrics(trained_run, TrainRow)][-20:])
    code, err = _plan(workspace, capsys, *TRAINED_RUN, f"train.output_model_dir={trained_run}")
    assert code == 0, err
    assert f"~{speed:,.0f} tokens/s (measured: median of the last log steps in {trained_run}" in err, err
    # Another sequence length, model or device is another speed: the figure is not reused, and the plan says so
    # (the 1b plan in the demo folder used to predict its duration from the tiny run's speed).
    for other in (["train.seq_len=64"], ["model.preset=125m"]):
        code, err = _plan(workspace, capsys, *TRAINED_RUN, f"train.output_model_dir={trained_run}", *other)
        assert code == 0 and "(measured" not in err, err
        assert "expected speed   unknown: no estimate on CPU, and the speeds in" in err and "not this setup" in err
    code, err = _plan(workspace, capsys, "--gpu-name", "H100", "--gpu-memory", "80", *TRAINED_RUN,
                      f"train.output_model_dir={trained_run}")
    assert code == 0 and "(estimated: assumed 40% MFU" in err and "measured for llama 4x128" in err, err


def test_a_run_that_cannot_fit_is_refused_with_a_fix_that_fits(dataset_prefix: Path, workspace: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    gpu = ["--gpu-name", "H100", "--gpu-memory", "80", "--gpus", "1"]
    too_big = ["model.preset=1b", "train.seq_len=2048", "train.global_batch_size=64", "train.micro_batch_size=64",
               "train.precision=bf16", "train.zero_stage=1", "train.train_tokens=null", "data.split=90,9,1"]
    code, err = _plan(workspace, capsys, *gpu, *too_big)
    assert code == 2 and "does not fit" in err, err
    fix = err.split("Fix: set ", 1)[1].split(" (~", 1)[0].split()
    assert fix and all("=" in kv for kv in fix), err
    code, err = _plan(workspace, capsys, *gpu, *too_big, *fix)
    assert code == 0, err
    # Without a micro-batch the planner picks the largest one that fits, and says so.
    code, err = _plan(workspace, capsys, *gpu, *[o for o in too_big if "micro_batch" not in o])
    assert code == 0 and "micro_batch_size=" in err, err


ONE_B_ON_8_H100 = ["--gpu-name", "H100", "--gpu-memory", "80", "--gpus", "8", "model.preset=1b", "train.seq_len=2048",
                   "train.precision=bf16", "train.zero_stage=1", "train.global_batch_size=128",
                   "train.train_tokens=null", "data.split=90,9,1"]


def test_the_1b_preset_on_8_h100_leaves_headroom(dataset_prefix: Path, workspace: Path, capsys: pytest.CaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner used to fill an 80 GB GPU to 98% (micro-batch 16, ~78 GiB): no room for a few % of error."""
    import re

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one GPU per node: this machine's host RAM is not a GPU node's
    code, err = _plan(workspace, capsys, *ONE_B_ON_8_H100)
    assert code == 0, err
    total, budget, device, headroom = map(float, re.search(
        r"total +~([.0-9]+) GiB on H100: budget ([.0-9]+) of ([.0-9]+) GiB, headroom ([.0-9]+) GiB", err).groups())
    assert device == 80 and budget == device - headroom and headroom >= 0.1 * device
    # Liger's fused loss and kernels (the GPU machine's [gpu] extra): micro-batch 16 at ~50 GiB
    assert total <= budget and "micro_batch_size=16 " in err and "loss             fused" in err, err


def test_a_run_that_fits_only_without_headroom_is_refused_with_a_fix(dataset_prefix: Path, workspace: Path,
                                                                     capsys: pytest.CaptureFixture,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import re

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    too_full = [*ONE_B_ON_8_H100, "train.micro_batch_size=16"]  # ~50 GiB
    too_full[too_full.index("--gpu-memory") + 1] = "55"
    code, err = _plan(workspace, capsys, *too_full)
    assert code == 2 and "does not fit" in err and "headroom" in err, err
    needed = float(re.search(r"it needs ~([.0-9]+) GiB per device", err).group(1))
    assert needed < 55  # the device itself would hold it: only the headroom refuses it
    fix = err.split("Fix: set ", 1)[1].split(" (~", 1)[0].split()
    code, err = _plan(workspace, capsys, *too_full, *fix)
    assert code == 0, err


def test_empty_split_is_refused_instead_of_hanging(dataset_prefix: Path, workspace: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    from gptpipe.data.indexed import idx_path, read_index

    documents = read_index(idx_path(dataset_prefix)).documents
    split = f"data.split={10 * documents - 2},1,1"  # valid and test shares of 1/10 document round to none
    code, err = _plan(workspace, capsys, split)
    assert code == 2 and "hang" in err and "valid split gets 0 documents" in err, err
    # The same through `gptpipe train`: it must fail fast, not loop in megatron's GPTDataset.
    done = run_train("--config", workspace / "config.yaml", *QUICK_TRAIN, split, timeout=300)
    assert done.returncode == 2 and "valid split gets 0 documents" in done.stderr, done.stderr[-2000:]


def test_data_another_tokenizer_encoded_is_refused(dataset_prefix: Path, workspace: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    """A new model's vocabulary and its export's tokenizer come from tokenize.tokenizer_dir, its ids from
    data.prefixes: data another stage-1 tokenizer encoded (here: the same corpus, the same vocabulary size) would
    train the model on another vocabulary's ids, and nothing later would notice."""
    from conftest import SMALLER, train_small_tokenizer

    other = tmp_path / "other"
    assert train_small_tokenizer(workspace, other, *SMALLER, "vocab_size=4000") == 0
    code, err = _plan(workspace, capsys, f"tokenize.tokenizer_dir={other}")
    assert code == 2 and f"not tokenized with tokenize.tokenizer_dir {other}" in err, err
    assert f"{dataset_prefix}: encoded with {workspace / 'tokenizers' / 'ja_4k'}" in err, err


def test_training_starts_without_library_notices(dataset_prefix: Path, workspace: Path, tmp_path: Path) -> None:
    """megatron-core's four "Transformer Engine and Apex are not installed" warnings and DeepSpeed's "Setting
    accelerator to CPU" said nothing about the run and were printed on every start."""
    import subprocess

    from conftest import train_command, train_env

    env = {**train_env(), "PYTHONWARNINGS": "default"}  # run_train ignores all warnings; this run must not
    done = subprocess.run(train_command("--config", workspace / "config.yaml", *QUICK_TRAIN, "train.train_iters=2",
                                        f"train.output_model_dir={tmp_path / 'run'}"),
                          env=env, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "step 2/2" in output, output[-3000:]
    for notice in ("Transformer Engine and Apex are not installed", "Setting accelerator to CPU"):
        assert notice not in output, output[-3000:]


def test_an_index_larger_than_host_ram_is_refused(dataset_prefix: Path, workspace: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    # The original's "-9" kill: train_samples=300M made megatron build index arrays for hundreds of epochs.
    code, err = _plan(workspace, capsys, "train.train_tokens=10_000_000_000_000")
    assert code == 2 and "host RAM" in err and "epochs" in err and "Fix: lower train.train_tokens" in err, err


def test_the_index_is_counted_once_per_node_and_split_indices_per_rank(dataset_prefix: Path, workspace: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    """Cached indices are memory-mapped by a node's ranks (one copy in the page cache), also where the nodes of a
    bucket run share no folder (each node builds its own); each rank holds megatron's split indices itself."""
    def host_ram(*argv: str) -> tuple[str, float]:
        code, err = _plan(workspace, capsys, "--gpus", "4", "--gpus-per-node", *argv, "train.global_batch_size=8",
                          "train.train_tokens=10_000_000_000")  # a ~2 GiB index
        assert code == 0, err
        line = next(line for line in err.splitlines() if "host RAM" in line)
        return line, float(re.search(r"~([\d.]+) (\w+) needed", line).group(1))

    two, two_needed = host_ram("2")
    assert "cached, memory-mapped by its ranks)" in two and "of split indices in each rank" in two
    index, build = (float(x) for x in re.search(r"dataset index ([\d.]+) GiB \(built once per node by a process "
                                                 r"holding up to ([\d.]+) GiB", two).groups())
    assert index <= build <= two_needed  # the cold start's builder: the indices and the split order's temporaries
    _, bucket_needed = host_ram("2", "train.output_model_dir=s3://bucket/run")
    assert bucket_needed == two_needed
    _, four_needed = host_ram("4")
    # two more ranks on the node add their own split indices (small), not more copies of the ~2 GiB index
    assert two_needed <= four_needed < two_needed + 1


def test_count_tokens_epoch_is_the_epoch_megatron_builds(dataset_prefix: Path, tmp_path: Path) -> None:
    """count_tokens' samples per epoch and train split are those of the GPTDataset training builds."""
    import numpy as np

    from gptpipe.data.config import DataConfig
    from gptpipe.data.count import count_dataset, epoch_schedule
    from gptpipe.data.split import document_order, split_bounds
    from gptpipe.data.indexed import idx_path, read_index
    from gptpipe.train.data import build_datasets

    seq_len, split, seed = SHIPPED.train.seq_len, SHIPPED.data.split, SHIPPED.data.seed
    counts = count_dataset(dataset_prefix, split, seed)
    epoch = epoch_schedule([counts], seq_len, 8, 1.0).samples_per_epoch
    data_cfg = DataConfig(prefixes=[dataset_prefix], split=split, seed=seed)
    train, valid, _ = build_datasets(data_cfg, [counts], seq_len, [epoch, 8, 8], tmp_path, 32000, 2)
    assert len(train) == epoch  # exactly one epoch: count_tokens' train_tokens trains on each token once
    documents = read_index(idx_path(dataset_prefix)).documents
    order = document_order(documents, seed)
    for dataset, (begin, end) in zip((train, valid), split_bounds(split, documents)):
        assert np.array_equal(np.unique(dataset.document_index), np.sort(order[begin:end]))
    assert int(read_index(idx_path(dataset_prefix)).sizes[train.indices].sum()) == counts.split_tokens[0]
    # The split order was computed once into the index cache, and every later reader maps that file.
    [cached] = tmp_path.glob("document_order-*.npy")
    assert cached.name == f"document_order-{documents}-{seed}.npy"
    mapped = document_order(documents, seed, tmp_path)
    assert isinstance(mapped, np.memmap) and np.array_equal(mapped, order)
    assert count_dataset(dataset_prefix, split, seed, tmp_path) == counts
    # The counts themselves are cached under the dataset's stage-2 manifest: a restart reads them, the order unread.
    [counted] = tmp_path.glob("split_counts-*.json")
    assert TOKENIZE.fingerprint(dataset_prefix)["manifest_sha256"][:16] in counted.name
    cached.unlink()
    assert count_dataset(dataset_prefix, split, seed, tmp_path) == counts and not cached.exists()
    counted.write_text('{"documents": 1}')  # damaged: counted again (the order recomputed), never trusted
    assert count_dataset(dataset_prefix, split, seed, tmp_path) == counts and cached.exists()
    assert json.loads(counted.read_text())["split_tokens"] == list(counts.split_tokens)
    assert count_dataset(dataset_prefix, "90,9,1", seed, tmp_path) != counts  # another split, another file
    assert len(list(tmp_path.glob("split_counts-*.json"))) == 2


def test_a_cached_split_order_of_another_dataset_is_refused(tmp_path: Path) -> None:
    import numpy as np

    from gptpipe.data.split import document_order

    np.save(tmp_path / "document_order-10-1.npy", np.arange(12, dtype=np.int32))
    with pytest.raises(ValueError, match="not the order of 10 documents: delete it"):
        document_order(10, 1, tmp_path)


@pytest.mark.parametrize("kind", ["cosine", "wsd"])
@pytest.mark.parametrize("total", [1, 2, 7, 100, 5003])
def test_lr_reaches_min_lr_at_the_last_step(kind: str, total: int) -> None:
    train = TrainConfig(lr=6e-4, min_lr=6e-5, lr_schedule=kind, warmup_fraction=0.01, lr_decay_fraction=0.2)
    schedule = Schedule.for_run(train, total)
    rates = [schedule.lr_at(s) for s in range(total)]
    assert rates[-1] == pytest.approx(6e-5, rel=1e-12)
    assert max(rates) == pytest.approx(6e-4, rel=1e-12) or total <= 2
    after_warmup = rates[schedule.warmup_steps:]
    assert all(a >= b for a, b in zip(after_warmup, after_warmup[1:]))  # never rises again after warmup
    assert all(r > 0 for r in rates)


def test_scheduler_given_to_deepspeed_follows_the_schedule() -> None:
    import torch

    schedule = Schedule.for_run(TrainConfig(lr=1e-3, min_lr=1e-4, warmup_fraction=0.1), 50)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    scheduler = schedule.scheduler_factory()(optimizer)
    seen = []
    for _ in range(50):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([schedule.lr_at(s) for s in range(50)], rel=1e-12)
    assert seen[-1] == pytest.approx(1e-4, rel=1e-12)


@pytest.mark.parametrize("kind", ["cosine", "wsd"])
def test_a_rewarm_starts_from_the_given_rate_peaks_and_decays_to_min_lr(kind: str) -> None:
    """Continued pretraining: the warmup rises linearly from the base's end rate (not 0) to the peak, then the
    schedule decays to min_lr at the last step as a new run's does; a new run still warms up from 0."""
    train = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, lr_schedule=kind, lr_decay_fraction=0.2)
    schedule = Schedule.for_run(train, 100, (2e-4, "the base's trainer_state.json"))
    rates = [schedule.lr_at(s) for s in range(100)]
    assert rates[0] == pytest.approx(2e-4 + 8e-4 / 10, rel=1e-12)  # a tenth of the way up from the start
    assert rates[:10] == pytest.approx([2e-4 + 8e-4 * (s + 1) / 10 for s in range(10)], rel=1e-12)
    assert rates[9] == max(rates) == pytest.approx(1e-3, rel=1e-12)
    assert rates[-1] == pytest.approx(1e-4, rel=1e-12)
    assert all(a >= b for a, b in zip(rates[9:], rates[10:]))
    scratch = Schedule.for_run(train, 100)
    assert (scratch.start_lr, scratch.start_origin) == (0.0, "")
    assert scratch.lr_at(0) == pytest.approx(1e-4, rel=1e-12) and scratch.lr_at(50) == schedule.lr_at(50)
    # a start above the peak (a base that ended higher than this run's peak) comes down to it, as stated
    down = Schedule.for_run(train, 100, (3e-3, "train.start_lr"))
    assert down.lr_at(0) == pytest.approx(3e-3 - 2e-3 / 10) and down.lr_at(9) == pytest.approx(1e-3)


def test_a_resumed_rewarm_lands_on_the_rate_of_the_uninterrupted_run() -> None:
    """The LambdaLR DeepSpeed checkpoints, saved mid-warmup and loaded into a new optimizer and scheduler built
    from the same schedule, goes on at the rates the uninterrupted one had."""
    import torch

    schedule = Schedule.for_run(TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=8), 30, (1e-4, "x"))

    def stepper():
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        return optimizer, schedule.scheduler_factory()(optimizer)

    optimizer, scheduler = stepper()
    whole = []
    for _ in range(30):
        whole.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert whole == pytest.approx([schedule.lr_at(s) for s in range(30)], rel=1e-12)
    assert whole[0] == pytest.approx(1e-4 + 9e-4 / 8)
    optimizer, scheduler = stepper()
    for _ in range(5):  # interrupted mid-warmup, after step 5
        optimizer.step()
        scheduler.step()
    saved = (optimizer.state_dict(), scheduler.state_dict())
    optimizer, scheduler = stepper()
    optimizer.load_state_dict(saved[0])
    scheduler.load_state_dict(saved[1])
    resumed = []
    for _ in range(25):
        resumed.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert resumed == pytest.approx(whole[5:], rel=1e-12)


def test_the_bases_end_rate_is_read_from_its_trainer_state_or_gptpipe_export(tmp_path: Path) -> None:
    """recorded_end_lr: transformers' trainer_state.json (its last logged learning_rate; the Trainer's closing
    summary row has none), a gptpipe export's manifest final_lr, nothing from a folder with neither or a broken
    file; warmup_start falls back to train.min_lr and says so, and train.start_lr overrides."""
    from gptpipe.runtime.base_model import recorded_end_lr
    from gptpipe.train.plan import warmup_start

    trainer = tmp_path / "trainer"
    trainer.mkdir()
    (trainer / "trainer_state.json").write_text(json.dumps({"global_step": 20, "log_history": [
        {"step": 10, "learning_rate": 4e-4, "loss": 2.0}, {"step": 20, "learning_rate": 3e-5, "loss": 1.5},
        {"step": 20, "train_runtime": 12.0, "train_loss": 1.7}]}))
    assert recorded_end_lr(trainer) == (3e-5, f"{trainer / 'trainer_state.json'}: learning_rate at step 20")
    export = tmp_path / "export"
    export.mkdir()
    (export / "manifest.json").write_text(json.dumps({"counts": {"step": 300, "final_lr": 2e-5}}))
    assert recorded_end_lr(export) == (2e-5, f"{export / 'manifest.json'}: final_lr of the gptpipe export of step 300")
    (export / "trainer_state.json").write_text("{not json")  # unreadable: the next record counts
    assert recorded_end_lr(export)[0] == 2e-5
    bare = tmp_path / "bare"
    bare.mkdir()
    assert recorded_end_lr(bare) is None
    train = TrainConfig(lr=1e-4, min_lr=1e-5, warmup_steps=5)
    start, origin = warmup_start(train, bare)
    assert start == 1e-5 and origin.startswith(f"train.min_lr: {bare} records no end rate")
    assert warmup_start(train, trainer)[0] == 3e-5 and warmup_start(train, None) is None
    assert warmup_start(replace(train, start_lr=0.0), trainer) == (0.0, "train.start_lr")


def test_a_continued_run_is_told_when_its_replay_or_peak_lies_outside_the_measured_range() -> None:
    """The plan's suggestions for model.init_from runs: no second dataset, a smallest share below the measured
    replay, a peak far above the base's recorded end rate; none inside the range, nor on a start that is no
    record of the base's (train.start_lr, the min_lr fallback)."""
    from gptpipe.train.config import CONTINUED_PEAK_RATIO_MAX, CONTINUED_REPLAY_MIN
    from gptpipe.train.plan import suggestions

    train = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10)
    recorded = Schedule.for_run(train, 100, (1e-3 / CONTINUED_PEAK_RATIO_MAX, "base/trainer_state.json: ..."))
    assert suggestions(["ja", "en"], [1 - CONTINUED_REPLAY_MIN, CONTINUED_REPLAY_MIN], recorded) == []
    only = suggestions(["ja"], None, recorded)
    assert len(only) == 1 and only[0].startswith("no replay: only ja is trained on")
    low = suggestions(["ja", "en"], [0.97, 0.03], recorded)
    assert low == [f"the smallest share, en at 3.0%, is below the {CONTINUED_REPLAY_MIN:.0%} replay measured to keep "
                   "the base's language: if it is the replay, raise its data.weights share (bench/"
                   "bench_vocab_extension.py, docs/benchmarks.md)"]
    steep = Schedule.for_run(train, 100, (1e-3 / CONTINUED_PEAK_RATIO_MAX / 2, "base/manifest.json: ..."))
    assert [line.split(";")[0] for line in suggestions(["ja", "en"], [0.7, 0.3], steep)] == [
        f"train.lr 0.001 is {2 * CONTINUED_PEAK_RATIO_MAX:.1f}x the rate the re-warm starts from "
        f"({1e-3 / CONTINUED_PEAK_RATIO_MAX / 2:g})"]
    for origin in ("train.start_lr", "train.min_lr: base records no end rate"):
        assert suggestions(["ja", "en"], [0.7, 0.3], Schedule.for_run(train, 100, (1e-4, origin))) == []


def test_deepspeed_config_fills_the_template_consistently(tmp_path: Path) -> None:
    template = json.loads(TEMPLATE.read_text(encoding="utf-8"))  # valid JSON, no bare placeholders
    assert template["wandb"]["project"]
    for precision in ("bf16", "fp16", "fp32"):
        train = TrainConfig(precision=precision, zero_stage=2, global_batch_size=32)
        config, wandb_block = deepspeed_config(train, micro_batch=4, accumulation=4, dp=2, on_gpu=False)
        assert config["bf16"]["enabled"] == (precision == "bf16")
        assert config["fp16"]["enabled"] == (precision == "fp16")
        assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"],
                config["gradient_accumulation_steps"]) == (32, 4, 4)
        assert config["zero_optimization"]["stage"] == 2
        assert config["optimizer"]["params"]["torch_adam"] is True
        assert config["optimizer"]["params"]["betas"] == [0.9, 0.95]
        assert "wandb" not in config and wandb_block["project"] == template["wandb"]["project"]
        assert "auto" not in json.dumps(config)
    # The original's defect: a template that hard-codes fp16 while the run is bf16 is refused.
    template["fp16"]["enabled"] = True
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps(template))
    with pytest.raises(EngineConfigError, match="fp16.enabled"):
        deepspeed_config(TrainConfig(precision="bf16", ds_config_template=bad), 4, 1, 1, on_gpu=False)



def test_no_weight_decay_on_norms_biases_and_embeddings() -> None:
    from gptpipe.runtime.model import build_model, parameter_groups

    for arch in ("llama", "gpt2"):
        model = build_model(build_model_config(ModelConfig(arch=arch), TOKENIZER, 64))
        decay, no_decay = parameter_groups(model, 0.1)
        assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
        names = {id(p): n for n, p in model.named_parameters()}
        decayed = {names[id(p)] for p in decay["params"]}
        assert decayed and all(model.get_parameter(n).dim() == 2 for n in decayed)
        assert not any("norm" in n or "ln_" in n or "bias" in n or "embed" in n or "wte" in n or "wpe" in n
                       for n in decayed)
        assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


# --- the planner held to the real thing: autograd's saved tensors and the loss path's allocations -------------

def _tiny_bf16_model(arch: str, layers: int):
    import torch

    from gptpipe.runtime.model import build_model

    cfg = ModelConfig(arch=arch, preset="custom", num_layers=layers, hidden_size=256, num_attn_heads=4,
                      num_kv_heads=None if arch == "gpt2" else 2, num_experts=4)
    torch.manual_seed(0)
    model = build_model(build_model_config(cfg, SimpleNamespace(vocab_size=1000, bos_id=1, eos_id=2, pad_id=3),
                                           128)).to(torch.bfloat16)
    return model, resolve_shape(cfg, 1000)


def _saved_bytes(model, tokens, **inputs) -> int:
    """Bytes of the distinct non-parameter storages autograd saves for backward in one forward."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=tokens, use_cache=False, **inputs)
    return sum(saved.values())


def _tiny_base_config(model_type: str, layers: int, **overrides):
    """A tiny random config of `model_type` with transformers' own class, as a base model (model.init_from) has
    it: hidden 256, 4 heads over 2 KV heads (GPT-2: 4), a head_dim of its own (96, not 64) where the architecture
    has one (Qwen3, Gemma), no dropout."""
    from transformers import AutoConfig

    if model_type == "gpt2":
        return AutoConfig.for_model("gpt2", vocab_size=1000, n_embd=256, n_layer=layers, n_head=4, n_inner=512,
                                    n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **overrides)
    own = {"head_dim": 96} if model_type in ("qwen3", "gemma2", "gemma3_text") else {}
    experts = {"mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
               # as build_model_config makes it: every layer a mixture, no shared experts
               "ernie4_5_moe": {"moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 512,
                                "moe_num_shared_experts": 0, "moe_layer_start_index": 0,
                                "moe_layer_end_index": layers - 1, "tie_word_embeddings": False}}.get(model_type, {})
    return AutoConfig.for_model(model_type, vocab_size=1000, hidden_size=256, intermediate_size=512,
                                num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=128, **own, **experts, **overrides)


def _cuda_attention_on_cpu(shape, precision: str, windowed: bool):
    """SDPA on CPU with the kernel that keeps what CUDA's keeps for this block. CPU's flash kernel keeps what
    CUDA's flash and memory-efficient ones do (q, k, v, the log-sum-exp; with a mask, the mask); but it takes
    fp32 with grouped-query attention, where CUDA has no fused kernel (flash is bf16/fp16 only, memory-efficient
    takes no GQA) and runs the math composite: on CPU too, then."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    math = (precision == "fp32" and shape.num_kv_heads < shape.num_attn_heads and not windowed
            and not shape.eager_attention)
    return sdpa_kernel(SDPBackend.MATH) if math else contextlib.nullcontext()


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("model_type, overrides", [
    ("llama", {}), ("mistral", {}), ("qwen2", {}), ("qwen3", {}), ("gemma2", {}), ("gemma3_text", {}),
    ("gemma3_text", {"sliding_window": 64}),  # its sliding layers then get a mask
    ("gpt2", {}),  # a base GPT-2's gelu_new
    ("gpt2", {"activation_function": "gelu_pytorch_tanh"}),  # GPT-2 from scratch (build_model_config)
    ("mixtral", {}), ("ernie4_5_moe", {})],
    ids=lambda v: ",".join(f"{k}={v[k]}" for k in v) or "defaults" if isinstance(v, dict) else v)
def test_planned_activations_are_what_autograd_keeps(model_type: str, overrides: dict, precision: str) -> None:
    """One block's saved tensors (a 2-layer model's less a 1-layer one's) per token, against the planner's
    figure, for every supported architecture as build_model runs it (Gemma 2's eager attention), with the
    attention kernel CUDA would run: GPT-2 with gelu_new kept 21,532 values/token/layer at h=768 against 13,056
    planned, and every base model's block was counted as Llama's (missing Gemma 2's S×S scores, Qwen3's and
    Gemma 3's q/k norms, Gemma's four norms, and fp32 GQA's math fallback)."""
    import torch

    from gptpipe.runtime.memory import activation_bytes_per_token, windowed_layers
    from gptpipe.runtime.model import base_shape, build_model

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    tokens = torch.randint(0, 1000, (2, 128))
    saved = {}
    for layers in (1, 2):
        config = _tiny_base_config(model_type, layers, **overrides)
        shape = base_shape(config)
        windowed = windowed_layers(shape, 128) > 0  # the tiny models' layers are alike: all windowed, or none
        torch.manual_seed(0)
        model = build_model(config).to(dtype)
        with _cuda_attention_on_cpu(shape, precision, windowed):
            saved[layers] = _saved_bytes(model, tokens)
    measured = (saved[2] - saved[1]) / tokens.numel()
    planned = activation_bytes_per_token(shape, precision, fused_kernels=False, seq_len=128, windowed=windowed)
    assert planned == pytest.approx(measured, rel=0.10), (measured, planned)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("model_type", ["llama", "gpt2", "mixtral", "ernie4_5_moe"])
def test_planned_activations_count_a_document_mask(model_type: str, precision: str) -> None:
    """train.document_mask: position ids restarting within each sample (two documents of 64 tokens) make
    transformers pass every layer the documents' block-causal mask, which the planner counts as a sliding
    window's (estimate_memory's document_mask)."""
    import torch

    from gptpipe.runtime.memory import activation_bytes_per_token
    from gptpipe.runtime.model import base_shape, build_model

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    tokens = torch.randint(0, 1000, (2, 128))
    positions = torch.cat([torch.arange(64), torch.arange(64)]).expand(2, -1)
    saved = {}
    for layers in (1, 2):
        config = _tiny_base_config(model_type, layers)
        shape = base_shape(config)
        torch.manual_seed(0)
        model = build_model(config).to(dtype)
        with _cuda_attention_on_cpu(shape, precision, windowed=True):
            saved[layers] = _saved_bytes(model, tokens, position_ids=positions)
    measured = (saved[2] - saved[1]) / tokens.numel()
    planned = activation_bytes_per_token(shape, precision, fused_kernels=False, seq_len=128, windowed=True)
    assert planned == pytest.approx(measured, rel=0.10), (measured, planned)


class _AllocationTracker:
    """Live and peak bytes of the storages torch's ops create (a dispatch mode: it sees every allocation)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker.track(out)
                return out

        self.mode, self.live, self.peak, self.alive = Mode(), 0, 0, set()

    def track(self, out) -> None:
        import weakref

        import torch
        from torch.utils._pytree import tree_leaves

        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in self.alive:
                storage = t.untyped_storage()
                key, size = storage._cdata, storage.nbytes()
                self.alive.add(key)
                self.live += size
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self.free, key, size)

    def free(self, key: int, size: int) -> None:
        self.alive.discard(key)
        self.live -= size


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_planned_loss_memory_is_the_unfused_loss_peak(precision: str) -> None:
    """transformers' loss from the last hidden state to its gradient peaks at 12 bytes per logit element (the
    planner said 10: it missed the two fp32 gradients live at the start of backward)."""
    import torch

    from gptpipe.runtime.memory import EngineSettings, estimate_memory

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model, shape = _tiny_bf16_model("llama", 1)
    model.to(dtype)
    model.lm_head = torch.nn.Linear(64, 8192, bias=False, dtype=dtype)  # a large vocab on a narrow model
    batch, seq = 2, 256
    hidden = torch.randn(batch, seq, 64, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, 8192, (batch, seq))
    tracker = _AllocationTracker()
    with tracker.mode:
        logits = model.lm_head(hidden)
        loss = model.loss_function(logits=logits, labels=None, vocab_size=8192, shift_labels=labels)
        del logits
        loss.backward()
    shape = replace(shape, vocab_size=8192, hidden_size=64)
    planned = estimate_memory(shape, 0, seq, precision, 1, EngineSettings(batch, 0, False, False),
                              fused_loss=False, fp32_gradients=True).logits
    assert planned == pytest.approx(tracker.peak, rel=0.10), (tracker.peak, planned)


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835), ("NVIDIA H200", 989),
    ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA L40S", 362), ("NVIDIA L40", 181), ("NVIDIA L4", 121)])
def test_peak_flops_by_the_name_torch_reports(name: str, tflops: float) -> None:
    from gptpipe.runtime.devices import peak_flops

    assert peak_flops(name, "bf16", None) == tflops * 1e12
    assert peak_flops(name, "fp32", None) == tflops * 1e12 / 2
    assert peak_flops(name, "bf16", 100.0) == 100e12


def test_ranks_per_node_reads_both_launchers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The deepspeed launcher sets LOCAL_SIZE (torchrun LOCAL_WORLD_SIZE): on 8 nodes x 8 GPUs each node counted
    all 64 ranks in its host-RAM check."""
    import os

    from gptpipe.runtime.devices import host_threads_per_rank, ranks_per_node

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    assert ranks_per_node(64) == 64  # no launcher and no GPU here: one machine
    monkeypatch.setenv("LOCAL_SIZE", "8")
    assert ranks_per_node(64) == 8 and ranks_per_node(4) == 4
    assert host_threads_per_rank(64) == max(1, (os.cpu_count() or 1) // 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert ranks_per_node(64) == 2


def test_plan_counts_the_ranks_of_one_node(dataset_prefix: Path, workspace: Path, capsys: pytest.CaptureFixture,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    gpus = ["--gpu-name", "H100", "--gpu-memory", "80", "--gpus", "64", "model.preset=125m",
            "train.global_batch_size=128", "train.train_tokens=null", "data.split=90,9,1"]
    code, err = _plan(workspace, capsys, *gpus)  # all 64 ranks on this machine: their host RAM does not fit
    assert code == 2 and "host RAM" in err, err
    # 2 per node (2.5 GiB of host RAM each): what this machine's RAM holds, 8 would need 20 GiB
    code, err = _plan(workspace, capsys, *gpus, "--gpus-per-node", "2")
    assert code == 0 and "(2 ranks on this node)" in err, err
    monkeypatch.setenv("LOCAL_SIZE", "2")  # what the deepspeed launcher sets
    code, err = _plan(workspace, capsys, *gpus)
    assert code == 0 and "(2 ranks on this node)" in err, err


def test_one_decision_of_the_fused_loss_for_planner_and_engine() -> None:
    """The planner reserved Liger's small loss whenever liger-kernel imported, while the engine applies it to
    llama and mixtral only: gpt2 125m on one H100 was planned at micro-batch 64 and needs ~47 GiB."""
    from gptpipe.runtime.devices import loss_path

    assert not loss_path("gpt2", on_gpu=True, liger_kernels=True, other_machine=True).fused
    assert "no gpt2 patch" in loss_path("gpt2", on_gpu=True, liger_kernels=True).why
    assert loss_path("llama", on_gpu=True, liger_kernels=True, other_machine=True).fused
    assert loss_path("mixtral", on_gpu=True, liger_kernels=True, other_machine=True).fused
    assert not loss_path("llama", on_gpu=True, liger_kernels=False, other_machine=True).fused
    assert not loss_path("llama", on_gpu=False, liger_kernels=True).fused


def test_gpt2_on_an_h100_is_planned_with_its_full_logits(dataset_prefix: Path, workspace: Path, tokenizer_dir: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    import re

    from gptpipe.artifacts import read_tokenizer

    code, err = _plan(workspace, capsys, "--gpu-name", "H100", "--gpu-memory", "80", "--gpus", "1",
                      "model.arch=gpt2", "model.preset=125m", "train.seq_len=2048", "train.global_batch_size=64",
                      "train.train_tokens=null", "data.split=90,9,1")
    assert code == 0 and "unfused: Liger has no gpt2 patch" in err, err
    micro = int(re.search(r"micro_batch_size=(\d+)", err).group(1))
    logits = float(re.search(r"logits ([.0-9]+) GiB", err).group(1))
    vocab = padded_vocab_size(read_tokenizer(tokenizer_dir).vocab_size)
    assert micro < 64 and logits == pytest.approx(micro * 2048 * vocab * 12 / 1024**3, rel=0.01), err
    # llama is planned with Liger's fused loss on the GPU machine, installed here or not
    code, err = _plan(workspace, capsys, "--gpu-name", "H100", "--gpu-memory", "80", "--gpus", "1",
                      "model.preset=125m", "train.seq_len=2048", "train.global_batch_size=64",
                      "train.train_tokens=null", "data.split=90,9,1")
    assert code == 0 and "fused: Liger's fused linear cross-entropy" in err, err


def test_bf16_gradients_are_accumulated_and_reduced_in_fp32() -> None:
    from gptpipe.runtime.memory import EngineSettings, estimate_memory

    for stage in (1, 2, 3):
        config, _ = deepspeed_config(TrainConfig(precision="bf16", zero_stage=stage), 4, 1, 2, on_gpu=False)
        assert config["data_types"]["grad_accum_dtype"] == "fp32" and config["communication_data_type"] == "fp32"
    off, _ = deepspeed_config(TrainConfig(precision="bf16", fp32_gradients=False), 4, 1, 2, on_gpu=False)
    zero0, _ = deepspeed_config(TrainConfig(precision="bf16", zero_stage=0), 4, 1, 2, on_gpu=False)
    fp32, _ = deepspeed_config(TrainConfig(precision="fp32"), 4, 1, 2, on_gpu=False)
    assert all("data_types" not in c and "communication_data_type" not in c for c in (off, zero0, fp32))
    # the plan counts them: 4 bytes per gradient instead of 2
    shape = resolve_shape(ModelConfig(preset="125m"), 32000)
    n = count_parameters(shape, 2048)
    settings = EngineSettings(1, 2, False, False)
    on, bf16 = (estimate_memory(shape, n, 2048, "bf16", 1, settings, False, fp32).gradients for fp32 in (True, False))
    assert on == pytest.approx(2 * bf16)


def test_fp32_runs_count_zero_s_own_master_copy() -> None:
    from gptpipe.runtime.memory import EngineSettings, estimate_memory

    shape = resolve_shape(ModelConfig(preset="125m"), 32000)
    n = count_parameters(shape, 2048)
    zero0, zero1 = (estimate_memory(shape, n, 2048, "fp32", 1, EngineSettings(1, stage, False, False), False,
                                    True).optimizer for stage in (0, 1))
    assert (zero0, zero1) == (8 * n, 12 * n)


def test_triton_is_checked_before_liger_or_compile_use_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Triton compiles a C launcher at first use: without a C compiler the first step raised; the run now
    trains unfused/uncompiled and says why."""
    from gptpipe.runtime.devices import triton_missing

    monkeypatch.setenv("PATH", str(tmp_path))  # no gcc, no clang
    monkeypatch.delenv("CC", raising=False)
    reason = triton_missing()
    assert reason in ("triton is not installed", "no C compiler (gcc, clang or $CC) for Triton's launcher")
