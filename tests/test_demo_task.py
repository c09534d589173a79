"""The demo task (`gptpipe make-demo-task`) built from the real Japanese man pages."""

from __future__ import annotations

import csv
import shutil
from collections import Counter
from pathlib import Path

import pytest

from conftest import REPO, require_manpages, run_cli
from gptpipe.finetune.demo_task import SECTION_LABELS, name_description
from gptpipe.stage import Manifest


@pytest.fixture(scope="module")
def demo_task(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The task built with the shipped evaluate_config.yaml: data/finetune/manpage_section/."""
    require_manpages()
    ws = tmp_path_factory.mktemp("demo_task")
    shutil.copy(REPO / "evaluate_config.yaml", ws)
    run_cli("make-demo-task", "--config", ws / "evaluate_config.yaml")
    return ws / "data" / "finetune" / "manpage_section"


def read_tsv(path: Path) -> list[list[str]]:
    with open(path, encoding="utf-8", newline="") as fh:
        return list(csv.reader(fh, delimiter="\t", quoting=csv.QUOTE_NONE))


def pages(folder: Path) -> list[dict[str, str]]:
    with open(folder / "pages.tsv", encoding="utf-8", newline="") as fh:
        return list(csv.DictReader(fh, delimiter="\t", quoting=csv.QUOTE_NONE))


def test_rows_are_input_tab_label_and_counts_match_the_manifest(demo_task: Path) -> None:
    counts = Manifest.read(demo_task / "manifest.json").counts
    labels = Counter()
    for split in ("train", "validation", "test"):
        rows = read_tsv(demo_task / f"{split}.tsv")
        assert len(rows) == counts["splits"][split] > 0
        assert all(len(r) == 2 and r[0].strip() and r[1] in SECTION_LABELS.values() for r in rows)
        labels.update(r[1] for r in rows)
    assert dict(labels) == counts["labels"]
    assert counts["pages"] > 1500  # manpages-ja + manpages-ja-dev have ~1,800 pages
    # Sections 4 and 6 have a few dozen pages: left out, and said so; the rest are in every split.
    assert set(counts["dropped_sections"]) == {"4 特殊ファイル", "6 ゲーム"}
    assert set(labels) == {"コマンド", "システムコール", "ライブラリ関数", "ファイル形式", "概要と規約", "管理コマンド"}
    for split in ("validation", "test"):
        assert {r[1] for r in read_tsv(demo_task / f"{split}.tsv")} == set(labels)
    # Imbalanced: library functions are the majority, about a third.
    assert counts["majority_share"] == pytest.approx(max(labels.values()) / sum(labels.values()), abs=1e-4)
    assert 0.25 < counts["majority_share"] < 0.45
    assert counts["skipped_pages"][".so alias"] >= 1


def test_the_chat_set_holds_every_row_as_a_two_turn_conversation(demo_task: Path) -> None:
    from gptpipe.data.jsonl import Reasons
    from gptpipe.finetune.chat_data import read_conversations

    by_input = {r["input"]: r for r in pages(demo_task)}
    for split in ("train", "validation", "test"):
        skipped = Reasons()
        chats = read_conversations(demo_task / "chat" / f"{split}.jsonl", skipped)
        assert not skipped.counts and len(chats) == len(read_tsv(demo_task / f"{split}.tsv"))
        for chat in chats:
            question, description, _, section = (m["content"] for m in chat.messages)
            page = by_input[description]
            assert page["split"] == split and f"`{Path(page['page'].split(',')[0]).stem}`" in question
            assert section == f"{page['page'][3]}章 ({page['label']}) です。"


def test_the_llm_jp_eval_files_hold_the_splits_as_its_reader_takes_them(demo_task: Path) -> None:
    """The test split as an llm-jp-eval task, its few-shot examples the train split's first rows (../train/)."""
    from gptpipe.llmjp_eval import read_folders

    [[task]] = read_folders([demo_task / "llm-jp-eval" / "test"], num_fewshot=2).values()
    test, train = read_tsv(demo_task / "test.tsv"), read_tsv(demo_task / "train.tsv")
    assert task.name == "llmjp_manpage_section" and task.metrics == ["exact_match"]
    assert [[s["input"], s["output"]] for s in task.samples] == test
    assert [[s["input"], s["output"]] for s in task.shots] == train[:2]
    labels = sorted({label for _, label in train})
    assert sorted(task.label_list) == labels and all(label in task.instruction for label in labels)


def test_the_preference_set_pairs_every_conversation_in_trls_shape(demo_task: Path) -> None:
    import json

    from gptpipe.data.jsonl import Reasons
    from gptpipe.finetune.kinds.preference import read_pairs

    by_input = {r["input"]: r for r in pages(demo_task)}
    for split in ("train", "validation", "test"):
        skipped = Reasons()
        path = demo_task / "preference" / f"{split}.jsonl"
        pairs = read_pairs(path, skipped)
        raw = [json.loads(line) for line in path.read_text("utf-8").splitlines()]
        assert not skipped.counts and len(pairs) == len(raw) == len(read_tsv(demo_task / f"{split}.tsv"))
        for k, row in enumerate(raw):
            assert set(row) == {"prompt", "chosen", "rejected"}
            if k % 2:  # the conversation up to the section question: the right section over a wrong one
                page = by_input[row["prompt"][1]["content"]]
                assert row["prompt"][-1]["content"] == "マニュアルの何章ですか?"
                section_line = f"{page['page'][3]}章 ({page['label']}) です。"
                assert row["chosen"] == [{"role": "assistant", "content": section_line}]
                assert row["rejected"][0]["content"] != row["chosen"][0]["content"]
                assert row["rejected"][0]["content"].endswith(") です。")
            else:  # the question about the command: its description over the section line
                page = by_input[row["chosen"]]
                assert page["split"] == split and row["prompt"].endswith("は何をしますか?")
                assert row["rejected"] == f"{page['page'][3]}章 ({page['label']}) です。"


def test_no_page_and_no_description_in_two_splits(demo_task: Path) -> None:
    rows = pages(demo_task)
    split_of: dict[str, str] = {}
    for row in rows:
        for page in row["page"].split(","):
            assert split_of.setdefault(page, row["split"]) == row["split"], page
    texts = Counter(r["input"] for r in rows)
    assert texts.most_common(1)[0][1] == 1
    assert not any(Path("/usr/share/man/ja", p + ".gz").is_symlink() for p in split_of)


def test_known_pages_land_in_their_section(demo_task: Path) -> None:
    by_page = {page: row for row in pages(demo_task) for page in row["page"].split(",")}
    assert by_page["man1/ls.1"]["label"] == "コマンド"
    assert by_page["man1/ls.1"]["input"] == "ディレクトリの内容をリスト表示する"
    assert by_page["man2/open.2"]["label"] == "システムコール"
    assert by_page["man3/printf.3"]["label"] == "ライブラリ関数"
    assert by_page["man5/passwd.5"]["label"] == "ファイル形式"
    assert by_page["man8/mount.8"]["label"] == "管理コマンド"
    assert by_page["man7/signal.7"]["input"] == "シグナルの概要"
    assert by_page["man1/biff.1"]["input"] == "メールの到着と、それが誰からのメールかを知らせる"  # mdoc .Nd
    assert by_page["man8/ping.8"]["input"] == "ICMP ECHO_REQUEST パケットをネットワーク上のホストに送る"


def test_same_seed_same_files_other_seed_other_split(demo_task: Path, tmp_path: Path) -> None:
    config = REPO / "evaluate_config.yaml"
    for seed, name in ((1234, "same"), (7, "other")):
        run_cli("make-demo-task", "--config", config, f"demo_task.output_dir={tmp_path / name}",
                f"demo_task.seed={seed}")
    for split in ("train", "validation", "test"):
        assert (tmp_path / "same" / f"{split}.tsv").read_bytes() == (demo_task / f"{split}.tsv").read_bytes()
    assert (tmp_path / "other" / "test.tsv").read_bytes() != (demo_task / "test.tsv").read_bytes()
    assert sorted(read_tsv(tmp_path / "other" / "train.tsv") + read_tsv(tmp_path / "other" / "test.tsv")
                  + read_tsv(tmp_path / "other" / "validation.tsv")) == sorted(
        read_tsv(demo_task / "train.tsv") + read_tsv(demo_task / "test.tsv") + read_tsv(demo_task / "validation.tsv"))


@pytest.mark.parametrize("source, description", [
    ('.TH LS 1\n.SH 名前\nls \\- ディレクトリの内容を\nリスト表示する\n.SH 書式\n',
     "ディレクトリの内容をリスト表示する"),
    ('.SH "NAME"\n.B iso_8859\\-11\n\\- ISO 8859\\-11 文字集合\n.SH X\n', "ISO 8859-11 文字集合"),
    ('.de XX\n.SH "\\\\$1"\n..\n.SH\n名称\nfoo \\- \\fB太字\\fP の説明\n', "太字 の説明"),
    (".Sh 名前\n.Nm ping\n.Nd\n.Tn ICMP\nパケットを送る\n.Sh 書式\n", "ICMP パケットを送る"),
    (".Sh 名前\n.Nm rup\nリモートホストの状態を表示する\n.Sh 書式\n", "リモートホストの状態を表示する"),
    (".SH 名前\nrexec -- リモート実行クライアント\n", "リモート実行クライアント"),
    (".SH 概要\nfoo \\- 説明\n", None),
])
def test_name_description_reads_man_and_mdoc(source: str, description: str | None) -> None:
    assert name_description(source) == description
