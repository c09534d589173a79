"""Roff man pages (man and mdoc macros) → plain text with groff, the formatter man(1) uses: the offline
Japanese demo corpus. docs/benchmarks.md compares it with the hand-written converter it replaced."""

from __future__ import annotations

import gzip
import os
import re
import subprocess
from pathlib import Path

from gptpipe.stage import StageInputError

# One paragraph must come out as one line, so the line length is huge (-rLL); then the page header and footer
# would span it, and so would centred or boxed tables. The header and footer are the only three-part titles
# (.tl) that man and mdoc print: before the page, .tl becomes a macro that prints nothing.
_BEFORE = r""".de tl
..
"""
# Right after the page's .TH (man) or .Dd (mdoc) line, where -mandoc has just loaded that macro package: one
# space ends a sentence (.ss), not two; tables get a terminal's width (the length before the table is kept in a
# register: tbl's own code changes the line length too).
_AFTER_TITLE = r""".ss 12 0
.am1 TS
.nr gptpipe-ll \\n[.l]
.ll 78n
..
.am1 TE
.ll \\n[gptpipe-ll]u
..
"""
_FIRST_TITLE = re.compile(r"^\.\s*(TH|Dd)\b.*\n?", re.MULTILINE)
# UTF-8 in and out, tables (tbl), no hyphenation, no bold/underline overstrikes.
_GROFF = ["groff", "-Tutf8", "-Kutf8", "-t", "-mandoc", "-rLL=10000n", "-rHY=0", "-P-c", "-P-b", "-P-u", "-"]
_ALIAS = re.compile(r"^\.so\s", re.MULTILINE)
# groff turns every line break of filled text into a space, but Japanese puts none between its characters
# (hiragana, katakana, CJK ideographs and punctuation, full-width forms: all from U+2E80 on).
_WIDE_SPACE_WIDE = re.compile(r"(?<=[\u2e80-\U0010ffff]) (?=[\u2e80-\U0010ffff])")
TIMEOUT_S = 60
MAX_INDENT = 200


class GroffError(RuntimeError):
    """groff could not format one page; the message says how it failed."""


def formatter_version() -> str:
    """groff's version line: man pages are re-formatted (stage 0 reruns) when it changes."""
    try:
        done = subprocess.run(["groff", "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "groff not found"
    return done.stdout.splitlines()[0] if done.stdout else "groff (unknown version)"


def roff_to_text(source: str, page: str = "<page>") -> str:
    """Plain text of one man page's roff source ('' when it is only an alias: `.so other.1`).

    Paragraphs are single lines, hyphenation is off, the body indentation is removed (deeper indents keep
    their extra spaces), no space stands between two Japanese characters, runs of blank lines become one.
    Raises GroffError when groff fails on the page, StageInputError (naming `page`) when groff is missing."""
    if _ALIAS.search(source):
        return ""
    title = _FIRST_TITLE.search(source)
    head, rest = (source[:title.end()], source[title.end():]) if title else ("", source)
    if head and not head.endswith("\n"):
        head += "\n"
    lines_before = head.count("\n")  # .lf: groff's warnings keep the page's line numbers
    text = f"{_BEFORE}.lf 1\n{head}{_AFTER_TITLE}.lf {lines_before + 1}\n{rest}"
    try:
        done = subprocess.run(_GROFF, input=text.encode("utf-8"), capture_output=True,
                              env={**os.environ, "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8"}, timeout=TIMEOUT_S)
    except FileNotFoundError:
        raise StageInputError(f"{page}: man pages are formatted with groff, which is not installed "
                              "(apt-get install groff-base)") from None
    except subprocess.TimeoutExpired:
        raise GroffError(f"groff timed out ({TIMEOUT_S} s)") from None
    if done.returncode != 0:
        raise GroffError(f"groff failed (exit {done.returncode})")
    return _tidy(done.stdout.decode("utf-8", errors="replace"))


def _tidy(formatted: str) -> str:
    lines = [line.rstrip() for line in formatted.splitlines()]
    indents = [len(line) - len(line.lstrip(" ")) for line in lines]
    # The body indentation is that of the first indented line: the text under the first heading. A line
    # indented beyond a terminal's width was centred (.ce) on the huge line: it starts at its text.
    body = next((n for n in indents if 0 < n <= MAX_INDENT), 0)
    lines = [line[n if n > MAX_INDENT else min(body, n):] for line, n in zip(lines, indents)]
    text = re.sub(".\x08", "", "\n".join(lines))  # overstruck characters (\o, \b): keep the last, as col -b does
    text = _WIDE_SPACE_WIDE.sub("", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def read_manpage(path: Path) -> str:
    """Decode a (possibly gzipped) man page; Japanese pages are UTF-8, a few old ones EUC-JP."""
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    for encoding in ("utf-8", "euc_jp"):
        try:
            return data.decode(encoding)
        except UnicodeDecodeError:
            continue
    raise UnicodeDecodeError("utf-8", data, 0, 1, f"{path}: neither UTF-8 nor EUC-JP")


def find_manpages(root: Path) -> list[Path]:
    """Every page file under root's man*/ sections, in a stable order; symlinks are aliases of a page."""
    return sorted(p for p in root.glob("man*/*") if p.is_file() and not p.is_symlink())
