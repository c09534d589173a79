"""jsonl records → texts, the same way in every stage, and the reasons a record gives none.

Stages 0, 1 and 2 read a line with :func:`record_text` (stage 0 also whole .json arrays and dataset rows with
:func:`object_text`); stage 7 reads its rows with :func:`parse_record` and :func:`field_text`. A line that
cannot be used is skipped and counted by reason (the constants below) in a :class:`Reasons`, with file:line
examples; a stage fails only when nothing usable is left.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from typing import Any
from collections.abc import Mapping

import orjson

from gptpipe.log import get_logger

BLANK = "blank line"  # only whitespace
UNDECODABLE = "undecodable utf-8"
INVALID_JSON = "invalid json"
LONE_SURROGATE = "lone surrogate"  # JSON with lone surrogate escapes (\ud800): no text sentencepiece can encode
NOT_AN_OBJECT = "not an object"  # JSON, but not an object
MISSING_KEY = "missing key"  # the object has no text key
NOT_A_STRING = "not a string"  # the text key holds a number, list, null, ...
EMPTY = "empty"  # the text is "" (also after removing NULs)
TOO_LONG = "too long"  # over the stage's character limit; stage 7: a row over train.seq_len tokens
WRONG_COLUMNS = "wrong column count"  # stage 7's TSV: a line that is not input<TAB>label
NOT_A_MESSAGE_LIST = "not a message list"  # stage 7's chat rows: `messages` is not a list of objects
UNKNOWN_ROLE = "unknown role"  # a turn whose role is not system, user or assistant
NO_ASSISTANT_TURN = "no assistant turn"  # nothing for the model to learn to answer
TEMPLATE_ERROR = "template error"  # the chat template raised on the row (e.g. roles that do not alternate)
NO_CHOSEN = "no chosen answer"  # stage 7's preference rows: `chosen` missing, null or no turn: nothing preferred
IDENTICAL_ANSWERS = "identical answers"  # a preference row whose chosen and rejected answers are the same
# Repairs, counted for records that are kept: NULs (binary junk, broken extraction) are removed, and stage 7
# cuts an input that does not fit train.seq_len.
NUL_STRIPPED = "nul stripped"
CUT_TO_FIT = "cut to fit"
REPAIRS = (NUL_STRIPPED, CUT_TO_FIT)
NO_LIMIT = sys.maxsize
# Documents longer than this many characters are refused by every stage's default (stage 0's max_chars, stage 2's
# max_document_chars); it also bounds what a line may hold when the user sets no limit.
DEFAULT_MAX_CHARS = 1_000_000


def max_line_bytes(max_chars: int | None) -> int:
    """The longest jsonl line a stage reads (a longer one is dropped as too long, never held whole in memory):
    12 bytes per character is JSON's worst case (a \\uXXXX\\uXXXX pair), plus room for the other keys."""
    return 12 * (max_chars or DEFAULT_MAX_CHARS) + (64 << 10)
EXAMPLES_PER_REASON = 5

_MISSING = object()


def record_text(line: bytes | None, text_key: str, max_chars: int = NO_LIMIT,
                max_line_bytes: int = NO_LIMIT) -> tuple[str | None, str | None]:
    """(text or None, reason or None): the document in one jsonl line, or why there is none (or what was
    repaired). ``line`` is None for a line too long to have been read whole; a trailing newline is fine."""
    # The length test also applies to lines that happened to be read whole, so stage 2's outcome never
    # depends on where its blocks and ranges were cut.
    if line is None or len(line) > max_line_bytes:
        return None, TOO_LONG
    try:
        return object_text(orjson.loads(line), text_key, max_chars)  # also rejects bad UTF-8, lone surrogates
    except orjson.JSONDecodeError:
        return _record_text_slowly(line, text_key, max_chars)


def object_text(obj: Any, text_key: str, max_chars: int = NO_LIMIT) -> tuple[str | None, str | None]:
    """(text or None, reason or None) of one parsed record."""
    if not isinstance(obj, dict):
        return None, NOT_AN_OBJECT
    text = obj.get(text_key, _MISSING)
    if text is _MISSING:
        return None, MISSING_KEY
    if not isinstance(text, str):
        return None, NOT_A_STRING
    if len(text) > max_chars:
        return None, TOO_LONG
    reason = None
    if "\x00" in text:
        text, reason = text.replace("\x00", ""), NUL_STRIPPED
    if not text:
        return None, EMPTY
    return text, reason


def _record_text_slowly(line: bytes, text_key: str, max_chars: int) -> tuple[str | None, str | None]:
    """The rare lines orjson refuses: name the problem, or accept what the stdlib reads (BOM, NaN, 1e400)."""
    obj, reason = _parse_slowly(line)
    if reason:
        return None, reason
    return field_text(obj, text_key, max_chars)


def parse_record(line: bytes) -> tuple[Any, str | None]:
    """(the JSON value of one jsonl line, None) or (None, the reason it has none)."""
    try:
        return orjson.loads(line), None
    except orjson.JSONDecodeError:
        return _parse_slowly(line)


def _parse_slowly(line: bytes) -> tuple[Any, str | None]:
    if not line.strip():
        return None, BLANK
    try:
        decoded = line.decode("utf-8-sig")
    except UnicodeDecodeError:
        return None, UNDECODABLE
    try:
        return json.loads(decoded), None
    except ValueError:
        return None, INVALID_JSON


def field_text(obj: Any, key: str, max_chars: int = NO_LIMIT) -> tuple[str | None, str | None]:
    """:func:`object_text`, and a text with lone surrogates (which only the stdlib parser lets through)
    refused: no tokenizer can encode it."""
    text, reason = object_text(obj, key, max_chars)
    if text is not None:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return None, LONE_SURROGATE
    return text, reason


class Reasons:
    """Skipped (and repaired) records counted by reason, with the first few places of each.

    A place is "file:line"; inside a stage-2 worker it is the line number within its byte range, made
    "file:line" by the main process (data/ranges.py LineNumbers) before the workers' counts are merged.
    """

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, list[Any]] = {}

    def add(self, reason: str, where: Any) -> None:
        self.counts[reason] += 1
        examples = self.examples.setdefault(reason, [])
        if len(examples) < EXAMPLES_PER_REASON:
            examples.append(where)

    def merge(self, counts: Mapping[str, int], examples: Mapping[str, list[Any]]) -> None:
        """Add another part's counts (a worker's range, a shard's manifest); examples stay in input order."""
        self.counts.update(counts)
        for reason, where in examples.items():
            kept = self.examples.setdefault(reason, [])
            kept.extend(where[:EXAMPLES_PER_REASON - len(kept)])

    def merge_manifest(self, counts: Mapping[str, Any]) -> None:
        """Add the reasons a stage's manifest counts hold (see :meth:`manifest_counts`)."""
        self.merge({**counts["skipped"], **counts["repaired"]}, counts["examples"])

    @property
    def skipped(self) -> int:
        return sum(n for reason, n in self.counts.items() if reason not in REPAIRS)

    def manifest_counts(self) -> dict[str, Any]:
        """The manifest's "skipped", "repaired" and "examples" counts, the same in every stage."""
        return {"skipped": {r: n for r, n in sorted(self.counts.items()) if r not in REPAIRS},
                "repaired": {r: n for r, n in sorted(self.counts.items()) if r in REPAIRS},
                "examples": dict(self.examples)}

    def summary(self) -> str:
        return ", ".join(f"{reason}: {n:,}" for reason, n in self.counts.most_common())

    def lines(self) -> str:
        """One console line per reason with its examples; empty when nothing was skipped or repaired."""
        return "\n".join(f"  {n:,} {'kept, ' + reason if reason in REPAIRS else 'skipped: ' + reason} "
                         f"(e.g. {'; '.join(map(str, self.examples.get(reason, [])))})"
                         for reason, n in self.counts.most_common())

    def report(self, stage: str, lines: int) -> None:
        for reason, n in self.counts.most_common():
            what = "kept, repaired" if reason in REPAIRS else "skipped"
            get_logger(stage).info(f"  {reason}: {n:,} line(s) {what}, e.g. "
                                   f"{', '.join(map(str, self.examples.get(reason, [])))}")
        if self.skipped:
            get_logger(stage).info(f"skipped {self.skipped:,} of {lines:,} lines; every other line became a document")
