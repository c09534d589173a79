"""Training text for SentencePiece with bounded host RAM: held-out documents and a reservoir sample of lines.

The original pipeline loaded the whole corpus into the trainer (6 GB of text took ~30 GB of RAM). Here the
corpus (one or more jsonl files, taken as one stream) is read twice: a byte scan counts documents (and
estimates lines) so held-out documents can be drawn up front, then every line of every other document goes
through reservoir sampling, so at most ``input_sentence_size`` lines are ever held, whatever the corpus
size. Documents are split on newlines (the newline is a user-defined piece, never learned), and lines
longer than ``max_sentence_length`` bytes are cut, because SentencePiece silently skips longer sentences.
jsonl records that hold no document are skipped and counted by reason, as in stages 0 and 2.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable, Iterator

from tqdm import tqdm

from gptpipe.data.jsonl import Reasons, max_line_bytes, record_text
from gptpipe.data.ranges import capped_lines
from gptpipe.stage import StageInputError

READ_CHUNK = 1 << 24
TEXT_KEY = "text"  # the key stage 0 writes, and the original pipeline's
RECORD_FRAMING = len(json.dumps({TEXT_KEY: ""}) + "\n")  # bytes of a bare {"text": ...} record that are not its text
UTF8_CONTINUATION = bytes(range(0x80, 0xC0))  # every other byte starts a character


@dataclass
class CorpusScan:
    """What one fast byte pass over the jsonl tells before any parsing."""

    documents: int  # jsonl lines, bad ones included
    lines_estimate: int  # non-empty lines (what sampling counts): documents + escaped newlines - empty lines
    bytes: int
    text_bytes_estimate: int  # UTF-8 bytes of those lines: the file less each record's JSON and the newlines
    text_chars_estimate: int  # their characters: the same, counting UTF-8 lead bytes only


@dataclass
class Sample:
    """What was written for training, and the documents kept out of it."""

    lines: int = 0  # training lines written (after cutting long ones)
    bytes: int = 0  # their UTF-8 size, before any morpheme pre-splitting
    chars: int = 0  # their characters (SentencePiece's memory grows with both)
    lines_seen: int = 0  # lines of the training documents, all of which had an equal chance
    lines_cut: int = 0  # lines longer than max_sentence_length bytes, cut into several
    training_documents: int = 0
    heldout: list[str] = field(default_factory=list)
    reasons: Reasons = field(default_factory=Reasons)  # the jsonl lines skipped (or repaired), by reason


def scan_corpus(files: list[Path]) -> CorpusScan:
    """Count documents (jsonl lines) and estimate their non-empty text lines and text bytes at disk speed:
    each escaped "\\n" starts one more line, an empty one when it follows another "\\n" (sampling skips those:
    a third of the man pages' lines are blank). Other escapes (quotes, backslashes) are rare enough to ignore."""
    documents = escaped_newlines = empty_lines = size = continuation_bytes = framing = 0
    with tqdm(total=sum(p.stat().st_size for p in files), unit="B", unit_scale=True,
              desc="stage 1: scanning corpus", mininterval=1.0) as bar:
        for path in files:
            last, before = b"\n", documents
            with open(path, "rb") as fh:
                per_record = _framing(fh.readline(READ_CHUNK))
                fh.seek(0)
                while chunk := fh.read(READ_CHUNK):
                    documents += chunk.count(b"\n")
                    escaped_newlines += chunk.count(b"\\n")
                    size += len(chunk)
                    continuation_bytes += len(chunk) - len(chunk.translate(None, UTF8_CONTINUATION))
                    last = chunk[-1:]
                    bar.update(len(chunk))
                    # A run of k newlines holds k - 1 empty lines: non-overlapping pairs plus triples count that
                    # exactly up to k = 4 (and k = 6), at the speed of a count; longer runs are rare.
                    empty_lines += chunk.count(b"\\n\\n") + chunk.count(b"\\n\\n\\n")
            documents += last != b"\n"  # a last line without its newline
            framing += (documents - before) * per_record
    # An escaped newline is 2 bytes, and sampled lines exclude it.
    text_bytes = max(0, size - framing - 2 * escaped_newlines)
    return CorpusScan(documents, documents + escaped_newlines - empty_lines, size, text_bytes,
                      max(0, text_bytes - continuation_bytes))


def _framing(line: bytes) -> int:
    """The bytes of a file's records that are not their text, as its first record has them (stage 0's carry
    their source and origin too; a user's may hold other fields), else a bare {"text": ...} record's."""
    try:
        record = json.loads(line)
        text = record[TEXT_KEY]
        return max(0, len(line.rstrip(b"\n")) + 1 - len(json.dumps(text, ensure_ascii=False).encode()) + 2)
    except (ValueError, TypeError, KeyError):
        return RECORD_FRAMING


def cut_utf8(line: str, max_bytes: int) -> list[str]:
    """``line`` as pieces of at most ``max_bytes`` UTF-8 bytes, cut between characters."""
    data = line.encode("utf-8")
    if len(data) <= max_bytes:
        return [line]
    pieces = []
    while data:
        end = min(max_bytes, len(data))
        while end < len(data) and data[end] & 0xC0 == 0x80:  # never split a multi-byte character
            end -= 1
        pieces.append(data[:end].decode("utf-8"))
        data = data[end:]
    return pieces


def _documents(files: list[Path], bar: tqdm, reasons: Reasons) -> Iterator[tuple[int, str]]:
    """(line number across all files, text) of every document; lines holding none are counted in ``reasons``."""
    number, cap = 0, max_line_bytes(None)  # a longer line is counted as too long, never held whole
    for path in files:
        with open(path, "rb") as fh:
            for line_in_file, raw in enumerate(capped_lines(fh, cap), start=1):
                number += 1
                bar.update(len(raw or b"") + 1)
                text, reason = record_text(raw, TEXT_KEY, max_line_bytes=cap)
                if reason:
                    reasons.add(reason, f"{path}:{line_in_file}")
                if text is not None:
                    yield number, text


def sample_corpus(files: list[Path], scan: CorpusScan, out_path: Path, size: int, max_bytes: int,
                  heldout_documents: int, seed: int, presplit: Callable[[str], str] | None = None) -> Sample:
    """Hold out ``heldout_documents`` random documents, reservoir-sample ``size`` lines of the rest into
    ``out_path`` (one per line), pre-split by ``presplit`` when given. Returns the counts and held-out texts."""
    rng = random.Random(seed)
    heldout_lines = set(rng.sample(range(1, scan.documents + 1), min(heldout_documents, scan.documents)))
    sample = Sample()
    reservoir: list[str] = []
    with tqdm(total=scan.bytes, unit="B", unit_scale=True, desc="stage 1: sampling lines", mininterval=1.0) as bar:
        for number, text in _documents(files, bar, sample.reasons):
            if number in heldout_lines:
                sample.heldout.append(text)
                continue
            sample.training_documents += 1
            for line in text.split("\n"):
                if not line:
                    continue
                pieces = cut_utf8(line, max_bytes)
                sample.lines_cut += len(pieces) > 1
                for piece in pieces:
                    # Algorithm R: after n lines, each has had the same chance size/n to be in the reservoir.
                    sample.lines_seen += 1
                    if len(reservoir) < size:
                        reservoir.append(piece)
                    else:
                        slot = rng.randrange(sample.lines_seen)
                        if slot < size:
                            reservoir[slot] = piece
    if not reservoir:
        skipped = f"; skipped lines: {sample.reasons.summary()}" if sample.reasons.counts else ""
        raise StageInputError(f"{', '.join(map(str, files))}: no training text left after holding out "
                              f"{len(sample.heldout)} documents{skipped}")
    lines = tqdm(reservoir, desc="stage 1: morpheme split" if presplit else "stage 1: writing sample",
                 unit=" line", mininterval=1.0)
    with open(out_path, "w", encoding="utf-8") as out:
        for line in lines:
            sample.bytes += len(line.encode("utf-8"))
            sample.chars += len(line)
            out.write((presplit(line) if presplit else line) + "\n")
    sample.lines = len(reservoir)
    return sample
