"""Stage 0: real man pages, every local source kind, bad records counted, rerun/force behaviour."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest
import yaml

from conftest import corpus_texts as read_corpus
from conftest import run_cli
from gptpipe.cli import main
from gptpipe.corpus.config import QualityConfig
from gptpipe.corpus.manpages import find_manpages, read_manpage, roff_to_text
from gptpipe.corpus.quality import pii_masker
from gptpipe.stage import Manifest, StageInputError


def write_config(folder: Path, sources: list[dict], **corpus) -> Path:
    config = {"corpus": {"sources": sources, "output_dir": "out", "min_chars": 5, **corpus}}
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config, allow_unicode=True), encoding="utf-8")
    return path


def test_manpages_become_japanese_documents(corpus_dir: Path) -> None:
    texts = read_corpus(corpus_dir)
    manifest = Manifest.read(corpus_dir / "manifest.json")
    assert len(texts) == manifest.counts["documents"] > 1500
    dir_page = next(t for t in texts if t.startswith("名前\ndir - "))
    assert "dir - ディレクトリの内容をリスト表示する\n" in dir_page
    assert "-a, --all\n" in dir_page and "\\f" not in dir_page  # options kept, font escapes gone
    # ls(1) and vdir(1) are dir(1) with another name: near duplicates of it, which comes first.
    assert not any(t.startswith(("名前\nls - ", "名前\nvdir - ")) for t in texts)
    near = [json.loads(line) for line in (corpus_dir / "dropped" / "near_duplicate_Jaccard_0.8.jsonl").open()]
    assert {"origin": "man1/ls.1.gz", "duplicate_of": "man1/dir.1.gz"} in [
        {key: sample[key] for key in ("origin", "duplicate_of")} for sample in near]
    assert 10 <= manifest.counts["dropped"]["near duplicate (Jaccard ≥ 0.8)"] <= 40
    # netrc(5) is an mdoc page (.Dd/.Sh/.Nm/.Nd), not a man one.
    assert any(t.startswith("名前\nnetrc, .netrc — ftp のためのユーザー設定ファイル\n") for t in texts)
    # No page header or footer: every document starts with its NAME heading (a few pages lack one).
    assert sum(t.split("\n", 1)[0] in ("名前", "名称", "NAME") for t in texts) >= len(texts) - 3
    joined = "\n".join(texts)
    assert "\b" not in joined and "\x1b" not in joined  # no overstrikes, no terminal colours
    # Roff is left only where the pages about roff quote it: groff(7), groff_man(7), groff_mdoc(7), groff_me(7), man(7).
    leftover = [t for t in texts if re.search(r"^\.(TH|SH|Sh|Dd|PP|Pp|TP|IP|nf|fi) ", t, re.MULTILINE)]
    assert len(leftover) <= 5
    assert joined.count("\\fB") + joined.count("\\fI") <= 3
    assert manifest.counts["dropped"].get("alias page (.so)", 0) >= 1
    assert len(set(texts)) == len(texts)


def test_languages_keep_japanese_pages_and_judge_mixed_ones_by_share(corpus_dir: Path, tmp_path: Path) -> None:
    """The shipped config keeps documents mainly in Japanese (languages: [ja]); a page whose option lists are
    English or whose examples are C stays, an untranslated page goes, and the manifest tells the corpus's
    languages."""
    from gptpipe.corpus import language

    counts = Manifest.read(corpus_dir / "manifest.json").counts
    main = counts["main_languages"]
    assert main["ja"] > 1500 and main["en"] >= 10, main
    assert counts["dropped"]["language: under 0.3 ja (mainly en)"] >= 5, counts["dropped"]
    texts = read_corpus(corpus_dir)
    assert all(language.judge(t, frozenset({"ja"}), 0.5).share >= 0.3 for t in texts)
    ranlib = next(t for t in texts if t.startswith("名前\nranlib - "))  # Japanese prose, English options
    assert 0.3 <= language.judge(ranlib, frozenset({"ja"}), 0.5).share < 0.5
    # Japanese prose around C declarations: 0.26 of the voting characters, 0.32 with kana and kanji counted as
    # the English letters they stand for.
    memcpy = next(t for t in texts if t.startswith("名前\nmemcpy - "))
    assert 0.3 <= language.judge(memcpy, frozenset({"ja"}), 0.5).share
    assert not any(t.startswith("名前\nman-recode - convert manual pages") for t in texts)  # untranslated

    # Korean, German and Japanese man pages in one run, Korean kept.
    sources = [{"type": "manpages", "path": f"/usr/share/man/{lang}", "max_documents": 40}
               for lang in ("ko", "de", "ja")]
    run_cli("prepare", "--config", write_config(tmp_path, sources, min_chars=50, languages=["ko"]))
    counts = Manifest.read(tmp_path / "out" / "manifest.json").counts
    kept = read_corpus(tmp_path / "out")
    assert 20 <= len(kept) <= 40 and all(language.judge(t, frozenset({"ko"}), 0.5).main == "ko" for t in kept)
    assert counts["dropped"]["language: under 0.3 ko (mainly de)"] >= 30
    assert counts["dropped"]["language: under 0.3 ko (mainly ja)"]


def test_unknown_language_is_a_config_error(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    config = write_config(tmp_path, [{"type": "manpages", "path": "/usr/share/man/ja"}], languages=["ja", "jpn"],
                          language_min_share=1.5)
    assert main(["prepare", "--config", str(config)]) == 2
    err = capfd.readouterr().err
    assert "'jpn' is not a language the model knows" in err and "language_min_share" in err
    assert not (tmp_path / "out").exists()


def test_quality_rules_keep_the_man_pages_and_drop_junk_made_from_them(corpus_dir: Path, tmp_path: Path) -> None:
    """Every rule on by default keeps every Japanese man page; junk built from real pages (a page repeated, a menu
    of its short line heads, a run of one character, truncated snippets, a table of its lines' numbers, a list
    of its nouns) is dropped by the rule meant for it;
    an NG-word file and PII masking work when set."""
    counts = Manifest.read(corpus_dir / "manifest.json").counts
    assert not [reason for reason in counts["dropped"] if reason.startswith("quality:")], counts["dropped"]
    pages = read_corpus(corpus_dir)
    dir_page = next(t for t in pages if t.startswith("名前\ndir - "))
    page = pages[100]
    lines = [line for line in page.split("\n") if len(line) > 20]
    nouns = re.findall(r"[ァ-ヴー一-龥]{2,}", page)
    junk = {"duplicate lines > 0.3": "\n".join([page] * 4),
            "short lines > 0.9": "\n".join(line[:8] for line in lines),
            "a character repeated 200+ times": page + "ー" * 300,
            "lines ending in ellipsis > 0.7": "\n".join(line[:30] + "…" for line in lines) + "\n",
            "letters < 0.4 of the characters": "\n".join(f"{line[:4]}\t{ord(line[0])}\t{len(line)}\t"
                                                          f"{line.count(' ')}\t{sum(map(ord, line)) % 1000}"
                                                          for line in lines),
            "hiragana < 0.1 of the Japanese characters": "\n".join(" ".join(nouns[i:i + 5])
                                                                    for i in range(0, len(nouns), 5)),
            "an NG word of ng.txt": dir_page}
    mask = pii_masker(QualityConfig(mask_pii=True))
    plain = next(t for t in pages[300:] if mask(t) == t)  # a page with no address or number to mask
    contact = pages[200] + "\n問い合わせ: taro@example.co.jp または 090-1234-5678 まで。"
    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n"
                           for t in [*junk.values(), plain, contact]), encoding="utf-8")
    (tmp_path / "ng.txt").write_text("ディレクトリの内容\n", encoding="utf-8")
    config = write_config(tmp_path, [{"type": "jsonl", "path": str(raw)}],
                          quality={"ng_words_file": "ng.txt", "mask_pii": True})
    run_cli("prepare", "--config", config)
    counts = Manifest.read(tmp_path / "out" / "manifest.json").counts
    assert counts["dropped"] == {f"quality: {name}": 1 for name in junk}
    kept = read_corpus(tmp_path / "out")
    assert kept[0] == plain and "taro@" not in kept[1] and "xxxx@yyy.jp" in kept[1]
    assert "090-1234-XXXX" in kept[1] and counts["notes"] == {"personal information masked": 1}


def test_fast_measures_give_the_reference_values(corpus_dir: Path) -> None:
    """The numpy measures give HojiChar's character repetition ratio and the regex counts exactly, and the
    language vote that stops once decided gives the full vote's verdict, on the man pages and junk made of them
    (other languages: German and Chinese pages, the hard case against Japanese)."""
    from hojichar.filters.document_filters import CharRepetitionRatioFilter

    from gptpipe.corpus import language, quality

    pages = read_corpus(corpus_dir)[::10]
    others = [roff_to_text(read_manpage(page), str(page)) for lang in ("de", "zh_CN")
              for page in find_manpages(Path(f"/usr/share/man/{lang}"))[:15]]
    texts = pages + others + ["", "a", "ab" * 3, "ー" * 300 + "あ", "\n".join(p[:40] for p in pages)]
    for text in texts:
        assert quality.char_repetition(text) == CharRepetitionRatioFilter.compute_character_repetition_ratio(text, 5)
        assert quality.longest_run(text) == max((len(m.group()) for m in re.finditer(r"(.)\1+", text, re.DOTALL)),
                                                default=min(len(text), 1))
        kana = len(re.findall(r"[\u3041-\u30ff\u31f0-\u31ff\uff66-\uff9f]", text))
        assert quality.hiragana_share(text) == (1.0 if kana < quality.MIN_KANA else len(re.findall(
            r"[\u3041-\u309f]", text)) / (kana + len(re.findall(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]", text))))
    wanted = frozenset({"ja"})
    verdicts = [(language.judge(t, wanted, 0.5).share >= 0.3, language.judge(t, wanted, 0.5, 0.3).share >= 0.3)
                for t in pages + others]
    assert all(full == early for full, early in verdicts)
    assert sum(full for full, _ in verdicts) == len(pages) and not any(full for full, _ in verdicts[len(pages):])
    assert quality.letter_share("😀😀 abc") == 0.6 and quality.hiragana_share("中文文本" * 50) == 1.0


def test_quality_config_errors_name_the_key(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    config = write_config(tmp_path, [{"type": "manpages", "path": "/usr/share/man/ja"}],
                          quality={"char_repetition_max": 1.5, "ng_words_file": "missing.txt"})
    assert main(["prepare", "--config", str(config)]) == 2
    err = capfd.readouterr().err
    assert "quality.char_repetition_max: must be in (0, 1]" in err and "missing.txt is not a file" in err


def test_roff_conversion_details() -> None:
    source = ('.TH X 1\n.SH 名前\nfoo \\- バー\n.SH 書式\n.B foo\n[\n.BI \\-o " file"\n]\n'
              '.PP\n日本語の\n文章です。\nEnglish\nwords \\(em ok. Next\n.nf\n  keep   spaces\n.fi\n'
              '.TS\ncenter box tab(@);\nl l.\nA@B\n.TE\n.TP\n.B \\-a\nall of them\n')
    text = roff_to_text(source)
    assert text.startswith("名前\nfoo - バー\n\n書式\nfoo [ -o file ]\n")  # no header, body indent removed
    assert "\n日本語の文章です。 English words — ok. Next\n" in text  # CJK lines join without a space
    assert "\n  keep   spaces\n" in text  # no-fill text is kept verbatim
    assert "│A   B │" in text and max(map(len, text.splitlines())) < 80  # tables keep a terminal's width
    assert text.endswith("\n-a     all of them")
    assert "X(1)" not in text
    mdoc = ".Dd May 1, 2020\n.Dt FOO 1\n.Os\n.Sh 名前\n.Nm foo\n.Nd ふうを表示\n.Sh 書式\n.Nm\n.Op Fl a Ar file\n"
    assert roff_to_text(mdoc) == "名前\nfoo — ふうを表示\n\n書式\nfoo [-a file]"
    assert roff_to_text(".so man1/other.1\n") == ""


def test_manpage_groff_fails_or_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    man1 = tmp_path / "man" / "man1"
    man1.mkdir(parents=True)
    (man1 / "good.1").write_text(".TH GOOD 1\n.SH 名前\ngood \\- 良いページです\n", encoding="utf-8")
    (man1 / "bad.1").write_text(".TH BAD 1\n.SH 名前\n.ab broken page\n", encoding="utf-8")
    (man1 / "alias.1").write_text(".so man1/good.1\n", encoding="utf-8")
    config = write_config(tmp_path, [{"type": "manpages", "path": "man"}])
    run_cli("prepare", "--config", config)
    assert read_corpus(tmp_path / "out") == ["名前\ngood - 良いページです"]
    counts = Manifest.read(tmp_path / "out" / "manifest.json").counts
    assert counts["dropped"] == {"groff failed (exit 1)": 1, "alias page (.so)": 1}
    assert counts["dropped_examples"]["groff failed (exit 1)"] == ["man1/bad.1"]
    monkeypatch.setenv("PATH", str(tmp_path))  # no groff on it
    with pytest.raises(StageInputError, match=r"good\.1: .*apt-get install groff-base"):
        roff_to_text(".TH GOOD 1\n", "man1/good.1")


def test_local_sources_and_bad_records(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    good = [f"良い文書その{i}です。" for i in range(4)]
    with open(raw / "a.jsonl", "wb") as fh:
        fh.write(json.dumps({"text": good[0]}, ensure_ascii=False).encode() + b"\n")
        fh.write(b'{"text": broken json\n')
        fh.write(b'{"text": "\xff\xfe bad utf8"}\n')
        fh.write(json.dumps({"title": "no text"}).encode() + b"\n")
        fh.write(json.dumps({"text": 42}).encode() + b"\n")
        fh.write(json.dumps({"text": "短い"}, ensure_ascii=False).encode() + b"\n")
        fh.write(json.dumps({"text": good[0]}, ensure_ascii=False).encode() + b"\n")  # duplicate
        fh.write(json.dumps({"text": good[1] + "\x00"}, ensure_ascii=False).encode() + b"\n")
    with gzip.open(raw / "b.json.gz", "wt", encoding="utf-8") as fh:
        json.dump([{"text": good[2]}], fh, ensure_ascii=False)
    (raw / "c.txt").write_text(f"{good[3]}\n\n二つ目の段落です。\n", encoding="utf-8")
    config = write_config(tmp_path, [
        {"type": "jsonl", "path": "raw/*.json*"},
        {"type": "text", "path": "raw/c.txt", "text_unit": "paragraph"},
    ])
    run_cli("prepare", "--config", config)
    out = tmp_path / "out"
    texts = read_corpus(out)
    assert texts == [good[0], good[1], good[2], good[3], "二つ目の段落です。"]
    dropped = Manifest.read(out / "manifest.json").counts["dropped"]
    assert dropped == {"invalid json": 1, "undecodable utf-8": 1, "missing key": 1, "not a string": 1,
                       "shorter than min_chars (5)": 1, "exact duplicate": 1}
    examples = Manifest.read(out / "manifest.json").counts["dropped_examples"]
    assert examples["invalid json"] == [f"{raw / 'a.jsonl'}:2"]


def test_hf_dataset_local_forms(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = {"text": ["一つ目の文書です。", "二つ目の文書です。"], "id": [1, 2]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "rows.parquet"))
    config = write_config(tmp_path, [{"type": "hf_dataset", "path": "saved"},
                                     {"type": "hf_dataset", "path": "rows.parquet"}], dedup=False,
                          near_dedup={"threshold": None})
    run_cli("prepare", "--config", config)
    assert read_corpus(tmp_path / "out") == rows["text"] * 2


def test_rerun_skips_force_redoes_and_config_change_redoes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "docs.jsonl").write_text(
        "".join(json.dumps({"text": f"文書番号 {i} の本文です。"}, ensure_ascii=False) + "\n" for i in range(20)),
        encoding="utf-8")
    config = write_config(tmp_path, [{"type": "jsonl", "path": "docs.jsonl"}])
    run_cli("prepare", "--config", config)
    first = (tmp_path / "out" / "manifest.json").read_text()
    capsys.readouterr()
    run_cli("prepare", "--config", config)
    assert "up to date" in capsys.readouterr().err
    assert (tmp_path / "out" / "manifest.json").read_text() == first
    run_cli("prepare", "--config", config, "--force")
    assert "up to date" not in capsys.readouterr().err
    run_cli("prepare", "--config", config, "corpus.sources.0.max_documents=3")
    assert len(read_corpus(tmp_path / "out")) == 3


def test_missing_source_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = write_config(tmp_path, [{"type": "jsonl", "path": "nowhere/*.jsonl"}])
    from gptpipe.cli import main

    assert main(["prepare", "--config", str(config)]) == 2
    assert "no input files found" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
