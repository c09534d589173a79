"""count_tokens.py: counts from the .idx alone, megatron's split, the plan, and the config.yaml rewrite."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SHIPPED
from ruamel.yaml import YAML

from gptpipe.cli import EXIT_BAD_INPUT, main
from gptpipe.data.count import document_order, split_bounds
from gptpipe.data.indexed import bin_path, idx_path, manifest_path, read_index


def count(config: Path, *extra: str) -> int:
    return main(["count", "--config", str(config), *extra])


@pytest.mark.parametrize("split", ["969,30,1", "949,50,1", "98,2,0", "1,0,0", "80,10,10", "0.7,0.2,0.1", "100,0,1",
                                   "1,1,1"])
def test_split_bounds_are_megatrons(split: str) -> None:
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split)

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    for documents in (0, 1, 7, 500, 1785, 1_000_003):
        theirs = [None if m is None else (int(round(m[0] * documents)), int(round(m[1] * documents))) for m in matrix]
        assert split_bounds(split, documents) == theirs


def test_count_prints_the_plan_and_rewrites_only_train_tokens(workspace: Path, dataset_prefix: Path, capsys) -> None:
    config = workspace / "count_config.yaml"  # beside config.yaml, so its relative paths resolve the same
    shutil.copy(workspace / "config.yaml", config)
    original = config.read_text(encoding="utf-8")

    assert count(config) == 0
    out = capsys.readouterr().out
    index = read_index(idx_path(dataset_prefix))
    sizes = index.sizes.astype("int64")
    bounds = split_bounds(SHIPPED.data.split, index.documents)
    train_documents = document_order(index.documents, SHIPPED.data.seed)[bounds[0][0]:bounds[0][1]]
    train_tokens = int(sizes[train_documents].sum())  # the split training cuts from the seeded shuffle
    seq_len, batch = SHIPPED.train.seq_len, SHIPPED.train.global_batch_size
    assert SHIPPED.train.train_epochs == 1
    samples = (train_tokens - 1) // seq_len  # 1 epoch, as in the shipped config.yaml
    assert f"{index.documents:,} documents, {int(sizes.sum()):,} tokens (uint16)" in out
    assert f"train {bounds[0][1] - bounds[0][0]:>12,} documents {train_tokens:>16,} tokens" in out
    assert f"samples per epoch     {samples:,}" in out
    assert f"iterations per epoch  {samples // batch:,}" in out

    rewritten = config.read_text(encoding="utf-8")
    changed = [(a, b) for a, b in zip(original.splitlines(), rewritten.splitlines()) if a != b]
    assert len(original.splitlines()) == len(rewritten.splitlines()) and len(changed) == 1
    before, after = changed[0]
    assert before.split("#")[1] == after.split("#")[1]  # the user's comment is kept
    assert YAML().load(rewritten)["train"]["train_tokens"] == samples * seq_len

    assert count(config, "--no-write", "train.train_epochs=2") == 0
    assert config.read_text(encoding="utf-8") == rewritten
    assert f"train_tokens {2 * samples * seq_len:,}" in capsys.readouterr().out


def test_count_sums_several_prefixes(workspace: Path, dataset_prefix: Path, capsys) -> None:
    index = read_index(idx_path(dataset_prefix))
    assert count(workspace / "config.yaml", "--no-write", f"data.prefixes=[{dataset_prefix},{dataset_prefix}]") == 0
    out = capsys.readouterr().out
    assert f"all 2 datasets: {2 * index.documents:,} documents, {2 * index.tokens:,} tokens" in out


def test_count_refuses_a_dataset_without_complete_manifest(workspace: Path, dataset_prefix: Path, tmp_path: Path,
                                                           capfd) -> None:
    copy = tmp_path / dataset_prefix.name
    for path in (bin_path, idx_path):
        shutil.copy2(path(dataset_prefix), path(copy))  # copy2 keeps the mtimes the manifest recorded
    config = workspace / "config.yaml"
    assert count(config, "--no-write", f"data.prefixes=[{copy}]") == EXIT_BAD_INPUT
    err = capfd.readouterr().err
    assert f"{copy.name}.manifest.json not found" in err and "Run: bash 2_tokenize.sh" in err

    shutil.copy2(manifest_path(dataset_prefix), manifest_path(copy))
    assert count(config, "--no-write", f"data.prefixes=[{copy}]") == 0  # the complete copy is accepted
    with open(bin_path(copy), "ab") as fh:
        fh.write(b"\0\0")
    assert count(config, "--no-write", f"data.prefixes=[{copy}]") == EXIT_BAD_INPUT
    assert "changed after the stage finished" in capfd.readouterr().err


def test_count_imports_neither_torch_nor_megatron(workspace: Path, dataset_prefix: Path) -> None:
    code = ("import sys; from gptpipe.cli import main; "
            f"assert main(['count', '--config', {str(workspace / 'config.yaml')!r}, '--no-write']) == 0; "
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'transformers')); "
            "assert not heavy, heavy")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
