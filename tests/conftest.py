"""Shared fixtures: the real pipeline, run once per test session on the Japanese man pages.

Each fixture runs a stage through the `gptpipe` command exactly as a user would, in a temporary copy of
the shipped YAMLs, so later stages' tests consume real outputs of earlier stages. Tests that need the man
pages skip outside CI when they are not installed, and fail in CI (which installs them).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from gptpipe.cli import main

REPO = Path(__file__).resolve().parent.parent
MANPAGES = Path("/usr/share/man/ja")
SHIPPED_YAMLS = ("config.yaml", "sentence_piece_config.yaml", "convert_config.yaml")


def manpages_installed() -> bool:
    return MANPAGES.is_dir() and sum(1 for _ in MANPAGES.rglob("*.gz")) > 1000


def require_manpages() -> None:
    if manpages_installed():
        return
    message = "needs the Japanese man pages: apt-get install manpages-ja manpages-ja-dev"
    if os.environ.get("CI"):
        pytest.fail(message + " (CI must install them)")
    pytest.skip(message)


def run_cli(*argv: str) -> None:
    """Run a gptpipe subcommand in-process and fail the test on a non-zero exit."""
    code = main([str(a) for a in argv])
    assert code == 0, f"gptpipe {' '.join(map(str, argv))} exited {code}"


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


@pytest.fixture(scope="session")
def tiny_run(tokenizer_dir: Path, dataset_prefix: Path, tmp_path_factory: pytest.TempPathFactory):
    """Factory: ``tiny_run(arch, zero, bf16, ranks)`` → a stage-3-shaped run folder holding one DeepSpeed
    checkpoint of a tiny model trained 3 steps on the dataset (tests/make_tiny_checkpoint.py, in a subprocess
    so no process group leaks into the test process). Made once per argument set."""
    import socket
    import subprocess
    import sys

    from gptpipe.stages import read_tokenizer

    info = read_tokenizer(tokenizer_dir)
    made: dict[tuple, Path] = {}

    def make(arch: str = "llama", zero: int = 1, bf16: bool = False, ranks: int = 1) -> Path:
        key = (arch, zero, bf16, ranks)
        if key not in made:
            run = tmp_path_factory.mktemp(f"run-{arch}-z{zero}{'-bf16' if bf16 else ''}-r{ranks}")
            with socket.socket() as free:  # a free port, so concurrent test sessions do not collide
                free.bind(("127.0.0.1", 0))
                port = str(free.getsockname()[1])
            launcher = [sys.executable] if ranks == 1 else [
                sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", f"--master_port={port}"]
            done = subprocess.run(
                [*launcher, str(REPO / "tests" / "make_tiny_checkpoint.py"), "--run-dir", str(run), "--arch", arch,
                 "--zero", str(zero), *(["--bf16"] if bf16 else []), "--tokenizer-dir", str(tokenizer_dir),
                 "--dataset-prefix", str(dataset_prefix), "--vocab", str(info.vocab_size),
                 "--ids", str(info.bos_id), str(info.eos_id), str(info.pad_id)],
                capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": port})
            assert done.returncode == 0, done.stderr[-3000:]
            made[key] = run
        return made[key]

    return make


@pytest.fixture(scope="session")
def exported_model(trained_run: Path, workspace: Path) -> Path:
    """Stage 4 with the shipped convert_config.yaml on the stage-3 run: the verified folder models/hf/demo."""
    run_cli("convert", "--config", workspace / "convert_config.yaml")
    return workspace / "models" / "hf" / "demo"


# --- stage 3 -------------------------------------------------------------------------------------------
# Small-run overrides shared by the training tests: the tiny preset on 64-token samples, nothing extra logged.
QUICK_TRAIN = ("train.seq_len=64", "train.global_batch_size=8", "train.eval_iters=1", "train.eval_interval=1000",
               "train.log_interval=1", "train.sample_prompts=[]", "train.train_tokens=null", "train.train_epochs=1",
               "logging.wandb=false", "logging.tensorboard=false", "train.precision=fp32")
# The run the loss test checks and stage 4 exports: a few hundred steps of the tiny preset, every logger on.
TRAINED_RUN = ("train.seq_len=128", "train.global_batch_size=8", "train.lr=3e-3", "train.min_lr=3e-4",
               "train.train_iters=250", "train.log_interval=10", "train.eval_interval=125", "train.eval_iters=8",
               "train.save_interval=125", "train.train_tokens=null", "train.train_epochs=1", "train.zero_stage=1",
               "train.precision=fp32", "logging.wandb=true", "logging.tensorboard=true")


def train_command(*argv: object, ranks: int = 1, launcher: str = "torchrun") -> list[str]:
    """argv of `gptpipe train` on `ranks` CPU ranks (gloo): plain python, torchrun or the deepspeed launcher."""
    import socket
    import sys

    args = ["-m", "gptpipe", "train", *map(str, argv)]
    if ranks == 1:
        return [sys.executable, *args]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    if launcher == "deepspeed":
        return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port", port,
                "--no_local_rank", "--module", *args[1:]]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", port,
            *args]


def train_env(ranks: int = 1) -> dict[str, str]:
    """The cores split between the ranks; wandb offline; no process-group variables from outside."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // ranks)), WANDB_MODE="offline",
               PYTHONWARNINGS="ignore")
    return env


def run_train(*argv: object, ranks: int = 1, launcher: str = "torchrun", timeout: float = 900):
    """Stage 3 in a subprocess (its process group must not leak into the test process); returns the
    CompletedProcess with stderr (the plan, the log lines) captured as text."""
    import subprocess

    return subprocess.run(train_command(*argv, ranks=ranks, launcher=launcher), env=train_env(ranks),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def trained_run(dataset_prefix: Path, workspace: Path) -> Path:
    """Stage 3: the tiny preset trained 250 steps on the man pages (fp32, ZeRO-1, wandb offline and
    TensorBoard on) → the run folder <workspace>/runs/demo with checkpoints global_step125 and 250."""
    done = run_train("--config", workspace / "config.yaml", *TRAINED_RUN)
    assert done.returncode == 0, done.stderr[-3000:]
    return workspace / "runs" / "demo"
