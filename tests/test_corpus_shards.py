"""Stage 0 in shards: the same corpus whatever the shards and the workers (processes here, a two-node Ray
cluster on this machine), line numbers of cut files as in the file, and a run that died continuing from the
shards it finished."""

from __future__ import annotations

import json
import logging
import os
import random
import re
from pathlib import Path

import pytest
import yaml

from conftest import corpus_bytes, corpus_texts, require_manpages
from gptpipe.artifacts import read_corpus
from gptpipe.cli import main
from gptpipe.corpus import dedup, executor, shards
from gptpipe.corpus.config import CorpusConfig, SourceConfig
from gptpipe.stage import Manifest
from test_corpus_neardup import MAN, manpage_texts, near_copy, write_jsonl

NEAR = "near duplicate (Jaccard ≥ 0.8)"


@pytest.fixture(scope="module")
def documents(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of input: big.jsonl (Japanese and English man pages, near copies of some, exact copies of kept
    pages far from their originals, short documents, bad lines) and more/ (three small jsonl files)."""
    require_manpages()
    folder = tmp_path_factory.mktemp("shard-input")
    ja, en = manpage_texts(MAN / "ja", 41, 20), manpage_texts(MAN, 701, 12)
    rng = random.Random(5)
    lines = [json.dumps({"text": t}, ensure_ascii=False) for t in ja + en]
    lines[3:3] = ["", "{not json", json.dumps({"text": "短すぎる"}, ensure_ascii=False)]
    lines += [json.dumps({"text": near_copy(t, "ja", rng)}, ensure_ascii=False) for t in ja[:8]]
    lines += [json.dumps({"text": t}, ensure_ascii=False) for t in (ja[1], en[2], ja[1])]  # exact copies
    (folder / "big.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (folder / "more").mkdir()
    for i in range(3):
        write_jsonl(folder / "more" / f"part{i}.jsonl", [near_copy(en[i], "en", rng), ja[10 + i], f"短い{i}"])
    return folder


def run_stage0(documents: Path, out: Path, *overrides: str) -> Manifest:
    """Stage 0 on both sources of `documents` (Japanese and English kept) into `out`."""
    config = {"corpus": {"sources": [{"type": "jsonl", "path": str(documents / "big.jsonl")},
                                     {"type": "jsonl", "path": str(documents / "more")}],
                         "output_dir": str(out), "languages": ["ja", "en"]}}
    path = out.with_name(out.name + ".yaml")
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    assert main(["prepare", "--config", str(path), *overrides]) == 0
    return Manifest.read(out / "manifest.json")


def samples(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted((out / "dropped").glob("*.jsonl"))}


def test_the_corpus_is_the_same_whatever_the_shards_and_workers(documents: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    whole = run_stage0(documents, tmp_path / "whole", "corpus.workers=1")
    assert whole.counts["shards"] == 2  # one per source: big.jsonl is far under 64 MB
    monkeypatch.setattr(shards, "MB", 24 << 10)  # shards of 48 KB: big.jsonl is cut into line ranges
    plan = shards.plan_shards(CorpusConfig(sources=[SourceConfig(type="jsonl", path=documents / "big.jsonl"),
                                                    SourceConfig(type="jsonl", path=documents / "more")],
                                           shard_mb=2))
    cut = [s for s in plan if s.end is not None]
    assert len(cut) >= 4 and cut[0].start == 0 and all(a.end == b.start for a, b in zip(cut, cut[1:]))
    assert [file for s in plan if s.source == 1 for file in s.files] == [
        str(documents / "more" / f"part{i}.jsonl") for i in range(3)]
    one = run_stage0(documents, tmp_path / "one", "corpus.shard_mb=2", "corpus.workers=1")
    two = run_stage0(documents, tmp_path / "two", "corpus.shard_mb=2", "corpus.workers=2")
    assert one.counts["shards"] == len(plan)
    kept = corpus_texts(tmp_path / "whole")
    assert corpus_texts(tmp_path / "one") == corpus_texts(tmp_path / "two") == kept
    # Byte for byte, origins included: a cut file's lines carry the file's line numbers whatever the cut.
    assert corpus_bytes(tmp_path / "one") == corpus_bytes(tmp_path / "two") == corpus_bytes(tmp_path / "whole")
    assert samples(tmp_path / "one") == samples(tmp_path / "two")
    assert one.counts == two.counts
    # The exact copies are of kept pages, so every drop is counted as without shards, with the file's line
    # numbers (a near copy names the page it duplicates).
    assert one.counts["dropped"] == whole.counts["dropped"]
    assert one.counts["dropped_examples"][NEAR] == whole.counts["dropped_examples"][NEAR]
    big = documents / "big.jsonl"
    assert whole.counts["dropped_examples"][NEAR][0] == f"{big}:36 (duplicate of {big}:1)"
    more = [f"{documents / 'more' / f'part{i}.jsonl'}:2" for i in range(3)]
    assert one.counts["dropped"]["exact duplicate"] == 6
    assert set(one.counts["dropped_examples"]["exact duplicate"]) <= {f"{big}:{n}" for n in (44, 45, 46)} | set(more)
    assert one.counts["dropped_examples"]["blank line"] == [f"{big}:4"]
    assert samples(tmp_path / "one")["dropped/near_duplicate_Jaccard_0.8.jsonl"] == \
        samples(tmp_path / "whole")["dropped/near_duplicate_Jaccard_0.8.jsonl"]
    # Where and how fast the shards are judged is left out of the manifest: another worker count is up to date.
    assert "workers" not in one.config and "executor" not in one.config
    # One file per shard that kept a document, in shard order (not dropped/*.jsonl), each document with its
    # source's label and its origin.
    files = read_corpus(tmp_path / "one").files
    assert files == tuple(tmp_path / "one" / f"corpus-{n:05d}.jsonl" for n in range(len(files)))
    assert all(path.stat().st_size for path in files) and len(files) < one.counts["shards"]  # more/ kept none
    records = [json.loads(line) for path in files for line in path.read_text(encoding="utf-8").splitlines()]
    assert {r["source"] for r in records} == {"big"}  # more/'s pages are copies of big's, or too short
    assert one.counts["sources"] == {
        "big": {"documents": len(records), "characters": one.counts["characters"], "files": [p.name for p in files]},
        "more": {"documents": 0, "characters": 0, "files": []}}
    lines = (documents / "big.jsonl").read_text(encoding="utf-8").splitlines()
    for record in records:
        path, line = record["origin"].rsplit(":", 1)
        if path == str(documents / "big.jsonl"):
            assert json.loads(lines[int(line) - 1])["text"].strip() == record["text"]
    assert not (tmp_path / "one" / ".work").exists()
    # corpus.join: the same documents in one corpus.jsonl; the shards of the run before it are gone.
    joined = run_stage0(documents, tmp_path / "one", "corpus.shard_mb=2", "corpus.workers=1", "corpus.join=true")
    assert read_corpus(tmp_path / "one").files == (tmp_path / "one" / "corpus.jsonl",)
    assert (tmp_path / "one" / "corpus.jsonl").read_bytes() == corpus_bytes(tmp_path / "two")
    assert sorted(p.name for p in (tmp_path / "one").glob("corpus*")) == ["corpus.jsonl"]
    assert joined.counts["documents"] == one.counts["documents"]


def test_a_run_that_died_continues_from_its_finished_shards(documents: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shards, "MB", 24 << 10)
    clean = run_stage0(documents, tmp_path / "clean", "corpus.shard_mb=2", "corpus.workers=1")
    judged: list[int] = []
    real = executor.judge_shard

    def dies_at_the_third(config, shard, work):  # judge_shard's signature
        if len(judged) == 2 and not os.environ.get("SHARDS_LIVE"):
            raise KeyboardInterrupt  # as a kill between two shards
        judged.append(shard.index)
        return real(config, shard, work)

    monkeypatch.setattr(executor, "judge_shard", dies_at_the_third)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        run_stage0(documents, out, "corpus.shard_mb=2", "corpus.workers=1")
    assert not list(out.glob("corpus*.jsonl"))
    assert sorted(p.name for p in (out / ".work").glob("shard-*")) == ["shard-000000", "shard-000001"]
    monkeypatch.setenv("SHARDS_LIVE", "1")
    judged.clear()
    again = run_stage0(documents, out, "corpus.shard_mb=2", "corpus.workers=1")
    assert judged == list(range(2, clean.counts["shards"]))  # the two finished shards were not judged again
    assert corpus_bytes(out) == corpus_bytes(tmp_path / "clean")
    assert again.counts["dropped"] == clean.counts["dropped"] and samples(out) == samples(tmp_path / "clean")
    # Another config is another plan: its shards start from nothing.
    monkeypatch.delenv("SHARDS_LIVE")
    judged.clear()
    with pytest.raises(KeyboardInterrupt):
        run_stage0(documents, out, "corpus.shard_mb=2", "corpus.workers=1", "corpus.min_chars=60")
    judged.clear()
    monkeypatch.setenv("SHARDS_LIVE", "1")
    run_stage0(documents, out, "corpus.shard_mb=3", "corpus.workers=1", "corpus.min_chars=60")
    assert judged[0] == 0


def test_a_run_killed_while_deduplicating_continues_without_judging_again(
        documents: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shards, "MB", 24 << 10)
    clean = run_stage0(documents, tmp_path / "clean", "corpus.shard_mb=2", "corpus.workers=1")
    searched: list[dedup.Search] = []
    real = dedup.search

    def dies_at_the_second(config, item, work):  # search's signature
        if len(searched) == 1 and not os.environ.get("SHARDS_LIVE"):
            raise KeyboardInterrupt  # as a kill between two partitions
        searched.append(item)
        return real(config, item, work)

    monkeypatch.setattr(dedup, "search", dies_at_the_second)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        run_stage0(documents, out, "corpus.shard_mb=2", "corpus.workers=1")
    assert not list(out.glob("corpus*.jsonl")) and (out / ".work" / "dedup").is_dir()
    judged: list[int] = []
    monkeypatch.setattr(executor, "judge_shard", lambda config, shard, work: judged.append(shard.index))
    monkeypatch.setenv("SHARDS_LIVE", "1")
    again = run_stage0(documents, out, "corpus.shard_mb=2", "corpus.workers=1")
    assert judged == []  # every shard was finished: only the duplicate steps ran again
    assert corpus_bytes(out) == corpus_bytes(tmp_path / "clean")
    assert again.counts["dropped"] == clean.counts["dropped"] and samples(out) == samples(tmp_path / "clean")


def test_an_origin_in_a_cut_file_moves_to_the_files_line_with_what_its_example_says() -> None:
    assert shards.relocate("big.jsonl:5", 10) == "big.jsonl:15"
    assert shards.relocate("/d:x/big.jsonl:5 (duplicate of big.jsonl:3)", 10) == \
        "/d:x/big.jsonl:15 (duplicate of big.jsonl:3)"
    assert shards.relocate('big.jsonl:5 (overlaps jcqa item 3: "a:7") (left 9 characters)', 1) == \
        'big.jsonl:6 (overlaps jcqa item 3: "a:7") (left 9 characters)'


def test_two_node_ray_cluster_writes_the_same_corpus(documents: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A real Ray cluster on this machine: a head node and a second node joined to it, one CPU each (Ray binds
    them to the machine's own address rather than 127.0.0.1); stage 0 joins it as a driver."""
    if os.environ.get("CI"):
        import ray
    else:
        ray = pytest.importorskip("ray", reason="pip install -e .[ray]")
    from ray.cluster_utils import Cluster

    monkeypatch.setattr(shards, "MB", 24 << 10)
    local = run_stage0(documents, tmp_path / "local", "corpus.shard_mb=2", "corpus.workers=1")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        with caplog.at_level(logging.INFO, logger="gptpipe.prepare"):
            on_ray = run_stage0(documents, tmp_path / "ray", "corpus.shard_mb=2", "corpus.executor=ray",
                                f"corpus.ray_address={cluster.address}")
        assert not ray.is_initialized()  # stage 0 left the cluster as it found it
    finally:
        cluster.shutdown()
    # Every step ran as Ray tasks: judging, bucketing, the search of the partitions and the filtering.
    for what in ("shard(s) to judge", "shard(s) to bucket for duplicates", "partition(s) to search for duplicates",
                 "shard(s) to filter"):
        assert f"{what} on Ray (2 node(s), 2 CPU(s))" in caplog.text, what
        # Each task's CPU seconds came back from the Ray worker that ran it (one per node, or one of them).
        assert re.search(rf"{re.escape(what)}: [\d.]+ CPU s in the tasks, in [12] process\(es\)", caplog.text), what
    assert corpus_bytes(tmp_path / "ray") == corpus_bytes(tmp_path / "local")
    assert on_ray.counts == local.counts and samples(tmp_path / "ray") == samples(tmp_path / "local")


def test_an_hf_dataset_in_a_folder_splits_by_its_data_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save_to_disk folder in 3 arrow files (a DatasetDict's train split) and a folder of 3 parquet files
    are planned a shard or more per file at a small shard_mb, read in row order, each row's origin its file and
    row; the corpus is the one whole shards give."""
    datasets = pytest.importorskip("datasets")
    require_manpages()
    texts = manpage_texts(MAN / "ja", 41, 12)
    rows = {"text": [*texts[:5], "短い", *texts[5:]]}  # one row dropped as too short: its origin is shown
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "saved"),
                                                                                    num_shards={"train": 3})
    (tmp_path / "parquet").mkdir()
    for i in range(3):
        datasets.Dataset.from_dict({"text": texts[4 * i:4 * i + 4]}).to_parquet(str(tmp_path / "parquet" /
                                                                                 f"part-{i}.parquet"))
    config = {"corpus": {"sources": [{"type": "hf_dataset", "path": str(tmp_path / "saved")},
                                     {"type": "hf_dataset", "path": str(tmp_path / "parquet")}],
                         "output_dir": str(tmp_path / "whole"), "languages": [],
                         "near_dedup": {"threshold": None}, "dedup": False}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    assert main(["prepare", "--config", str(path), "corpus.workers=1"]) == 0
    monkeypatch.setattr(shards, "MB", 1 << 10)  # shard_mb 1 = 1 KB: every data file a shard of its own
    plan = shards.plan_shards(CorpusConfig(sources=[SourceConfig(type="hf_dataset", path=tmp_path / "saved"),
                                                    SourceConfig(type="hf_dataset", path=tmp_path / "parquet")],
                                           shard_mb=1))
    arrow = sorted(str(p) for p in (tmp_path / "saved" / "train").glob("*.arrow"))
    parquet = [str(tmp_path / "parquet" / f"part-{i}.parquet") for i in range(3)]
    assert [s.files for s in plan] == [(f,) for f in arrow + parquet]
    assert main(["prepare", "--config", str(path), f"corpus.output_dir={tmp_path / 'split'}", "corpus.shard_mb=1",
                 "corpus.workers=2"]) == 0
    kept = corpus_texts(tmp_path / "split")
    assert kept == corpus_texts(tmp_path / "whole") == texts + texts
    manifest = Manifest.read(tmp_path / "split" / "manifest.json")
    assert manifest.counts["shards"] == 6
    assert manifest.counts["dropped_examples"]["shorter than min_chars (50)"] == [f"{arrow[1]}[0]"]
