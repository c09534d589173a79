"""llm-jp-eval's dataset format as tasks (gptpipe.llmjp_eval): folders of its JSON files, written here in its exact
layout (evaluation/{train,test}/<task>.json) from the Japanese man pages, scored end to end by `gptpipe evaluate`
on the stage-4 export; the metric functions against hand-computed values; answer extraction; bad files."""

from __future__ import annotations

import json
import logging
import os
import re
import unicodedata
from pathlib import Path

import pytest

from conftest import REPO, require_manpages, run_cli
from gptpipe import llmjp_eval
from gptpipe.llmjp_eval import (char_f1, contains_answer, exact_match, exact_match_figure, extract_answer,
                                parse_float, pearson, read_folder, read_task, set_f1, spearman)
from gptpipe.stage import Manifest, StageInputError

MAN_DIR = Path("/usr/share/man/ja")
NLI_LABELS = ["entailment", "contradiction", "neutral"]
PREAMBLE = "以下は、タスクを説明する指示と、文脈のある入力の組み合わせです。要求を適切に満たす応答を書きなさい。"


def command_rows() -> list[tuple[str, str]]:
    """(command name, its one-line description) of the section-1 man pages, by page."""
    from gptpipe.finetune.demo_task import read_rows

    require_manpages()
    rows = sorted((r for r in read_rows(MAN_DIR)[0] if r.section == "1"), key=lambda r: r.page)
    return [(r.page.split(",")[0].split("/")[1].rsplit(".", 1)[0], r.input) for r in rows]


def nli(rows: list[tuple[str, str]], i: int) -> dict[str, str]:
    """A JNLI-like pair: the premise a page's description, the hypothesis that one (entailment), another page's
    (contradiction) or a weaker claim (neutral), by turns."""
    name, desc = rows[i]
    label = NLI_LABELS[i % 3]
    hypothesis = {"entailment": f"{name} は{desc}。", "contradiction": f"{name} は{rows[i + 1][1]}。",
                  "neutral": f"{name} はよく使われる。"}[label]
    return {"input": f"前提：{name} は{desc}。\n仮説：{hypothesis}", "output": label}


def squad(rows: list[tuple[str, str]], i: int) -> dict[str, str]:
    """A JSQuAD-like extraction: the answer, a page's description, is a span of the passage."""
    name, desc = rows[i]
    return {"input": f"文章：{name}: {desc}。マニュアルのセクション 1 に載っている。\n質問：{name} は何をするか？",
            "output": desc}


def choice(rows: list[tuple[str, str]], i: int) -> dict[str, str]:
    """A JCommonsenseQA-like choice among five commands, the answer the index of the one described."""
    options = [rows[(i + k) % len(rows)][0] for k in range(5)]
    answer = (i * 2) % 5
    options[0], options[answer] = options[answer], options[0]
    listed = ",".join(f"{k}.{o}" for k, o in enumerate(options))
    return {"input": f"質問：「{rows[i][1]}」コマンドはどれ？\n選択肢：{listed}", "output": str(answer)}


STRICT = "何も含めないことを厳守してください。"
TASKS = {
    "jnli": ({"instruction": "前提と仮説の関係をentailment、contradiction、neutralの中から回答してください。"
                             f"それ以外には{STRICT}",
              "output_length": 3, "metrics": ["exact_match"], "label_list": NLI_LABELS}, nli),
    "jsquad": ({"instruction": "質問に対する回答を文章から一言で抽出してください。回答は名詞で答えてください。 "
                               f"それ以外には{STRICT}",
                "output_length": 25, "metrics": ["char_f1"], "num_few_shots": 1}, squad),
    "jcommonsenseqa": ({"instruction": "質問と回答の選択肢を入力として受け取り、選択肢から回答を選択してください。"
                                       "なお、回答は選択肢の番号（例：0）でするものとします。 "
                                       f"回答となる数値をint型で返し、他には{STRICT}",
                        "output_length": 1, "metrics": ["exact_match"], "label_list": ["0", "1", "2", "3", "4"],
                        "answer_extract_pattern": "([0-4])"}, choice),
}
TEST_DOCS, TRAIN_DOCS = 5, 3


def write_llmjp(root: Path, rows: list[tuple[str, str]]) -> Path:
    """llm-jp-eval's preprocessed layout under `root`: evaluation/train/<task>.json (the few-shot pool) and
    evaluation/test/<task>.json, each file its format (instruction, output_length, metrics, few_shots, samples,
    and label_list / answer_extract_pattern / num_few_shots where the task has one); the test folder."""
    for split, start, n in (("train", 0, TRAIN_DOCS), ("test", 40, TEST_DOCS)):
        folder = root / "evaluation" / split
        folder.mkdir(parents=True, exist_ok=True)
        for name, (head, make) in TASKS.items():
            data = {**head, "few_shots": [], "samples": [make(rows, start + k) for k in range(n)]}
            (folder / f"{name}.json").write_text(json.dumps(data, ensure_ascii=False, indent=4), encoding="utf-8")
    return root / "evaluation" / "test"


def expected_prompt(instruction: str, shots: list[dict[str, str]], text: str) -> str:
    """llm-jp-eval's default prompt, written out here as its template reads."""
    prompt = f"{PREAMBLE}\n\n### 指示:\n{instruction}"
    for shot in shots:
        prompt += f"\n\n### 入力:\n{shot['input']}\n\n### 応答:\n{shot['output']}"
    return prompt + f"\n\n### 入力:\n{text}\n\n### 応答:\n"


# ---- metrics, extraction, prompt: by hand ----

def test_char_f1_is_thefuzz_token_sort_ratio_in_whole_percent() -> None:
    assert char_f1("中央区", "中央区") == 1.0
    assert char_f1("東京都中央区", "中央区") == 0.67  # LCS 3 of 6 + 3 characters: 2·3/9 = 66.7% → 67
    assert char_f1("YES", "yes") == 1.0  # lower-cased
    assert char_f1("中央区。", "中央区") == 1.0  # punctuation becomes space, stripped
    assert char_f1("ディレクトリ 内容", "内容 ディレクトリ") == 1.0  # words sorted
    # "・" splits "ダイ ハード" (6 characters with the space) against "ダイハード" (5): 2·5/11 = 90.9% → 91
    assert char_f1("ダイ・ハード", "ダイハード") == 0.91
    assert char_f1("3×4", "34") == 1.0  # U+0080-U+00FF are dropped, as thefuzz's force_ascii does
    # one common character of 8 + 8: exactly 12.5%, rounded to even as Python rounds → 12
    assert char_f1("あいうえおかきく", "あさしすせそたち") == 0.12
    assert char_f1("", "中央区") == 0.0


def test_set_f1_exact_match_and_the_number_metrics() -> None:
    # answer lines {売上高 positive, 営業利益 negative}; gold lines [売上高 positive, 経常利益 positive]: 1 hit,
    # precision 1/2, recall 1/2
    assert set_f1("売上高 positive\n営業利益 negative\n売上高 positive", "売上高 positive\n経常利益 positive") == 0.5
    assert set_f1("売上高 positive", "売上高 positive\n経常利益 positive") == pytest.approx(2 / 3)  # P 1, R 1/2
    assert set_f1("", "売上高 positive") == 0.0
    assert exact_match("entailment", "entailment") == 1.0 and exact_match("entailment ", "entailment") == 0.0
    assert exact_match_figure("3.0", "3") == 1.0 and exact_match_figure("三", "3") == 0.0
    assert contains_answer("答えは中央区です", "中央区") == 1.0 and contains_answer("中央", "中央区") == 0.0
    assert parse_float("約4.0点") == 4.0 and parse_float("不明") == -2.0 and parse_float("-1") == 1.0
    # gold 1, 2, 3 against 1, 2, 4: cov 3, var 2 and 42/9 → r = 9/√84
    assert pearson([("1", "1"), ("2", "2"), ("4", "3")]) == pytest.approx(9 / 84 ** 0.5)
    assert pearson([("2", "1"), ("2", "2"), ("2", "3")]) == 0.0  # a constant answer: undefined, 0
    # ranks of gold 1, 2, 3, 4 and of answers 1, 3, 3, 2 (ties averaged: 1, 3.5, 3.5, 2), both of mean 2.5:
    # cov 2.25 - 0.5 + 0.5 - 0.75 = 1.5, squares 5 and 4.5
    assert spearman([("1", "1"), ("3", "2"), ("3", "3"), ("2", "4")]) == pytest.approx(1.5 / (5 * 4.5) ** 0.5)


def test_the_answer_is_extracted_with_the_files_pattern() -> None:
    default = llmjp_eval.DEFAULT_PATTERN
    assert extract_answer("ディレクトリの内容を表示する\n\n### 入力:\n次", default) == "ディレクトリの内容を表示する"
    assert extract_answer(" entailment\nです", default) == "entailment\nです"  # only a blank line ends it
    assert extract_answer("答えは 2 です", "([0-4])") == "2"
    # the pattern is searched in the generation as it is, the answer NFKC-normalised after, as llm-jp-eval does
    assert extract_answer("１", "([0-4])") == ""
    assert extract_answer("答え：ＡＢＣ", "答え：(.*)") == "ABC"
    assert extract_answer("回答: 中央区\n\n補足", r"回答:\s*(.*?)(?=\n\n|\Z)") == "中央区"
    assert extract_answer("選べません", "([0-4])") == ""


def test_prompt_few_shots_and_task_configs(tmp_path: Path) -> None:
    rows = command_rows()
    test = write_llmjp(tmp_path, rows)
    tasks = {t.name: t for t in read_folder(test, num_fewshot=2)}
    assert list(tasks) == ["llmjp_jcommonsenseqa", "llmjp_jnli", "llmjp_jsquad"]
    train = {n: json.loads((tmp_path / "evaluation/train" / f"{n}.json").read_text(encoding="utf-8"))["samples"]
             for n in TASKS}
    # the first N of the train split's samples; the file's num_few_shots (jsquad: 1) over the run's 2
    assert tasks["llmjp_jnli"].shots == train["jnli"][:2] and tasks["llmjp_jsquad"].shots == train["jsquad"][:1]
    doc = tasks["llmjp_jnli"].samples[0]
    assert tasks["llmjp_jnli"].prompt(doc["input"]) == expected_prompt(TASKS["jnli"][0]["instruction"],
                                                                       train["jnli"][:2], doc["input"])
    spec = llmjp_eval.lm_eval_task(tasks["llmjp_jnli"])
    assert spec["generation_kwargs"]["max_gen_toks"] == 3 and spec["num_fewshot"] == 0
    assert [m["metric"] for m in spec["metric_list"]] == ["exact_match", "out_of_label"]
    # what lm-eval's process_results gets: the raw generation; the answer extracted, scored, labels checked
    assert spec["process_results"](doc, [f"{doc['output']}\n\n### 入力:"]) == {"exact_match": 1.0, "out_of_label": 0.0}
    assert spec["process_results"](doc, ["はい"]) == {"exact_match": 0.0, "out_of_label": 1.0}
    assert [s["task"] for s in llmjp_eval.task_dicts(test)] == list(tasks)

    zero = {t.name: t for t in read_folder(test)}
    assert zero["llmjp_jnli"].shots == [] and len(zero["llmjp_jsquad"].shots) == 1


# ---- bad files ----

def write(path: Path, data: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, ensure_ascii=False) if not isinstance(data, str) else data, encoding="utf-8")
    return path


GOOD = {"instruction": "質問に答えてください。", "output_length": 10, "metrics": ["exact_match"],
        "samples": [{"input": "質問：ls は何をするか？", "output": "ディレクトリの内容をリスト表示する"}]}


@pytest.mark.parametrize(("change", "message"), [
    ({"instruction": None}, "key instruction missing"),
    ({"output_length": "10"}, "output_length must be a whole number >= 1"),
    ({"metrics": ["exact_match", "bleu_ja"]}, "metrics: bleu_ja is not supported here (supported: exact_match, "),
    ({"metrics": ["comet_wmt22"]}, "metrics: comet_wmt22 is not supported"),
    ({"samples": [{"input": "質問"}]}, "samples[0].output missing"),
    ({"samples": [GOOD["samples"][0], {"input": "質問", "output": 3}]}, "samples[1].output must be a string, not int"),
    ({"samples": []}, "samples is empty"),
    ({"answer_extract_pattern": "回答:.*"}, "has no group"),
    ({"answer_extract_pattern": "(回答"}, "is not a regular expression"),
    ({"answer_pattern_id": "answer_tags_jp"}, "answer_pattern_id 'answer_tags_jp' is not supported"),
    ({"metrics": ["pearson"]}, "samples[0].output 'ディレクトリの内容をリスト表示する' is not a number, which metric "
                               "pearson needs"),
    ({"num_few_shots": 2}, "2 few-shot examples asked"),
    ({"label_list": "entailment"}, "label_list must be a list of strings"),
    ({"custom_prompt_template": "{instruction}\n{input}"}, "custom_prompt_template is not supported"),
])
def test_bad_files_name_the_file_and_the_key(tmp_path: Path, change: dict, message: str) -> None:
    data = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    path = write(tmp_path / "evaluation" / "test" / "task.json", data)
    with pytest.raises(StageInputError) as info:
        read_task(path)
    assert str(info.value).startswith(f"{path}: ") and message in str(info.value)


def test_an_unknown_key_is_named_and_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write(tmp_path / "task.json", {**GOOD, "output_lenght": 5, "metadata": {"source": "JGLUE"}})
    with caplog.at_level(logging.WARNING, logger="gptpipe.llmjp_eval"):
        assert read_task(path).output_length == 10
    assert (f"{path}: key output_lenght is not one of llm-jp-eval's, ignored (did you mean output_length?)"
            in caplog.text)
    assert f"{path}: key metadata is not one of llm-jp-eval's, ignored" in caplog.text


def test_bad_folders_and_json(tmp_path: Path) -> None:
    path = write(tmp_path / "test" / "broken.json", '{"instruction": "質問",\n "output_length": }')
    with pytest.raises(StageInputError, match=r"broken.json: not JSON \(line 2"):
        read_task(path)
    with pytest.raises(StageInputError, match="a JSON object, not a list"):
        read_task(write(tmp_path / "test" / "list.json", [GOOD]))
    with pytest.raises(StageInputError, match="holds no .json file"):
        read_folder(write(tmp_path / "empty" / "README.md", "").parent)
    # too few examples in the train split's file of the same name: named
    write(tmp_path / "evaluation" / "train" / "task.json", GOOD)
    test = write(tmp_path / "evaluation" / "test" / "task.json", GOOD)
    train = tmp_path / "evaluation" / "train" / "task.json"
    with pytest.raises(StageInputError, match=re.escape(f"2 few-shot examples asked but {train} holds 1")):
        read_task(test, num_fewshot=2)
    assert read_task(test, num_fewshot=1).shots == GOOD["samples"]
    # the same task name from two folders
    other = write(tmp_path / "other" / "task.json", GOOD)
    with pytest.raises(StageInputError, match=re.escape(f"two llm-jp-eval files make task llmjp_task: {test} and "
                                                        f"{other}")):
        llmjp_eval.read_folders([test.parent, other.parent])


# ---- end to end on the stage-4 export ----

@pytest.mark.slow
def test_evaluate_scores_llmjp_folders_on_the_export(exported_model: Path, tmp_path: Path) -> None:
    rows = command_rows()
    test = write_llmjp(tmp_path / "llm-jp-eval", rows)
    out = tmp_path / "evaluation"
    args = ("evaluate", "--config", REPO / "evaluate_config.yaml", f"model_dir={exported_model}", "tasks=[]",
            f"task_dirs=[{test}]", "num_fewshot=2", "batch_size=1", f"output_dir={out}")
    run_cli(*args)

    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    tasks = results["tasks"]
    assert {t: (r["n_shot"], r["samples"], sorted(r["metrics"])) for t, r in tasks.items()} == {
        "llmjp_jnli": (2, TEST_DOCS, ["exact_match", "out_of_label"]),
        "llmjp_jsquad": (1, TEST_DOCS, ["char_f1"]),
        "llmjp_jcommonsenseqa": (2, TEST_DOCS, ["exact_match", "out_of_label"])}
    for row in tasks.values():
        for metric in row["metrics"].values():
            assert 0 <= metric["value"] <= 1 and metric["stderr"] is not None
    config = results["configs"]["llmjp_jsquad"]
    assert config["generation_kwargs"]["max_gen_toks"] == 25
    assert config["metadata"]["source"] == str(test / "jsquad.json")
    assert "llmjp_eval.Task(" in config["process_results"] and rows[40][1] not in config["process_results"]
    table = (out / "results.md").read_text(encoding="utf-8")
    assert "| llmjp_jsquad | 1 | char_f1 | " in table and "| llmjp_jnli | 2 | out_of_label | " in table
    manifest = Manifest.read(out / "manifest.json")
    assert manifest.inputs[str(test)]["files"] == 6  # the three test files and their three few-shot files

    # The same data: nothing to redo. A few-shot file changed: the results are made again.
    before = (out / "results.json").stat().st_mtime_ns
    run_cli(*args)
    assert (out / "results.json").stat().st_mtime_ns == before
    shots = tmp_path / "llm-jp-eval/evaluation/train/jnli.json"
    os.utime(shots, ns=(shots.stat().st_atime_ns, shots.stat().st_mtime_ns + 10**9))
    run_cli(*args)
    assert (out / "results.json").stat().st_mtime_ns != before


@pytest.mark.slow
def test_each_document_is_prompted_extracted_and_scored_as_llm_jp_eval_does(exported_model: Path,
                                                                            tmp_path: Path) -> None:
    """lm-eval's own record of every document (log_samples): the prompt it generated after is llm-jp-eval's, the
    generation at most output_length tokens, and each document's scores those of the answer the file's pattern
    extracts from that generation; the task's figure their mean."""
    import lm_eval
    from transformers import AutoTokenizer

    from gptpipe.evaluate import _hf_lm
    from gptpipe.lm_tasks import load_tasks, summarize

    rows = command_rows()
    test = write_llmjp(tmp_path, rows)
    specs = llmjp_eval.task_dicts(test, num_fewshot=2)
    raw = lm_eval.simple_evaluate(model=_hf_lm(exported_model, "float32", 1, "cpu"), tasks=specs, log_samples=True,
                                  task_manager=load_tasks(specs, "-"))
    tokenizer = AutoTokenizer.from_pretrained(str(exported_model))
    summary = summarize(raw)
    train = {n: json.loads((tmp_path / "evaluation/train" / f"{n}.json").read_text(encoding="utf-8"))["samples"]
             for n in TASKS}
    for name, (head, _) in TASKS.items():
        samples = raw["samples"][f"llmjp_{name}"]
        shots = train[name][:head.get("num_few_shots", 2)]
        assert len(samples) == TEST_DOCS
        per_metric: dict[str, list[float]] = {}
        for s in samples:
            context, gen = s["arguments"][0]
            assert context == expected_prompt(head["instruction"], shots, s["doc"]["input"])
            assert gen["max_gen_toks"] == head["output_length"]
            generation = s["resps"][0][0]
            # at most output_length tokens, not the export's generation_config max_new_tokens (128); the text
            # encoded again needn't give back the same tokens, hence the margin
            assert len(tokenizer(generation, add_special_tokens=False)["input_ids"]) <= 2 * head["output_length"]
            answer = extract_answer(generation, head.get("answer_extract_pattern", llmjp_eval.DEFAULT_PATTERN))
            gold = unicodedata.normalize("NFKC", s["doc"]["output"])
            for metric in head["metrics"]:
                expected = {"exact_match": exact_match, "char_f1": char_f1}[metric](answer, gold)
                assert s[metric] == expected
                per_metric.setdefault(metric, []).append(expected)
            if "label_list" in head:
                assert s["out_of_label"] == float(answer not in head["label_list"])
        for metric, values in per_metric.items():
            assert summary[f"llmjp_{name}"]["metrics"][metric]["value"] == pytest.approx(sum(values) / len(values))
