"""llm-jp-eval's dataset format as lm-evaluation-harness tasks: a folder of its JSON files (one per task, as its
preprocessing writes them to ``evaluation/{train,dev,test}/<task>.json``) becomes one generation task per file,
prompted, extracted and scored as llm-jp-eval does, so it runs through the same `simple_evaluate` call as every
other task (`gptpipe evaluate`'s task_dirs, stage 3's train.eval_task_dirs).

A file holds ``instruction``, ``output_length`` (the most tokens generated), ``metrics``, ``samples`` (the
documents: ``input``/``output``) and optionally ``few_shots`` (the first format's examples in the file itself),
``label_list``, ``answer_extract_pattern``, ``num_few_shots``, ``answer_pattern_id``, ``language`` and
``custom_prompt_template``. What llm-jp-eval does with them, and so what this module does:

- Few-shot examples: the first N ``samples`` of the train split's file of the same name
  (``<folder>/../train/<task>.json``), else the first N of the file's own ``few_shots``. N is the file's
  ``num_few_shots`` where it sets one, else the run's few-shot count.
- The prompt: llm-jp-eval's default template, the instruction under "### 指示:" after its fixed preamble, each
  example as "### 入力:" / "### 応答:" pairs, then the document's input and an open "### 応答:".
- Greedy generation of at most ``output_length`` new tokens, no stop sequence but the end of text.
- The answer: the groups of ``answer_extract_pattern``'s first match in the generation (dot matches newline), or
  by default the text up to the first blank line; NFKC-normalised and stripped; the gold output NFKC-normalised.
- The metrics (`METRICS`), averaged over the documents unless said otherwise. Where the file has a
  ``label_list``, ``out_of_label`` beside them: the share of answers outside it (llm-jp-eval's "ool").
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gptpipe.log import get_logger
from gptpipe.stage import StageInputError, tree_fingerprint

log = get_logger("llmjp_eval")

TASK_PREFIX = "llmjp_"  # task names: llmjp_<file stem>, apart from any lm-eval registry name
PREAMBLE = "以下は、タスクを説明する指示と、文脈のある入力の組み合わせです。要求を適切に満たす応答を書きなさい。"
DEFAULT_PATTERN = r"(?s)^(.*?)(?=\n\n|\Z)"  # llm-jp-eval's default: the answer ends at the first blank line
# answer_pattern_id values whose answer is what answer_extract_pattern (or the default) extracts; the others add
# a format instruction of llm-jp-eval's own to the prompt, which is not reproduced here.
PATTERN_IDS = {"custom", "dataset"}
KEYS = {"instruction", "output_length", "metrics", "samples", "few_shots", "label_list", "answer_extract_pattern",
        "num_few_shots", "answer_pattern_id", "language", "custom_prompt_template"}


# ---- metrics: per document (pred, gold) → score, or over the task (pearson, spearman) ----

def exact_match(pred: str, gold: str) -> float:
    """1 when the answer is the gold output, else 0."""
    return float(pred == gold)


def _fuzz_text(text: str) -> str:
    """The string thefuzz compares (its default processing, as llm-jp-eval calls it): characters U+0080-U+00FF
    dropped, every non-word character made a space, lower-cased, stripped; then its words sorted and joined by one
    space (token_sort)."""
    text = "".join(c for c in text if not 0x80 <= ord(c) <= 0xFF)
    text = re.sub(r"\W", " ", text).lower().strip()
    return " ".join(sorted(text.split()))


def _lcs(a: str, b: str) -> int:
    """Length of the longest common subsequence of two strings."""
    if len(a) < len(b):
        a, b = b, a
    row = [0] * (len(b) + 1)
    for ca in a:
        diagonal = 0
        for j, cb in enumerate(b, 1):
            diagonal, row[j] = row[j], diagonal + 1 if ca == cb else max(row[j], row[j - 1])
    return row[-1]


def char_f1(pred: str, gold: str) -> float:
    """llm-jp-eval's char_f1: thefuzz's token_sort_ratio / 100, the Indel similarity 2·LCS / (len + len) of the
    two processed strings (`_fuzz_text`) in whole percent (rounded as Python rounds). Two empty strings are equal."""
    a, b = _fuzz_text(pred), _fuzz_text(gold)
    total = len(a) + len(b)
    if total == 0:
        return 1.0
    similarity = (1 - (total - 2 * _lcs(a, b)) / total) * 100
    return int(round(similarity)) / 100


def set_f1(pred: str, gold: str) -> float:
    """F1 of the answer's lines (a set, stripped) against the gold output's lines (a list, stripped): precision over
    the answer's distinct lines, recall over the gold's lines, both counting answer lines found in the gold."""
    answer = {line.strip() for line in pred.split("\n")}
    expected = [line.strip() for line in gold.split("\n")]
    hits = sum(1 for line in answer if line in expected)
    precision, recall = hits / len(answer), hits / len(expected)
    return 2 * precision * recall / (precision + recall) if precision + recall else 0.0


def exact_match_figure(pred: str, gold: str) -> float:
    """1 when both read as the same number (so "3.0" matches "3"), 0 otherwise or when either is not a number."""
    try:
        return float(float(pred) == float(gold))
    except ValueError:
        return 0.0


def contains_answer(pred: str, gold: str) -> float:
    """1 when the gold output occurs in the answer."""
    return float(gold in pred)


def parse_float(text: str) -> float:
    """An answer as llm-jp-eval reads a number from it: everything but digits and dots dropped; -2 when the rest
    is not a number."""
    try:
        return float(re.sub(r"[^0-9.]", "", text))
    except ValueError:
        return -2.0


def _pearson(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan


def _ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties given their average rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def pearson(pairs: list[tuple[str, str]]) -> float:
    """Pearson's r between the gold outputs (numbers) and the answers read by `parse_float`; 0 where undefined
    (fewer than two documents, or a constant side)."""
    r = _pearson([float(g) for _, g in pairs], [parse_float(p) for p, _ in pairs]) if len(pairs) > 1 else math.nan
    return 0.0 if math.isnan(r) else r


def spearman(pairs: list[tuple[str, str]]) -> float:
    """Spearman's rho (Pearson's r of the ranks, ties averaged) of the same pairs as `pearson`; 0 where undefined."""
    if len(pairs) < 2:
        return 0.0
    r = _pearson(_ranks([float(g) for _, g in pairs]), _ranks([parse_float(p) for p, _ in pairs]))
    return 0.0 if math.isnan(r) else r


@dataclass(frozen=True)
class Metric:
    """How one of llm-jp-eval's metric names is scored: per document and averaged, or over all (pred, gold)
    pairs at once."""

    per_document: Callable[[str, str], float] | None = None
    over_task: Callable[[list[tuple[str, str]]], float] | None = None
    numeric_gold: bool = False  # the gold outputs must be numbers


METRICS: dict[str, Metric] = {
    "exact_match": Metric(exact_match),
    "char_f1": Metric(char_f1),
    "set_f1": Metric(set_f1),
    "exact_match_figure": Metric(exact_match_figure),
    "contains_answer": Metric(contains_answer),
    "pearson": Metric(over_task=pearson, numeric_gold=True),
    "spearman": Metric(over_task=spearman, numeric_gold=True),
}
OUT_OF_LABEL = "out_of_label"


# ---- the format ----

@dataclass
class Task:
    """One llm-jp-eval JSON file, read and checked."""

    path: Path
    instruction: str
    output_length: int
    metrics: list[str]
    samples: list[dict[str, str]]
    shots: list[dict[str, str]]  # the few-shot examples put in every prompt, in order
    pattern: str
    label_list: list[str] = field(default_factory=list)
    sources: list[Path] = field(default_factory=list)  # the files read (the task's and the few-shot one)

    def __repr__(self) -> str:
        # short: lm-eval writes its task configs' callables (partials of this) into results.json by their repr
        return f"llmjp_eval.Task({str(self.path)!r})"

    @property
    def name(self) -> str:
        return TASK_PREFIX + self.path.stem

    def prompt(self, text: str) -> str:
        """llm-jp-eval's default prompt for a document whose input is `text`."""
        parts = [f"{PREAMBLE}\n\n### 指示:\n{self.instruction}"]
        parts += [f"### 入力:\n{s['input']}\n\n### 応答:\n{s['output']}" for s in self.shots]
        parts.append(f"### 入力:\n{text}\n\n### 応答:\n")
        return "\n\n".join(parts)


def extract_answer(generation: str, pattern: str) -> str:
    """The answer in a generation: the groups of the pattern's first match joined (dot matches newline), or ""
    without a match; NFKC-normalised and stripped."""
    match = re.search(pattern, generation, re.DOTALL)
    return unicodedata.normalize("NFKC", "".join(g or "" for g in match.groups())).strip() if match else ""


def _load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise StageInputError(f"{path}: cannot be read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise StageInputError(f"{path}: not JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise StageInputError(f"{path}: an llm-jp-eval task file is a JSON object, not a {type(data).__name__}")
    return data


def _examples(path: Path, data: dict[str, Any], key: str, required: bool) -> list[dict[str, str]]:
    """`key`'s list of {input, output} objects (extra keys kept), each checked."""
    if key not in data:
        if required:
            raise StageInputError(f"{path}: key {key} missing (the documents: a list of {{input, output}})")
        return []
    rows = data[key]
    if not isinstance(rows, list):
        raise StageInputError(f"{path}: {key} must be a list of {{input, output}} objects")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise StageInputError(f"{path}: {key}[{i}] must be an object with input and output")
        for part in ("input", "output"):
            if not isinstance(row.get(part), str):
                what = "missing" if part not in row else f"must be a string, not {type(row[part]).__name__}"
                raise StageInputError(f"{path}: {key}[{i}].{part} {what}")
    return rows


def _pattern(path: Path, data: dict[str, Any]) -> str:
    pattern_id = data.get("answer_pattern_id")
    if pattern_id not in (None, "", *PATTERN_IDS):
        raise StageInputError(
            f"{path}: answer_pattern_id {pattern_id!r} is not supported (its answer format instruction is "
            f"llm-jp-eval's own); use {' or '.join(sorted(PATTERN_IDS))} with an answer_extract_pattern")
    pattern = data.get("answer_extract_pattern") or DEFAULT_PATTERN
    if not isinstance(pattern, str):
        raise StageInputError(f"{path}: answer_extract_pattern must be a string (a regular expression)")
    try:
        groups = re.compile(pattern).groups
    except re.error as exc:
        raise StageInputError(f"{path}: answer_extract_pattern {pattern!r} is not a regular expression ({exc})") \
            from None
    if not groups:
        raise StageInputError(f"{path}: answer_extract_pattern {pattern!r} has no group: the answer is what its "
                              "groups capture, e.g. (.*?)")
    return pattern


def read_task(path: Path, num_fewshot: int = 0) -> Task:
    """Read and check one llm-jp-eval JSON file; `num_fewshot` examples unless the file's num_few_shots says."""
    data = _load(path)
    for key in sorted(set(data) - KEYS):
        close = difflib.get_close_matches(key, KEYS, n=1)
        log.warning(f"{path}: key {key} is not one of llm-jp-eval's, ignored"
                    + (f" (did you mean {close[0]}?)" if close else ""))
    for key in ("instruction", "output_length", "metrics"):
        if key not in data:
            raise StageInputError(f"{path}: key {key} missing")
    instruction, output_length, metrics = data["instruction"], data["output_length"], data["metrics"]
    if not isinstance(instruction, str):
        raise StageInputError(f"{path}: instruction must be a string")
    if isinstance(output_length, bool) or not isinstance(output_length, int) or output_length < 1:
        raise StageInputError(f"{path}: output_length must be a whole number >= 1 (tokens), not {output_length!r}")
    if isinstance(metrics, str):
        metrics = [metrics]
    if not isinstance(metrics, list) or not metrics or not all(isinstance(m, str) for m in metrics):
        raise StageInputError(f"{path}: metrics must be a non-empty list of metric names")
    for metric in metrics:
        if metric not in METRICS:
            raise StageInputError(f"{path}: metrics: {metric} is not supported here (supported: "
                                  f"{', '.join(METRICS)})")
    samples = _examples(path, data, "samples", required=True)
    if not samples:
        raise StageInputError(f"{path}: samples is empty (no document to evaluate)")
    for metric in metrics:
        if METRICS[metric].numeric_gold:
            for i, row in enumerate(samples):
                try:
                    float(unicodedata.normalize("NFKC", row["output"]))
                except ValueError:
                    raise StageInputError(f"{path}: samples[{i}].output {row['output']!r} is not a number, which "
                                          f"metric {metric} needs") from None
    labels = data.get("label_list") or []
    if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
        raise StageInputError(f"{path}: label_list must be a list of strings")
    for key in ("custom_prompt_template",):
        if data.get(key):
            raise StageInputError(f"{path}: {key} is not supported (the task is prompted with llm-jp-eval's "
                                  "default template); remove it")
    shots_wanted = data.get("num_few_shots")
    if shots_wanted is None:
        shots_wanted = num_fewshot
    elif isinstance(shots_wanted, bool) or not isinstance(shots_wanted, int) or shots_wanted < 0:
        raise StageInputError(f"{path}: num_few_shots must be a whole number >= 0 or null, not {shots_wanted!r}")
    shots, sources = few_shots(path, data, shots_wanted)
    return Task(path=path, instruction=instruction, output_length=output_length, metrics=list(metrics),
                samples=samples, shots=shots, pattern=_pattern(path, data), label_list=list(labels),
                sources=[path, *sources])


def few_shots(path: Path, data: dict[str, Any], n: int) -> tuple[list[dict[str, str]], list[Path]]:
    """(the first `n` examples, the other files read): from the train split's file of the same name, as
    llm-jp-eval takes them, else from the file's own few_shots."""
    own = _examples(path, data, "few_shots", required=False)
    if n == 0:
        return [], []
    train = path.resolve().parent.parent / "train" / path.name
    if train.is_file():
        pool, where, sources = _examples(train, _load(train), "samples", required=True), str(train), [train]
    elif own:
        pool, where, sources = own, f"{path}'s few_shots", []
    else:
        raise StageInputError(f"{path}: {n} few-shot examples asked (num_fewshot, or the file's num_few_shots) "
                              f"but there is no {train} and the file has no few_shots")
    if len(pool) < n:
        raise StageInputError(f"{path}: {n} few-shot examples asked but {where} holds {len(pool)}")
    return pool[:n], sources


def json_files(folder: Path) -> list[Path]:
    """The task files of a folder (its *.json, not its subfolders), sorted; an error when there are none."""
    if not folder.is_dir():
        raise StageInputError(f"llm-jp-eval task folder {folder} not found")
    files = sorted(p for p in folder.glob("*.json") if p.is_file())
    if not files:
        raise StageInputError(f"llm-jp-eval task folder {folder} holds no .json file (point at e.g. "
                              "<llm-jp-eval output>/evaluation/test)")
    return files


def read_folder(folder: Path, num_fewshot: int = 0) -> list[Task]:
    """Every task file of `folder`, read and checked."""
    return [read_task(p, num_fewshot) for p in json_files(folder)]


def read_folders(folders: list[Path], num_fewshot: int = 0) -> dict[Path, list[Task]]:
    """`read_folder` of each folder; two files of one name (one task name) are an error naming both."""
    read: dict[Path, list[Task]] = {}
    seen: dict[str, Path] = {}
    for folder in folders:
        read[folder] = read_folder(folder, num_fewshot)
        for task in read[folder]:
            if task.name in seen:
                raise StageInputError(f"two llm-jp-eval files make task {task.name}: {seen[task.name]} and "
                                      f"{task.path}; give one of their folders")
            seen[task.name] = task.path
    return read


def fingerprint(tasks: list[Task]) -> dict[str, Any]:
    """The fingerprint of what tasks read (their files and the few-shot files), for a manifest's inputs."""
    return tree_fingerprint(sorted({p for t in tasks for p in t.sources}))


# ---- as lm-eval tasks ----

def _documents(task: Task, **_: Any) -> Any:
    """lm-eval's custom_dataset: the samples as the test split, each with its prompt (lm-eval passes the task's
    metadata as keyword arguments, unused here)."""
    import datasets

    rows = [{"input": s["input"], "output": s["output"], "prompt": task.prompt(s["input"])} for s in task.samples]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def score_document(task: Task, doc: dict[str, Any], results: list[str]) -> dict[str, Any]:
    """lm-eval's process_results: the answer extracted from the generation, scored by each metric (the pair itself
    for the metrics computed over the task)."""
    pred = extract_answer(results[0], task.pattern)
    gold = unicodedata.normalize("NFKC", doc["output"])
    scores: dict[str, Any] = {}
    for name in task.metrics:
        metric = METRICS[name]
        scores[name] = metric.per_document(pred, gold) if metric.per_document else (pred, gold)
    if task.label_list:
        scores[OUT_OF_LABEL] = float(pred not in task.label_list)
    return scores


def lm_eval_task(task: Task) -> dict[str, Any]:
    """The lm-eval task config of one file: greedy generation of output_length tokens after llm-jp-eval's prompt
    (few-shot examples inside it, so lm-eval adds none), scored by `score_document`."""
    metric_list = [{"metric": name, "aggregation": METRICS[name].over_task or "mean", "higher_is_better": True}
                   for name in task.metrics]
    if task.label_list:
        metric_list.append({"metric": OUT_OF_LABEL, "aggregation": "mean", "higher_is_better": False})
    return {
        "task": task.name,
        "custom_dataset": functools.partial(_documents, task),
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": "prompt",  # a column's name: its value as it is (a template would be rendered)
        "doc_to_target": "output",
        "process_results": functools.partial(score_document, task),
        "metric_list": metric_list,
        "generation_kwargs": {"until": [], "max_gen_toks": task.output_length, "do_sample": False},
        "num_fewshot": 0,
        "metadata": {"version": 1.0, "source": str(task.path), "shots_in_prompt": len(task.shots)},
    }


def task_dicts(folder: Path, num_fewshot: int = 0) -> list[dict[str, Any]]:
    """The lm-eval task configs of a folder of llm-jp-eval files, one per file (what lm-eval's simple_evaluate and
    TaskManager.load take); `num_fewshot` examples in each prompt unless a file's num_few_shots says otherwise."""
    return [lm_eval_task(t) for t in read_folder(folder, num_fewshot)]
