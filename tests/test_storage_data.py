"""Data in a bucket, on real object-storage servers on 127.0.0.1 (moto's S3 server, gcp-storage-emulator):
stage 0 reading its sources from URLs, stage 2 writing its prefix to one, count_tokens and stage 3 reading URL
prefixes and a URL tokenizer through the verified cache, stage 4 exporting to a URL and stage 6 uploading from
there."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import (FAKE_KEY_ID, FAKE_SECRET, FAKE_TOKEN, TINY_RUN, corpus_bytes, corpus_texts, open_store, run_cli,
                      run_train, train_losses)
from conftest import HUB_TOKEN as TOKEN

from gptpipe.cli import main
from gptpipe.stage import Manifest


@contextlib.contextmanager
def data_store(kind: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator:
    """conftest's store, with the fetch cache (under the system temp folder) moved into ``tmp_path``."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with open_store(kind, monkeypatch) as store:
        yield store


@pytest.fixture(params=["s3", "gs"])
def store(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    with data_store(request.param, monkeypatch, tmp_path) as store:
        yield store


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    with data_store("s3", monkeypatch, tmp_path) as store:
        yield store


def test_stage0_reads_the_same_corpus_from_a_bucket(store, tmp_path: Path, capfd) -> None:
    datasets = pytest.importorskip("datasets")
    raw = tmp_path / "raw"
    raw.mkdir()
    good = [f"バケットの文書その{i}です。" for i in range(6)]
    lines = (json.dumps({"text": good[0]}, ensure_ascii=False).encode(), b'{"text": broken',
             json.dumps({"text": good[0]}, ensure_ascii=False).encode(),  # a duplicate
             json.dumps({"text": good[1]}, ensure_ascii=False).encode())
    (raw / "a.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))
    with gzip.open(raw / "b.json.gz", "wt", encoding="utf-8") as fh:
        json.dump([{"text": good[2]}], fh, ensure_ascii=False)
    with gzip.open(raw / "c.jsonl.gz", "wt", encoding="utf-8") as fh:
        fh.write(json.dumps({"text": good[3]}, ensure_ascii=False) + "\n")
    (raw / "d.txt").write_text(f"{good[4]}\n\n短い\n", encoding="utf-8")
    datasets.Dataset.from_dict({"text": [good[5]]}).to_parquet(str(raw / "e.parquet"))
    store.fs.put(str(raw) + "/", f"{store.bucket}/corpus/", recursive=True)

    def sources(root: str) -> list[dict]:
        return [{"type": "jsonl", "path": f"{root}/*.json*"},
                {"type": "text", "path": f"{root}/d.txt", "text_unit": "paragraph"},
                {"type": "hf_dataset", "path": f"{root}/e.parquet"}]

    corpora = {}
    for name, root in (("local", str(raw)), ("bucket", f"{store.url}/corpus")):
        config = tmp_path / f"{name}.yaml"
        config.write_text(yaml.safe_dump({"corpus": {"sources": sources(root), "output_dir": name, "min_chars": 5}},
                                         allow_unicode=True), encoding="utf-8")
        run_cli("prepare", "--config", config)
        corpora[name] = Manifest.read(tmp_path / name / "manifest.json").counts
    assert corpus_texts(tmp_path / "bucket") == corpus_texts(tmp_path / "local") == good
    assert corpora["bucket"]["dropped"] == corpora["local"]["dropped"] == {
        "invalid json": 1, "exact duplicate": 1, "shorter than min_chars (5)": 1}
    assert corpora["bucket"]["dropped_examples"]["invalid json"] == [f"{store.url}/corpus/a.jsonl:2"]

    # The objects' versions are the stage's input: unchanged, a rerun skips; a rewritten object redoes it.
    capfd.readouterr()
    run_cli("prepare", "--config", tmp_path / "bucket.yaml")
    assert "up to date" in capfd.readouterr().err
    store.fs.pipe_file(f"{store.bucket}/corpus/c.jsonl.gz",
                       gzip.compress(json.dumps({"text": "書き換えた文書です。"}, ensure_ascii=False).encode()))
    run_cli("prepare", "--config", tmp_path / "bucket.yaml")
    assert "書き換えた文書です。" in corpus_texts(tmp_path / "bucket")
    with pytest.raises(AssertionError):  # a glob that matches nothing is refused, naming it
        run_cli("prepare", "--config", tmp_path / "bucket.yaml", f"corpus.sources=[{{type: jsonl, path: "
                f"'{store.url}/nothing/*.jsonl'}}]")
    assert f"{store.url}/nothing/*.jsonl: no input files found" in capfd.readouterr().err


def test_stage0_plans_a_bucket_source_in_shards_as_local_files(s3, corpus_dir: Path, tmp_path: Path) -> None:
    """A source of 25 objects of mixed sizes in a bucket (the man-page corpus's lines, one object of 2.6 MB among
    them) is sized from one listing and planned as the same files on disk are: the same shards, the big object cut
    into 1 MB line ranges read with ranged reads; stage 0 on two workers writes the same corpus from either."""
    from gptpipe.corpus.shards import plan_shards

    lines = corpus_bytes(corpus_dir).splitlines(keepends=True)
    raw = tmp_path / "raw"
    raw.mkdir()
    big, at = 0, 0
    while big < (2600 << 10):  # the first object: 2.6 MB of whole lines
        big += len(lines[at])
        at += 1
    (raw / "part-00.jsonl").write_bytes(b"".join(lines[:at]))
    for k in range(1, 25):  # then 24 more of 1 to 24 lines each
        (raw / f"part-{k:02d}.jsonl").write_bytes(b"".join(lines[at:at + k]))
        at += k
    s3.fs.put(str(raw) + "/", f"{s3.bucket}/corpus/", recursive=True)

    plans, corpora = {}, {}
    for name, root in (("local", str(raw)), ("bucket", f"{s3.url}/corpus")):
        config = tmp_path / f"{name}.yaml"
        config.write_text(yaml.safe_dump({"corpus": {"sources": [{"type": "jsonl", "path": f"{root}/*.jsonl"}],
                                                     "output_dir": name, "shard_mb": 1, "workers": 2}}),
                          encoding="utf-8")
        plans[name] = [(s.source, [Path(f).name for f in s.files], s.size, s.start, s.end)
                       for s in plan_shards(_corpus_config(config))]
        run_cli("prepare", "--config", config)
        corpora[name] = corpus_texts(tmp_path / name)
    assert plans["bucket"] == plans["local"] and len(plans["bucket"]) >= 4
    cut = [p for p in plans["bucket"] if p[4] is not None]
    assert [p[1] for p in cut] == [["part-00.jsonl"]] * 3 and cut[-1][4] == (raw / "part-00.jsonl").stat().st_size
    assert corpora["bucket"] == corpora["local"] and len(corpora["local"]) > 100


def _corpus_config(path: Path):
    """config.yaml's corpus section at `path`, as stage 0 loads it."""
    from gptpipe.config.core import load_config
    from gptpipe.pipeline import PipelineConfig

    return load_config(PipelineConfig, path).corpus


def cached_files(tmp_path: Path) -> set[str]:
    cache = tmp_path / "tmp" / f"gptpipe-cache-{os.getuid()}"
    return {p.name for p in cache.rglob("*") if p.is_file() and p.name != ".lock"}


def test_stage2_to_a_bucket_then_count_and_train_from_it(s3, workspace: Path, dataset_prefix: Path,
                                                         tokenizer_dir: Path, tiny_run, tmp_path: Path,
                                                         capfd) -> None:
    config = workspace / "config.yaml"
    # The tokenizer as `aws s3 sync` / `gsutil rsync` leaves it (new mtimes: the fetch checks sizes and the manifest).
    s3.fs.put(str(tokenizer_dir) + "/", f"{s3.bucket}/tokenizers/ja_32k/", recursive=True)
    tokenizer_url = f"{s3.url}/tokenizers/ja_32k"
    prefix_url = f"{s3.url}/tokenized/ja_text_document"
    bucket = (f"tokenize.tokenizer_dir={tokenizer_url}", f"data.prefixes=[{prefix_url}]")

    # Stage 2 writes locally, then uploads the .bin/.idx and its manifest last: the same bytes as a local run.
    run_cli("tokenize", "--config", config, *bucket, f"tokenize.output_prefix={s3.url}/tokenized/ja")
    for suffix in (".bin", ".idx"):
        assert s3.fs.cat_file(f"{prefix_url[5:]}{suffix}") == dataset_prefix.with_name(
            dataset_prefix.name + suffix).read_bytes()
    manifest = json.loads(s3.fs.cat_file(f"{prefix_url[5:]}.manifest.json"))
    assert manifest["complete"] and manifest["config"]["output_prefix"] == f"{s3.url}/tokenized/ja"
    # The bucket's tokenizer is the local one: its fingerprint (the manifest's hash) is the same.
    local_manifest = Manifest.read(dataset_prefix.with_name(dataset_prefix.name + ".manifest.json"))
    assert manifest["inputs"]["tokenizer"] == local_manifest.inputs["tokenizer"]
    capfd.readouterr()
    run_cli("tokenize", "--config", config, *bucket, f"tokenize.output_prefix={s3.url}/tokenized/ja")
    assert f"{prefix_url} is up to date" in capfd.readouterr().err

    # count_tokens on a new machine (an empty cache) reads the .idx alone and counts what the local count does.
    cache = tmp_path / "tmp" / f"gptpipe-cache-{os.getuid()}"
    for path in sorted(cache.rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    run_cli("count", "--config", config, "--no-write", *bucket)
    from_bucket = capfd.readouterr().out
    run_cli("count", "--config", config, "--no-write")
    local = capfd.readouterr().out
    assert from_bucket.replace(prefix_url, str(dataset_prefix)) == local
    assert "ja_text_document.bin" not in cached_files(tmp_path) and "ja_text_document.idx" in cached_files(tmp_path)

    # Stage 3 on the bucket's data and tokenizer trains exactly as on the local ones; its dataset indices and split
    # order go up beside the data, the record last.
    done = run_train("--config", config, *TINY_RUN, *bucket, f"train.output_model_dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert train_losses(tmp_path / "run") == train_losses(tiny_run())
    assert {"ja_text_document.bin", "tokenizer.model"} <= cached_files(tmp_path)
    assert "building the dataset indices" in done.stderr and "uploaded the dataset indices to" in done.stderr
    [record] = s3.fs.glob(f"{prefix_url[5:]}.indices/*/indices.json")
    copied = json.loads(s3.fs.cat_file(record))["files"]
    built = next((tmp_path / "run" / "data_cache").glob("indices-*"))
    assert {n for n in copied if not n.startswith("document_order-")} == {p.name for p in built.iterdir()}
    assert [n for n in copied if n.startswith("document_order-")]
    # A second run with a cache of its own (another node, a restart on a fresh machine) downloads them instead of
    # building, and trains the same.
    again = run_train("--config", config, *TINY_RUN, *bucket, f"train.output_model_dir={tmp_path / 'run2'}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "fetched the dataset indices from" in again.stderr and "building the dataset indices" not in again.stderr
    assert train_losses(tmp_path / "run2") == train_losses(tiny_run())
    for secret in (FAKE_KEY_ID, FAKE_SECRET, FAKE_TOKEN):
        assert secret not in done.stderr + from_bucket


def test_a_planted_or_torn_bucket_copy_of_the_indices_is_not_used(s3, tmp_path: Path, capfd) -> None:
    """A bucket copy of the dataset indices holding a pickle (an object array, which megatron-core's allow_pickle
    load would run), or whose record lists a file that is not there, is refused with the URL and the reason: the
    builder builds instead, and nothing of the copy is left in the cache folder."""
    import numpy as np

    from gptpipe.committed import CommittedFolder
    from gptpipe.train.index_cache import COPY_RECORD, fetch_copy

    planted = tmp_path / "planted"
    planted.mkdir()
    np.save(planted / "abc-GPTDataset-train-document_index.npy", np.array([{"x": 1}], dtype=object))
    files = {p.name: p.stat().st_size for p in planted.iterdir()}
    cache = tmp_path / "cache"
    cache.mkdir()
    for name, listed in (("pickled", files), ("torn", {**files, "abc-GPTDataset-train-sample_index.npy": 64})):
        copy = CommittedFolder(f"{s3.url}/data/ja_text_document.indices/{name}", COPY_RECORD)
        copy.put(planted, files)
        copy.fs.pipe_file(copy.path(COPY_RECORD), json.dumps({"files": listed}).encode())
        assert not fetch_copy(copy, cache / f"indices-{name}")
        err = capfd.readouterr().err
        assert f"not using the dataset indices at {copy.url}" in err and "building them here" in err
        assert ("holds Python objects" if name == "pickled" else "sample_index.npy is missing") in err
        assert list(cache.iterdir()) == []


def test_incomplete_dataset_in_a_bucket_is_refused(s3, workspace: Path, dataset_prefix: Path, capfd) -> None:
    config = workspace / "config.yaml"
    name = dataset_prefix.name
    for suffix in (".bin", ".idx", ".manifest.json"):
        s3.fs.put_file(str(dataset_prefix.with_name(name + suffix)), f"{s3.bucket}/ds/{name}{suffix}")
    url = f"{s3.url}/ds/{name}"
    s3.fs.rm_file(f"{s3.bucket}/ds/{name}.bin")
    assert main(["count", "--config", str(config), "--no-write", f"data.prefixes=[{url}]"]) == 2
    assert f"{url}.bin is missing" in capfd.readouterr().err
    s3.fs.rm_file(f"{s3.bucket}/ds/{name}.manifest.json")
    assert main(["count", "--config", str(config), "--no-write", f"data.prefixes=[{url}]"]) == 2
    err = capfd.readouterr().err
    assert f"{url}.manifest.json not found" in err and "Run: bash 2_tokenize.sh" in err


def test_stage4_exports_to_a_bucket_and_stage6_uploads_from_it(s3, hub, workspace: Path,
                                                               exported_model: Path, monkeypatch, capsys) -> None:
    convert = workspace / "convert_config.yaml"
    url = f"{s3.url}/models/demo"
    run_cli("convert", "--config", convert, f"output_tokenizer_and_model_dir={url}")
    manifest = json.loads(s3.fs.cat_file(f"{url[5:]}/manifest.json"))
    assert manifest["counts"]["verified"]
    for name in manifest["outputs"]:
        assert s3.fs.info(f"{url[5:]}/{name}")["size"] == (exported_model / name).stat().st_size
    capsys.readouterr()
    assert main(["upload", "--config", str(convert), f"output_tokenizer_and_model_dir={url}",
                 "huggingface_name=from-bucket", "--dry-run"]) == 0
    listed = capsys.readouterr().out
    assert f"from {url} (verified copy in" in listed and "model.safetensors" in listed
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert main(["upload", "--config", str(convert), f"output_tokenizer_and_model_dir={url}",
                 "huggingface_name=from-bucket"]) == 0
    out = capsys.readouterr()
    assert "from-bucket" in out.out and TOKEN not in out.out + out.err


@pytest.mark.slow
def test_a_bucket_source_through_stages_0_and_2_on_a_ray_cluster_then_training(
        s3, workspace: Path, corpus_dir: Path, tokenizer_dir: Path, tmp_path: Path, capfd,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 43's cluster path end to end: a source of 25 objects and a second source of near copies of some
    of their documents, in a local S3 server, through stage 0 and stage 2 as Ray tasks on a two-node cluster on
    this machine: the same corpus and dataset bytes as one local process, the near copies found across objects
    and sources; stage 3 trains on the dataset."""
    if os.environ.get("CI"):
        import ray
    else:
        ray = pytest.importorskip("ray", reason="pip install -e .[ray]")
    from ray.cluster_utils import Cluster
    from test_corpus_neardup import near_copy

    lines = corpus_bytes(corpus_dir).splitlines(keepends=True)
    raw = tmp_path / "raw"
    (raw / "web").mkdir(parents=True)
    (raw / "copies").mkdir()
    for k in range(25):  # objects of 1 to 25 lines
        (raw / "web" / f"part-{k:02d}.jsonl").write_bytes(b"".join(lines[k * (k + 1) // 2:(k + 1) * (k + 2) // 2]))
    rng = random.Random(3)
    originals = [json.loads(line)["text"] for line in lines[100:300:20]]
    originals = [text for text in originals if len(text) > 1500][:4]
    (raw / "copies" / "copies.jsonl").write_text("".join(
        json.dumps({"text": near_copy(text, "ja", rng)}, ensure_ascii=False) + "\n" for text in originals),
        encoding="utf-8")
    s3.fs.put(str(raw) + "/", f"{s3.bucket}/raw/", recursive=True)
    sources = [{"type": "jsonl", "path": f"{s3.url}/raw/web/*.jsonl"},
               {"type": "jsonl", "path": f"{s3.url}/raw/copies"}]
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({**yaml.safe_load((workspace / "config.yaml").read_text(encoding="utf-8")),
                                      "corpus": {"sources": sources, "output_dir": str(tmp_path / "local"),
                                                 "shard_mb": 1, "workers": 1}}), encoding="utf-8")
    run_cli("prepare", "--config", config)
    local = Manifest.read(tmp_path / "local" / "manifest.json")
    tokenized = (f"tokenize.tokenizer_dir={tokenizer_dir}", f"tokenize.input=[{tmp_path / 'local'}]")
    run_cli("tokenize", "--config", config, *tokenized, f"tokenize.output_prefix={tmp_path / 'local'}")

    # The cluster's nodes start with this process's environment: the S3 server's endpoint and keys. Ray's
    # sockets live under its temp folder, whose path must stay short (TMPDIR is under tmp_path here).
    monkeypatch.setenv("RAY_TMPDIR", "/tmp")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray_keys = ("executor=ray", f"ray_address={cluster.address}")
        run_cli("prepare", "--config", config, f"corpus.output_dir={tmp_path / 'ray'}",
                *(f"corpus.{key}" for key in ray_keys))
        run_cli("tokenize", "--config", config, *tokenized, f"tokenize.output_prefix={tmp_path / 'ray'}",
                *(f"tokenize.{key}" for key in ray_keys))
        assert not ray.is_initialized()
    finally:
        cluster.shutdown()
    err = capfd.readouterr().err
    assert "partition(s) to search for duplicates on Ray (2 node(s), 2 CPU(s))" in err
    assert "range(s) to encode on Ray (2 node(s), 2 CPU(s))" in err
    assert corpus_bytes(tmp_path / "ray") == corpus_bytes(tmp_path / "local")
    on_ray = Manifest.read(tmp_path / "ray" / "manifest.json")
    assert on_ray.counts == local.counts and local.counts["shards"] >= 3
    # Every near copy (the second source) is found as a duplicate of its original in one of the 25 objects.
    near = local.counts["dropped_examples"]["near duplicate (Jaccard ≥ 0.8)"]
    assert local.counts["dropped"]["near duplicate (Jaccard ≥ 0.8)"] == len(originals) >= 3
    assert all("/raw/copies/copies.jsonl:" in e and "(duplicate of s3://" in e and "/raw/web/part-" in e
               for e in near), near
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ray_text_document{suffix}").read_bytes() == \
            (tmp_path / f"local_text_document{suffix}").read_bytes()

    done = run_train("--config", config, *TINY_RUN, tokenized[0], "data.split=90,9,1",
                     f"data.prefixes=[{tmp_path / 'ray_text_document'}]",
                     f"train.output_model_dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert train_losses(tmp_path / "run")
