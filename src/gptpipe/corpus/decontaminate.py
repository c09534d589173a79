"""Stage 0's decontamination: evaluation items → a small n-gram index; a document → the items it overlaps, where.

Items come from item sources (`ItemSource`): a file of texts (.jsonl: every string of each line; .txt: each
line) or lm-eval tasks (registry names, local task YAMLs: every string of each test and validation document,
as the task's process_docs leaves it; not the prompt template, whose words every item shares). A source yields
(task name, item text) pairs, so one source may hold several tasks (an lm-eval group); a new kind of source is
a class with `items()` and `fingerprint()` and one entry in FILE_KINDS (by suffix) or in `sources`.

Text is normalised before it is cut (NFKC, case-folded), so that full-width letters, capitals, re-wrapped lines
and re-spaced words still match:
- an item written mainly without spaces (Japanese, Chinese: neardup's `spaceless_share`, the near-dedup's own
  choice) is cut into character n-grams of its letters and digits (punctuation and whitespace removed);
- any other item into n-grams of its words (`\\w+`, as the near-dedup's word shingles).
An item shorter than twice the configured n-gram is cut into shorter ones (a ladder down to the minimum), so
that one edited word or character in a quoted item leaves at least one n-gram whole; an item shorter than the
minimum is not looked for. A document is cut both ways (a Japanese page may quote an English item), each
n-gram hashed to 64 bits with a polynomial hash over its code points (words: over its words' hashes), computed
for all positions at once with numpy, and looked up in each size's sorted hashes. The index is built once on
the driver and saved to stage 0's work folder, where each worker reads it (corpus/firstpass.py).
"""

from __future__ import annotations

import hashlib
import json
import pickle
import re
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from gptpipe.corpus.config import CorpusConfig, DecontaminationConfig
from gptpipe.corpus.neardup import WORD, spaceless_share
from gptpipe.stage import StageInputError, atomic_path, tree_fingerprint

INDEX_FILE = "decontamination.pkl"
LADDER_STEP = 0.8  # each shorter n-gram size is this share of the one above
# A base character and the marks NFKC composes with it (combining marks, half-width (semi-)voiced sound marks):
# normalised together when a text is normalised piece by piece.
CLUSTER = re.compile(r"(?s).[\u0300-\u036f\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\u3099\u309a\ufe20-\ufe2f"
                     r"\uff9e\uff9f]*")
NOT_LETTER = re.compile(r"[\W_]")
_CHAR_BASE, _WORD_BASE = np.uint64(0x100000001B3), np.uint64(0x9E3779B97F4A7C15 | 1)  # odd: invertible mod 2^64


def normalised(text: str) -> tuple[str, np.ndarray]:
    """The text NFKC-normalised and case-folded, and for each of its characters the position in `text` of the
    character it came from (so that a match can be cut out of the original)."""
    whole = unicodedata.normalize("NFKC", text).casefold()
    if len(whole) == len(text):  # nearly always: one character for one (full-width → ASCII, kana as they are)
        return whole, np.arange(len(text), dtype=np.int64)
    pieces = [(m.start(), _normal_piece(m.group())) for m in CLUSTER.finditer(text)]
    lengths = np.fromiter((len(p) for _, p in pieces), dtype=np.int64, count=len(pieces))
    starts = np.fromiter((s for s, _ in pieces), dtype=np.int64, count=len(pieces))
    return "".join(p for _, p in pieces), np.repeat(starts, lengths)


@lru_cache(maxsize=1 << 14)
def _normal_piece(piece: str) -> str:
    return unicodedata.normalize("NFKC", piece).casefold()


def _powers(base: np.uint64, count: int) -> np.ndarray:
    """base^0 .. base^(count-1) modulo 2^64."""
    powers = np.full(count, base, dtype=np.uint64)
    if count:
        powers[0] = 1
    with np.errstate(over="ignore"):
        return np.cumprod(powers, dtype=np.uint64)


_INVERSE = {base: np.uint64(pow(int(base), -1, 1 << 64)) for base in (_CHAR_BASE, _WORD_BASE)}


def _span_hashes(values: np.ndarray, starts: np.ndarray, ends: np.ndarray, base: np.uint64) -> np.ndarray:
    """The polynomial hash of each run values[start:end] (sum of value[start+k] * base^k modulo 2^64): from the
    prefix sums of value[i] * base^i, each run's sum shifted down by the inverse power of its start."""
    with np.errstate(over="ignore"):
        powers = _powers(base, len(values))
        prefix = np.concatenate(([np.uint64(0)], np.cumsum(values * powers, dtype=np.uint64)))
        return (prefix[ends] - prefix[starts]) * _powers(_INVERSE[base], len(values) + 1)[starts]


def _window_hashes(values: np.ndarray, n: int, base: np.uint64) -> np.ndarray:
    """The hash of every window of `n` consecutive values (uint64), mixed (splitmix64's finaliser)."""
    count = len(values) - n + 1
    if count <= 0:
        return np.zeros(0, dtype=np.uint64)
    starts = np.arange(count)
    hashes = _span_hashes(values, starts, starts + n, base)
    with np.errstate(over="ignore"):
        hashes ^= hashes >> np.uint64(30)
        hashes *= np.uint64(0xBF58476D1CE4E5B9)
        hashes ^= hashes >> np.uint64(27)
        hashes *= np.uint64(0x94D049BB133111EB)
        hashes ^= hashes >> np.uint64(31)
    return hashes


@dataclass(frozen=True)
class Cut:
    """A text's units for one kind of n-gram: their values (code points, or word hashes) and each unit's span
    [start, end) in the original text."""

    values: np.ndarray
    starts: np.ndarray
    ends: np.ndarray


def cut_chars(text: str) -> Cut:
    """The letters and digits of the normalised text, one unit each."""
    norm, origin = normalised(text)
    keep = np.flatnonzero(np.frombuffer(NOT_LETTER.sub("\0", norm).encode("utf-32-le", "surrogatepass"),
                                        dtype=np.uint32) != 0)
    points = np.frombuffer(norm.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    starts = origin[keep]
    return Cut(points[keep].astype(np.uint64), starts, starts + 1)


def cut_words(text: str) -> Cut:
    """The words of the normalised text (\\w+), each one unit valued by the hash of its characters."""
    norm, origin = normalised(text)
    spans = [m.span() for m in WORD.finditer(norm)]
    if not spans:
        return Cut(np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    bounds = np.asarray(spans, dtype=np.int64)
    points = np.frombuffer(norm.encode("utf-32-le", "surrogatepass"), dtype=np.uint32).astype(np.uint64)
    # a word's value: the hash of its characters, its length mixed in
    words = _span_hashes(points, bounds[:, 0], bounds[:, 1], _CHAR_BASE) ^ (bounds[:, 1] - bounds[:, 0]).astype(
        np.uint64)
    ends = np.append(origin, len(text))[bounds[:, 1] - 1] + 1
    return Cut(words, origin[bounds[:, 0]], ends)


def ladder(longest: int, shortest: int) -> list[int]:
    """The n-gram sizes, longest first: each LADDER_STEP of the one above, down to `shortest`."""
    sizes = [longest]
    while (size := int(sizes[-1] * LADDER_STEP)) > shortest:
        sizes.append(size)
    return sizes + [shortest] if sizes[-1] != shortest else sizes


def size_for(length: int, sizes: list[int]) -> int | None:
    """The n-gram size for an item of `length` units: the longest of `sizes` at most half of it (one edit then
    leaves an n-gram whole), else the shortest; None when the item is shorter than that."""
    if length < sizes[-1]:
        return None
    return next((size for size in sizes if size <= length // 2), sizes[-1])


class ItemSource(Protocol):
    """Where evaluation items come from."""

    label: str  # how a config error or the manifest names the source

    def items(self) -> Iterator[tuple[str, str]]:
        """(task name, item text) pairs."""
        ...

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the items' content (files' sizes and times, a task's name and lm-eval version)."""
        ...


def strings(value: Any) -> Iterator[str]:
    """Every string inside a JSON-like value (dict values, list members), in order."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for member in value.values():
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

    def items(self) -> Iterator[tuple[str, str]]:
        with open(self.path, encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise StageInputError(f"{self.path}:{number}: not JSON ({exc.msg})") from None
                for text in strings(value):
                    yield self.path.stem, text

    def fingerprint(self) -> dict[str, Any]:
        return tree_fingerprint([self.path])


@dataclass(frozen=True)
class LineItems(JsonlItems):
    """A .txt file: each non-blank line is an item."""

    def items(self) -> Iterator[tuple[str, str]]:
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
    label: str = "lm-eval tasks"

    def items(self) -> Iterator[tuple[str, str]]:
        from gptpipe.lm_tasks import built_tasks

        tasks = built_tasks(list(self.specs), "corpus.decontamination.files: [your_task.yaml]")
        for name, task in tasks.items():
            for docs in (task.test_docs() if task.has_test_docs() else None,
                         task.validation_docs() if task.has_validation_docs() else None):
                for doc in docs or ():
                    for text in strings(doc):
                        yield name, text

    def fingerprint(self) -> dict[str, Any]:
        from gptpipe.lm_tasks import spec_name

        return {spec_name(spec): inputs for spec, inputs in zip(self.specs, self.inputs)}


def _registry_inputs(name: str) -> dict[str, Any]:
    from importlib import metadata

    return {"registry": name, "lm_eval": metadata.version("lm_eval")}


def _task_file_inputs(path: Path) -> tuple[dict, dict[str, Any]]:
    from gptpipe.lm_tasks import flatten, local_task

    task = local_task(path)
    local = [Path(f) for f in flatten((task.get("dataset_kwargs") or {}).get("data_files")) if Path(f).is_file()]
    return task, tree_fingerprint([path, *local])


FILE_KINDS = {".jsonl": JsonlItems, ".txt": LineItems}  # the other suffixes of ITEM_FILE_SUFFIXES are task YAMLs


def sources(config: DecontaminationConfig) -> list[ItemSource]:
    """The item sources of the config: its files in order, then its registry tasks and task YAMLs as one
    lm-eval source (one TaskManager for them all: indexing the registry is slow)."""
    found: list[ItemSource] = []
    specs: list[str | dict] = []
    inputs: list[dict[str, Any]] = []
    for path in config.files:
        kind = FILE_KINDS.get(Path(path).suffix)
        if kind:
            found.append(kind(Path(path)))
        else:
            task, fingerprint = _task_file_inputs(Path(path))
            specs.append(task)
            inputs.append(fingerprint)
    for name in config.tasks:
        specs.append(name)
        inputs.append(_registry_inputs(name))
    if specs:
        found.append(TaskItems(tuple(specs), tuple(inputs)))
    return found


def fingerprint(config: DecontaminationConfig) -> dict[str, Any]:
    """What stage 0's manifest records of the items (a change reruns the stage)."""
    return {"settings": {k: getattr(config, k) for k in ("word_ngram", "char_ngram", "min_word_ngram",
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
    """The n-grams of every item: per (kind, size), the sorted hashes and the item each came from."""

    tasks: list[str]
    item_task: np.ndarray  # per item: the number of its task
    previews: list[str]  # per item: its first characters, for the report and the dropped samples
    grams: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]]
    counts: dict[str, dict[str, int]]  # per task: items, items too short to look for, n-grams

    @classmethod
    def build(cls, corpus: CorpusConfig) -> Index:
        config = corpus.decontamination
        ladders = {"word": ladder(config.word_ngram, config.min_word_ngram),
                   "char": ladder(config.char_ngram, config.min_char_ngram)}
        tasks: dict[str, int] = {}
        item_task: list[int] = []
        previews: list[str] = []
        found: dict[tuple[str, int], list[tuple[np.ndarray, int]]] = {}
        counts: dict[str, dict[str, int]] = {}
        seen: set[tuple[int, str]] = set()
        for source in sources(config):
            for task, text in source.items():
                number = tasks.setdefault(task, len(tasks))
                count = counts.setdefault(task, {"items": 0, "too short": 0, "ngrams": 0})
                key = (number, text.strip())
                if key in seen or not key[1]:  # the same text twice in a task (a passage with several questions)
                    continue
                seen.add(key)
                count["items"] += 1
                kind = "char" if spaceless_share(text) >= corpus.near_dedup.spaceless_share else "word"
                cut = cut_chars(text) if kind == "char" else cut_words(text)
                size = size_for(len(cut.values), ladders[kind])
                if size is None:
                    count["too short"] += 1
                    continue
                hashes = np.unique(_window_hashes(cut.values, size, _CHAR_BASE if kind == "char" else _WORD_BASE))
                found.setdefault((kind, size), []).append((hashes, len(item_task)))
                count["ngrams"] += len(hashes)
                item_task.append(number)
                previews.append(" ".join(text.split())[:80])
        grams = {}
        for key, parts in found.items():
            hashes = np.concatenate([h for h, _ in parts])
            owners = np.concatenate([np.full(len(h), item, dtype=np.int64) for h, item in parts])
            order = np.argsort(hashes, kind="stable")
            grams[key] = (hashes[order], owners[order])
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

    def find(self, text: str) -> Overlap:
        """The items `text` shares an n-gram with, and where (spans of the original text, merged: two matches
        closer than their n-gram's length are one span, the edited part between them included)."""
        overlap = Overlap()
        if not self.grams:
            return overlap
        spans: list[tuple[int, int, int]] = []  # (start, end, size in characters of the n-gram's reach)
        hits: list[np.ndarray] = []
        cuts: dict[str, Cut] = {}
        for (kind, size), (hashes, owners) in self.grams.items():
            cut = cuts.get(kind)
            if cut is None:
                cut = cuts[kind] = cut_chars(text) if kind == "char" else cut_words(text)
            windows = _window_hashes(cut.values, size, _CHAR_BASE if kind == "char" else _WORD_BASE)
            if not len(windows):
                continue
            where = np.minimum(np.searchsorted(hashes, windows), len(hashes) - 1)
            found = np.flatnonzero(hashes[where] == windows)
            if not len(found):
                continue
            for position in found.tolist():
                at = where[position]
                # every item holding this n-gram (equal hashes sit together)
                first = np.searchsorted(hashes, hashes[at], side="left")
                last = np.searchsorted(hashes, hashes[at], side="right")
                hits.append(owners[first:last])
                start, end = int(cut.starts[position]), int(cut.ends[position + size - 1])
                spans.append((start, end, end - start))
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
        with atomic_path(path) as tmp, open(tmp, "wb") as fh:
            pickle.dump(self, fh, protocol=pickle.HIGHEST_PROTOCOL)


@lru_cache(maxsize=2)
def load(path: Path, mtime_ns: int) -> Index:
    """The index a driver saved (once per worker process and file version)."""
    with open(path, "rb") as fh:
        return pickle.load(fh)


def _with_punctuation(text: str, start: int, end: int) -> tuple[int, int]:
    """A span widened over the punctuation around it on its lines (a quote's 「」, its last 。 or period, a
    command's `$ `, a re-spaced quote's brackets), not over the spaces at the new edges."""
    low, high = start, end
    while low > 0 and not text[low - 1].isalnum() and text[low - 1] != "\n":
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
