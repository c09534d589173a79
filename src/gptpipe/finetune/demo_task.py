"""The demo fine-tuning task: a man page's one-line description → its manual section.

Built offline from the installed Japanese man pages: the NAME section's description ("ls \\- ディレクトリの
内容をリスト表示する" → "ディレクトリの内容をリスト表示する") is the input, the section of the page
(man1 → コマンド, man2 → システムコール, ...) the label. Rows are split by page, stratified per label and
seeded, into train/validation/test TSV files (``input<TAB>label``, no header), beside an lm-evaluation-harness
task YAML over the same files (``gptpipe evaluate``) and pages.tsv saying which page each row came from. The
same splits as a chat set (``chat/<split>.jsonl``, task.kind chat): "What does `ls` do?" answered by the
description, then "Which section of the manual?" answered by the section. And as a preference set
(``preference/<split>.jsonl``, task.kind preference, TRL's prompt/chosen/rejected rows, see `manpage_pairs`): the
description preferred over the section line, the right section over a wrong one. And in llm-jp-eval's format
(``llm-jp-eval/{train,test}/manpage_section.json``, `llmjp_eval_task`: `gptpipe evaluate`'s task_dirs takes the test
folder), the section generated and matched exactly.

Only the NAME line is read, so a few lines of roff are parsed here instead of rendering whole pages.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import yaml

from gptpipe.config.core import option
from gptpipe.corpus.manpages import find_manpages, read_manpage
from gptpipe.log import get_logger
from gptpipe.stage import StageInputError, StageResult, atomic_path, tree_fingerprint
from gptpipe.artifacts import DEMO_TASK

TASK_NAME = "manpage_section"
log = get_logger(TASK_NAME)
# Label strings: short Japanese names of the sections, as the Japanese man(1) describes them.
SECTION_LABELS = {
    "1": "コマンド", "2": "システムコール", "3": "ライブラリ関数", "4": "特殊ファイル",
    "5": "ファイル形式", "6": "ゲーム", "7": "概要と規約", "8": "管理コマンド",
}
SPLITS = ("train", "validation", "test")
# What build writes beside the TSV files; in the manifest's inputs, so a folder built before a set was added is
# rebuilt rather than reported current.
SETS = ["chat", "preference", "llm-jp-eval"]
# The prompt the lm-eval task scores each label after; the fine-tune's default template is its own business.
EVAL_PROMPT = "説明: {{input}}\nマニュアルの種類:"

_NAME_HEADINGS = {"name", "名前", "名称"}
_HEADING = re.compile(r"^[.']\s*(SH|Sh|SS|Ss)\b\s*(.*)$")
_COMMENT = re.compile(r"^[.']\s*\\\"|^\.\s*$")
_JAPANESE = re.compile(r"[\u3040-\u30ff\u3400-\u9fff]")
_GLYPHS = {"em": "—", "en": "–", "hy": "-", "mi": "-", "lq": "“", "rq": "”", "dq": '"', "aq": "'", "oq": "‘",
           "cq": "’", "ti": "~", "ha": "^", "rs": "\\", "bu": "•", "co": "©"}
_ESCAPE = re.compile(r"\\(?:\((..)|\[([^\]]*)\]|f(?:\(..|\[[^\]]*\]|.)|s[-+]?\d|\*(?:\(..|\[[^\]]*\]|.)|(.))")
_TEXT_MACROS = {"B", "I", "BR", "IR", "RB", "RI", "BI", "IB", "SM", "SB", "Tn", "Xr", "Ar", "Fl", "Cm", "Li", "Em",
                "Sy", "Pa", "Dv", "Ev", "Fn", "Fa", "Va", "Ql", "Dq", "Sq", "Pq", "Nx", "Bx", "Ux", "At"}
_SINGLE = {"-": "-", "e": "\\", "\\": "\\", " ": " ", "~": " ", "0": " ", ".": ".", "'": "'", "`": "`"}


@dataclass
class DemoTaskConfig:
    """`gptpipe make-demo-task`: where the man pages are, where the task goes, how it is split."""

    man_dir: Path = option(Path("/usr/share/man/ja"), "root of the man pages (man1/ ... man8/, gzipped or not)")
    output_dir: Path = option(Path("data/finetune/manpage_section"), "folder for train/validation/test.tsv")
    seed: int = option(1234, "seed of the per-label shuffle that splits the pages")
    validation_fraction: float = option(0.1, "share of each label's pages in validation.tsv")
    test_fraction: float = option(0.1, "share of each label's pages in test.tsv")
    min_pages: int = option(50, "sections with fewer usable pages are left out (too few to learn or test)")

    def check(self) -> list[tuple[str, str]]:
        problems = []
        for key in ("validation_fraction", "test_fraction"):
            if not 0 < getattr(self, key) < 0.5:
                problems.append((key, "must be between 0 and 0.5"))
        if self.min_pages < 3:
            problems.append(("min_pages", "must be >= 3 (a page for each split)"))
        return problems


def unescape(text: str) -> str:
    """The characters a roff line prints, for the few escapes NAME lines use; fonts and sizes are dropped."""
    def replace(m: re.Match) -> str:
        if m.group(1) is not None or m.group(2) is not None:
            return _GLYPHS.get(m.group(1) or m.group(2), "")
        if m.group(3) is not None:
            return _SINGLE.get(m.group(3), "")
        return ""

    return _ESCAPE.sub(replace, text.split('\\"', 1)[0])


def _macro_args(rest: str) -> str:
    """A macro line's arguments as text: quotes group words and are dropped."""
    return " ".join(m.group(1) if m.group(1) is not None else m.group(2)
                    for m in re.finditer(r'"([^"]*)"?|(\S+)', rest))


def _join(parts: list[str]) -> str:
    """Filled lines joined by a space, except between two Japanese characters, which need none."""
    text = ""
    for part in (p.strip() for p in parts):
        if not part:
            continue
        if text and not (_JAPANESE.match(text[-1]) and _JAPANESE.match(part[0])):
            text += " "
        text += part
    return text


def name_description(source: str) -> str | None:
    """The description of a page's NAME section (man: the text after ``\\-``; mdoc: ``.Nd``), or None."""
    lines = [line for line in source.splitlines() if not _COMMENT.match(line)]
    start = None
    for i, line in enumerate(lines):
        m = _HEADING.match(line)
        if m and m.group(1) in ("SH", "Sh"):
            title = m.group(2).strip() or (lines[i + 1] if i + 1 < len(lines) else "")
            if title.strip('"').strip().lower() in _NAME_HEADINGS:
                start = i + 1 if m.group(2).strip() else i + 2
                break
    if start is None:
        return None
    body = []
    for line in lines[start:]:
        if _HEADING.match(line):
            break
        body.append(line)
    names, text, described = [], [], None
    for line in body:
        if not line.startswith((".", "'")):
            text.append(line)
            continue
        macro, _, rest = line[1:].strip().partition(" ")
        if macro == "Nm":
            names.append(_macro_args(rest))
        elif macro == "Nd":  # mdoc: the description runs from here to the next heading
            described = len(text)
            text.append(_macro_args(rest))
        elif macro in _TEXT_MACROS:
            text.append(_macro_args(rest))
        # other requests (paragraph breaks, hyphenation, ...) print nothing here
    if described is not None:
        return _clean(unescape(_join(text[described:])))
    raw = _join(text)
    # The separator is "\-" (spaced first: names such as iso_8859\-11 hold one); a few pages write " - ",
    # " -- " or an em dash instead.
    for separator in (r" \- ", r"\-", " -- ", " - ", r"\(em", " — "):
        if separator in raw:
            return _clean(unescape(raw.split(separator, 1)[1]))
    return _clean(unescape(raw)) if names else None  # mdoc without .Nd: the names stood apart on .Nm


def _clean(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


@dataclass
class Row:
    page: str  # e.g. "man1/ls.1"; pages that repeat one description: "man1/dir.1,man1/ls.1,man1/vdir.1"
    section: str
    input: str


def read_rows(man_dir: Path) -> tuple[list[Row], Counter]:
    """One row per page with a Japanese NAME description; the Counter says why other pages were skipped."""
    rows, skipped = [], Counter()
    for path in find_manpages(man_dir):  # symlinked aliases are already left out
        section = path.parent.name.removeprefix("man")[:1]
        if section not in SECTION_LABELS:
            skipped["section unknown"] += 1
            continue
        try:
            source = read_manpage(path)
        except (OSError, UnicodeDecodeError, EOFError):
            skipped["unreadable"] += 1
            continue
        if re.search(r"^\.so\s", source, re.MULTILINE) and not _HEADING.search(source):
            skipped[".so alias"] += 1
            continue
        description = name_description(source)
        if not description:
            skipped["no NAME description"] += 1
        elif not _JAPANESE.search(description):
            skipped["description not translated"] += 1
        else:
            page = f"{path.parent.name}/{path.name.removesuffix('.gz')}"
            rows.append(Row(page, section, description))
    return rows, skipped


def dedupe(rows: list[Row]) -> tuple[list[Row], Counter]:
    """One row per description (so no description is in two splits): repeats within a section become one
    row naming all their pages; a description several sections share says nothing of the section: dropped."""
    by_text: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        by_text[row.input].append(row)
    kept, dropped = [], Counter()
    for group in by_text.values():
        if len({r.section for r in group}) > 1:
            dropped["description in several sections"] += len(group)
        else:
            kept.append(Row(",".join(r.page for r in group), group[0].section, group[0].input))
            dropped["repeated description"] += len(group) - 1
    return kept, dropped


def split_rows(rows: list[Row], config: DemoTaskConfig) -> dict[str, list[Row]]:
    """Per label: shuffle its pages with the seed, cut test and validation shares off the front."""
    by_section: dict[str, list[Row]] = defaultdict(list)
    for row in sorted(rows, key=lambda r: r.page):
        by_section[row.section].append(row)
    splits: dict[str, list[Row]] = {name: [] for name in SPLITS}
    for section, group in sorted(by_section.items()):
        random.Random(f"{config.seed}-{section}").shuffle(group)
        n_test = max(1, round(len(group) * config.test_fraction))
        n_val = max(1, round(len(group) * config.validation_fraction))
        splits["test"] += group[:n_test]
        splits["validation"] += group[n_test:n_test + n_val]
        splits["train"] += group[n_test + n_val:]
    for name, part in splits.items():  # mixed labels in every file, so a `limit` of N rows sees all of them
        random.Random(f"{config.seed}-{name}").shuffle(part)
    return splits


def chat_conversation(row: Row) -> dict:
    """The row as a two-turn conversation: the command's purpose, then its manual section."""
    command = row.page.split(",")[0].split("/")[-1].rsplit(".", 1)[0]
    return {"messages": [
        {"role": "user", "content": f"`{command}` は何をしますか?"},
        {"role": "assistant", "content": row.input},
        {"role": "user", "content": "マニュアルの何章ですか?"},
        {"role": "assistant", "content": f"{row.section}章 ({SECTION_LABELS[row.section]}) です。"}]}


def manpage_pairs(chats: list[dict]) -> list[dict]:
    """Preference rows from make-demo-task's man-page conversations, alternating two shapes: a string prompt
    (the question about the command) preferring the page's NAME description over its section line, and the
    conversation up to the section question (a message list) preferring the right section's line over a wrong
    section's (the next sections in turn)."""
    sections = sorted(SECTION_LABELS)
    rows = []
    for k, chat in enumerate(c for c in chats if "messages" in c):
        messages = chat["messages"]
        section_line = messages[-1]["content"]
        right = section_line.split("章")[0]
        if k % 2:
            wrong = sections[(sections.index(right) + 1 + k // 2 % (len(sections) - 1)) % len(sections)]
            rows.append({"prompt": messages[:-1], "chosen": [messages[-1]],
                         "rejected": [{"role": "assistant", "content": f"{wrong}章 ({SECTION_LABELS[wrong]}) です。"}]})
        else:
            question = next(m["content"] for m in messages if m["role"] == "user")
            rows.append({"prompt": question, "chosen": messages[-3]["content"], "rejected": section_line})
    return rows


def lm_eval_task(labels: list[str]) -> dict:
    """The lm-evaluation-harness task over the TSV files: score every label by log-likelihood after the prompt.
    data_files are relative to the YAML's folder (`gptpipe evaluate` resolves them), so the folder can move."""
    csv = {"delimiter": "\t", "column_names": ["input", "label"], "quoting": 3, "na_filter": False}
    return {
        "task": TASK_NAME,
        "dataset_path": "csv",
        "dataset_kwargs": {"data_files": {s: f"{s}.tsv" for s in SPLITS}, **csv},
        "output_type": "multiple_choice",
        "training_split": "train",
        "validation_split": "validation",
        "test_split": "test",
        "fewshot_split": "train",
        "doc_to_text": EVAL_PROMPT,
        "doc_to_target": "{{label}}",
        "doc_to_choice": labels,
        "target_delimiter": " ",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0},
    }


def llmjp_eval_task(rows: list[Row], labels: list[str]) -> dict:
    """The task as an llm-jp-eval file: the section generated after the description, exact match, the labels
    as its label_list (llm-jp-eval's out-of-label share beside it)."""
    return {"instruction": "マニュアルの説明を読み、そのマニュアルの種類を次の中から一つ答えてください: "
                           + "、".join(labels),
            "output_length": 8, "metrics": ["exact_match"], "label_list": labels,
            "samples": [{"input": r.input, "output": SECTION_LABELS[r.section]} for r in rows]}


def build(config: DemoTaskConfig) -> StageResult:
    """Read, dedupe, drop small sections, split, write the files (each atomically); manifest by the caller."""
    rows, skipped = read_rows(config.man_dir)
    rows, dropped = dedupe(rows)
    per_section = Counter(r.section for r in rows)
    small = {s: n for s, n in sorted(per_section.items()) if n < config.min_pages}
    rows = [r for r in rows if r.section not in small]
    if not rows:
        raise StageInputError(f"no usable man pages under {config.man_dir} (skipped: {dict(skipped)}); "
                              "install them: apt-get install manpages-ja manpages-ja-dev")
    splits = split_rows(rows, config)
    labels = [SECTION_LABELS[s] for s in sorted({r.section for r in rows})]
    out = config.output_dir
    written = []
    for name, part in splits.items():
        written.append(_write(out / f"{name}.tsv", "".join(f"{r.input}\t{SECTION_LABELS[r.section]}\n" for r in part)))
    for name, part in splits.items():
        written.append(_write(out / "chat" / f"{name}.jsonl", "".join(
            json.dumps(chat_conversation(r), ensure_ascii=False) + "\n" for r in part)))
    for name, part in splits.items():
        written.append(_write(out / "preference" / f"{name}.jsonl", "".join(
            json.dumps(row, ensure_ascii=False) + "\n" for row in manpage_pairs([chat_conversation(r) for r in part]))))
    for name in ("train", "test"):  # llm-jp-eval's layout: the few-shot examples come from ../train/
        written.append(_write(out / "llm-jp-eval" / name / f"{TASK_NAME}.json", json.dumps(
            llmjp_eval_task(splits[name], labels), ensure_ascii=False, indent=1) + "\n"))
    written.append(_write(out / "pages.tsv", "page\tsplit\tlabel\tinput\n" + "".join(
        f"{r.page}\t{name}\t{SECTION_LABELS[r.section]}\t{r.input}\n" for name, part in splits.items() for r in part)))
    written.append(_write(out / f"{TASK_NAME}.yaml", yaml.safe_dump(
        lm_eval_task(labels), allow_unicode=True, sort_keys=False)))
    label_counts = {SECTION_LABELS[s]: n for s, n in sorted(Counter(r.section for r in rows).items())}
    counts = {
        "pages": len(rows),
        "labels": label_counts,
        "majority_share": round(max(label_counts.values()) / len(rows), 4),
        "splits": {name: len(part) for name, part in splits.items()},
        "dropped_sections": {f"{s} {SECTION_LABELS[s]}": n for s, n in small.items()},
        "skipped_pages": dict(skipped),
        "dropped_rows": {k: v for k, v in dropped.items() if v},
    }
    return StageResult(outputs=written, counts=counts)


def _write(path: Path, text: str) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return path


def report(counts: dict) -> str:
    """What the task holds, for the terminal: label counts, the majority share, what was left out and why."""
    total = counts["pages"]
    lines = [f"{total} pages: " + ", ".join(f"{k} {v}" for k, v in counts["splits"].items())]
    lines += [f"  {label}: {n} ({n / total:.1%})" for label, n in counts["labels"].items()]
    lines.append(f"majority class share (accuracy of always answering it): {counts['majority_share']:.1%}")
    if counts["dropped_sections"]:
        lines.append("sections left out (fewer pages than min_pages): "
                     + ", ".join(f"{k} ({v})" for k, v in counts["dropped_sections"].items()))
    for what in ("skipped_pages", "dropped_rows"):
        if counts[what]:
            lines.append(f"{what.replace('_', ' ')}: " + ", ".join(f"{k} {v}" for k, v in counts[what].items()))
    return "\n".join(lines)


def make_demo_task(config: DemoTaskConfig, force: bool = False) -> Path:
    """Build the task unless it is current; returns the output folder."""
    if not config.man_dir.is_dir():
        raise StageInputError(f"{config.man_dir} not found: install the Japanese man pages "
                              "(apt-get install manpages-ja manpages-ja-dev) or set demo_task.man_dir")
    pages = [p for p in config.man_dir.glob("man*/*") if p.is_file()]
    manifest = DEMO_TASK.run(config.output_dir, config,
                             {"man_pages": tree_fingerprint(pages), "sets": SETS}, lambda: build(config), force=force,
                             input_paths={"demo_task.man_dir": config.man_dir})
    log.info(f"{config.output_dir}\n{report(manifest.counts)}")
    return config.output_dir


def run(config, args) -> int:
    """`gptpipe make-demo-task`: the demo_task section of evaluate_config.yaml."""
    make_demo_task(config.demo_task, force=args.force)
    return 0
