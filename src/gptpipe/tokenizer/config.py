"""Stage 1 settings: sentence_piece_config.yaml (flat keys, as in the original pipeline)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gptpipe.config.core import option
from gptpipe.tokenizer import charsets


@dataclass
class TokenizerConfig:
    """Stage 1: train a SentencePiece tokenizer and export it as a HuggingFace fast tokenizer; or, for continued
    pretraining, extend a base model's tokenizer with pieces learned on the corpus (base_tokenizer)."""

    input: Path | list[Path] = option(
        Path("data/corpus"), "training text: jsonl file(s) with a \"text\" string per line, e.g. the stage-0 "
        "output folder (the corpus files its manifest lists) or your own; a path, a list of paths, or glob "
        "patterns (data/*.jsonl)")
    output_dir: Path = option(Path("tokenizers/ja_32k"), "folder for tokenizer.model/.vocab, hf/ and the manifest")
    model_prefix: str = option("tokenizer", "file name stem of the .model/.vocab files")
    vocab_size: int = option(32000, "number of pieces, special tokens included")
    model_type: Literal["unigram", "bpe"] = option(
        "unigram", "SentencePiece algorithm: unigram gave ~2% fewer bits per character on the man pages; bpe's "
        "GGUF tokenizes every text as transformers in llama.cpp, unigram's every text whose characters all have "
        "pieces (see character_coverage; docs/benchmarks.md)")
    character_coverage: float = option(
        0.9999, "share of the sample's characters covered by pieces; the rest byte-fall-back, which llama.cpp's "
        "unigram tokenizer lacks: its GGUF misread 2-7% of held-out 300-character passages at 0.9995, 1-1.6% at "
        "0.9999 and about as many at 1.0 (characters the sample never held: character_sets covers those); 1.0 "
        "would give every character of the sample a piece, thousands of rare ones on web text")
    character_sets: list[str] = option(
        factory=lambda: [charsets.AUTO],
        doc="characters that get a piece each even when the sample lacks them, so that a unigram GGUF reads them "
        "in llama.cpp (no <unk>): basic (ASCII, Latin-1, punctuation, 225), ja (kana, symbols and JIS level-1 "
        "kanji, 3,489), ja-level2, ko (2,350 Hangul), zh-hans, zh-hant; auto takes basic and each set whose "
        "script is at least 0.5% of the sample, when it fits a quarter of vocab_size (the manifest says which); "
        "[] for none")
    normalization: Literal["identity", "nfkc", "nmt_nfkc"] = option(
        "identity", "text normalization; identity round-trips Japanese exactly (decode(encode(x)) == x)")
    byte_fallback: bool = option(True, "encode unknown characters as UTF-8 bytes instead of <unk>")
    split_digits: bool = option(True, "every digit is its own piece")
    allow_whitespace_only_pieces: bool = option(True, "pieces made only of spaces are allowed (code, tables)")
    max_sentencepiece_length: int = option(16, "longest piece in characters (llm-jp uses 8 for Japanese)")
    user_defined_symbols: list[str] = option(
        factory=lambda: ["<CLS>", "<SEP>", "<EOD>", "<MASK>", "\n"],
        doc="pieces always kept whole; the newline piece lets documents keep their lines")
    input_sentence_size: int = option(
        3_000_000, "lines sampled (reservoir, so RAM stays bounded at any corpus size) to train on")
    max_sentence_length: int = option(16384, "longer lines are cut into pieces of this many bytes for training")
    num_threads: int = option(0, "training threads (0: all cores)")
    train_extremely_large_corpus: bool = option(
        False, "accepted from the original pipeline's YAML; sentencepiece >= 0.2 ignores it "
        "(host RAM is bounded by input_sentence_size instead)")
    pretokenize: Literal["none", "morpheme"] = option(
        "none", "morpheme: pre-split Japanese with fugashi+unidic-lite (extra [ja]) so pieces never cross "
        "morpheme boundaries; the tokenizer still encodes raw text without the analyzer")
    base_tokenizer: Path | None = option(
        None, "a base model's HF folder (tokenizer.json, or tokenizer.model beside tokenizer_config.json): extend "
        "its tokenizer with new_pieces pieces learned on input instead of training one (continued pretraining; "
        "byte-level or SentencePiece-style BPE). Writes <output_dir>/hf, for tokenize.tokenizer_dir, and "
        "new_pieces.jsonl; the SentencePiece keys above are not used")
    new_pieces: int = option(
        8000, "with base_tokenizer: pieces added after the base's ids, learned with the base's own BPE (characters "
              "the base lacks first, then merges, most frequent first); fewer when no pair of tokens occurs twice "
              "more in the sample")
    heldout_documents: int = option(200, "documents kept out of training to verify SP==HF ids and measure compression")
    seed: int = option(1234, "seed for sampling lines and picking held-out documents")

    def check(self) -> list[tuple[str, str]]:
        problems = []
        if not 100 <= self.vocab_size <= 1_000_000:
            problems.append(("vocab_size", f"must be between 100 and 1,000,000, got {self.vocab_size}"))
        if not 0.9 <= self.character_coverage <= 1.0:
            problems.append(("character_coverage", "must be between 0.9 and 1.0"))
        unknown = [name for name in self.character_sets if name not in charsets.NAMES]
        if unknown:
            problems.append(("character_sets", f"unknown {', '.join(unknown)}; known: {', '.join(charsets.NAMES)}"))
        else:
            named = charsets.choose([n for n in self.character_sets if n != charsets.AUTO], {}, self.vocab_size)
            if len(named.characters) > self.vocab_size // 2:
                problems.append(("character_sets", f"{len(named.characters):,} characters need more than half of "
                                 f"vocab_size {self.vocab_size:,}: raise vocab_size or drop a set"))
        if self.input_sentence_size < 1000:
            problems.append(("input_sentence_size", "must be at least 1000"))
        if self.num_threads < 0:
            problems.append(("num_threads", "must be >= 0"))
        if self.model_type == "bpe" and self.vocab_size > 300_000:
            problems.append(("vocab_size", "BPE training above 300k pieces is impractically slow"))
        if self.normalization != "identity" and not self.byte_fallback:
            problems.append(("byte_fallback", "needed with a normalizing tokenizer to export identical HF ids"))
        if len(set(self.user_defined_symbols)) != len(self.user_defined_symbols):
            problems.append(("user_defined_symbols", "contains duplicates"))
        reserved = sorted(set(self.user_defined_symbols) & {"<unk>", "<s>", "</s>", "<pad>"})
        if reserved:
            problems.append(("user_defined_symbols", f"{', '.join(reserved)} already have fixed ids "
                             "(unk=0, bos=1, eos=2, pad=3); remove them from the list"))
        if any(not s or "," in s for s in self.user_defined_symbols):
            problems.append(("user_defined_symbols", "symbols must be non-empty and contain no comma "
                             "(SentencePiece reads the list comma-separated)"))
        fixed = 4 + len(self.user_defined_symbols) + (256 if self.byte_fallback else 0)
        if self.vocab_size <= fixed:
            problems.append(("vocab_size", f"must exceed the {fixed} fixed pieces (4 special, "
                             f"{len(self.user_defined_symbols)} user-defined"
                             + (", 256 byte-fallback)" if self.byte_fallback else ")")))
        if self.max_sentence_length < 256:
            problems.append(("max_sentence_length", "must be at least 256 bytes"))
        if self.base_tokenizer is not None and self.new_pieces < 1:
            problems.append(("new_pieces", "must be at least 1 to extend base_tokenizer"))
        if self.heldout_documents < 1:
            problems.append(("heldout_documents", "must be at least 1: the export is verified on them"))
        return problems
