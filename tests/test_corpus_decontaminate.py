"""Stage 0's decontamination: man pages quoting held-out man-page paragraphs (the evaluation items, as a jsonl
file and as a local lm-eval task), exactly, with a word or character edited, re-wrapped and re-spaced; every
quoting document caught, no other lost; spans cut out instead; the report on the same corpora agrees."""

from __future__ import annotations

import json
import random
import re
import textwrap
from pathlib import Path

import pytest
import yaml

from conftest import corpus_bytes, corpus_texts, require_manpages, run_cli
from gptpipe.cli import main
from gptpipe.corpus.config import DecontaminationConfig
from gptpipe.corpus.decontaminate import Index
from gptpipe.stage import Manifest
from test_corpus_neardup import MAN, manpage_texts

VARIANTS = ("exact", "edited", "re-wrapped", "re-spaced")
WORD, LETTERS = re.compile(r"\w+"), re.compile(r"[\W_]+")


def paragraphs(text: str) -> list[str]:
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def quoted(item: str, variant: str, japanese: bool, rng: random.Random) -> str:
    """`item` as a web page quotes it."""
    if variant == "edited":  # one word (English) or character (Japanese) changed, in the middle
        if japanese:
            middle = len(item) // 2
            return item[:middle] + ("猫" if item[middle] != "猫" else "犬") + item[middle + 1:]
        words = item.split(" ")
        words[len(words) // 2] = "zebra"
        return " ".join(words)
    if variant == "re-wrapped":
        return "\n".join(textwrap.wrap(item, rng.choice((17, 23, 31))))
    if variant == "re-spaced":  # a PDF's or an OCR's spacing; full-width letters and capitals in English
        if japanese:  # a space after every third Japanese character (English words stay whole)
            return re.sub(r"([^\x00-\x7f]{3})(?=[^\x00-\x7f])", r"\1 ", item)
        return "  ".join(word.upper() if i % 3 == 0 else word for i, word in enumerate(item.split()))
    return item


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Clean pages (Japanese and English), host pages quoting one item each, and the items: paragraphs of other
    pages found in no clean or host page, half in items.jsonl (task `heldout`), half in a local lm-eval task
    (`heldout_task`, its data in a jsonl file beside the YAML)."""
    require_manpages()
    folder = tmp_path_factory.mktemp("decontaminate")
    ja = manpage_texts(MAN / "ja", 3, 120)
    en = manpage_texts(MAN, 60, 45)
    clean, hosts, sources = ja[0::3] + en[0::3], ja[1::3] + en[1::3], ja[2::3] + en[2::3]
    # Every run of 8 words and of 20 letters of the clean and host pages: an item shares none (the man pages
    # share boilerplate: licences, bug addresses, gcloud's flag texts).
    seen: set[int] = set()
    for page in clean + hosts:
        words, letters = WORD.findall(page.lower()), LETTERS.sub("", page.lower())
        seen.update(hash(tuple(words[i:i + 8])) for i in range(len(words) - 7))
        seen.update(hash(letters[i:i + 20]) for i in range(len(letters) - 19))
    items: list[tuple[str, bool]] = []  # (paragraph, Japanese?)
    for page in sources:
        for paragraph in paragraphs(page):
            paragraph = " ".join(paragraph.split())
            japanese = bool(re.search(r"[ぁ-んァ-ン]", paragraph))
            words, letters = WORD.findall(paragraph.lower()), LETTERS.sub("", paragraph.lower())
            # At least twice the shortest n-gram (20 letters, 8 words): one edit then leaves an n-gram whole.
            if not ((50 <= len(letters) <= 300) if japanese else (20 <= len(words) <= 80)):
                continue
            if (any(hash(tuple(words[i:i + 8])) in seen for i in range(len(words) - 7))
                    or any(hash(letters[i:i + 20]) in seen for i in range(len(letters) - 19))):
                continue
            if sum(j == japanese for _, j in items) < 16:
                items.append((paragraph, japanese))
                break
    assert sum(j for _, j in items) == 16 and len(items) == 32
    rng = random.Random(0)
    quoting, cut = [], []
    # A host page each: Japanese items in Japanese pages, English ones in English and Japanese pages by turns.
    ja_hosts, en_hosts = iter(ja[1::3]), iter(en[1::3])
    for i, (item, japanese) in enumerate(items):
        host = paragraphs(next(ja_hosts if japanese or i % 4 < 2 else en_hosts))
        at = len(host) // 2
        text = "\n\n".join(host[:at] + [quoted(item, VARIANTS[i // 2 % 4], japanese, rng)] + host[at:])
        quoting.append(text)
        cut.append("\n\n".join(host[:at]) + "\n" + "\n\n".join(host[at:]))  # what remove_span leaves
    documents = folder / "documents.jsonl"
    documents.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in clean + quoting),
                         encoding="utf-8")
    (folder / "heldout.jsonl").write_text(
        "".join(json.dumps({"text": item, "id": str(i)}, ensure_ascii=False) + "\n"
                for i, (item, _) in enumerate(items) if i % 2 == 0), encoding="utf-8")
    task = folder / "task"
    task.mkdir()
    (task / "heldout.jsonl").write_text(
        "".join(json.dumps({"question": item, "label": "yes"}, ensure_ascii=False) + "\n"
                for i, (item, _) in enumerate(items) if i % 2), encoding="utf-8")
    (task / "heldout_task.yaml").write_text(yaml.safe_dump({
        "task": "heldout_task", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": "heldout.jsonl"}},
        "output_type": "multiple_choice", "test_split": "test", "doc_to_text": "{{question}}",
        "doc_to_target": 0, "doc_to_choice": ["{{label}}"],
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}), encoding="utf-8")
    return {"folder": folder, "clean": clean, "quoting": quoting, "cut": cut, "items": items, "documents": documents}


def configure(folder: Path, setup: dict, name: str, workers: int = 1, **decontamination) -> Path:
    """A config reading the documents, with `decontamination` (none: off); `workers` > 1 cuts them into 1 MB
    shards judged by that many processes, each reading the index the driver saved."""
    corpus: dict = {"sources": [{"type": "jsonl", "path": str(setup["documents"])}], "output_dir": name,
                    "workers": workers, "shard_mb": 1 if workers > 1 else 64}
    if decontamination:
        corpus["decontamination"] = {"files": [str(setup["folder"] / "heldout.jsonl"),
                                               str(setup["folder"] / "task" / "heldout_task.yaml")],
                                     **decontamination}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"corpus": corpus}, allow_unicode=True), encoding="utf-8")
    return path


def report(config: Path, capsys: pytest.CaptureFixture, *corpus: Path) -> dict[str, tuple[int, int]]:
    """--contamination-report's rows: task → (items found, documents quoting one)."""
    capsys.readouterr()
    assert main(["prepare", "--config", str(config), "--contamination-report", *map(str, corpus)]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| heldout")]
    return {row[0].strip(): (int(row[3].replace(",", "")), int(row[4].replace(",", ""))) for row in rows}


def test_every_quoting_document_is_dropped_and_no_other(setup: dict, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    baseline = configure(tmp_path, setup, "baseline")
    run_cli("prepare", "--config", baseline)
    kept_before = corpus_texts(tmp_path / "baseline")
    assert all(text in kept_before for text in setup["quoting"])  # only decontamination could drop them
    config = configure(tmp_path, setup, "drop", workers=2, action="drop")
    run_cli("prepare", "--config", config)
    manifest = Manifest.read(tmp_path / "drop" / "manifest.json")
    kept = corpus_texts(tmp_path / "drop")
    assert kept == [text for text in kept_before if text not in setup["quoting"]]
    dropped = manifest.counts["dropped"]
    assert dropped["contaminated: heldout"] == 16 and dropped["contaminated: heldout_task"] == 16, dropped
    # The task's items are its documents' strings: the questions, and the labels (too short to look for).
    assert manifest.counts["decontamination"]["items"] == {
        "heldout": {"items": 32, "too short": 16, "ngrams": pytest.approx(1500, rel=0.7)},
        "heldout_task": {"items": 17, "too short": 1, "ngrams": pytest.approx(1500, rel=0.7)}}
    samples = [json.loads(line) for line in (tmp_path / "drop" / "dropped" / "contaminated_heldout.jsonl").open()]
    assert len(samples) == 16 and all(s["text"] in setup["quoting"] and "item" in s["overlaps"] for s in samples)
    assert set(manifest.inputs["decontamination"]) == {"settings", str(setup["folder"] / "heldout.jsonl"),
                                                        str(setup["folder"] / "task" / "heldout_task.yaml")}

    # The report reads a corpus and changes nothing: the quotes in the corpus without decontamination, none after.
    before = corpus_bytes(tmp_path / "drop")
    assert report(config, capsys, tmp_path / "baseline") == {"heldout": (16, 16), "heldout_task": (16, 16)}
    assert report(config, capsys) == {"heldout": (0, 0), "heldout_task": (0, 0)}
    assert corpus_bytes(tmp_path / "drop") == before

    # --explain names the check and the item; the rerun is current until the items change.
    one = tmp_path / "one.txt"
    one.write_text(setup["quoting"][3], encoding="utf-8")
    assert main(["prepare", "--config", str(config), "--explain", str(one)]) == 0
    out = capsys.readouterr().out
    assert "dropped: contaminated: heldout_task" in out and "DROPS  contaminated: heldout_task: " in out
    run_cli("prepare", "--config", config)
    assert "up to date" in capsys.readouterr().err
    with open(setup["folder"] / "heldout.jsonl", "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"text": setup["clean"][0][:500]}, ensure_ascii=False) + "\n")
    try:
        run_cli("prepare", "--config", config)
        assert len(corpus_texts(tmp_path / "drop")) == len(kept) - 1
    finally:  # the module's other tests read the file as it was
        lines = (setup["folder"] / "heldout.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
        (setup["folder"] / "heldout.jsonl").write_text("".join(lines[:-1]), encoding="utf-8")


def test_a_folder_of_llm_jp_eval_files_is_an_item_source(setup: dict, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    """llm-jp-eval's test folder (the tasks `gptpipe evaluate` runs from task_dirs): its samples are the items."""
    folder = tmp_path / "evaluation" / "test"
    folder.mkdir(parents=True)
    items = [item for i, (item, _) in enumerate(setup["items"]) if i % 4 == 0]
    (folder / "heldout_qa.json").write_text(json.dumps({
        "instruction": "この文章はどのマニュアルのものか答えてください。", "output_length": 8,
        "metrics": ["exact_match"], "few_shots": [],
        "samples": [{"input": item, "output": "man"} for item in items]}, ensure_ascii=False), encoding="utf-8")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"corpus": {"sources": [{"type": "jsonl", "path": str(setup["documents"])}],
                                                 "decontamination": {"files": [str(folder)]}}}), encoding="utf-8")
    capsys.readouterr()
    assert main(["prepare", "--config", str(config), "--contamination-report", str(setup["documents"])]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| llmjp_")]
    assert [(row[0].strip(), int(row[3]), int(row[4])) for row in rows] == [("llmjp_heldout_qa", 8, 8)]


def test_remove_span_cuts_the_quotes_and_keeps_the_rest(setup: dict, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    config = configure(tmp_path, setup, "cut", action="remove_span")
    run_cli("prepare", "--config", config)
    manifest = Manifest.read(tmp_path / "cut" / "manifest.json")
    assert manifest.counts["notes"] == {"contaminated spans removed: heldout": 16,
                                        "contaminated spans removed: heldout_task": 16}
    kept = corpus_texts(tmp_path / "cut")
    clean = [text for text in kept if text in setup["clean"]]
    cut = [text for text in kept if text not in setup["clean"]]
    assert cut == setup["cut"]  # the host page as it was, less the quote (its punctuation included)
    assert report(config, capsys) == {"heldout": (0, 0), "heldout_task": (0, 0)}
    assert len(clean) + len(cut) == len(kept)


def test_index_matches_normalised_text_and_short_items_are_skipped(tmp_path: Path) -> None:
    """Full-width letters, capitals and line breaks do not hide a quote; a Japanese page quoting an English item
    is caught; an item shorter than the shortest n-gram is not looked for."""
    items = tmp_path / "items.txt"
    items.write_text("The script is intended as a simple front end for the openssl program for use by a beginner\n"
                     "yes\n", encoding="utf-8")
    index = Index.build(DecontaminationConfig(files=[items]))
    assert index.counts == {"items": {"items": 2, "too short": 1, "ngrams": 11}}
    page = ("解説\nこのスクリプトは ＴＨＥ ＳＣＲＩＰＴ is intended as a simple\nfront end for the OpenSSL program, "
            "for use by a beginner. と書かれている。")
    overlap = index.find(page)
    (start, end), = overlap.spans
    assert overlap.tasks == ["items"] and page[start:end].startswith("ＴＨＥ ＳＣＲＩＰＴ")
    assert not index.find("The script is intended as a simple tool for the openssl program, yes")
    # A line the normalisation lengthens (a ligature) still maps each match to its place in the original.
    line = "See ﬁg. 1: the script is intended as a simple front end for the openssl program for use by a beginner."
    (start, end), = index.find(line).spans
    assert line[start:end] == line[line.index("the script"):]
    # `fields` picks the keys of a record that hold items.
    records = tmp_path / "records.jsonl"
    records.write_text(json.dumps({"question": line, "source": "copied from the manual page of the openssl "
                                   "command, section one, by a volunteer"}) + "\n", encoding="utf-8")
    assert Index.build(DecontaminationConfig(files=[records])).counts["records"]["items"] == 2
    only = Index.build(DecontaminationConfig(files=[records], fields=["question"]))
    assert only.counts["records"]["items"] == 1 and only.find(line)
    assert not only.find("copied from the manual page of the openssl command, section one, by a volunteer")


def test_decontamination_config_errors_name_the_key(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    (tmp_path / "items.csv").write_text("a,b\n", encoding="utf-8")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"corpus": {"decontamination": {
        "files": ["missing.jsonl", "items.csv", "."]}}}), encoding="utf-8")
    assert main(["prepare", "--config", str(config)]) == 2
    err = capfd.readouterr().err
    assert "corpus.decontamination.files.0" in err and "missing.jsonl does not exist" in err
    assert "corpus.decontamination.files.1" in err and "not an item file or task (.jsonl, .txt, .yaml" in err
    assert "corpus.decontamination.files.2" in err and "llm-jp-eval task files (*.json), and it holds none" in err
    # The paths are looked at once the values are right: these come first.
    config.write_text(yaml.safe_dump({"corpus": {"decontamination": {
        "files": ["missing.jsonl"], "min_char_ngram": 60, "acton": "drop"}}}), encoding="utf-8")
    assert main(["prepare", "--config", str(config)]) == 2
    err = capfd.readouterr().err
    assert "corpus.decontamination.min_char_ngram" in err and "must not exceed char_ngram (50)" in err
    assert "corpus.decontamination.acton" in err and "did you mean corpus.decontamination.action" in err
    assert main(["prepare", "--config", str(configure(tmp_path, {"documents": tmp_path / "d.jsonl"}, "off")),
                 "--contamination-report"]) == 2
    assert "corpus.decontamination.tasks or corpus.decontamination.files" in capfd.readouterr().err


def test_unreadable_items_are_named_and_nothing_is_written(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """A bad line of an item file and an unknown lm-eval task are refused before stage 0 writes anything."""
    documents = tmp_path / "d.jsonl"
    documents.write_text(json.dumps({"text": "本文" * 40}, ensure_ascii=False) + "\n", encoding="utf-8")
    (tmp_path / "items.jsonl").write_text('{"question": "ok"}\n{"question": \n', encoding="utf-8")
    config = configure(tmp_path, {"documents": documents, "folder": tmp_path}, "bad")
    text = yaml.safe_load(config.read_text(encoding="utf-8"))
    text["corpus"]["decontamination"] = {"files": ["items.jsonl"]}
    config.write_text(yaml.safe_dump(text), encoding="utf-8")
    assert main(["prepare", "--config", str(config)]) == 2
    assert f"{tmp_path / 'items.jsonl'}:2: not JSON" in capfd.readouterr().err
    text["corpus"]["decontamination"] = {"tasks": ["no_such_task_xyz"]}
    config.write_text(yaml.safe_dump(text), encoding="utf-8")
    assert main(["prepare", "--config", str(config)]) == 2
    assert "unknown lm-eval task(s): no_such_task_xyz" in capfd.readouterr().err
    assert not (tmp_path / "bad").exists()
