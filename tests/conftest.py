"""Shared fixtures and helpers: the real pipeline, run once per test session on the Japanese man pages.

Each fixture runs a stage through the `gptpipe` command exactly as a user would, in a temporary copy of
the shipped YAMLs, so later stages' tests consume real outputs of earlier stages. Tests that need the man
pages skip outside CI when they are not installed, and fail in CI (which installs them).

Tiers (markers, added here from the fixtures a test uses): ``manpages`` for every test that needs the man
pages, ``slow`` for every test that needs the stage-1 tokenizer (minutes per session) or trains a model, and
for every test marked ``ranks`` (it starts a multi-rank launcher: torchrun or deepspeed's);
``pytest -m "not slow"`` is the quick tier.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from gptpipe.cli import main
from gptpipe.config.core import load_config
from gptpipe.pipeline import PipelineConfig
from gptpipe.stage import Manifest
from gptpipe.tokenizer.config import TokenizerConfig
from gptpipe.train.logging import read_metrics

REPO = Path(__file__).resolve().parent.parent
MANPAGES = Path("/usr/share/man/ja")
SHIPPED_YAMLS = ("config.yaml", "sentence_piece_config.yaml", "convert_config.yaml")
# The shipped settings, for expected figures (split, seed, vocabulary...) that follow the YAMLs.
SHIPPED = load_config(PipelineConfig, REPO / "config.yaml")
SHIPPED_TOKENIZER = load_config(TokenizerConfig, REPO / "sentence_piece_config.yaml")

MANPAGE_FIXTURES = {"corpus_dir"}  # every later stage's fixture depends on it
# Stage 1 trains the shipped 32k tokenizer on the man pages (~3 min on 2 cores); everything after it is slower.
SLOW_FIXTURES = {"tokenizer_dir"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))  # the closure: fixtures of fixtures included
        if fixtures & MANPAGE_FIXTURES:
            item.add_marker(pytest.mark.manpages)
        if fixtures & SLOW_FIXTURES or item.get_closest_marker("ranks"):
            item.add_marker(pytest.mark.slow)


def manpages_installed() -> bool:
    return MANPAGES.is_dir() and sum(1 for _ in MANPAGES.rglob("*.gz")) > 1000


def require_manpages() -> None:
    if manpages_installed():
        return
    message = "needs the Japanese man pages: apt-get install manpages-ja manpages-ja-dev"
    if os.environ.get("CI"):
        pytest.fail(message + " (CI must install them)")
    pytest.skip(message)


def run_cli(*argv: object) -> None:
    """Run a gptpipe subcommand in-process and fail the test on a non-zero exit."""
    code = main([str(a) for a in argv])
    assert code == 0, f"gptpipe {' '.join(map(str, argv))} exited {code}"


def free_port() -> str:
    """A TCP port free right now, so concurrent test sessions' process groups do not collide."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def corpus_texts(folder: Path) -> list[str]:
    """The documents of a stage-0 folder's corpus.jsonl, in order."""
    with open(folder / "corpus.jsonl", "rb") as fh:
        return [orjson.loads(line)["text"] for line in fh]


def manifest_counts(folder: Path) -> dict:
    """The counts a stage recorded in ``folder``/manifest.json."""
    return Manifest.read(folder / "manifest.json").counts


def metrics(run: Path) -> list[dict]:
    """A stage-3 run folder's metrics.jsonl rows, read by the package's own reader."""
    return read_metrics(run / "metrics.jsonl")


def train_losses(run: Path) -> dict[int, float]:
    """Per-step training loss; a resumed run appends, and a repeated step must repeat its loss exactly."""
    seen: dict[int, float] = {}
    for row in metrics(run):
        if "loss" in row:
            assert seen.setdefault(row["step"], row["loss"]) == row["loss"], f"step {row['step']} differs"
    return seen


@pytest.fixture(scope="session")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding copies of the shipped YAMLs; stage outputs land beside them."""
    ws = tmp_path_factory.mktemp("pipeline")
    for name in SHIPPED_YAMLS:
        shutil.copy(REPO / name, ws / name)
    return ws


@pytest.fixture(scope="session")
def corpus_dir(workspace: Path) -> Path:
    """Stage 0 on the man pages: data/corpus/corpus.jsonl + manifest.json."""
    require_manpages()
    run_cli("prepare", "--config", workspace / "config.yaml")
    return workspace / "data" / "corpus"


@pytest.fixture(scope="session")
def tokenizer_dir(corpus_dir: Path, workspace: Path) -> Path:
    """Stage 1 with the shipped sentence_piece_config.yaml (32k unigram) on the man-page corpus."""
    run_cli("train-tokenizer", "--config", workspace / "sentence_piece_config.yaml")
    return workspace / "tokenizers" / "ja_32k"


@pytest.fixture(scope="session")
def dataset_prefix(tokenizer_dir: Path, workspace: Path) -> Path:
    """Stage 2: data/tokenized/ja_text_document.bin/.idx."""
    run_cli("tokenize", "--config", workspace / "config.yaml")
    return workspace / "data" / "tokenized" / "ja_text_document"


# --- stage 3 -------------------------------------------------------------------------------------------
# What every short run leaves out: evaluation beyond one batch at the end, samples, wandb and TensorBoard.
QUIET_RUN = ("train.eval_iters=1", "train.eval_interval=1000", "train.log_interval=1", "train.sample_prompts=[]",
             "train.train_tokens=null", "train.train_epochs=1", "logging.wandb=false", "logging.tensorboard=false")
# Small-run overrides shared by the training tests: the tiny preset on 64-token samples.
QUICK_TRAIN = (*QUIET_RUN, "train.seq_len=64", "train.global_batch_size=8", "train.precision=fp32")
QUICK = load_config(PipelineConfig, REPO / "config.yaml", list(QUICK_TRAIN)).train
# tiny_run's folders: the fewest steps and tokens that still give a complete stage-3 run folder.
TINY_STEPS = 3
TINY_RUN = (*QUIET_RUN, "train.seq_len=32", "train.global_batch_size=2", f"train.train_iters={TINY_STEPS}")
# The run the loss test checks and stage 4 exports: a few hundred steps of the tiny preset, every logger on.
TRAINED_RUN = ("train.seq_len=128", "train.global_batch_size=8", "train.lr=3e-3", "train.min_lr=3e-4",
               "train.train_iters=250", "train.log_interval=10", "train.eval_interval=125", "train.eval_iters=8",
               "train.save_interval=125", "train.train_tokens=null", "train.train_epochs=1", "train.zero_stage=1",
               "train.precision=fp32", "logging.wandb=true", "logging.tensorboard=true")
# TRAINED_RUN's settings as the run reads them, for the figures its tests expect.
TRAINED = load_config(PipelineConfig, REPO / "config.yaml", list(TRAINED_RUN)).train


def train_command(*argv: object, ranks: int = 1, launcher: str = "torchrun") -> list[str]:
    """argv of `gptpipe train` on `ranks` CPU ranks (gloo): plain python, torchrun or the deepspeed launcher."""
    args = ["-m", "gptpipe", "train", *map(str, argv)]
    if ranks == 1:
        return [sys.executable, *args]
    if launcher == "deepspeed":
        return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port",
                free_port(), "--no_local_rank", "--module", *args[1:]]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
            free_port(), *args]


def train_env(ranks: int = 1) -> dict[str, str]:
    """The cores split between the ranks; wandb offline; no process-group variables from outside."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // ranks)), WANDB_MODE="offline",
               PYTHONWARNINGS="ignore")
    return env


def start_train(config: Path, *overrides: str):
    """A quick stage-3 run (QUICK_TRAIN) in the background, stderr captured: for tests that signal or kill it."""
    import subprocess

    return subprocess.Popen(train_command("--config", config, *QUICK_TRAIN, *overrides), env=train_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def run_train(*argv: object, ranks: int = 1, launcher: str = "torchrun", timeout: float = 900):
    """Stage 3 in a subprocess (its process group must not leak into the test process); returns the
    CompletedProcess with stderr (the plan, the log lines) captured as text."""
    return subprocess.run(train_command(*argv, ranks=ranks, launcher=launcher), env=train_env(ranks),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def tiny_run(dataset_prefix: Path, workspace: Path, tmp_path_factory: pytest.TempPathFactory):
    """Factory: ``tiny_run(arch, zero, bf16, ranks)`` → the run folder of a real `gptpipe train` of the tiny
    preset, TINY_STEPS steps on the man pages (`ranks` CPU ranks through torchrun), with its one checkpoint
    global_step{TINY_STEPS}. Made once per argument set."""
    made: dict[tuple, Path] = {}

    def make(arch: str = "llama", zero: int = 1, bf16: bool = False, ranks: int = 1) -> Path:
        key = (arch, zero, bf16, ranks)
        if key not in made:
            run = tmp_path_factory.mktemp(f"run-{arch}-z{zero}{'-bf16' if bf16 else ''}-r{ranks}")
            done = run_train("--config", workspace / "config.yaml", *TINY_RUN, f"model.arch={arch}",
                             f"train.zero_stage={zero}", f"train.precision={'bf16' if bf16 else 'fp32'}",
                             f"train.output_model_dir={run}", ranks=ranks)
            assert done.returncode == 0, done.stderr[-3000:]
            made[key] = run
        return made[key]

    return make


@pytest.fixture(scope="session")
def trained_run(dataset_prefix: Path, workspace: Path) -> Path:
    """Stage 3: the tiny preset trained TRAINED.train_iters steps on the man pages (fp32, ZeRO-1, wandb
    offline and TensorBoard on) → the run folder <workspace>/runs/demo with a checkpoint every save_interval."""
    # ~2 min on a quiet 2-core machine (docs/benchmarks.md); the generous limit is for one shared with other work.
    done = run_train("--config", workspace / "config.yaml", *TRAINED_RUN, timeout=2700)
    assert done.returncode == 0, done.stderr[-3000:]
    return workspace / "runs" / "demo"


@pytest.fixture(scope="session")
def exported_model(trained_run: Path, workspace: Path) -> Path:
    """Stage 4 with the shipped convert_config.yaml on the stage-3 run: the verified folder models/hf/demo."""
    run_cli("convert", "--config", workspace / "convert_config.yaml")
    return workspace / "models" / "hf" / "demo"


@pytest.fixture(scope="session")
def tiny_lm(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A HF folder: the stage-1 tokenizer (SentencePiece, Japanese) and a small random Llama."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-lm")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir / "hf")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=64, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_t5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random T5 with the ByT5 tokenizer: both built offline."""
    import torch
    from transformers import ByT5Tokenizer, T5Config, T5ForConditionalGeneration

    folder = tmp_path_factory.mktemp("tiny-t5")
    tokenizer = ByT5Tokenizer()
    config = T5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                      pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    torch.manual_seed(0)
    T5ForConditionalGeneration(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
