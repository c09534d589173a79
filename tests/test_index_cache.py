"""Stage 3's dataset indices built once per cache folder (train/index_cache.py), on three ranks of two "nodes": ranks
0 and 1 share one cache folder, rank 2 (the other node) has its own. The lowest rank of each folder builds (in a
child process), the others memory-map what it built; a second start builds nothing."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from conftest import train_env
from prewarmed import torchrun_env

from gptpipe.ports import free_port

RANK = """
import json, sys
from pathlib import Path
import numpy as np
import torch
import torch.distributed as td
from gptpipe.data.config import DataConfig
from gptpipe.data.count import count_dataset
from gptpipe.train.data import build_datasets

prefix, cache = Path(sys.argv[1]), Path(sys.argv[2])
td.init_process_group("gloo")
stats = [count_dataset(prefix, "90,9,1", 7)]
train, valid, _ = build_datasets(DataConfig(prefixes=[prefix], split="90,9,1", seed=7), stats, 64, [32, 8, 8], cache,
                                 32000, 2)
print(json.dumps({"rank": td.get_rank(), "mapped": [isinstance(a, np.memmap) for a in (
                      train.document_index, train.sample_index, train.shuffle_index, valid.document_index)],
                  "file": str(Path(train.document_index.filename).resolve()),
                  "sample": train[5]["tokens"].tolist()}))
"""


def start_ranks(prefix: Path, folders: list[Path]) -> list[tuple[dict, str]]:
    """One process per folder (its rank's cache folder), joined in a gloo group; each rank's line and stderr."""
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(prefix), str(folder)],
                              env={**train_env(len(folders)), **torchrun_env(rank, len(folders), 2, port)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank, folder in enumerate(folders)]
    outputs = [rank.communicate(timeout=600) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0] * len(ranks), "\n".join(err[-3000:] for _, err in outputs)
    return [(json.loads(out.strip().splitlines()[-1]), err) for out, err in outputs]


def test_one_builder_per_cache_folder_and_the_other_ranks_map_its_indices(dataset_prefix: Path,
                                                                         tmp_path: Path) -> None:
    node0, node1 = tmp_path / "node0" / "cache", tmp_path / "node1" / "cache"
    ranks = start_ranks(dataset_prefix, [node0, node0, node1])
    built = [r["rank"] for r, err in ranks if "building the dataset indices" in err]
    assert built == [0, 2]  # the lowest rank of each folder
    for (row, _), folder in zip(ranks, [node0, node0, node1]):
        assert all(row["mapped"]), row  # every index of every rank is a view of the cached file
        assert Path(row["file"]).parent.parent == folder.resolve()
    assert ranks[0][0]["sample"] == ranks[1][0]["sample"] == ranks[2][0]["sample"]  # the same data on both nodes
    for folder in (node0, node1):
        [indices] = folder.glob("indices-*")  # one folder of indices, no temporary or probe left
        assert sorted(p.name for p in folder.iterdir()) == sorted([indices.name, *(p.name for p in folder.glob(
            "document_order-*.npy"))])
        assert len(list(indices.glob("*.npy"))) == 9  # document, sample, shuffle index of train, valid, test
    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*.npy")}

    again = start_ranks(dataset_prefix, [node0, node0, node1])
    assert not [r["rank"] for r, err in again if "building the dataset indices" in err]
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*.npy")} == stamps
    assert [r["sample"] for r, _ in again] == [r["sample"] for r, _ in ranks]


def test_a_rerun_stage_2_gets_new_indices(dataset_prefix: Path, tmp_path: Path) -> None:
    """The cached indices are named by the dataset's manifest: another dataset (or a rerun) never reads them."""
    import shutil

    from gptpipe.artifacts import TOKENIZE
    from gptpipe.train.index_cache import indices_folder

    prefix = tmp_path / "data" / dataset_prefix.name
    prefix.parent.mkdir()
    for path in dataset_prefix.parent.glob(dataset_prefix.name + ".*"):
        shutil.copy2(path, prefix.parent / path.name)
    settings = {"split": "90,9,1", "seed": 7}
    first = indices_folder(tmp_path, [prefix], settings)
    assert first == indices_folder(tmp_path, [dataset_prefix], settings)  # the same manifest
    assert indices_folder(tmp_path, [prefix], {**settings, "seed": 8}) != first
    manifest = TOKENIZE.manifest_path(prefix)
    manifest.write_text(manifest.read_text().replace('"created"', '"created" ', 1))  # as a rerun writes another
    assert indices_folder(tmp_path, [prefix], settings) != first


def test_a_killed_builder_leaves_its_temporary_to_the_next_builder(dataset_prefix: Path, tmp_path: Path) -> None:
    """A rank SIGKILLed while its child builds (the whole process group: no cleanup runs) leaves a temporary folder;
    the next start on this host removes it, says so, and builds."""
    cache = tmp_path / "cache"
    rank = subprocess.Popen([sys.executable, "-c", RANK, str(dataset_prefix), str(cache)],
                            env={**train_env(1), **torchrun_env(0, 1, 1, free_port())}, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not list(cache.glob("indices-*.tmp-*")) and rank.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(rank.pid, signal.SIGKILL)
    rank.wait()
    [left] = cache.glob("indices-*.tmp-*")
    assert left.name.endswith(f"-{rank.pid}@{socket.gethostname()}")

    [(row, err)] = start_ranks(dataset_prefix, [cache])
    assert f"removing {left}: left by a build that was killed (pid {rank.pid})" in err
    assert "building the dataset indices" in err and all(row["mapped"])
    [indices] = cache.glob("indices-*")
    assert ".tmp-" not in indices.name and not left.exists()
