"""count_tokens.py: counts from the .idx alone, megatron's split, the plan, and the config.yaml rewrite."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SHIPPED
from ruamel.yaml import YAML

from gptpipe.cli import main
from gptpipe.data.indexed import bin_path, idx_path, read_index
from gptpipe.data.split import document_order, split_bounds
from gptpipe.artifacts import EXIT_BAD_INPUT, TOKENIZE


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
    new_lines = rewritten.splitlines()
    record = next(i for i, line in enumerate(new_lines) if line.strip().startswith("train_tokens_counted_for:"))
    assert new_lines[record - 1].strip().startswith("train_tokens:")  # the record sits right below the count
    del new_lines[record]
    changed = [(a, b) for a, b in zip(original.splitlines(), new_lines) if a != b]
    assert len(original.splitlines()) == len(new_lines) and len(changed) == 1
    before, after = changed[0]
    assert before.split("#")[1] == after.split("#")[1]  # the user's comment is kept
    train_section = YAML().load(rewritten)["train"]
    assert train_section["train_tokens"] == samples * seq_len
    assert f"split={SHIPPED.data.split}" in train_section["train_tokens_counted_for"]

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

    shutil.copy2(TOKENIZE.manifest_path(dataset_prefix), TOKENIZE.manifest_path(copy))
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


def test_training_refuses_a_train_tokens_counted_for_other_data(workspace: Path, dataset_prefix: Path,
                                                                  tmp_path: Path, capfd) -> None:
    """A count written for one dataset must not silently cut short (or stretch) a run on another."""
    config = workspace / "stale_config.yaml"  # beside config.yaml, so its relative paths resolve the same
    shutil.copy(workspace / "config.yaml", config)
    plan = ["plan", "--config", str(config)]
    assert count(config) == 0
    assert main(plan) == 0
    # Another real dataset: stage 2 again, skipping the longest documents.
    other = tmp_path / "other"
    assert main(["tokenize", "--config", str(config), f"tokenize.output_prefix={other}",
                 "tokenize.max_document_chars=20000"]) == 0
    elsewhere = f"data.prefixes=[{other}_text_document]"
    capfd.readouterr()
    assert main([*plan, elsewhere]) == EXIT_BAD_INPUT
    err = capfd.readouterr().err
    assert "was counted by count_tokens.py for other data" in err and "datasets " in err and "count_tokens.py" in err
    assert main([*plan, "train.train_epochs=2"]) == EXIT_BAD_INPUT  # the count was for one epoch
    assert "train_epochs 1 → 2" in capfd.readouterr().err
    assert main([*plan, elsewhere, "train.train_tokens_counted_for=null"]) == 0  # kept on purpose: a budget
    assert count(config, elsewhere) == 0  # counted again for the new data: accepted
    assert main([*plan, elsewhere]) == 0
