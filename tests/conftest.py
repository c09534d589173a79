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
