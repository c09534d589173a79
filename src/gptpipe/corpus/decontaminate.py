"""Stage 0's decontamination: evaluation items → a small n-gram index; a document → the items it overlaps, where.

Items come from item sources (`ItemSource`): a file of texts (.jsonl: every string of each line; .txt: each
line) or lm-eval tasks (registry names, local task YAMLs: every string of each test and validation document,
as the task's process_docs leaves it; not the prompt template, whose words every item shares; `fields` picks
among a record's keys). A source yields (task name, record) pairs, so one source may hold several tasks (an
lm-eval group); a new kind of source is
a class with `items()` and `fingerprint()` and one entry in PATH_KINDS (by suffix, or "/" for a folder).

Text is normalised before it is cut (NFKC, case-folded; punctuation, spaces and line breaks dropped), so that
full-width letters, capitals, re-wrapped lines and re-spaced words still match. Every item is cut two ways:
- into character n-grams of its letters and digits, each n-gram kept when at least half of it is letters of
  scripts written without spaces (Japanese, Chinese: charclass's SPACELESS, what the near-dedup's
  `spaceless_share` counts);
- into word n-grams (runs of letters and digits, each letter of those scripts a word of its own), each kept when
  at least half of it is words of the other scripts.
So an English item gives word n-grams, a Japanese one character n-grams, and a mixed one both, each where its
script holds; a path or an option list inside a Japanese item (twenty Latin letters: three or four words) gives
none. An item shorter than twice the configured n-gram is cut into shorter ones (a ladder down to the minimum),
so that one edit leaves at least one n-gram whole; one under twice the minimum is matched one edit apart (every
n-gram less one unit, in the item and in the document); one under the minimum is not looked for. Each n-gram is
a 64-bit polynomial hash (over its units' hashes), computed for all positions of a document at once from prefix
sums with numpy, and looked up in a byte filter then in each size's sorted hashes. A match stands for the whole
item around it (the index keeps where each n-gram sits in its item), so `remove_span` cuts the whole quote. The
index is built once on the driver and saved to stage 0's work folder, where each worker reads it
(corpus/firstpass.py).
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from gptpipe.corpus.charclass import LETTER, NUMBER, SPACELESS, classes
from gptpipe.stage import StageInputError, atomic_path, tree_fingerprint

if TYPE_CHECKING:  # the config module asks this one which paths are item files
    from gptpipe.corpus.config import DecontaminationConfig

INDEX_FILE = "decontamination.npz"
LADDER_STEP = 0.8  # each shorter n-gram size is this share of the one above
_BASE = np.uint64(0x100000001B3)  # odd, so invertible modulo 2^64
_INVERSE = np.uint64(pow(int(_BASE), -1, 1 << 64))
# A base character and the marks NFKC composes with it (combining marks, half-width (semi-)voiced sound marks).
CLUSTER = re.compile(r"(?s).[\u0300-\u036f\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\u3099\u309a\ufe20-\ufe2f"
                     r"\uff9e\uff9f]*")
CLOSING = frozenset(",.;:!?)]}>、。，．：；！？）」』】〉》")  # what ends the text before a quote
_FILTER_BITS = 22  # the prefilter's slots: 2^22 bytes (in cache), 1 in 60 set by 70,000 n-grams


def normalised(text: str) -> tuple[str, np.ndarray]:
    """The text NFKC-normalised and case-folded, and for each of its characters the position in `text` of the
    character it came from (so that a match can be cut out of the original). A line whose length that changes
    (ligatures, decomposed accents, half-width kana with their sound marks) is normalised a base character and
    its marks at a time, to know where each normalised character came from."""
    whole = unicodedata.normalize("NFKC", text).casefold()
    if len(whole) == len(text):  # nearly always: one character for one (full-width → ASCII, kana as they are)
        return whole, np.arange(len(text), dtype=np.int64)
    pieces, origins, at = [], [], 0
    for line in text.splitlines(keepends=True):
        norm = unicodedata.normalize("NFKC", line).casefold()
        if len(norm) == len(line):
            pieces.append(norm)
            origins.append(np.arange(at, at + len(line)))
        else:
            for cluster in CLUSTER.finditer(line):
                piece = unicodedata.normalize("NFKC", cluster.group()).casefold()
                pieces.append(piece)
                origins.append(np.full(len(piece), at + cluster.start()))
        at += len(line)
    return "".join(pieces), np.concatenate(origins) if origins else np.zeros(0, dtype=np.int64)


def _powers(base: np.uint64, count: int) -> np.ndarray:
    """base^0 .. base^(count-1) modulo 2^64 (numpy's integer arrays wrap around silently)."""
    powers = np.full(count, base, dtype=np.uint64)
    if count:
        powers[0] = 1
    return np.cumprod(powers, dtype=np.uint64)


def _of_its_kind(cut: Units, size: int, kind: str) -> np.ndarray:
    """Per window of `size` units: whether at least half of them are of the kind's script: letters of scripts
    written without spaces for "char" (20 letters of a path or of options in a Japanese item are weak), the
    others for "word" (so is a run of Japanese characters cut as words)."""
    counts = np.concatenate(([0], np.cumsum(cut.spaceless)))
    spaceless = counts[size:] - counts[:-size]
    return spaceless * 2 >= size if kind == "char" else (size - spaceless) * 2 >= size


class Polynomial:
    """Polynomial hashes of runs of `values` (sum of value[start+k] * base^k modulo 2^64), any run in a few numpy
    operations: the prefix sums of value[i] * base^i, each run's sum shifted down by its start's inverse power.
    (Not mixed further: the multiplications carry every value into the top bits, which the index's filter
    reads.)"""

    def __init__(self, values: np.ndarray) -> None:
        self.prefix = np.concatenate((np.zeros(1, dtype=np.uint64),
                                      np.cumsum(values * _powers(_BASE, len(values)), dtype=np.uint64)))
        self.inverse = _powers(_INVERSE, len(values) + 1)

    def runs(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        return (self.prefix[ends] - self.prefix[starts]) * self.inverse[starts]

    def windows(self, n: int) -> np.ndarray:
        """The hash of every run of `n` values, by start."""
        count = max(len(self.prefix) - n, 0)
        return (self.prefix[n:n + count] - self.prefix[:count]) * self.inverse[:count]

    def windows_less_one(self, n: int, k: int) -> np.ndarray:
        """The hash of every run of `n` values with its k-th left out, by start: two texts one edit
        (substitution, insertion, deletion) apart share one of these where their windows hold the edit."""
        count = max(len(self.prefix) - n, 0)
        prefix, inverse = self.prefix, self.inverse
        return ((prefix[k:k + count] - prefix[:count]) * inverse[:count]
                + (prefix[n:n + count] - prefix[k + 1:k + 1 + count]) * inverse[1:1 + count])


@dataclass(frozen=True)
class Units:
    """A text's units for one kind of n-gram, each valued by the hash of its normalised characters, with its
    span [start, end) in the original text and whether it is a letter of a script written without spaces."""

    values: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    spaceless: np.ndarray  # bool per unit

    def __len__(self) -> int:
        return len(self.values)


def units(text: str, kind: str) -> Units:
    """`kind` "char": each letter or digit of the normalised text (punctuation, spaces and line breaks dropped);
    "word": the runs of letters and digits, each letter of a script written without spaces a unit of its own
    (an English word right after a Japanese one is still a word). Also whether each unit is of such a script."""
    norm, origin = normalised(text)
    points = np.frombuffer(norm.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    bits = classes(points)
    alnum = (bits & (LETTER | NUMBER)) != 0
    spaceless = alnum & ((bits & SPACELESS) != 0)
    alone = alnum if kind == "char" else spaceless
    joined = alnum & ~alone
    before = np.concatenate(([False], joined[:-1]))
    after = np.concatenate((joined[1:], [False]))
    starts = np.flatnonzero(alone | (joined & ~before))
    ends = np.flatnonzero(alone | (joined & ~after)) + 1
    values = Polynomial(points.astype(np.uint64)).runs(starts, ends) ^ (ends - starts).astype(np.uint64)
    return Units(values, origin[starts], origin[ends - 1] + 1, spaceless[starts])


def ladder(longest: int, shortest: int) -> list[int]:
    """The n-gram sizes, longest first: each LADDER_STEP of the one above, down to `shortest`."""
    sizes = [longest]
    while (size := int(sizes[-1] * LADDER_STEP)) > shortest:
        sizes.append(size)
    return sizes + [shortest] if sizes[-1] != shortest else sizes


def size_for(length: int, sizes: list[int]) -> int | None:
    """The n-gram size for an item of `length` units: the longest of `sizes` at most half of it (one edit then
    leaves an n-gram whole), else the shortest (its n-grams are then also matched one edit apart); None when
    the item is shorter than that."""
    if length < sizes[-1]:
        return None
    return next((size for size in sizes if size <= length // 2), sizes[-1])


class ItemSource(Protocol):
    """Where evaluation items come from."""

    label: str  # how a config error or the manifest names the source

    def items(self) -> Iterator[tuple[str, Any]]:
        """(task name, record) pairs: a record is an item's text, or a JSON-like value whose strings are items
        (corpus.decontamination.fields picks among a mapping's)."""
        ...

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the items' content (files' sizes and times, a task's name and lm-eval version)."""
        ...


def strings(value: Any, fields: tuple[str, ...] = ()) -> Iterator[str]:
    """Every string inside a JSON-like value (dict values, list members), in order; of a mapping, only the
    values of `fields` when given."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, member in value.items():
            if not fields or key in fields:
                yield from strings(member)
    elif isinstance(value, (list, tuple)):
        for member in value:
            yield from strings(member)


@dataclass(frozen=True)
class JsonlItems:
    """A .jsonl file: every string of each line (object or not) is an item; the task is the file's stem."""

    path: Path

    @property
    def label(self) -> str:
        return str(self.path)

    def items(self) -> Iterator[tuple[str, Any]]:
        with open(self.path, encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise StageInputError(f"{self.path}:{number}: not JSON ({exc.msg})") from None
                yield self.path.stem, value

    def fingerprint(self) -> dict[str, Any]:
        return tree_fingerprint([self.path])


@dataclass(frozen=True)
class LineItems(JsonlItems):
    """A .txt file: each non-blank line is an item."""

    def items(self) -> Iterator[tuple[str, Any]]:
        with open(self.path, encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    yield self.path.stem, line


@dataclass(frozen=True)
class TaskItems:
    """lm-eval tasks, any spec lm_tasks loads (registry names, local task dicts): every string of each test and
    validation document; a group's tasks are named one by one. `inputs`: what identifies each spec's content."""

    specs: tuple[str | dict, ...]
    inputs: tuple[dict[str, Any], ...]
    label: str

    def items(self) -> Iterator[tuple[str, Any]]:
        from gptpipe.lm_tasks import built_tasks

        tasks = built_tasks(list(self.specs), "corpus.decontamination.files: [your_task.yaml]")
        for name, task in tasks.items():
            for docs in (task.test_docs() if task.has_test_docs() else None,
                         task.validation_docs() if task.has_validation_docs() else None):
                for doc in docs or ():
                    yield name, doc

    def fingerprint(self) -> dict[str, Any]:
        from gptpipe.lm_tasks import spec_name

        return {spec_name(spec): inputs for spec, inputs in zip(self.specs, self.inputs)}


def registry_tasks(names: list[str]) -> TaskItems:
    """lm-eval registry tasks, identified by name and lm-eval's version (their YAMLs ship with it)."""
    from importlib import metadata

    version = metadata.version("lm_eval")
    return TaskItems(tuple(names), tuple({"registry": name, "lm_eval": version} for name in names),
                     "lm-eval registry tasks")


def task_yaml(path: Path) -> TaskItems:
    """A local lm-eval task YAML, identified by it and its local data files."""
    from gptpipe.lm_tasks import flatten, local_task

    task = local_task(path)
    local = [Path(f) for f in flatten((task.get("dataset_kwargs") or {}).get("data_files")) if Path(f).is_file()]
    return TaskItems((task,), (tree_fingerprint([path, *local]),), str(path))


@dataclass(frozen=True)
class LlmJpItems:
    """A folder of llm-jp-eval task files (gptpipe/llmjp_eval.py, what `gptpipe evaluate` runs from task_dirs):
    each sample's input and output, under the task's name as evaluate reports it."""

    path: Path

    @property
    def label(self) -> str:
        return str(self.path)

    def items(self) -> Iterator[tuple[str, Any]]:
        from gptpipe.llmjp_eval import read_folder

        for task in read_folder(self.path):
            for sample in task.samples:
                yield task.name, sample

    def fingerprint(self) -> dict[str, Any]:
        from gptpipe.llmjp_eval import fingerprint, read_folder

        return fingerprint(read_folder(self.path))


# The kinds of corpus.decontamination.files, by suffix ("/" for a folder): each gives the path's item source. A new
# kind is one entry here.
PATH_KINDS: dict[str, Callable[[Path], ItemSource]] = {".jsonl": JsonlItems, ".txt": LineItems, ".yaml": task_yaml,
                                                       ".yml": task_yaml, "/": LlmJpItems}


def config_problems(config: DecontaminationConfig) -> list[tuple[str, str]]:
    """The entries of corpus.decontamination.files that are missing or of no known kind (as the config loads)."""
    problems = []
    for i, path in enumerate(map(Path, config.files)):
        if not path.exists():
            problems.append((f"files.{i}", f"{path} does not exist"))
        elif ("/" if path.is_dir() else path.suffix) not in PATH_KINDS:
            problems.append((f"files.{i}", f"{path}: not an item file or task ({', '.join(PATH_KINDS)})"))
        elif path.is_dir() and not any(path.glob("*.json")):
            problems.append((f"files.{i}", f"{path}: a folder here is one of llm-jp-eval task files (*.json), and "
                                           "it holds none"))
    return problems


def sources(config: DecontaminationConfig) -> list[ItemSource]:
    """The item sources of the config: its files in order, then its registry tasks as one source (one
    TaskManager for them all: indexing the registry is slow)."""
    found = [PATH_KINDS["/" if Path(path).is_dir() else Path(path).suffix](Path(path)) for path in config.files]
    return found + ([registry_tasks(config.tasks)] if config.tasks else [])


def fingerprint(config: DecontaminationConfig) -> dict[str, Any]:
    """What stage 0's manifest records of the items (a change reruns the stage)."""
    return {"settings": {k: getattr(config, k) for k in ("fields", "word_ngram", "char_ngram", "min_word_ngram",
                                                        "min_char_ngram")},
            **{source.label: source.fingerprint() for source in sources(config)}}


@dataclass
class Overlap:
    """What a document shares with the items: per task (in the index's order) the items it overlaps and the
    n-grams found; the spans of the document they cover, merged, in order."""

    items: dict[str, set[int]] = field(default_factory=dict)
    ngrams: dict[str, int] = field(default_factory=dict)
    spans: list[tuple[int, int]] = field(default_factory=list)

    @property
    def tasks(self) -> list[str]:
        return list(self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


@dataclass
class Index:
    """The n-grams of every item: per (kind, size, one edit apart or not), the sorted hashes, the item each came
    from and the item's units before and after it; a byte per slot of the hashes' top bits in front of them
    (most windows of a document are rejected by one lookup there), built where the index is used, not saved."""

    tasks: list[str]
    item_task: np.ndarray  # per item: the number of its task
    previews: list[str]  # per item: its first characters, for the report and the dropped samples
    grams: dict[tuple[str, int, bool], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]
    counts: dict[str, dict[str, int]]  # per task: items, items too short to look for, n-grams
    _filter: np.ndarray | None = field(default=None, repr=False, compare=False)

    @classmethod
    def build(cls, config: DecontaminationConfig) -> Index:
        ladders = {"word": ladder(config.word_ngram, config.min_word_ngram),
                   "char": ladder(config.char_ngram, config.min_char_ngram)}
        tasks: dict[str, int] = {}
        item_task: list[int] = []
        previews: list[str] = []
        found: dict[tuple[str, int, bool], list[tuple[np.ndarray, int]]] = {}
        counts: dict[str, dict[str, int]] = {}
        seen: set[tuple[int, str]] = set()
        for source in sources(config):
            for task, text in ((task, text) for task, record in source.items()
                               for text in strings(record, tuple(config.fields))):
                number = tasks.setdefault(task, len(tasks))
                count = counts.setdefault(task, {"items": 0, "too short": 0, "ngrams": 0})
                key = (number, text.strip())
                if key in seen or not key[1]:  # the same text twice in a task (a passage with several questions)
                    continue
                seen.add(key)
                count["items"] += 1
                number_of_item = len(item_task)
                total = 0
                for kind in ("char", "word"):
                    cut = units(text, kind)
                    size = size_for(len(cut), ladders[kind])
                    if size is None:
                        continue
                    hashes = Polynomial(cut.values)
                    # An item under twice the shortest n-gram: an edit may touch every n-gram of it, so its
                    # n-grams are matched one edit apart (each less one unit, on both sides).
                    fuzzy = size > len(cut) // 2
                    grams = (np.stack([hashes.windows_less_one(size, k) for k in range(size)]) if fuzzy
                             else hashes.windows(size)[None])
                    starts = np.flatnonzero(_of_its_kind(cut, size, kind))
                    grams = grams[:, starts]
                    # each n-gram with the item's units before and after it (where the item starts and ends
                    # around a match); none for one the item holds twice (C declarations): its place is unsure
                    ordered = np.sort(grams, axis=0)  # a window's variants may agree (a doubled letter)
                    fresh = np.ones(ordered.shape, dtype=bool)
                    fresh[1:] = ordered[1:] != ordered[:-1]
                    window = np.broadcast_to(np.arange(ordered.shape[1]), ordered.shape)[fresh]
                    grams, first, times = np.unique(ordered[fresh], return_index=True, return_counts=True)
                    before = starts[window[first]]
                    after = len(cut) - size - before
                    before, after = np.where(times == 1, before, 0), np.where(times == 1, after, 0)
                    if len(grams):
                        found.setdefault((kind, size, fuzzy), []).append((grams, number_of_item, before, after))
                        total += len(grams)
                # every item numbered, in the sources' order, whether it gave n-grams or not
                item_task.append(number)
                previews.append(" ".join(text.split())[:80])
                count["ngrams"] += total
                count["too short"] += not total
        grams = {}
        for key, parts in found.items():
            hashes = np.concatenate([h for h, *_ in parts])
            order = np.argsort(hashes, kind="stable")
            owners = np.concatenate([np.full(len(h), item, dtype=np.int64) for h, item, *_ in parts])
            before = np.concatenate([b for *_, b, _ in parts]).astype(np.int64)
            after = np.concatenate([a for *_, a in parts]).astype(np.int64)
            grams[key] = (hashes[order], owners[order], before[order], after[order])
        return cls(list(tasks), np.asarray(item_task, dtype=np.int64), previews, grams, counts)

    @property
    def digest(self) -> str:
        """A digest of every n-gram and the item it belongs to: the same items, cut the same way, give the same."""
        digest = hashlib.sha256(json.dumps(self.tasks).encode())
        for key in sorted(self.grams):
            digest.update(repr(key).encode())
            for array in self.grams[key]:
                digest.update(array.tobytes())
        return digest.hexdigest()

    def _slots(self) -> np.ndarray:
        if self._filter is None:
            self._filter = np.zeros(1 << _FILTER_BITS, dtype=bool)
            for hashes, *_ in self.grams.values():
                self._filter[hashes >> np.uint64(64 - _FILTER_BITS)] = True
        return self._filter

    def find(self, text: str) -> Overlap:
        """The items `text` shares an n-gram with, and where (spans of the original text, merged: two matches
        closer than their n-gram's length are one span, the edited part between them included)."""
        overlap = Overlap()
        if not self.grams:
            return overlap
        slots = self._slots()
        spans: list[tuple[int, int, int]] = []  # (start, end, size in characters of the n-gram's reach)
        hits: list[np.ndarray] = []
        cuts: dict[str, tuple[Units, Polynomial]] = {}
        for (kind, size, fuzzy), (hashes, owners, before, after) in self.grams.items():
            if kind not in cuts:
                cut = units(text, kind)
                cuts[kind] = cut, Polynomial(cut.values)
            cut, polynomial = cuts[kind]
            if len(cut) < size:
                continue
            for windows in ([polynomial.windows_less_one(size, k) for k in range(size)] if fuzzy
                            else [polynomial.windows(size)]):
                maybe = np.flatnonzero(slots[windows >> np.uint64(64 - _FILTER_BITS)])
                if not len(maybe):
                    continue
                where = np.minimum(np.searchsorted(hashes, windows[maybe]), len(hashes) - 1)
                found = maybe[hashes[where] == windows[maybe]]
                for position in found.tolist():
                    # every item holding this n-gram (equal hashes sit together), and where it would start and
                    # end around it: the span cut is the whole item's, though only part of it gives n-grams
                    first = np.searchsorted(hashes, windows[position], side="left")
                    last = np.searchsorted(hashes, windows[position], side="right")
                    hits.append(owners[first:last])
                    for ahead, behind in zip(before[first:last].tolist(), after[first:last].tolist()):
                        start = int(cut.starts[max(position - ahead, 0)])
                        end = int(cut.ends[min(position + size - 1 + behind, len(cut) - 1)])
                        spans.append((start, end, int(cut.ends[position + size - 1]) - int(cut.starts[position])))
        if not hits:
            return overlap
        items = np.concatenate(hits)
        for item in items.tolist():
            task = self.tasks[int(self.item_task[item])]
            overlap.items.setdefault(task, set()).add(item)
            overlap.ngrams[task] = overlap.ngrams.get(task, 0) + 1
        order = sorted(overlap.items, key=self.tasks.index)
        overlap.items = {task: overlap.items[task] for task in order}
        overlap.ngrams = {task: overlap.ngrams[task] for task in order}
        merged: list[list[int]] = []
        for start, end, reach in sorted(spans):
            if merged and start <= merged[-1][1] + reach:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        overlap.spans = [_with_punctuation(text, a, b) for a, b in merged]
        return overlap

    def describe(self, overlap: Overlap) -> str:
        """One line on an overlap: per task, the items and n-grams shared, the first item's start."""
        parts = []
        for task, items in overlap.items.items():
            first = min(items)
            parts.append(f"{task}: {overlap.ngrams[task]} n-gram(s) of {len(items)} item(s), e.g. item {first} "
                         f"{self.previews[first][:40]!r}")
        return "; ".join(parts)

    def save(self, path: Path) -> None:
        """Arrays and a JSON header in one .npz (read back without pickle)."""
        keys = sorted(self.grams)
        header = {"tasks": self.tasks, "previews": self.previews, "counts": self.counts, "keys": keys}
        arrays = {f"gram{i}_{part}": array for i, key in enumerate(keys)
                  for part, array in zip(("hashes", "owners", "before", "after"), self.grams[key])}
        with atomic_path(path) as tmp, open(tmp, "wb") as fh:
            np.savez(fh, header=np.array(json.dumps(header, ensure_ascii=False)), item_task=self.item_task,
                     **arrays)


@lru_cache(maxsize=2)
def load(path: Path, mtime_ns: int) -> Index:
    """The index a driver saved (once per worker process and file version)."""
    with np.load(path, allow_pickle=False) as data:
        header = json.loads(str(data["header"]))
        grams = {(kind, size, fuzzy): tuple(data[f"gram{i}_{part}"] for part in ("hashes", "owners", "before",
                                                                                "after"))
                 for i, (kind, size, fuzzy) in enumerate(header["keys"])}
        return Index(header["tasks"], data["item_task"], header["previews"], grams, header["counts"])


def _with_punctuation(text: str, start: int, end: int) -> tuple[int, int]:
    """A span widened over the punctuation around it on its lines (a quote's 「」, its last 。 or period, a
    command's `$ `, a re-spaced quote's brackets), not back over the end of the sentence before it, nor over the
    spaces at the new edges."""
    low, high = start, end
    while low > 0 and not text[low - 1].isalnum() and text[low - 1] != "\n" and text[low - 1] not in CLOSING:
        low -= 1
    while high < len(text) and not text[high].isalnum() and text[high] != "\n":
        high += 1
    while low < start and text[low].isspace():
        low += 1
    while high > end and text[high - 1].isspace():
        high -= 1
    return low, high


def removed(text: str, spans: list[tuple[int, int]]) -> str:
    """`text` without `spans`; the text around each cut joined by a line break, blank edges stripped."""
    pieces, at = [], 0
    for start, end in spans:
        pieces.append(text[at:start])
        at = end
    pieces.append(text[at:])
    return "\n".join(piece.strip() for piece in pieces if piece.strip())
