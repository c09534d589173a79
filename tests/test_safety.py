"""What gptpipe refuses so that a wrong path never costs a user data: a stage writes only where it wrote before (or
into a new or empty folder), never over its inputs, the working directory or a folder above it, and never under a
name a user's file has."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, train_env

from gptpipe.artifacts import EXIT_BAD_INPUT


def script(name: str, *argv: object, cwd: Path) -> subprocess.CompletedProcess:
    """One of the numbered scripts as a user runs it, from `cwd`."""
    env = {**train_env(), "PYTHON": sys.executable, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return subprocess.run(["bash", str(REPO / name), *map(str, argv)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def tree(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under `folder` with its size and mtime: what must stay as it was."""
    return {p.relative_to(folder).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def jsonl_source(folder: Path, count: int = 40) -> Path:
    """A user's own jsonl source of `count` distinct Japanese documents."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "docs.jsonl"
    lines = [json.dumps({"text": f"これは{i}番目の文書です。日本語の文章を十分な長さで書いておきます。"
                                 f"番号{i * 7919}は重複を避けるためのものです。"}, ensure_ascii=False)
             for i in range(count)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def prepare(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "0_prepare_corpus.py"), "--config", str(cwd / "config.yaml"),
                           *overrides], cwd=cwd, env=train_env(), capture_output=True, text=True, timeout=600)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A user's project folder: the shipped config.yaml (comments and all) and a jsonl source under raw/."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "config.yaml").write_text((REPO / "config.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    jsonl_source(folder / "raw")
    return folder


SOURCE = ("corpus.sources=[{type: jsonl, path: raw/docs.jsonl}]", "corpus.languages=[]", "corpus.min_chars=10")


def test_stage_4_into_the_run_folder_is_refused_and_the_checkpoints_stay(tiny_run, tmp_path: Path) -> None:
    """A typo that names the training run as the export folder: exit 2 naming both paths and the key, and every
    checkpoint file as it was; an export folder above the run (it would hold the run) is refused the same way."""
    run = tiny_run()
    before = tree(run)
    for output in (run, run.parent):
        done = script("4_convert_to_HF.sh", "--config", REPO / "convert_config.yaml", f"input_model_dir={run}",
                      f"output_tokenizer_and_model_dir={output}", cwd=tmp_path)
        assert done.returncode == EXIT_BAD_INPUT, done.stderr[-3000:]
        assert f"output_tokenizer_and_model_dir {output}" in done.stderr and str(run) in done.stderr
        assert "Traceback" not in done.stderr
    assert tree(run) == before


def test_stage_0_into_the_working_directory_keeps_the_users_config(project: Path) -> None:
    """corpus.output_dir=. would have replaced the commented config.yaml by the resolved corpus section."""
    config = (project / "config.yaml").read_bytes()
    before = tree(project)
    done = prepare(project, *SOURCE, "corpus.output_dir=.")
    assert done.returncode == EXIT_BAD_INPUT, done.stderr[-3000:]
    assert f"corpus.output_dir {project} is the working directory" in done.stderr and "Traceback" not in done.stderr
    assert (project / "config.yaml").read_bytes() == config and tree(project) == before


def test_stage_0_refuses_an_output_folder_that_holds_its_source(project: Path) -> None:
    """The source's own folder as the corpus folder (it holds files stage 0 did not write), then a corpus folder
    the first run made that a later source lies inside: both refused, the source untouched."""
    source = project / "raw" / "docs.jsonl"
    text = source.read_bytes()
    done = prepare(project, *SOURCE, "corpus.output_dir=raw")
    assert done.returncode == EXIT_BAD_INPUT, done.stderr[-3000:]
    assert f"corpus.output_dir {project / 'raw'} holds files the prepare stage did not write (docs.jsonl" in done.stderr

    done = prepare(project, *SOURCE, "corpus.output_dir=out")
    assert done.returncode == 0, done.stderr[-3000:]
    inside = project / "out" / "more.jsonl"
    inside.write_bytes(text)
    done = prepare(project, "corpus.sources=[{type: jsonl, path: out/more.jsonl}]", *SOURCE[1:],
                   "corpus.output_dir=out")
    assert done.returncode == EXIT_BAD_INPUT, done.stderr[-3000:]
    assert f"corpus.output_dir {project / 'out'} holds corpus.sources[0].path {inside}" in done.stderr
    assert source.read_bytes() == text and inside.read_bytes() == text


def test_a_stage_writes_its_resolved_config_under_its_own_name(project: Path) -> None:
    """Beside the manifest: prepare.resolved.yaml, never config.yaml; a rerun into its own folder is allowed."""
    done = prepare(project, *SOURCE, "corpus.output_dir=out")
    assert done.returncode == 0, done.stderr[-3000:]
    out = project / "out"
    assert (out / "prepare.resolved.yaml").is_file() and not (out / "config.yaml").exists()
    done = prepare(project, *SOURCE, "corpus.output_dir=out", "--force")
    assert done.returncode == 0, done.stderr[-3000:]
