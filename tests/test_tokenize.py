"""Stage 2 on the real man-page corpus: exact ids, sharding, bad input, killed runs, reruns."""

from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from functools import partial
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from conftest import corpus_bytes, corpus_texts, run_cli
from gptpipe.cli import main
from gptpipe.data.config import TokenizeConfig
from gptpipe.data.partitions import Partitioned, partition_key, partitions_folder
from gptpipe.data.ranges import plan_tasks
from gptpipe.data.tokenize import tokenize_files
from gptpipe.data.worker import WorkerSettings
from gptpipe.data.indexed import IndexedDataset, bin_path, idx_path
from gptpipe.data.jsonl import (BLANK, EMPTY, INVALID_JSON, LONE_SURROGATE, MISSING_KEY, NOT_A_STRING, NOT_AN_OBJECT,
                                NUL_STRIPPED, TOO_LONG, UNDECODABLE)
from gptpipe.stage import Manifest, StageInputError
from gptpipe.artifacts import EXIT_BAD_INPUT, TOKENIZE, read_tokenizer
from gptpipe.taskpool import TaskPool


def expected_ids(tokenizer_dir: Path, texts: list[str]) -> list[list[int]]:
    info = read_tokenizer(tokenizer_dir)
    sp = spm.SentencePieceProcessor(model_file=str(info.model_path))
    return [ids + [info.eod_id] for ids in sp.encode(texts)]


def tokenize(workspace: Path, *overrides: str, shard: str | None = None, force: bool = False) -> None:
    extra = (["--shard", shard] if shard else []) + (["--force"] if force else [])
    run_cli("tokenize", "--config", workspace / "config.yaml", *extra, *overrides)


def same_dataset(a: Path, b: Path) -> bool:
    return all(p(a).read_bytes() == p(b).read_bytes() for p in (bin_path, idx_path))


def test_dataset_decodes_to_the_tokenizers_ids(dataset_prefix: Path, tokenizer_dir: Path, corpus_dir: Path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronDataset

    texts = corpus_texts(corpus_dir)
    expected = expected_ids(tokenizer_dir, texts)
    dataset = MegatronDataset(str(dataset_prefix), mmap=True)
    assert len(dataset) == len(texts)
    assert dataset.index.dtype == np.uint16  # the vocabulary is below 65,536
    for i, ids in enumerate(expected):  # every document, EOD included and counted in its size
        assert dataset[i].tolist() == ids, f"document {i} differs"
    counts = TOKENIZE.require(dataset_prefix).counts
    assert counts["documents"] == len(texts) and counts["skipped"] == {} and counts["repaired"] == {}
    assert counts["tokens"] == sum(map(len, expected)) == int(dataset.sequence_lengths.sum())


def test_shards_merge_into_the_single_run(workspace: Path, dataset_prefix: Path, tmp_path: Path, capfd) -> None:
    prefix = tmp_path / "sharded"
    for i, workers in enumerate((2, 1, 2)):  # the in-process path too
        tokenize(workspace, f"tokenize.output_prefix={prefix}", f"tokenize.workers={workers}",
                 "tokenize.task_bytes=1000000", shard=f"{i}/3")
    shards = [prefix.with_name(f"sharded_text_document.shard-{i}-of-3") for i in range(3)]
    assert all(TOKENIZE.require(s).counts["documents"] > 0 for s in shards)
    run_cli("merge", "--config", workspace / "config.yaml", "--shards", "3", f"tokenize.output_prefix={prefix}")
    merged = tmp_path / "sharded_text_document"
    assert same_dataset(merged, dataset_prefix)
    assert TOKENIZE.require(merged).counts["documents"] == TOKENIZE.require(dataset_prefix).counts["documents"]

    # A shard remade with a setting that changes its bytes no longer fits the others.
    tokenize(workspace, f"tokenize.output_prefix={prefix}", "tokenize.max_document_chars=1000", shard="1/3")
    code = main(["merge", "--config", str(workspace / "config.yaml"), "--shards", "3",
                 f"tokenize.output_prefix={prefix}", "--force"])
    assert code == EXIT_BAD_INPUT
    assert "(max_document_chars differ); remake it: bash 2_tokenize.sh --shard 1/3" in capfd.readouterr().err


def test_merge_refuses_missing_shards(workspace: Path, tokenizer_dir: Path, tmp_path: Path, capfd) -> None:
    code = main(["merge", "--config", str(workspace / "config.yaml"), "--shards", "2",
                 f"tokenize.output_prefix={tmp_path / 'none'}"])
    assert code == EXIT_BAD_INPUT
    assert "none_text_document.shard-0-of-2.manifest.json not found" in capfd.readouterr().err


# --------------------------------------------------------------------------------------------- bad input

MAX_CHARS = 50_000


def bad_corpus(tmp_path: Path, texts: list[str]) -> tuple[list[Path], list[str], Counter, dict[str, list[str]]]:
    """Two jsonl files mixing good documents with every kind of bad line; what stage 2 must make of them."""
    good = iter([t for t in texts if len(t) < 20_000])

    def good_line(wrap=lambda line: line, **extra) -> tuple[bytes, str | None, str]:
        text = next(good)
        return wrap(json.dumps({"text": text, **extra}, ensure_ascii=False).encode()), None, text

    a = [
        good_line(), (b"", BLANK, None), good_line(),
        (b'{"text": "\xff\xfe broken"}', UNDECODABLE, None), good_line(),
        (b'{"text": "unterminated', INVALID_JSON, None),
        (b'{"text": "a\\ud800b"}', LONE_SURROGATE, None), good_line(),
        (b'["not", "an", "object"]', NOT_AN_OBJECT, None),
        (b'{"body": "no text key"}', MISSING_KEY, None),
        (b'{"text": 42}', NOT_A_STRING, None), (b'{"text": null}', NOT_A_STRING, None), good_line(),
        (b'{"text": ""}', EMPTY, None), (b'{"text": "\\u0000\\u0000"}', EMPTY, None),
        (b'{"text": "ab\\u0000cd"}', NUL_STRIPPED, "abcd"), good_line(),
        (json.dumps({"text": "あ" * (MAX_CHARS + 1)}).encode(), TOO_LONG, None),  # over the character limit
        (b'{"text": "' + b"x" * (12 * MAX_CHARS + 70_000) + b'"}', TOO_LONG, None),  # over the line limit
        good_line(), (b"  \t ", BLANK, None),
        good_line(lambda line: line + b"\r"),  # CRLF line end
        good_line(score=float("nan")),  # NaN is not strict JSON; the document is still good
        good_line(),  # the file ends without a newline
    ]
    b = [
        good_line(lambda line: b"\xef\xbb\xbf" + line, id=10**30),  # a byte-order mark, a 100-bit integer
        (b'{"text": "unterminated', INVALID_JSON, None), good_line(),
        (b'{"id": 1e400, "text": "huge number, good text"}', None, "huge number, good text"),
        (b'{"text": 0.5}', NOT_A_STRING, None), good_line(),
    ]
    files, kept, reasons, examples = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"], [], Counter(), {}
    for path, lines, end in zip(files, (a, b), (b"", b"\n")):
        path.write_bytes(b"\n".join(line for line, _, _ in lines) + end)
        for number, (_, reason, text) in enumerate(lines, start=1):
            if reason:
                reasons[reason] += 1
                examples.setdefault(reason, []).append(f"{path}:{number}")
            if text is not None:
                kept.append(text)
    return files, kept, reasons, {r: e[:5] for r, e in examples.items()}


def test_bad_lines_are_counted_and_good_documents_kept(workspace: Path, tokenizer_dir: Path, corpus_dir: Path,
                                                       tmp_path: Path, capfd) -> None:
    files, kept, reasons, examples = bad_corpus(tmp_path, corpus_texts(corpus_dir))
    inputs = f"tokenize.input=[{','.join(map(str, files))}]"
    # Ranges of 4 KB: most documents and the over-long line cross range and block boundaries.
    tokenize(workspace, inputs, f"tokenize.output_prefix={tmp_path / 'bad'}", "tokenize.task_bytes=4096",
             "tokenize.workers=2", f"tokenize.max_document_chars={MAX_CHARS}")
    prefix = tmp_path / "bad_text_document"
    dataset = IndexedDataset(prefix)
    assert [dataset[i].tolist() for i in range(len(dataset))] == expected_ids(tokenizer_dir, kept)

    counts = TOKENIZE.require(prefix).counts
    assert counts["skipped"] == {r: n for r, n in reasons.items() if r != NUL_STRIPPED}
    assert counts["repaired"] == {NUL_STRIPPED: 1}
    assert counts["examples"] == examples  # file:line, right across ranges and files
    assert counts["lines"] == sum(1 for f in files for _ in f.read_bytes().splitlines())
    err = capfd.readouterr().err
    assert f"invalid json: 2 line(s) skipped, e.g. {files[0]}:6, {files[1]}:2" in err

    # One worker, automatic ranges, the files named by a glob pattern (sorted: a, b): the same bytes.
    tokenize(workspace, f"tokenize.input={tmp_path / '*.jsonl'}", f"tokenize.output_prefix={tmp_path / 'again'}",
             "tokenize.workers=1",
             f"tokenize.max_document_chars={MAX_CHARS}")
    assert same_dataset(tmp_path / "again_text_document", prefix)


def test_missing_input_is_refused_before_work(workspace: Path, tokenizer_dir: Path, tmp_path: Path, capfd) -> None:
    code = main(["tokenize", "--config", str(workspace / "config.yaml"), f"tokenize.input=[{tmp_path / 'no.jsonl'}]",
                 f"tokenize.output_prefix={tmp_path / 'out'}"])
    assert code == EXIT_BAD_INPUT
    assert f"{tmp_path / 'no.jsonl'} not found" in capfd.readouterr().err
    assert not list(tmp_path.iterdir())

    packed = tmp_path / "corpus.jsonl.gz"
    packed.write_bytes(gzip.compress(b'{"text": "a"}\n'))
    code = main(["tokenize", "--config", str(workspace / "config.yaml"), f"tokenize.input=[{packed}]",
                 f"tokenize.output_prefix={tmp_path / 'out'}"])
    assert code == EXIT_BAD_INPUT
    assert "corpus.jsonl.gz is gzip-compressed" in capfd.readouterr().err

    code = main(["tokenize", "--config", str(workspace / "config.yaml"), f"tokenize.input=[{tmp_path / '*.json'}]",
                 f"tokenize.output_prefix={tmp_path / 'out'}"])
    assert code == EXIT_BAD_INPUT
    assert f"tokenize.input: {tmp_path / '*.json'} matches no file" in capfd.readouterr().err


# ------------------------------------------------------------------------------------ killed runs, reruns


def start_tokenize(workspace: Path, *overrides: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "gptpipe", "tokenize", "--config", str(workspace / "config.yaml"), *overrides]
    return subprocess.Popen(command, stderr=subprocess.PIPE, text=True)


def wait_until_writing(proc: subprocess.Popen, folder: Path, name: str) -> None:
    """Return once the run is midway: its workers are writing part files."""
    deadline = time.time() + 120
    while not list(folder.glob(f".{name}.parts-*/part-*")):
        assert proc.poll() is None and time.time() < deadline, "the run ended before it could be killed"
        time.sleep(0.02)
    time.sleep(0.3)


def big_input(corpus_dir: Path, tmp_path: Path) -> Path:
    big = tmp_path / "big.jsonl"
    big.write_bytes(corpus_bytes(corpus_dir) * 4)
    return big


def test_killed_run_leaves_nothing_accepted(workspace: Path, corpus_dir: Path, tokenizer_dir: Path,
                                            tmp_path: Path) -> None:
    prefix = tmp_path / "killed_text_document"
    out = f"tokenize.output_prefix={tmp_path / 'killed'}"
    tokenize(workspace, out)  # a finished dataset, about to be replaced
    big = big_input(corpus_dir, tmp_path)
    proc = start_tokenize(workspace, out, f"tokenize.input=[{big}]", "tokenize.workers=1")
    try:
        wait_until_writing(proc, tmp_path, prefix.name)
    finally:
        proc.kill()
        proc.communicate()

    assert not Manifest.read(TOKENIZE.manifest_path(prefix)).complete
    with pytest.raises(StageInputError, match="not marked complete"):
        TOKENIZE.require(prefix)
    count = main(["count", "--config", str(workspace / "config.yaml"), f"data.prefixes=[{prefix}]", "--no-write"])
    assert count == EXIT_BAD_INPUT

    tokenize(workspace, out)  # the next run redoes the work and cleans up after the killed one
    assert TOKENIZE.require(prefix).counts["documents"] == len(corpus_texts(corpus_dir))
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the worker processes through /proc")
def test_a_dead_worker_fails_the_run_instead_of_hanging(workspace: Path, corpus_dir: Path, tokenizer_dir: Path,
                                                        tmp_path: Path) -> None:
    proc = start_tokenize(workspace, f"tokenize.output_prefix={tmp_path / 'oom'}",
                          f"tokenize.input=[{big_input(corpus_dir, tmp_path)}]", "tokenize.workers=2")
    try:
        wait_until_writing(proc, tmp_path, "oom_text_document")
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        os.kill(int(children[0]), signal.SIGKILL)  # what the OOM killer does
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert "a worker process died (killed for memory?); nothing was written to" in err
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".", "oom"))]


def test_rerun_skips_and_force_redoes(workspace: Path, dataset_prefix: Path, tmp_path: Path, capfd) -> None:
    # Its own output: the session's dataset is read by other tests meanwhile (run_tests.sh's two workers).
    prefix = tmp_path / "ja_text_document"
    tokenize(workspace, f"tokenize.output_prefix={tmp_path}/ja")
    files = [bin_path(prefix), idx_path(prefix), TOKENIZE.manifest_path(prefix)]
    before = [(os.stat(p).st_mtime_ns, p.read_bytes()) for p in files]
    assert [b[1] for b in before[:2]] == [p.read_bytes() for p in (bin_path(dataset_prefix), idx_path(dataset_prefix))]
    capfd.readouterr()
    tokenize(workspace, f"tokenize.output_prefix={tmp_path}/ja")
    assert "up to date" in capfd.readouterr().err
    assert [(os.stat(p).st_mtime_ns, p.read_bytes()) for p in files] == before

    tokenize(workspace, f"tokenize.output_prefix={tmp_path}/ja", force=True)
    assert "documents" in capfd.readouterr().err
    after = [(os.stat(p).st_mtime_ns, p.read_bytes()) for p in files]
    assert all(a[0] != b[0] for a, b in zip(after, before))  # rewritten ...
    assert [a[1] for a in after[:2]] == [b[1] for b in before[:2]]  # ... to the same bytes


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """A real Ray cluster on this machine, a head node and a second node of one CPU each: its address."""
    if os.environ.get("CI"):
        import ray  # noqa: F401
    else:
        pytest.importorskip("ray", reason="pip install -e .[ray]")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        yield cluster.address
    finally:
        cluster.shutdown()


def test_a_two_node_ray_cluster_writes_the_same_dataset(workspace: Path, dataset_prefix: Path, tmp_path: Path,
                                                         ray_cluster: str, capfd) -> None:
    """tokenize.executor: ray: every byte range encoded by a Ray task into a partition, the partitions put in place
    by Ray tasks; the dataset byte for byte the local run's, one source's dataset (by_source) too."""
    import ray

    on_ray = ("tokenize.executor=ray", f"tokenize.ray_address={ray_cluster}", "tokenize.task_bytes=1000000")
    tokenize(workspace, f"tokenize.output_prefix={tmp_path / 'ray'}", *on_ray)
    assert not ray.is_initialized()  # stage 2 left the cluster as it found it
    err = capfd.readouterr().err
    assert "range(s) to encode on Ray (2 node(s), 2 CPU(s))" in err
    assert "partition(s) to put in place on Ray (2 node(s), 2 CPU(s))" in err
    assert re.search(r"range\(s\) to encode: [\d.]+ CPU s in the tasks, in [12] process\(es\)", err)
    assert same_dataset(tmp_path / "ray_text_document", dataset_prefix)
    # The stage-0 corpus has one source, whose dataset is then the same again.
    tokenize(workspace, f"tokenize.output_prefix={tmp_path / 'mix'}", "tokenize.by_source=true", *on_ray)
    assert TOKENIZE.require(tmp_path / "mix" / "ja_text_document").counts["source"] == "ja"
    assert same_dataset(tmp_path / "mix" / "ja_text_document", dataset_prefix)
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".") or p.name.endswith(".partitions")]


def test_a_killed_ray_run_continues_from_its_finished_partitions(workspace: Path, dataset_prefix: Path,
                                                                  tmp_path: Path, ray_cluster: str, capfd) -> None:
    """The driver of a Ray run killed midway: the partitions finished so far are kept (each with its record), and
    the rerun, with another number of workers, encodes only the others into the same bytes as the local run."""
    prefix = tmp_path / "resumed_text_document"
    folder = tmp_path / "resumed_text_document.partitions"
    keys = (f"tokenize.output_prefix={tmp_path / 'resumed'}", "tokenize.executor=ray",
            f"tokenize.ray_address={ray_cluster}", "tokenize.task_bytes=200000")
    proc = start_tokenize(workspace, *keys, "tokenize.workers=1")  # one range at a time: ~70 in a row
    try:
        deadline = time.time() + 300
        while len(list(folder.glob("part-*.json"))) < 3:
            assert proc.poll() is None and time.time() < deadline, "the run ended before it could be killed"
            time.sleep(0.02)
    finally:
        proc.kill()
        proc.communicate()
    finished = len(list(folder.glob("part-*.json")))
    planned = len(json.loads((folder / "plan.json").read_text())["tasks"])
    assert 3 <= finished < planned and not bin_path(prefix).exists()
    assert not Manifest.read(TOKENIZE.manifest_path(prefix)).complete

    capfd.readouterr()
    tokenize(workspace, *keys, "tokenize.workers=2")
    err = capfd.readouterr().err
    kept = int(re.search(r"in (\d+) partition\(s\) → .*; (\d+) finished by an earlier run, kept", err)[2])
    assert finished <= kept < planned  # (the range in flight at the kill may have finished after it)
    assert f"{planned - kept:,} range(s) to encode on Ray" in err
    assert same_dataset(prefix, dataset_prefix) and not folder.exists()


def test_by_source_writes_one_dataset_per_source_and_weights_go_by_its_name(
        workspace: Path, tokenizer_dir: Path, corpus_dir: Path, tmp_path: Path, capfd) -> None:
    """Two sources through stage 0 (one cut into several shards) and stage 2 with tokenize.by_source: one dataset
    per source label, whose documents are, in order, the one dataset's of the same corpus; count_tokens takes the
    weights by those names."""
    texts = corpus_texts(corpus_dir)
    (tmp_path / "wiki").mkdir()
    for path, part in ((tmp_path / "web.jsonl", texts[:400]), (tmp_path / "wiki" / "a.jsonl", texts[400:600])):
        path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in part), encoding="utf-8")
    corpus = tmp_path / "corpus"
    run_cli("prepare", "--config", workspace / "config.yaml", f"corpus.output_dir={corpus}", "corpus.shard_mb=1",
            f"corpus.sources=[{{type: jsonl, path: {tmp_path / 'web.jsonl'}, label: web}}, "
            f"{{type: jsonl, path: {tmp_path / 'wiki'}}}]")
    sources = Manifest.read(corpus / "manifest.json").counts["sources"]
    assert list(sources) == ["web", "wiki"] and len(sources["web"]["files"]) >= 2 and sources["wiki"]["files"]
    common = (f"tokenize.tokenizer_dir={tokenizer_dir}", f"tokenize.input=[{corpus}]", "tokenize.workers=2")
    tokenize(workspace, *common, f"tokenize.output_prefix={tmp_path / 'all'}")
    tokenize(workspace, *common, f"tokenize.output_prefix={tmp_path / 'mix'}", "tokenize.by_source=true")
    whole = IndexedDataset(tmp_path / "all_text_document")
    parts = [IndexedDataset(tmp_path / "mix" / f"{label}_text_document") for label in ("web", "wiki")]
    assert [len(p) for p in parts] == [sources[label]["documents"] for label in ("web", "wiki")]
    assert [p[i].tolist() for p in parts for i in range(len(p))] == [whole[i].tolist() for i in range(len(whole))]
    for label in ("web", "wiki"):
        counts = TOKENIZE.require(tmp_path / "mix" / f"{label}_text_document").counts
        assert counts["source"] == label and counts["documents"] == sources[label]["documents"]

    prefixes = f"data.prefixes=[{tmp_path / 'mix' / 'web_text_document'}, {tmp_path / 'mix' / 'wiki_text_document'}]"
    capfd.readouterr()
    assert main(["count", "--config", str(workspace / "config.yaml"), "--no-write", prefixes, "data.split=90,9,1",
                 "data.weights={wiki: 1, web: 3}"]) == 0
    out = capfd.readouterr().out
    assert "mixture (data.weights, normalised):" in out
    assert "  web: " in out and "(75.0%)" in out and "  wiki: " in out and "(25.0%)" in out
    assert main(["count", "--config", str(workspace / "config.yaml"), "--no-write", prefixes,
                 "data.weights={web: 3, wik: 1}"]) == EXIT_BAD_INPUT
    err = capfd.readouterr().err
    assert "data.weights.wik: no prefix of data.prefixes has this name" in err and "did you mean 'wiki'?" in err
    assert "no weight for wiki" in err
    # Files whose source stage 0 did not record are refused before any work.
    assert main(["tokenize", "--config", str(workspace / "config.yaml"), *common[:1],
                 f"tokenize.input=[{tmp_path / 'web.jsonl'}]", f"tokenize.output_prefix={tmp_path / 'own'}",
                 "tokenize.by_source=true"]) == EXIT_BAD_INPUT
    assert "it is not a stage-0 output folder" in capfd.readouterr().err and not (tmp_path / "own").exists()


def test_partitions_are_kept_only_for_the_same_input_and_settings(tokenizer_dir: Path, corpus_dir: Path,
                                                                    tmp_path: Path) -> None:
    """The partition mechanics in one process: a run stopped after two partitions leaves exactly those, a rerun
    under the same key keeps them (not one whose record is torn), another key starts over, and the partitions put
    in place are the local run's bytes."""
    files = sorted(corpus_dir.glob("corpus-*.jsonl"))[:2]
    info, cfg = read_tokenizer(tokenizer_dir), TokenizeConfig()
    settings = WorkerSettings(model_path=str(info.model_path), eod_id=info.eod_id, dtype="uint16", text_key="text",
                              max_chars=cfg.max_document_chars, max_line_bytes=cfg.max_line_bytes,
                              block_bytes=1 << 20, parts_dir="")
    key = partition_key(files, "the tokenizer", settings, None)
    prefix, log = tmp_path / "p_text_document", logging.getLogger("test")
    with TaskPool("local", 1, None, log, "") as pool:
        plan = partial(plan_tasks, files, 1, 400_000, None)
        made = Partitioned(pool, prefix, key, plan)
        assert len(made.tasks) >= 5 and not made.records
        assert [r.task.index for r in islice(made.encode(settings), 2)] == [0, 1]  # then the driver stops
        assert set(Partitioned(pool, prefix, key, plan).records) == {0, 1}
        (partitions_folder(prefix) / "part-0000001.json").write_text('{"key": ')  # a torn record
        again = Partitioned(pool, prefix, key, plan)
        assert set(again.records) == {0}
        assert [r.task.index for r in again.encode(settings)] == list(range(1, len(made.tasks)))
        again.put_together(np.dtype("uint16"))
        tokenize_files(files, tmp_path / "local_text_document", settings, pool, 400_000, None)
        assert same_dataset(prefix, tmp_path / "local_text_document") and not partitions_folder(prefix).exists()

        assert list(islice(Partitioned(pool, prefix, key, plan).encode(settings), 1))
        other = partition_key(files, "the tokenizer", dataclasses.replace(settings, max_chars=1000), None)
        assert not Partitioned(pool, prefix, other, plan).records
        assert [p.name for p in partitions_folder(prefix).iterdir()] == ["plan.json"]
