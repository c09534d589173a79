"""`suite: ja` (gptpipe.eval_suite): lm-eval's Japanese leaderboard tasks run offline from a local data folder.

The hub datasets cannot be fetched here, so the tests write fixtures in the layout `gptpipe evaluate --fetch`
writes (eval_suite.store: one parquet file per split, dataset.json), each dataset with the real one's columns and
types (JGLUE's ClassLabel labels, SQuAD-style answers, JAQKET's contexts, MGSM's number answers, ...), its rows
built from the Japanese man pages, and run `gptpipe evaluate` on the stage-4 export with the hub switched off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, require_manpages, run_cli
from gptpipe import eval_suite
from gptpipe.cli import main
from gptpipe.stage import Manifest

pytest.importorskip("lm_eval", reason="needs lm-eval (pip install -e '.[ja-eval]')")
pytest.importorskip("neologdn", reason="the ja suite's XL-Sum imports neologdn (pip install -e '.[ja-eval]')")

MAN_DIR = Path("/usr/share/man/ja")
# The Japanese leaderboard's shots (each task YAML's num_fewshot; XWinograd's none: zero-shot)
SHOTS = {"ja_leaderboard_jaqket_v2": 1, "ja_leaderboard_jcommonsenseqa": 3, "ja_leaderboard_jnli": 3,
         "ja_leaderboard_jsquad": 2, "ja_leaderboard_marc_ja": 3, "ja_leaderboard_mgsm": 5,
         "ja_leaderboard_xlsum": 1, "ja_leaderboard_xwinograd": 0}
TRAIN_ROWS, EVAL_ROWS = 6, 3  # MGSM's 5 shots need 5 training rows


def pages() -> list[tuple[str, str]]:
    """(command, its one-line description) of the section-1 man pages."""
    from gptpipe.finetune.demo_task import read_rows

    require_manpages()
    rows = sorted((r for r in read_rows(MAN_DIR)[0] if r.section == "1"), key=lambda r: r.page)
    return [(r.page.split(",")[0].split("/")[1].rsplit(".", 1)[0], r.input) for r in rows]


def fixture_datasets(rows: list[tuple[str, str]]) -> dict[tuple[str, str | None], dict[str, list[dict]]]:
    """(dataset_path, dataset_name) → split → rows, each dataset's columns as the hub dataset has them."""
    def cycle(n: int, start: int = 0) -> list[tuple[int, str, str]]:
        return [(i, *rows[(start + i) % len(rows)]) for i in range(n)]

    def split_rows(make, sizes: dict[str, int]) -> dict[str, list[dict]]:
        out, start = {}, 0
        for split, n in sizes.items():
            out[split] = [make(i + start, name, desc) for i, name, desc in cycle(n, start)]
            start += n
        return out

    usual = {"train": TRAIN_ROWS, "validation": EVAL_ROWS}

    def jcqa(i: int, name: str, desc: str) -> dict:
        options = [rows[(i + k) % len(rows)][0] for k in range(5)]
        label = i % 5
        options[0], options[label] = options[label], options[0]
        return {"q_id": i, "question": f"「{desc}」コマンドはどれ？",
                **{f"choice{k}": o for k, o in enumerate(options)}, "label": label}

    def jnli(i: int, name: str, desc: str) -> dict:
        hypothesis = [f"{name} は{desc}。", f"{name} は{rows[(i + 1) % len(rows)][1]}。", f"{name} はよく使われる。"]
        return {"sentence_pair_id": str(i), "yjcaptions_id": f"{i}-{i}", "sentence1": f"{name} は{desc}。",
                "sentence2": hypothesis[i % 3], "label": i % 3}

    def jsquad(i: int, name: str, desc: str) -> dict:
        context = f"{name} [SEP] {name} は{desc}。マニュアルのセクション 1 に載っている。"
        return {"id": f"fixture-{i}", "title": name, "context": context, "question": f"{name} は何をするか？",
                "answers": {"text": [desc], "answer_start": [context.index(desc)]}, "is_impossible": False}

    def marc(i: int, name: str, desc: str) -> dict:
        return {"sentence": f"{name} は{desc}。" + ("とても便利です。" if i % 2 == 0 else "使いにくいです。"),
                "label": i % 2, "review_id": f"R{i}"}

    def jaqket(i: int, name: str, desc: str) -> dict:
        return {"qid": f"QA{i}", "question": f"{desc}コマンドは何？", "answers": {"text": [name]},
                "ctxs": {"id": [i], "title": [name], "text": [f"{name} は{desc}。"], "has_answer": [True]}}

    def mgsm(i: int, name: str, desc: str, train: bool) -> dict:
        a, b = len(name), len(desc)
        return {"question": f"問題：{name} のページは {a} 字、説明は {b} 字です。合わせて何字ですか？",
                "answer": f"ステップごとの答え：{a} + {b} = {a + b}。答えは {a + b} です。" if train else None,
                "answer_number": a + b, "equation_solution": f"{a} + {b} = {a + b}" if train else None}

    def xlsum(i: int, name: str, desc: str) -> dict:
        return {"id": str(i), "url": f"https://example.invalid/{i}", "title": name, "summary": f"{name} は{desc}。",
                "text": f"{name} は{desc}。これはマニュアルのセクション 1 に載っているコマンドだ。"}

    def xwinograd(i: int, name: str, desc: str) -> dict:
        other = rows[(i + 1) % len(rows)][0]
        right, wrong = f"{name} は{desc}。", f"{other} は{desc}。"
        return {"sentence1": right if i % 2 == 0 else wrong, "sentence2": wrong if i % 2 == 0 else right,
                "answer": str(1 + i % 2)}

    return {
        ("Rakuten/JGLUE", "JCommonsenseQA"): split_rows(jcqa, usual),
        ("Rakuten/JGLUE", "JNLI"): split_rows(jnli, usual),
        ("Rakuten/JGLUE", "JSQuAD"): split_rows(jsquad, usual),
        ("Rakuten/JGLUE", "MARC-ja"): split_rows(marc, usual),
        ("kumapo/JAQKET", "v2.0"): split_rows(jaqket, usual),
        ("juletxara/mgsm", "ja"): {"train": split_rows(lambda *a: mgsm(*a, True), {"train": TRAIN_ROWS})["train"],
                                   "test": split_rows(lambda *a: mgsm(*a, False), {"test": EVAL_ROWS})["test"]},
        ("mkshing/xlsum_ja", None): split_rows(xlsum, {**usual, "test": EVAL_ROWS}),
        ("polm-stability/xwinograd-ja", None): split_rows(xwinograd, {"test": EVAL_ROWS}),
    }


def features(path: str, name: str | None):
    """The hub dataset's column types where `datasets` would not infer them: JGLUE's ClassLabels, SQuAD answers."""
    import datasets

    v = datasets.Value
    labels = {"JCommonsenseQA": [f"choice{k}" for k in range(5)], "JNLI": ["entailment", "contradiction", "neutral"],
              "MARC-ja": ["positive", "negative"]}
    if name in labels:
        return {"label": datasets.ClassLabel(names=labels[name])}
    if name == "JSQuAD":
        return {"answers": datasets.Sequence({"text": v("string"), "answer_start": v("int32")})}
    if name == "ja":
        return {"answer": v("string"), "answer_number": v("int32"), "equation_solution": v("string")}
    return {}


def write_fixtures(data_dir: Path, only: set[tuple[str, str | None]] | None = None) -> dict:
    """The fixture datasets under `data_dir` in eval_suite's layout (what --fetch writes); returns them."""
    import datasets

    fixtures = fixture_datasets(pages())
    for (path, name), split_rows in fixtures.items():
        if only is not None and (path, name) not in only:
            continue
        data = {}
        for split, rows in split_rows.items():
            inferred = datasets.Dataset.from_list(rows).features
            data[split] = datasets.Dataset.from_list(rows, features=datasets.Features(
                {**inferred, **features(path, name)}))
        eval_suite.store(eval_suite.dataset_folder(data_dir, path, name), path, name, "fixture", data)
    return fixtures


@pytest.mark.slow
def test_ja_suite_runs_offline_on_the_export(exported_model: Path, tmp_path: Path) -> None:
    data_dir, out = tmp_path / "eval_datasets", tmp_path / "evaluation"
    fixtures = write_fixtures(data_dir)
    assert json.loads((data_dir / "Rakuten/JGLUE/JNLI/dataset.json").read_text())["splits"] == {
        "train": TRAIN_ROWS, "validation": EVAL_ROWS}
    before = {v: os.environ.get(v) for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    # num_fewshot is for other tasks: the suite's keep the leaderboard's shots
    # the export holds 128 tokens: the generation tasks' default of 256 new ones would not fit
    args = ("evaluate", "--config", REPO / "evaluate_config.yaml", f"model_dir={exported_model}", "tasks=[]",
            "suite=ja", f"suite_data_dir={data_dir}", "num_fewshot=2", "max_gen_toks=16", "batch_size=4",
            f"output_dir={out}")
    run_cli(*args)
    assert {v: os.environ.get(v) for v in before} == before  # the offline modes are the run's only

    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert {task: row["n_shot"] for task, row in results["tasks"].items()} == SHOTS
    eval_split = {"ja_leaderboard_mgsm": "test", "ja_leaderboard_xlsum": "test", "ja_leaderboard_xwinograd": "test"}
    for task, row in results["tasks"].items():
        config = results["configs"][task]
        path, name = config["metadata"]["dataset"], config["metadata"]["dataset_config"]
        assert config["dataset_path"] == "parquet" and config["metadata"]["dataset_revision"] == "fixture"
        assert row["samples"] == len(fixtures[(path, name)][eval_split.get(task, "validation")]) == EVAL_ROWS
        for metric in row["metrics"].values():
            assert 0 <= metric["value"] <= 1
    metrics = {task: set(row["metrics"]) for task, row in results["tasks"].items()}
    assert metrics["ja_leaderboard_jnli"] == {"acc"} and metrics["ja_leaderboard_xlsum"] == {"rouge2 (whitespaces)"}
    assert metrics["ja_leaderboard_jsquad"] == {"exact_match (whitespaces)"}
    generation = {t: c["generation_kwargs"] for t, c in results["configs"].items() if c.get("generation_kwargs")}
    assert {t: g["max_gen_toks"] for t, g in generation.items()} == {
        t: 16 for t in ("ja_leaderboard_jaqket_v2", "ja_leaderboard_jsquad", "ja_leaderboard_mgsm",
                        "ja_leaderboard_xlsum")}
    # JNLI's three fixture rows have the labels 0, 1, 2 (ClassLabel ints, as JGLUE's): a third each
    assert results["tasks"]["ja_leaderboard_jnli"]["majority_baseline"] == pytest.approx(1 / 3)
    table = (out / "results.md").read_text(encoding="utf-8")
    for task, shots in SHOTS.items():
        assert f"| {task} | {shots} | " in table
    manifest = Manifest.read(out / "manifest.json")
    assert str(data_dir / "Rakuten/JGLUE/JNLI") in manifest.inputs
    assert manifest.config["suite"] == "ja" and manifest.config["max_gen_toks"] == 16

    # Same data, same settings: nothing to redo.
    mtime = (out / "results.json").stat().st_mtime_ns
    run_cli(*args)
    assert (out / "results.json").stat().st_mtime_ns == mtime


@pytest.mark.slow
def test_a_subset_of_the_suite(exported_model: Path, tmp_path: Path) -> None:
    data_dir, out = tmp_path / "eval_datasets", tmp_path / "evaluation"
    write_fixtures(data_dir, {("Rakuten/JGLUE", "JNLI"), ("polm-stability/xwinograd-ja", None)})
    run_cli("evaluate", "--config", REPO / "evaluate_config.yaml", f"model_dir={exported_model}", "tasks=[]",
            "suite=ja", "suite_tasks=[ja_leaderboard_jnli,ja_leaderboard_xwinograd]", f"suite_data_dir={data_dir}",
            "limit=2", f"output_dir={out}")
    tasks = json.loads((out / "results.json").read_text(encoding="utf-8"))["tasks"]
    assert {t: (r["n_shot"], r["samples"]) for t, r in tasks.items()} == {
        "ja_leaderboard_jnli": (3, 2), "ja_leaderboard_xwinograd": (0, 2)}


def test_missing_suite_data_names_the_task_the_dataset_and_the_fetch(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    """Before any model work: the model folder holds only a config.json."""
    (tmp_path / "config.json").write_text("{}")
    data_dir = tmp_path / "eval_datasets"
    write_fixtures(data_dir, {("Rakuten/JGLUE", "JNLI")})
    config = REPO / "evaluate_config.yaml"
    assert main(["evaluate", "--config", str(config), f"model_dir={tmp_path}", "suite=ja",
                 f"suite_data_dir={data_dir}"]) == 2
    err = capsys.readouterr().err
    assert "ja_leaderboard_jcommonsenseqa (Rakuten/JGLUE JCommonsenseQA, split train, validation" in err
    assert "ja_leaderboard_jnli (" not in err  # its data is here
    assert f"gptpipe evaluate --fetch suite=ja suite_data_dir={data_dir}" in err
    assert err.rstrip().endswith("The tasks whose data is here run alone with suite_tasks=[ja_leaderboard_jnli]")
    assert not (tmp_path / "evaluation").exists()

    # a fetch that stopped half-way (no dataset.json) is no data either
    (data_dir / "Rakuten/JGLUE/JNLI/dataset.json").unlink()
    assert main(["evaluate", "--config", str(config), f"model_dir={tmp_path}", "suite=ja",
                 "suite_tasks=[ja_leaderboard_jnli]", f"suite_data_dir={data_dir}"]) == 2
    assert "ja_leaderboard_jnli (Rakuten/JGLUE JNLI, split train, validation" in capsys.readouterr().err


@pytest.mark.parametrize("overrides, message", [
    (["suite=en"], "suite: unknown suite 'en' (known: ja)"),
    (["suite_tasks=[ja_leaderboard_jnli]"], "suite_tasks: set suite too"),
    (["suite=ja", "suite_tasks=[jnli]"], "suite_tasks: jnli not in suite ja"),
])
def test_bad_suite_keys(tmp_path: Path, capsys: pytest.CaptureFixture, overrides: list[str], message: str) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert main(["evaluate", "--config", str(REPO / "evaluate_config.yaml"), f"model_dir={tmp_path}",
                 f"suite_data_dir={tmp_path}", *overrides]) == 2
    assert message in capsys.readouterr().err


def test_fetch_without_the_hub_says_where_to_run_it(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "gptpipe", "evaluate", "--config", str(REPO / "evaluate_config.yaml"),
                           "--fetch", "suite=ja", "suite_tasks=[ja_leaderboard_jnli]", f"suite_data_dir={tmp_path}"],
                          check=False, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0, done.stderr[-2000:]
    assert "suite ja: 1 hub dataset(s) could not be fetched (0 saved in" in done.stderr
    assert "  - Rakuten/JGLUE (JNLI): " in done.stderr and "where the HuggingFace hub is reachable" in done.stderr
    assert not any(tmp_path.iterdir())  # nothing half-written


def test_the_offline_modes_are_set_for_the_block_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Also in datasets' and huggingface_hub's constants, which they read from the environment once, at import."""
    import datasets.config
    import huggingface_hub.constants

    from gptpipe.lm_tasks import hub_offline

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    was = (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE)
    with hub_offline():
        assert os.environ["HF_HUB_OFFLINE"] == os.environ["HF_DATASETS_OFFLINE"] == "1"
        assert datasets.config.HF_HUB_OFFLINE and datasets.config.HF_DATASETS_OFFLINE
        assert huggingface_hub.is_offline_mode()
    assert "HF_HUB_OFFLINE" not in os.environ and os.environ["HF_DATASETS_OFFLINE"] == "0"
    assert (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE) == was


def test_which_tasks_need_the_hub(tmp_path: Path) -> None:
    from gptpipe.lm_tasks import needs_hub

    assert needs_hub("arc_easy") and needs_hub({"task": "t", "dataset_path": "Rakuten/JGLUE"})
    assert not needs_hub({"task": "t", "dataset_path": "parquet", "dataset_kwargs": {"data_files": {}}})
    assert not needs_hub({"task": "t", "dataset_path": str(tmp_path)})  # a local folder
    assert not needs_hub({"task": "t", "custom_dataset": print})
