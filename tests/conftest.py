"""Shared fixtures and helpers: the real pipeline, run once per test session on the Japanese man pages.

Each fixture runs a stage through the `gptpipe` command exactly as a user would, in a temporary copy of
the shipped YAMLs, so later stages' tests consume real outputs of earlier stages (built once for both of
run_tests.sh's xdist workers; runs fork from a prewarmed server, tests/prewarmed.py). Tests that need
the man pages skip outside CI when they are not installed, and fail in CI (which installs them).

Tiers (markers, added here from the fixtures a test uses): ``manpages`` for every test that needs the man
pages, ``slow`` for every test that needs the stage-1 tokenizer (half a minute per session) or fine-tunes tiny_t5,
and for every test marked ``ranks`` (it runs several ranks: forked, or through torchrun or deepspeed's launcher);
``pytest -m "not slow"`` is the quick tier.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import multiprocessing.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from filelock import FileLock
from prewarmed import Forked, run_gptpipe, run_ranks

from gptpipe.artifacts import read_corpus
from gptpipe.cli import main
from gptpipe.config.core import load_config
from gptpipe.pipeline import PipelineConfig
from gptpipe.ports import free_port
from gptpipe.stage import Manifest
from gptpipe.tokenizer.config import TokenizerConfig
from gptpipe.runtime.metrics_rows import Row, TrainRow, of_kind, parse_metrics, read_metrics

REPO = Path(__file__).resolve().parent.parent
MANPAGES = Path("/usr/share/man/ja")
SHIPPED_YAMLS = ("config.yaml", "sentence_piece_config.yaml", "convert_config.yaml")
# The shipped settings, for expected figures (split, seed, vocabulary...) that follow the YAMLs.
SHIPPED = load_config(PipelineConfig, REPO / "config.yaml")
SHIPPED_TOKENIZER = load_config(TokenizerConfig, REPO / "sentence_piece_config.yaml")

MANPAGE_FIXTURES = {"corpus_dir"}  # every later stage's fixture depends on it
# Stage 1 on the man pages takes ~30 s on 2 cores; everything after it is slower.
# tiny_t5 needs no man pages, but every test that takes it starts `gptpipe finetune` (minutes under load).
SLOW_FIXTURES = {"tokenizer_dir", "shipped_tokenizer", "tiny_t5"}
# Whether this session runs a test that reads the trained run (set at collection).
TRAINED_RUN_READERS = False


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> Iterator[None]:
    global TRAINED_RUN_READERS
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))  # the closure: fixtures of fixtures included
        if fixtures & MANPAGE_FIXTURES:
            item.add_marker(pytest.mark.manpages)
        # llama.cpp's checks write and read several GGUFs: seconds each, kept out of the quick tier.
        if fixtures & SLOW_FIXTURES or item.get_closest_marker("ranks") or item.get_closest_marker("llamacpp"):
            item.add_marker(pytest.mark.slow)
    yield  # -m and -k deselect
    readers = {item.path for item in items if "trained_run" in getattr(item, "fixturenames", ())}
    TRAINED_RUN_READERS = bool(readers)
    # xdist's loadfile hands out the files in this order (run_tests.sh turns off its own reordering): vLLM's (the
    # longest file) first, then the files with the most slow tests, the trained run's readers last, so that the
    # run, started in the background after stage 2, is done when they start.
    first = {item.path for item in items if item.get_closest_marker("vllm")}
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: (0 if item.path in first else 2 if item.path in readers else 1, -slow[item.path]))


def manpages_installed() -> bool:
    return MANPAGES.is_dir() and sum(1 for _ in MANPAGES.rglob("*.gz")) > 1000


def require_manpages() -> None:
    if manpages_installed():
        return
    message = "needs the Japanese man pages: apt-get install manpages-ja manpages-ja-dev"
    if os.environ.get("CI"):
        pytest.fail(message + " (CI must install them)")
    pytest.skip(message)


# --- runs shared by the pytest-xdist workers ------------------------------------------------------------------
# run_tests.sh starts two workers (--dist loadfile: a file's tests, and its module fixtures, stay on one worker).
# The pipeline's outputs (stages 0-4, the reference and tiny runs) are built once per session, by the first worker
# that needs one, in a folder both see; the other waits for it.
def shared_folder(factory: pytest.TempPathFactory) -> Path:
    """The session's folder that every xdist worker sees (the session's own folder without xdist)."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def session_temp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The system temp folder of the session's stages and their children (bucket caches, staging run folders,
    scratch files): inside pytest's own folder, so it goes when pytest removes that (pyproject.toml's retention:
    at once after a passing session), not piling up in /tmp from session to session. Ray keeps /tmp: its socket
    paths must stay short."""
    folder = tmp_path_factory.getbasetemp() / "tmp"
    folder.mkdir(exist_ok=True)
    # multiprocessing makes its folder (its forkserver's and pools' sockets) once per process, where TMPDIR points
    # then, and removes it at exit: in the system's, not in pytest's folder or a test's tmp_path, both gone by then.
    multiprocessing.util.get_temp_dir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_TMPDIR", os.environ.get("RAY_TMPDIR", "/tmp"))
        patch.setenv("TMPDIR", str(folder))
        patch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
        yield folder


def once(factory: pytest.TempPathFactory, name: str, make: Callable[[], object]) -> None:
    """Run `make` once per test session, in whichever worker asks first; the others wait until it is done. One
    that fails leaves no mark, so the next test that needs it tries again (and fails the same way)."""
    root = shared_folder(factory)
    done = root / f"{name}.done"
    with FileLock(root / f"{name}.lock"):
        if not done.exists():
            make()
            done.touch()


def run_cli(*argv: object) -> None:
    """Run a gptpipe subcommand in-process and fail the test on a non-zero exit."""
    code = main([str(a) for a in argv])
    assert code == 0, f"gptpipe {' '.join(map(str, argv))} exited {code}"


def corpus_texts(folder: Path) -> list[str]:
    """The documents of a stage-0 folder's corpus files, in order."""
    return [orjson.loads(line)["text"] for line in corpus_bytes(folder).splitlines()]


def corpus_bytes(folder: Path) -> bytes:
    """A stage-0 folder's corpus files (as its manifest lists them) concatenated: the corpus whatever its
    sharding."""
    return b"".join(path.read_bytes() for path in read_corpus(folder).files)


def manifest_counts(folder: Path) -> dict:
    """The counts a stage recorded in ``folder``/manifest.json."""
    return Manifest.read(folder / "manifest.json").counts


def metrics(run: Path, kind: type[Row] | tuple[type[Row], ...] = Row) -> list:
    """The rows of `kind` (all by default) of a run folder's metrics.jsonl, in order, read by the package's reader."""
    return of_kind(read_metrics(run / "metrics.jsonl"), kind)


def step_losses(rows: list[Row]) -> dict[int, float]:
    """Per-step training loss; a resumed run appends, and a repeated step must repeat its loss exactly."""
    seen: dict[int, float] = {}
    for row in of_kind(rows, TrainRow):
        assert seen.setdefault(row.step, row.loss) == row.loss, f"step {row.step} differs"
    return seen


def train_losses(run: Path) -> dict[int, float]:
    """`step_losses` of a run folder."""
    return step_losses(metrics(run))


# The workspace's pipeline has a 4,000-piece vocabulary instead of the shipped 32,000. The embedding and head are
# then about half of the tiny model instead of ~90%, so every run the tests train is ~3x faster (the trained run:
# 131 -> 38 s on 2 threads, docs/benchmarks.md). The shipped stage-1 YAML is trained as it is beside it
# (shipped_tokenizer).
TEST_VOCABULARY = {"sentence_piece_config.yaml": (("vocab_size: 32000", "vocab_size: 4000"),
                                                  ("tokenizers/ja_32k", "tokenizers/ja_4k")),
                   "config.yaml": (("tokenizers/ja_32k", "tokenizers/ja_4k"),)}
SHIPPED_STAGE1 = "sentence_piece_config.shipped.yaml"


@pytest.fixture(scope="session")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the shipped YAMLs, with TEST_VOCABULARY's edits, and the shipped stage-1 YAML as it is
    (SHIPPED_STAGE1); stage outputs land beside them."""
    ws = shared_folder(tmp_path_factory) / "pipeline"

    def make() -> None:
        ws.mkdir()
        for name in SHIPPED_YAMLS:
            text = (REPO / name).read_text(encoding="utf-8")
            for old, new in TEST_VOCABULARY.get(name, ()):
                assert text.count(old) == 1, f"{name}: {old!r} is not there once; update TEST_VOCABULARY"
                text = text.replace(old, new)
            (ws / name).write_text(text, encoding="utf-8")
        shutil.copy(REPO / "sentence_piece_config.yaml", ws / SHIPPED_STAGE1)

    once(tmp_path_factory, "workspace", make)
    return ws


@pytest.fixture(scope="session")
def corpus_dir(workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stage 0 on the man pages: data/corpus/corpus-00000.jsonl, ... + manifest.json."""
    require_manpages()
    once(tmp_path_factory, "corpus", lambda: run_cli("prepare", "--config", workspace / "config.yaml"))
    return workspace / "data" / "corpus"


@pytest.fixture(scope="session")
def tokenizer_dir(corpus_dir: Path, workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stage 1 of the workspace's pipeline (a 4k unigram, TEST_VOCABULARY) on the man-page corpus."""
    once(tmp_path_factory, "tokenizer",
         lambda: run_cli("train-tokenizer", "--config", workspace / "sentence_piece_config.yaml"))
    return workspace / "tokenizers" / "ja_4k"


@pytest.fixture(scope="session")
def shipped_tokenizer(corpus_dir: Path, workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stage 1 with the shipped sentence_piece_config.yaml as it is (32k unigram) on the man-page corpus."""
    once(tmp_path_factory, "shipped-tokenizer",
         lambda: run_cli("train-tokenizer", "--config", workspace / SHIPPED_STAGE1))
    return workspace / "tokenizers" / "ja_32k"


SMALL_TOKENIZER = ("vocab_size=2000", "input_sentence_size=20000", "heldout_documents=50")


def train_small_tokenizer(workspace: Path, out: Path, *overrides: str, force: bool = False) -> int:
    """Stage 1 through the CLI on the workspace corpus with small settings (seconds); the exit code."""
    argv = ["train-tokenizer", "--config", str(workspace / "sentence_piece_config.yaml"), f"output_dir={out}",
            *SMALL_TOKENIZER, *overrides]
    return main(argv + (["--force"] if force else []))


# tiny_export's Llama shape (grouped KV heads): gguf and vLLM exports in seconds.
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
SMALLER = ("input_sentence_size=5000",)  # a unigram model in seconds


def random_model(config: Any, folder: Path, tokenizer_hf: Path | None = None, tokenizer: Any = None) -> Path:
    """The one builder of a random model folder, for what no stage makes: a user's own base (a foreign
    vocabulary, an encoder-decoder). Seed 0, the config's model class
    (causal or seq2seq), the tokenizer folder's files copied byte for byte (`tokenizer_hf`) or `tokenizer`
    saved. Every export a stage can make is made by that stage instead (tiny_export)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    if tokenizer_hf is not None:
        shutil.copytree(tokenizer_hf, folder, dirs_exist_ok=True)
    else:
        tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    model_class = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    model_class.from_config(config).save_pretrained(folder)  # after the tokenizer: its files are the model's
    return folder


@pytest.fixture(scope="session")
def unigram_llama(tiny_export) -> Path:
    """A real fp32 export (stage 4) of a one-step Llama run on the workspace's unigram tokenizer: grouped KV heads,
    an untied head, far-apart logits (read-only: copy it to change it)."""
    return tiny_export("llama")


@pytest.fixture(scope="session")
def dataset_prefix(tokenizer_dir: Path, workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stage 2: data/tokenized/ja_text_document.bin/.idx."""

    def make() -> None:
        run_cli("tokenize", "--config", workspace / "config.yaml")
        # Under xdist the trained run (the longest shared run) starts now, beside the tests, rather than when a
        # test first asks for it, with the other worker likely waiting for it too.
        if os.environ.get("PYTEST_XDIST_WORKER") and TRAINED_RUN_READERS:
            threading.Thread(target=once, args=(tmp_path_factory, "trained-run", lambda: train_demo(workspace)),
                             daemon=True).start()

    once(tmp_path_factory, "dataset", make)
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


def train_command(*argv: object) -> list[str]:
    """argv of a one-rank `gptpipe train` subprocess."""
    return [sys.executable, "-m", "gptpipe", "train", *map(str, argv)]


def train_env(ranks: int = 1) -> dict[str, str]:
    """The cores split between the ranks (and the xdist workers); wandb offline; no process-group variables from
    outside."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    env.update(OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // (ranks * workers))), WANDB_MODE="offline",
               PYTHONWARNINGS="ignore")
    return env


def start_train(config: Path, *overrides: str) -> Forked:
    """A quick stage-3 run (QUICK_TRAIN) in the background, stderr captured: for tests that signal or kill it."""
    return Forked(["train", "--config", config, *QUICK_TRAIN, *overrides], train_env())


def run_train(*argv: object, ranks: int = 1, timeout: float = 900) -> subprocess.CompletedProcess:
    """Stage 3 through gptpipe_command; stderr (the plan, the log lines) as text."""
    return gptpipe_command("train", *argv, ranks=ranks, timeout=timeout)


def wait_for_step(run: Path, step: int, process: subprocess.Popen, timeout: float = 300) -> None:
    """Wait until `run`/metrics.jsonl has a row for `step` (a training or evaluation row); fail at once, with its
    stderr, if the process ends first (a run that died must not look like a slow one)."""
    deadline = time.monotonic() + timeout
    needle = f'"step": {step},'
    while time.monotonic() < deadline:
        path = run / "metrics.jsonl"
        if path.is_file() and needle in path.read_text(encoding="utf-8"):
            return
        assert process.poll() is None, process.stderr.read()[-3000:] if process.stderr else process.returncode
        time.sleep(0.02)
    raise AssertionError(f"step {step} not logged within {timeout} s")


# The uninterrupted run the fault tests compare against: REFERENCE_STEPS quick steps, a checkpoint every 2.
REFERENCE_STEPS = 8
REFERENCE_RUN = (f"train.train_iters={REFERENCE_STEPS}", "train.save_interval=2")


@pytest.fixture(scope="session")
def reference_run(dataset_prefix: Path, workspace: Path, tmp_path_factory: pytest.TempPathFactory):
    """Factory: ``reference_run(zero_stage, precision)`` → the folder of an uninterrupted QUICK_TRAIN +
    REFERENCE_RUN run (made once per setting): the per-step losses that a killed, preempted or bucket-mirrored
    run of the same settings must reproduce bit for bit, and the final checkpoint a resumed run's export must
    equal. Tests only read it."""
    def make(zero_stage: int = 1, precision: str = "fp32") -> Path:
        name = f"reference-z{zero_stage}-{precision}"
        run = shared_folder(tmp_path_factory) / name

        def train() -> None:
            done = run_train("--config", workspace / "config.yaml", *QUICK_TRAIN, *REFERENCE_RUN,
                             f"train.zero_stage={zero_stage}", f"train.precision={precision}",
                             f"train.output_model_dir={run}")
            assert done.returncode == 0, done.stderr[-3000:]
            assert sorted(train_losses(run)) == list(range(1, REFERENCE_STEPS + 1))

        once(tmp_path_factory, name, train)
        return run

    return make


@pytest.fixture(scope="session")
def tiny_run(dataset_prefix: Path, workspace: Path, tmp_path_factory: pytest.TempPathFactory):
    """Factory: ``tiny_run(arch, zero, bf16, ranks)`` → the run folder of a real `gptpipe train` of the tiny
    preset, TINY_STEPS steps on the man pages (`ranks` forked CPU ranks), with its one checkpoint
    global_step{TINY_STEPS}. Made once per argument set; ``tiny_run.stderr[folder]`` is that run's stderr."""
    stderr: dict[Path, str] = {}

    def make(arch: str = "llama", zero: int = 1, bf16: bool = False, ranks: int = 1) -> Path:
        name = f"run-{arch}-z{zero}{'-bf16' if bf16 else ''}-r{ranks}"
        run = shared_folder(tmp_path_factory) / name
        log = run.with_name(f"{name}.stderr")

        def train() -> None:
            done = run_train("--config", workspace / "config.yaml", *TINY_RUN, f"model.arch={arch}",
                             f"train.zero_stage={zero}", f"train.precision={'bf16' if bf16 else 'fp32'}",
                             f"train.output_model_dir={run}", ranks=ranks)
            assert done.returncode == 0, done.stderr[-3000:]
            log.write_text(done.stderr, encoding="utf-8")

        once(tmp_path_factory, name, train)
        stderr[run] = log.read_text(encoding="utf-8")
        return run

    make.stderr = stderr
    return make


@pytest.fixture(scope="session")
def trained_run(dataset_prefix: Path, workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stage 3: the tiny preset trained TRAINED.train_iters steps on the man pages (fp32, ZeRO-1, wandb
    offline and TensorBoard on) → the run folder <workspace>/runs/demo with a checkpoint every save_interval."""
    once(tmp_path_factory, "trained-run", lambda: train_demo(workspace))
    return workspace / "runs" / "demo"


def train_demo(workspace: Path) -> None:
    """TRAINED_RUN in the workspace: ~40 s on a quiet 2-core machine (docs/benchmarks.md); the generous limit is
    for one shared with other work."""
    done = run_train("--config", workspace / "config.yaml", *TRAINED_RUN, timeout=2700)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="session")
def exported_model(trained_run: Path, workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stage 4 with the shipped convert_config.yaml on the stage-3 run: the verified folder models/hf/demo."""
    once(tmp_path_factory, "export", lambda: run_cli("convert", "--config", workspace / "convert_config.yaml"))
    return workspace / "models" / "hf" / "demo"


# tiny_export's runs: one step of a small Llama on the man pages, whose export every reader of an export tests on.
# init_std 0.3 keeps the next-token logits far apart, so greedy decoding in another runtime does not
# hinge on rounding; lr 1e-5 leaves them so after the step.
TINY_EXPORT_RUN = (*QUIET_RUN, "train.seq_len=256", "train.global_batch_size=2", "train.train_iters=1",
                   "train.lr=1e-5", "train.min_lr=1e-5", "train.precision=fp32", "model.arch=llama",
                   "model.preset=custom", "model.num_layers=2", f"model.num_attn_heads={HEADS}",
                   f"model.num_kv_heads={KV_HEADS}", "model.ffn_hidden_size=128", "model.init_std=0.3",
                   "model.tie_word_embeddings=false")


# tiny_export's mixture of experts balanced by a selection bias (model.moe_balance: bias, transformers' Ernie 4.5
# class), one step at a rate that moves every bias by 0.05: enough to change some tokens' experts. Its heads are
# vLLM's smallest (head_dim 32).
MOE_BIAS_EXPORT = ("moe-bias", ("model.arch=mixtral", "model.moe_balance=bias", "model.moe_bias_update_rate=0.05"))
MOE_BIAS_HEAD_DIM = 32


# The same step continued from a base model's folder (model.init_from decides the shape).
CONTINUED_EXPORT_RUN = (*(o for o in TINY_EXPORT_RUN if not o.startswith("model.")), "model.arch=null",
                        "model.preset=null")


@pytest.fixture(scope="session")
def tiny_export(dataset_prefix: Path, workspace: Path, tmp_path_factory: pytest.TempPathFactory):
    """Factory: ``tiny_export(name, *train_overrides, dtype="fp32", head_dim=HEAD_DIM, base=None)`` → the folder
    `gptpipe convert` (stage 4, the workspace's convert_config.yaml, its gate passed) writes from a real `gptpipe
    train` of TINY_EXPORT_RUN on the workspace's data and 4k unigram tokenizer, or of CONTINUED_EXPORT_RUN from
    `base`. Each run is made once per name, each export once per (name, dtype); read-only: copy one to change it."""
    def make(name: str, *overrides: str, dtype: str = "fp32", head_dim: int = HEAD_DIM,
             base: Path | None = None) -> Path:
        shared = shared_folder(tmp_path_factory)
        run, out = shared / f"export-run-{name}", shared / f"export-{name}-{dtype}"
        settings = (*CONTINUED_EXPORT_RUN, f"model.init_from={base}") if base else (
            *TINY_EXPORT_RUN, f"model.hidden_size={HEADS * head_dim}")

        def train() -> None:
            done = run_train("--config", workspace / "config.yaml", *settings, *overrides,
                             f"train.output_model_dir={run}")
            assert done.returncode == 0, done.stderr[-3000:]

        once(tmp_path_factory, run.name, train)
        once(tmp_path_factory, out.name, lambda: run_cli(
            "convert", "--config", workspace / "convert_config.yaml", f"input_model_dir={run}",
            f"output_tokenizer_and_model_dir={out}", f"dtype={dtype}"))
        return out

    return make


@pytest.fixture(scope="session")
def tokenizer_export(tiny_export, corpus_dir: Path, workspace: Path, tmp_path_factory: pytest.TempPathFactory):
    """Factory: ``tokenizer_export(name, tokenizer, *train_overrides, data=name, base=None)`` → tiny_export's real
    export with another tokenizer: stage 1's output folder for a new model, or a base model's folder (`base`,
    its own tokenizer: a continued run). Stage 2 encodes the workspace corpus with it once per `data` name
    (several runs may share it), and the one-step run trains on that data."""
    def make(name: str, tokenizer: Path, *overrides: str, dtype: str = "fp32", data: str | None = None,
             head_dim: int = HEAD_DIM, base: Path | None = None) -> Path:
        prefix = shared_folder(tmp_path_factory) / f"data-{data or name}" / "text"
        once(tmp_path_factory, f"data-{data or name}", lambda: run_cli(
            "tokenize", "--config", workspace / "config.yaml", f"tokenize.tokenizer_dir={tokenizer}",
            f"tokenize.output_prefix={prefix}"))
        return tiny_export(name, f"tokenize.tokenizer_dir={tokenizer}", f"data.prefixes=[{prefix}_text_document]",
                           *overrides, dtype=dtype, head_dim=head_dim, base=base)

    return make


@pytest.fixture(scope="session")
def chat_lm_export(tokenizer_export, workspace: Path, tmp_path_factory: pytest.TempPathFactory):
    """Factory: ``chat_lm_export(name, rows)`` → the export a chat or preference fine-tune starts from, made by
    the stages: stage 1 trains a 1,200-piece SentencePiece unigram tokenizer on `rows` as JSON text and the
    shipped template's turn headers (its own jsonl, as a user's corpus), tokenizer_export a small Llama (32 wide,
    init_std 0.02) on it. 1,200 pieces at the coverage the chat tests' answer lengths were set with (stage 1's
    default, 0.9999, gives more of them to rare characters: the answers come out a token or two longer)."""
    def make(name: str, rows: list[dict]) -> Path:
        shared = shared_folder(tmp_path_factory)
        corpus, tokenizer = shared / f"{name}-corpus.jsonl", shared / f"{name}-tokenizer"
        texts = [json.dumps(row, ensure_ascii=False) for row in rows] + ["システム:\nユーザー:\nアシスタント:"]
        once(tmp_path_factory, tokenizer.name, lambda: (
            write_jsonl(corpus, [{"text": text} for text in texts]),
            run_cli("train-tokenizer", "--config", workspace / "sentence_piece_config.yaml", f"input={corpus}",
                    f"output_dir={tokenizer}", "vocab_size=1200", "character_coverage=0.9995", "num_threads=1",
                    "heldout_documents=20")))
        return tokenizer_export(name, tokenizer, "model.init_std=0.02", "model.num_kv_heads=4", head_dim=8)

    return make


@pytest.fixture(scope="session")
def tiny_lm(tiny_export) -> Path:
    """The model a fine-tune starts from, as stage 7's default model.path is: a real stage-4 export (the 4k
    stage-1 tokenizer, SentencePiece, Japanese) of a small Llama, 64 positions."""
    return tiny_export("lm", "train.seq_len=64", "model.init_std=0.02", "model.num_kv_heads=4", head_dim=8)


@pytest.fixture(scope="session")
def tiny_t5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random T5 with the ByT5 tokenizer: both built offline."""
    from transformers import ByT5Tokenizer, T5Config

    tokenizer = ByT5Tokenizer()
    config = T5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                      pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return random_model(config, tmp_path_factory.mktemp("tiny-t5"), tokenizer=tokenizer)


# --- object stores on 127.0.0.1 -------------------------------------------------------------------------
# Fake credentials: the servers accept anything, and none of these may ever be written or printed.
FAKE_KEY_ID = "AKIAGPTPIPEFAKE7Q2X"
FAKE_SECRET = "gptpipe-fake-secret-9f3Kq2LmVx"
FAKE_TOKEN = "gptpipe-fake-session-token-Zr81"


class S3Store:
    """moto's standalone S3 server in a thread; its objects survive stop() and start() (a store outage)."""

    scheme = "s3"

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self._server_class = ThreadedMotoServer
        self.running = False
        self.env = {"AWS_ACCESS_KEY_ID": FAKE_KEY_ID, "AWS_SECRET_ACCESS_KEY": FAKE_SECRET,
                    "AWS_SESSION_TOKEN": FAKE_TOKEN, "AWS_DEFAULT_REGION": "us-east-1",
                    "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{self.port}"}

    def start(self) -> None:
        self.server = self._server_class(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()
        self.running = True

    def stop(self) -> None:
        if self.running:
            self.server.stop()
            self.running = False


class GCSStore:
    """gcp-storage-emulator (in memory) in a thread."""

    scheme = "gs"

    def __init__(self) -> None:
        self.port = free_port()
        self.env = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{self.port}",
                    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}  # else each bucket call stalls ~60 s

    def start(self) -> None:
        from gcp_storage_emulator.server import create_server

        self.server = create_server("127.0.0.1", self.port, in_memory=True)
        self.server.start()

    def stop(self) -> None:
        self.server.stop()


@contextlib.contextmanager
def open_store(kind: str, monkeypatch: pytest.MonkeyPatch, bucket: str | None = None) -> Iterator:
    """A running store ("s3" or "gs") with an empty bucket (`bucket`, or a fresh `runs-<hex>`), its env set for
    this process and its children; ``store.fs``, ``store.bucket`` and ``store.url`` (scheme://bucket)."""
    import fsspec

    store = S3Store() if kind == "s3" else GCSStore()
    for key, value in store.env.items():
        monkeypatch.setenv(key, value)
    store.start()
    try:
        store.fs = fsspec.filesystem(store.scheme, skip_instance_cache=True)
        # Not the module `random`: in-process stages seed it, so its names would repeat from session to session
        # (and the reader caches under $TMPDIR, keyed by URL, would meet an earlier session's).
        store.bucket = bucket or f"runs-{uuid.uuid4().hex[:12]}"
        store.fs.mkdir(store.bucket)
        store.url = f"{store.scheme}://{store.bucket}"
        yield store
    finally:
        store.stop()


def bucket_losses(store, url: str) -> dict[int, float]:
    """`step_losses` of the metrics.jsonl in the bucket."""
    return step_losses(parse_metrics(store.fs.cat_file(f"{url}/metrics.jsonl").decode()))


def bucket_steps(store, url: str) -> dict[int, bool]:
    """{step: has its marker} for every checkpoint folder in the bucket."""
    store.fs.invalidate_cache()
    found: dict[int, bool] = {}
    for name in store.fs.find(f"{url}/checkpoints"):
        parts = name.split("/")
        if parts[-2].startswith("global_step"):
            step = int(parts[-2].removeprefix("global_step"))
            found[step] = found.get(step, False) or parts[-1] == "complete"
    return found


def assert_no_secret(texts: list[str], folders: list[Path], store, url: str) -> None:
    """No fake credential in any output, local file or object of the run."""
    blobs = [t.encode() for t in texts]
    blobs += [p.read_bytes() for folder in folders if folder.is_dir() for p in folder.rglob("*") if p.is_file()]
    store.fs.invalidate_cache()
    blobs += [store.fs.cat_file(name) for name in store.fs.find(url)]
    for secret in (FAKE_KEY_ID, FAKE_SECRET, FAKE_TOKEN):
        assert not any(secret.encode() in blob for blob in blobs), f"{secret} leaked"


# --- a local HuggingFace hub ------------------------------------------------------------------------------
HUB_TOKEN = "hf_gptpipeTestSecret0123456789"


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A local hub (tests/hub_server.py) on 127.0.0.1 accepting HUB_TOKEN; the client is pointed at it and has no
    login store unless a test writes one.

    huggingface_hub reads HF_ENDPOINT and HF_HUB_DISABLE_XET when it is imported (transformers already did),
    so its constants are set too; the uploader itself reads HF_ENDPOINT when it runs.
    """
    import huggingface_hub
    from hub_server import HubServer

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "login" / "token"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
    huggingface_hub.utils.logging.set_verbosity_debug()  # if the client logged secrets, the scan would see them
    with HubServer(HUB_TOKEN) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", server.url)
        monkeypatch.setattr(huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            server.url + "/{repo_id}/resolve/{revision}/{filename}")
        yield server
    huggingface_hub.utils.logging.set_verbosity_warning()


# --- stage 7 -------------------------------------------------------------------------------------------
# Small fine-tune runs: short rows, fp32, every step logged, no warm-up, wandb and TensorBoard off.
FINETUNE_QUICK = ("train.seq_len=48", "train.precision=fp32", "train.log_interval=1", "train.warmup_fraction=0",
         "logging.wandb=false", "logging.tensorboard=false", "train.lr=1e-3")


# --- labelled rows from the man pages -------------------------------------------------------------------
def manpage_rows(sections: tuple[str, ...] = ("1", "2", "3"), per_section: int = 24) -> list[tuple[str, str]]:
    """(NAME description, section) of the first man pages of each section that have one."""
    require_manpages()
    rows = []
    for section in sections:
        found = 0
        for page in sorted(Path("/usr/share/man/ja").glob(f"man{section}/*.gz")):
            text = gzip.decompress(page.read_bytes()).decode("utf-8", errors="replace")
            match = re.search(r'^\.SH\s+"?(?:名前|NAME)"?\s*\n(.+)$', text, re.MULTILINE)
            if not match or "\\-" not in match.group(1):
                continue
            description = re.sub(r"\\f[BIRP]", "", match.group(1).split("\\-", 1)[1]).strip()
            if description and "\t" not in description:
                rows.append((description, section))
                found += 1
            if found == per_section:
                break
    return rows


def write_tsv(path: Path, rows: list[tuple[str, str]]) -> Path:
    path.write_text("".join(f"{a}\t{b}\n" for a, b in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def task_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """train.tsv (48 rows) and validation.tsv (12 rows) over sections 1, 2, 3, interleaved."""
    rows = manpage_rows(per_section=20)
    rows = [rows[i + k * 20] for i in range(20) for k in range(3)]  # interleave the sections
    folder = tmp_path_factory.mktemp("task")
    return write_tsv(folder / "train.tsv", rows[:48]), write_tsv(folder / "validation.tsv", rows[48:])


# --- chat rows from the man pages ---------------------------------------------------------------------
def manpage_chats(count: int = 60) -> list[dict]:
    """make-demo-task's two-turn conversations about the first man pages of sections 1 and 8 with a Japanese
    description; every third one in the instruction/output shape (one turn), every fifth one with a system
    prompt."""
    from gptpipe.corpus.manpages import find_manpages, read_manpage
    from gptpipe.finetune.demo_task import Row, chat_conversation, name_description

    require_manpages()
    rows: list[dict] = []
    pages = [p for p in find_manpages(Path("/usr/share/man/ja")) if p.parent.name in ("man1", "man8")]
    for path in pages:
        if len(rows) == count:
            break
        description = name_description(read_manpage(path))
        if not description or not any("\u3040" <= c <= "\u9fff" for c in description):
            continue
        page = f"{path.parent.name}/{path.name.removesuffix('.gz')}"
        messages = chat_conversation(Row(page, path.parent.name[3:], description))["messages"]
        if len(rows) % 3 == 2:
            rows.append({"instruction": messages[0]["content"], "input": "", "output": description})
            continue
        if len(rows) % 5 == 0:
            messages.insert(0, {"role": "system", "content": "Linux のコマンドについて簡潔に答えます。"})
        rows.append({"messages": messages})
    return rows


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in rows),
                    encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def manpage_chat_rows() -> list[dict]:
    return manpage_chats(700)


@pytest.fixture(scope="session")
def chat_files(manpage_chat_rows: list[dict], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """train.jsonl (48 conversations) and validation.jsonl (12)."""
    folder = tmp_path_factory.mktemp("chat")
    return (write_jsonl(folder / "train.jsonl", manpage_chat_rows[:48]),
            write_jsonl(folder / "validation.jsonl", manpage_chat_rows[48:60]))


CHAT_RUN = ("task.kind=chat", "train.seq_len=160", "train.global_batch_size=8", "train.train_iters=12",
            "train.eval_interval=4", "train.save_interval=4", "task.chat_eval_rows=4",
            "chat.max_new_tokens=12", "predict.max_new_tokens=12")


def chat_args(model: Path, chat_files: tuple[Path, Path], run: Path, *overrides: str) -> list[str]:
    train, validation = chat_files
    return [f"model.path={model}", f"data.train={train}", f"data.validation={validation}", "data.test=null",
            f"train.output_model_dir={run}", *FINETUNE_QUICK, *CHAT_RUN, *overrides]


def gptpipe_command(command: str, *argv: object, ranks: int = 1, stdin: str | None = None,
            timeout: float = 900) -> subprocess.CompletedProcess:
    """A gptpipe subcommand in processes of its own (its process group must not leak into the test process), forked
    from the prewarmed server: one, or `ranks` of one node as torchrun starts them. The launchers themselves are
    tested through the scripts that call them."""
    if ranks == 1:
        return run_gptpipe([command, *argv], train_env(), stdin=stdin, timeout=timeout)
    return run_ranks([command, *argv], train_env(ranks), ranks, free_port(), timeout=timeout)


def finetune_args(model: Path, task_files: tuple[Path, Path], run: Path, *overrides: str) -> list[str]:
    train, validation = task_files
    return [f"model.path={model}", f"data.train={train}", f"data.validation={validation}", "data.test=null",
            f"train.output_model_dir={run}", *FINETUNE_QUICK, *overrides]



# The classifier run test_finetune checks (evaluation at every step, the best checkpoint kept beyond keep-last-1)
# and test_export exports: tiny_lm on task_files, 5 steps of 8 rows.
CLASSIFIER_RUN = ("train.global_batch_size=8", "train.train_iters=5", "train.eval_interval=1", "train.save_interval=1",
                  "train.keep_checkpoints=1", "train.best_metric=accuracy")


@pytest.fixture(scope="session")
def classifier_run(tiny_lm: Path, task_files: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory):
    """(run folder, its `gptpipe finetune` arguments, its stderr) of CLASSIFIER_RUN. Tests only read the folder."""
    run = tmp_path_factory.mktemp("classifier") / "run"
    args = finetune_args(tiny_lm, task_files, run, *CLASSIFIER_RUN)
    done = gptpipe_command("finetune", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    return run, args, done.stderr


# The encoder-decoder run test_finetune predicts with and test_export exports (a chosen, not the newest, step).
T5_RUN = ("train.global_batch_size=8", "train.train_iters=3", "train.save_interval=2", "train.eval_interval=1000",
          "train.seq_len=64", "task.prompt='入力: {input}'")


@pytest.fixture(scope="session")
def t5_run(tiny_t5: Path, task_files: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory):
    """(run folder, its `gptpipe finetune` arguments, its stderr) of T5_RUN: tiny_t5 fine-tuned 3 steps with
    checkpoints at steps 2 and 3. Tests only read the folder."""
    run = tmp_path_factory.mktemp("t5") / "run"
    args = finetune_args(tiny_t5, task_files, run, *T5_RUN)
    done = gptpipe_command("finetune", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    return run, args, done.stderr


# --- base models' tokenizers, trained here (no hub) ------------------------------------------------------
SHIFT = 65_000  # the trained pieces' ids are moved up by this much, so most of them need int32


def byte_level_bpe(texts: list[str], folder: Path, adds_bos: bool, shift: int = 0) -> Path:
    """A byte-level BPE tokenizer trained on ``texts``, saved as an HF folder. ``shift`` moves every trained
    piece's id up, leaving unreachable filler pieces below (a large vocabulary without a long training)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trained.train_from_iterator(texts[:300], trainers.BpeTrainer(vocab_size=1500, special_tokens=specials,
                                                                 initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    state = json.loads(trained.to_str())
    vocab = state["model"]["vocab"]
    if shift:
        vocab = {**{f"\u0100filler{i}\u0100": i for i in range(shift)}, **{p: i + shift for p, i in vocab.items()}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m) if isinstance(m, list) else tuple(m.split(" "))
                                                          for m in state["model"]["merges"]]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(specials)
    bos = tokenizer.token_to_id(specials[0])
    if adds_bos:  # as Llama 3's tokenizer does
        tokenizer.post_processor = processors.TemplateProcessing(single=f"{specials[0]} $A", special_tokens=[
            (specials[0], bos)])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=specials[0], eos_token=specials[1]).save_pretrained(
        folder)
    return folder
