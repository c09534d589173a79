"""Stage 0's near-duplicate removal, dropped samples and --explain, on real Japanese and English man pages with
near duplicates made from them (random edits, re-wrapping, added page boilerplate). The makers below are also
bench/bench_corpus_neardup.py's, which runs them on every page."""

from __future__ import annotations

import json
import random
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import corpus_texts, require_manpages, run_cli
from gptpipe.cli import main
from gptpipe.corpus import neardup
from gptpipe.corpus.config import NearDedupConfig
from gptpipe.corpus.manpages import GroffError, find_manpages, read_manpage, roff_to_text
from gptpipe.stage import Manifest

MAN = Path("/usr/share/man")
MIN_CHARS = 1500  # originals this long: on a stub page, the boilerplate alone outweighs the text
HEADER = {"ja": "ホーム > ドキュメント > マニュアル > コマンド\nこのページを共有する: X Facebook はてな\n",
          "en": "Home > Docs > Manual pages > Commands\nShare this page: X Facebook Reddit\n"}
FOOTER = {"ja": "\n© 2024 サンプル文書館 無断転載を禁じます | プライバシーポリシー | お問い合わせ",
          "en": "\n(c) 2024 Example Docs. All rights reserved. | Privacy policy | Contact us"}
TYPO = {"ja": "あいうえおかきくけこアイウエオ日本語文書", "en": "abcdefghijklmnopqrstuvwxyz"}


def manpage_texts(root: Path, every: int, count: int, min_chars: int = MIN_CHARS) -> list[str]:
    """`count` pages of `root`'s sections, every `every`-th page file, formatted as stage 0 does, each at least
    `min_chars` long."""
    texts: list[str] = []
    for page in find_manpages(root)[::every]:
        try:
            text = roff_to_text(read_manpage(page), str(page))
        except (GroffError, UnicodeDecodeError):
            continue
        if len(text) >= min_chars:
            texts.append(text)
        if len(texts) == count:
            break
    return texts


EDIT_EVERY = {"ja": 300, "en": 600}  # characters: about one edit per 100 words in either language


def near_copy(text: str, lang: str, rng: random.Random, edit_every: int | None = None) -> str:
    """A near duplicate of `text` as the web makes them: random character edits (substitutions, deletions,
    insertions; one per `edit_every` characters), the text re-wrapped at another width, a page header and
    footer."""
    chars = list(text)
    for _ in range(max(2, len(chars) // (edit_every or EDIT_EVERY[lang]))):
        at, kind = rng.randrange(len(chars)), rng.randrange(3)
        if kind == 0:
            chars[at] = rng.choice(TYPO[lang])
        elif kind == 1:
            del chars[at]
        else:
            chars.insert(at, rng.choice(TYPO[lang]))
    width = rng.choice((40, 60, 72))
    paragraphs = "".join(chars).split("\n\n")
    wrapped = "\n\n".join("\n".join(textwrap.wrap(p, width)) for p in paragraphs)
    return HEADER[lang] + wrapped + FOOTER[lang]


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    return path


def write_config(folder: Path, documents: Path, **corpus) -> Path:
    config = {"corpus": {"sources": [{"type": "jsonl", "path": str(documents)}], "output_dir": "out", **corpus}}
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config, allow_unicode=True), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def pages() -> dict[str, list[str]]:
    """24 Japanese and 24 English man pages (2-3 s of groff)."""
    require_manpages()
    return {"ja": manpage_texts(MAN / "ja", 37, 24), "en": manpage_texts(MAN, 661, 24)}


def test_near_duplicates_of_man_pages_lose_their_copy(pages: dict[str, list[str]], tmp_path: Path) -> None:
    """Originals, then one near copy of each (edited, re-wrapped, boilerplate added): every copy is dropped as
    a near duplicate of its original, every original kept; Japanese is shingled by characters, English by
    words."""
    rng = random.Random(0)
    hasher = neardup.MinHasher(NearDedupConfig())
    originals = pages["ja"] + pages["en"]
    assert all(hasher.by_characters(t) for t in pages["ja"]) and not any(map(hasher.by_characters, pages["en"]))
    copies = [near_copy(t, lang, rng) for lang in ("ja", "en") for t in pages[lang]]
    run_cli("prepare", "--config", write_config(tmp_path, write_jsonl(tmp_path / "docs.jsonl", originals + copies)))
    kept = corpus_texts(tmp_path / "out")
    assert kept[:len(originals)] == originals  # no original lost
    assert len(kept) - len(originals) <= 0.1 * len(copies), kept[len(originals):]  # >= 90% of the copies gone
    counts = Manifest.read(tmp_path / "out" / "manifest.json").counts
    assert counts["dropped"] == {"near duplicate (Jaccard ≥ 0.8)": len(copies) - (len(kept) - len(originals))}
    n = len(originals)
    assert counts["dropped_examples"]["near duplicate (Jaccard ≥ 0.8)"][0] == (
        f"{tmp_path / 'docs.jsonl'}:{n + 1} (duplicate of {tmp_path / 'docs.jsonl'}:1)")


def test_clusters_are_transitive_and_the_first_is_kept(pages: dict[str, list[str]], tmp_path: Path) -> None:
    """A~B and B~C while A and C are further apart than the threshold: one cluster, of which only the first
    document in input order (here C) is kept."""
    hasher = neardup.MinHasher(NearDedupConfig())
    a, other = pages["ja"][0], pages["ja"][1]
    step = len(a) // 12
    b = a[:step] + other[:step] + a[2 * step:]  # a twelfth replaced by another page's text
    c = b[:6 * step] + other[-step:] + b[7 * step:]  # and another twelfth

    def jaccard(x: str, y: str) -> float:
        sx, sy = set(hasher.shingles(x)), set(hasher.shingles(y))
        return len(sx & sy) / len(sx | sy)

    assert jaccard(a, b) >= 0.8 and jaccard(b, c) >= 0.8 and jaccard(a, c) < 0.8, (jaccard(a, b), jaccard(a, c))
    others = pages["ja"][2:7]
    run_cli("prepare", "--config", write_config(tmp_path, write_jsonl(tmp_path / "d.jsonl", [c, *others, a, b])))
    assert corpus_texts(tmp_path / "out") == [c, *others]


def test_shards_and_partitions_give_the_same_clusters(pages: dict[str, list[str]], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Many shards, partitions and pair chunks (as a large corpus gets, each step a task of its own) find the
    same duplicates as one shard in one partition; the clusters are those of a plain union-find of the pairs."""
    rng = random.Random(1)
    config = NearDedupConfig()
    hasher = neardup.MinHasher(config)
    texts = pages["ja"] + pages["en"]
    texts += [near_copy(t, "ja" if hasher.by_characters(t) else "en", rng) for t in texts for _ in range(2)]
    order = list(range(len(texts)))
    rng.shuffle(order)
    signatures = np.stack([hasher.signature(texts[i]) for i in order])

    def pairs_and_clusters(shards: int, bits: int) -> tuple[np.ndarray, ...]:
        starts = np.linspace(0, len(signatures), shards + 1).astype(np.int64)
        keys, rows = [], []
        for s in range(shards):
            mine = signatures[starts[s]:starts[s + 1]]
            rows.append(tmp_path / f"{shards}-{s}.sig")
            mine.tofile(rows[-1])
            keys.append(tmp_path / f"{shards}-{s}.keys")
            neardup.write_buckets(keys[-1], neardup._band_keys(mine, config.bands, config.rows), int(starts[s]), bits)
        reader = neardup.Signatures(rows, starts, config.bands * config.rows)
        found = [neardup.similar_pairs(*neardup.bucket_pairs(neardup.partition_records(keys, p)), reader,
                                       config.threshold) for p in range(1 << bits)]
        a, b = np.concatenate([f[0] for f in found]), np.concatenate([f[1] for f in found])
        return (*neardup.clusters(a, b), a, b)

    later, first, a, b = pairs_and_clusters(1, 0)
    monkeypatch.setattr(neardup, "PAIR_CHUNK", 5)
    many = pairs_and_clusters(7, 3)
    assert np.array_equal(later, many[0]) and np.array_equal(first, many[1])
    assert sorted(zip(a.tolist(), b.tolist())) == sorted(zip(many[2].tolist(), many[3].tolist()))
    # A plain union-find of the pairs, each cluster's lowest document its root.
    parent = list(range(len(order)))

    def root(k: int) -> int:
        while parent[k] != k:
            k = parent[k]
        return k

    for x, y in zip(a.tolist(), b.tolist()):
        rx, ry = root(x), root(y)
        parent[max(rx, ry)] = min(rx, ry)
    roots = [root(k) for k in range(len(order))]
    assert dict(zip(later.tolist(), first.tolist())) == {k: r for k, r in enumerate(roots) if r != k}
    # Of the copies, nearly all are in the cluster of their family's first member.
    n = len(texts) // 3  # originals, then two copies of each in a row
    family = [i if i < n else (i - n) // 2 for i in order]
    joined = [roots[k] == roots[family.index(family[k])] for k in range(len(order)) if k != family.index(family[k])]
    assert len(later) > 0.5 * len(order) and sum(joined) >= 0.9 * len(joined)


def test_rerun_is_identical_and_samples_are_capped(pages: dict[str, list[str]], tmp_path: Path) -> None:
    rng = random.Random(2)
    base = pages["ja"][:4]
    texts = base + [near_copy(base[0], "ja", rng) for _ in range(5)] + ["短い"] * 3
    config = write_config(tmp_path, write_jsonl(tmp_path / "d.jsonl", texts), dropped_samples=2, min_chars=50)
    run_cli("prepare", "--config", config)
    out = tmp_path / "out"
    first = {p.relative_to(out): p.read_bytes() for p in out.rglob("*.jsonl")}
    run_cli("prepare", "--config", config, "--force")
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*.jsonl")} == first
    manifest = Manifest.read(out / "manifest.json")
    near = "near duplicate (Jaccard ≥ 0.8)"
    assert manifest.counts["dropped"] == {near: 5, "shorter than min_chars (50)": 1, "exact duplicate": 2}
    assert manifest.counts["dropped_samples"] == {near: 2, "shorter than min_chars (50)": 1, "exact duplicate": 2}
    assert sorted(manifest.outputs) == ["corpus-00000.jsonl", "dropped/exact_duplicate.jsonl",
                                        "dropped/near_duplicate_Jaccard_0.8.jsonl",
                                        "dropped/shorter_than_min_chars_50.jsonl"]
    samples = [json.loads(line) for line in first[Path("dropped/near_duplicate_Jaccard_0.8.jsonl")].splitlines()]
    assert [s["origin"] for s in samples] == [f"{tmp_path / 'd.jsonl'}:{i}" for i in (5, 6)]
    assert all(s["duplicate_of"] == f"{tmp_path / 'd.jsonl'}:1" and s["text"] in texts for s in samples)
    assert not (out / ".work").exists()  # the scratch folder is gone
    # No samples asked for: none written, none listed; near-dedup off keeps the copies.
    run_cli("prepare", "--config", config, "corpus.dropped_samples=0", "corpus.near_dedup.threshold=null")
    manifest = Manifest.read(out / "manifest.json")
    assert list(manifest.outputs) == ["corpus-00000.jsonl"] and not list((out / "dropped").iterdir())
    assert len(corpus_texts(out)) == 9


def test_explain_prints_each_rule_and_writes_nothing(pages: dict[str, list[str]], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    page = pages["ja"][3]
    lines = [line for line in page.split("\n") if len(line) > 20]
    texts = [page, "\n".join([page] * 4), near_copy(page, "ja", random.Random(3)), "\n".join(l[:8] for l in lines)]
    documents = write_jsonl(tmp_path / "ask.jsonl", texts)
    config = write_config(tmp_path, documents)
    assert main(["prepare", "--config", str(config), "--explain", str(documents)]) == 0
    out = capsys.readouterr().out
    reports = re.split(rf"^{re.escape(str(documents))}:", out, flags=re.MULTILINE)[1:]
    assert reports[0].startswith("1: kept\n") and "DROPS" not in reports[0]
    assert reports[0].count("\n    ok") >= 7  # length, the quality rules, exact and near duplicate
    assert reports[1].startswith("2: dropped: quality: duplicate lines > 0.3\n")
    assert "    DROPS  quality: duplicate lines > 0.3: 0.7" in reports[1]  # 3 of 4 copies repeat
    assert reports[2].startswith("3: dropped: near duplicate (Jaccard ≥ 0.8)\n")
    similarity = re.search(r"DROPS  near duplicate \(Jaccard ≥ 0.8\): (0\.\d+) with (.*)\n", reports[2])
    assert similarity and float(similarity[1]) >= 0.8 and similarity[2] == f"{documents}:1"
    assert reports[3].startswith("4: dropped: quality: short lines > 0.9\n")
    assert not (tmp_path / "out").exists()
    # A text file is one document.
    (tmp_path / "one.txt").write_text(page, encoding="utf-8")
    assert main(["prepare", "--config", str(config), "--explain", str(tmp_path / "one.txt")]) == 0
    assert capsys.readouterr().out.startswith(f"{tmp_path / 'one.txt'}: kept\n")


def test_near_dedup_config_errors_name_the_key(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    config = write_config(tmp_path, tmp_path / "none.jsonl", near_dedup={"row": 3})
    assert main(["prepare", "--config", str(config)]) == 2
    err = capfd.readouterr().err
    assert "corpus.near_dedup.row: unknown key; did you mean corpus.near_dedup.rows?" in err
    config = write_config(tmp_path, tmp_path / "none.jsonl", near_dedup={"threshold": 1.5, "bands": 0,
                                                                          "spaceless_share": 2})
    assert main(["prepare", "--config", str(config)]) == 2
    err = capfd.readouterr().err
    for message in ("corpus.near_dedup.threshold: must be in (0, 1]", "corpus.near_dedup.bands: must be at least 1",
                    "corpus.near_dedup.spaceless_share: must be between 0 and 1"):
        assert message in err, err
    assert main(["prepare", "--config", str(write_config(tmp_path, tmp_path / "none.jsonl", dropped_samples=-1))]) == 2
    assert "corpus.dropped_samples: must be >= 0" in capfd.readouterr().err


def test_a_partition_without_records_has_no_pairs() -> None:
    first, other = neardup.bucket_pairs(np.empty(0, dtype=neardup.RECORD))
    assert len(first) == len(other) == 0
