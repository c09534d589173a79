"""Roff man pages (man and mdoc macros) → plain text: the offline Japanese demo corpus.

Not a typesetter: it keeps the words a reader sees (headings, paragraphs, option tags, table cells,
examples) and drops formatting. Filled text lines are joined with a space, except between two
non-ASCII characters, where Japanese needs none.
"""

from __future__ import annotations

import gzip
import re
from pathlib import Path

# Named glyphs that occur in the pages; any other \(xx or \[name] escape is dropped.
_GLYPHS = {
    "em": "—", "en": "–", "hy": "-", "bu": "•", "aq": "'", "dq": '"', "lq": "“", "rq": "”", "oq": "‘",
    "cq": "’", "co": "©", "rg": "®", "tm": "™", "mu": "×", "di": "÷", "+-": "±", "<=": "≤", ">=": "≥",
    "!=": "≠", "->": "→", "<-": "←", "de": "°", "ti": "~", "ha": "^", "rs": "\\", "sl": "/", "ba": "|",
    "at": "@", "sh": "#", "Do": "$", "lB": "[", "rB": "]", "lC": "{", "rC": "}", "ga": "`", "aa": "´",
    "fm": "′", "sc": "§", "ps": "¶", "pl": "+", "mi": "−", "eq": "=", "**": "∗", "ua": "↑", "da": "↓",
}
_STRINGS = {"lq": "“", "rq": "”", "R": "®", "Tm": "™", "Lq": "“", "Rq": "”"}
_ESCAPE = re.compile(
    r"""\\(?:
        \((?P<glyph2>..)                # \(xx glyph
      | \[(?P<glyphn>[^\]]*)\]          # \[name] glyph
      | \*(?:\((?P<str2>..)|\[(?P<strn>[^\]]*)\]|(?P<str1>.))   # \*x strings
      | f(?:\(..|\[[^\]]*\]|.)          # font change
      | s[-+]?(?:\(..|\[[^\]]*\]|\d\d?)  # size change
      | n(?:\(..|\[[^\]]*\]|.)          # number register
      | [hvwlLDoxHSRZbkz]'[^']*'        # motions and other quoted-argument escapes
      | (?P<char>.)                     # everything else: one character
    )""",
    re.VERBOSE,
)
_SINGLE = {"-": "-", "e": "\\", "\\": "\\", " ": " ", "~": " ", "0": " ", "t": "\t", ".": ".", "'": "'",
           "`": "`", '"': ""}
# mdoc macros that render as nothing themselves inside a line (their arguments are kept).
_MDOC_INLINE = {"Ar", "Cm", "Dv", "Em", "Er", "Ev", "Fa", "Fl", "Fn", "Ft", "Ic", "Li", "Nm", "Pa", "Sy",
                "Va", "Xr", "Op", "Oo", "Oc", "Dq", "Do", "Dc", "Ql", "Qq", "Sq", "Pq", "Aq", "Bq", "Brq",
                "Ns", "No", "Tn", "Ux", "At", "Bx", "Ad", "Cd", "Ms", "Lk", "Mt", "Pf"}
_PARAGRAPH = {"PP", "LP", "P", "Pp", "sp", "Sp", "IP", "TP", "HP", "Lp", "It", "br", "Bd", "Ed", "Bl", "El"}
_HEADING = {"SH", "SS", "Sh", "Ss"}
_FONT_ALTERNATING = {"BR", "BI", "IB", "IR", "RB", "RI"}
_FONT_WHOLE = {"B", "I", "SM", "SB", "Nd", "Dt"} | _MDOC_INLINE
_NO_FILL_START = {"nf", "EX", "Vb", "Bd"}
_NO_FILL_END = {"fi", "EE", "Ve", "Ed"}


def unescape(text: str) -> str:
    """Replace roff escapes by the characters they print (or nothing)."""
    if "\\" not in text:
        return text
    text = text.split('\\"', 1)[0]  # an in-line comment runs to the end of the line

    def replace(m: re.Match) -> str:
        if m.group("glyph2") is not None:
            return _GLYPHS.get(m.group("glyph2"), "")
        if m.group("glyphn") is not None:
            return _GLYPHS.get(m.group("glyphn"), "")
        name = m.group("str2") or m.group("strn") or m.group("str1")
        if name is not None:
            return _STRINGS.get(name, "")
        if m.group("char") is not None:
            return _SINGLE.get(m.group("char"), "")
        return ""

    return _ESCAPE.sub(replace, text)


def _split_args(rest: str) -> list[str]:
    """Macro arguments: space-separated, double quotes group words; ``\\\\`` reads as ``\\`` (copy mode)."""
    return [(m.group(1) if m.group(1) is not None else m.group(2)).replace("\\\\", "\\")
            for m in re.finditer(r'"((?:[^"]|"")*)"|((?:\\.|[^\s\\]|\\$)+)', rest)]  # "\ " does not split


def _is_wide(ch: str) -> bool:
    return ord(ch) > 0x2E7F  # CJK and beyond: no space when joining filled lines


class _Text:
    """Accumulates output lines, joining filled text the way a reader expects."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.current = ""

    def add(self, words: str, fill: bool) -> None:
        words = words.strip() if fill else words.rstrip()
        if not words:
            if not fill:
                self.flush()
                self.lines.append("")
            return
        if not fill:
            self.flush()
            self.lines.append(words)
        elif not self.current:
            self.current = words
        elif _is_wide(self.current[-1]) and _is_wide(words[0]):
            self.current += words
        else:
            self.current += " " + words

    def flush(self) -> None:
        if self.current:
            self.lines.append(self.current)
            self.current = ""

    def paragraph(self) -> None:
        self.flush()
        if self.lines and self.lines[-1] != "":
            self.lines.append("")

    def text(self) -> str:
        self.flush()
        out = "\n".join(self.lines)
        return re.sub(r"\n{3,}", "\n\n", out).strip()


def roff_to_text(source: str) -> str:
    """Plain text of one man page's roff source ('' when it is only an alias: `.so other.1`)."""
    out = _Text()
    fill = True
    in_table = in_table_format = False
    tag_next = False  # .TP: the next line is the tag, which stands on its own line
    skip_until: str | None = None
    for raw in source.splitlines():
        if skip_until is not None:
            if raw.strip() == skip_until:
                skip_until = None
            continue
        if raw.startswith((".\\\"", "'\\\"", '.\\"', "\\\"")) or raw.strip() in (".", "'"):
            continue
        if raw.startswith((".", "'")):
            macro, _, rest = raw[1:].strip().partition(" ")
            args = _split_args(rest)
            if macro == "so":
                return ""
            if macro in ("de", "ig", "am"):
                skip_until = ".."
            elif macro == "TS":
                in_table = in_table_format = True
                out.paragraph()
            elif macro == "TE":
                in_table = False
                out.paragraph()
            elif macro in _HEADING:
                out.paragraph()
                out.add(unescape(" ".join(args)), fill=False)
            elif macro in _FONT_ALTERNATING:
                out.add(unescape("".join(args)), fill)
                if tag_next:
                    out.flush()
                    tag_next = False
            elif macro in _FONT_WHOLE:
                words = [a for a in args if a not in _MDOC_INLINE]
                if macro == "Fl":
                    words = ["-" + w for w in words] or ["-"]
                out.add(unescape(" ".join(words)), fill)
                if tag_next:
                    out.flush()
                    tag_next = False
            elif macro in _PARAGRAPH:
                if macro in ("br",):
                    out.flush()
                else:
                    out.paragraph()
                tag_next = macro == "TP"
                tag = [a for a in args if a not in _MDOC_INLINE and not a.startswith("-")]
                if macro in ("IP", "It") and tag:
                    out.add(unescape(" ".join(tag[:1] if macro == "IP" else tag)), fill)
                    out.flush()
            elif macro in _NO_FILL_START:
                out.flush()
                fill = False
            elif macro in _NO_FILL_END:
                fill = True
            continue  # every other request only formats
        if in_table:
            if in_table_format:  # format lines end with '.'; options end with ';'
                if raw.rstrip().endswith("."):
                    in_table_format = False
                continue
            cells = [unescape(c).strip() for c in raw.split("\t")]
            out.add("  ".join(c for c in cells if c and c not in ("_", "=", "T{", "T}")), fill=False)
            continue
        out.add(unescape(raw), fill)
        if tag_next:
            out.flush()
            tag_next = False
    return out.text()


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
