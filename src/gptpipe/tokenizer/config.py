"""Stage 1 settings: sentence_piece_config.yaml (flat keys, as in the original pipeline)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gptpipe.config.core import option


@dataclass
class TokenizerConfig:
    """Stage 1: train a SentencePiece tokenizer and export it as a HuggingFace fast tokenizer."""

    input: Path = option(Path("data/corpus/corpus.jsonl"), "training text: the stage-0 corpus (jsonl)")
    output_dir: Path = option(Path("tokenizers/ja_32k"), "folder for tokenizer.model/.vocab, hf/ and the manifest")
    model_prefix: str = option("tokenizer", "file name stem of the .model/.vocab files")
    vocab_size: int = option(32000, "number of pieces, special tokens included")
    model_type: Literal["unigram", "bpe"] = option("unigram", "SentencePiece algorithm")
    character_coverage: float = option(0.9995, "share of characters covered by pieces; the rest byte-fall-back")
    normalization: Literal["identity", "nfkc", "nmt_nfkc"] = option(
        "identity", "text normalization; identity round-trips Japanese exactly (decode(encode(x)) == x)")
    byte_fallback: bool = option(True, "encode unknown characters as UTF-8 bytes instead of <unk>")
    split_digits: bool = option(True, "every digit is its own piece")
    allow_whitespace_only_pieces: bool = option(True, "pieces made only of spaces are allowed (code, tables)")
    remove_extra_whitespaces: bool = option(False, "collapse runs of whitespace (off: keep the text as it is)")
    max_sentencepiece_length: int = option(16, "longest piece in characters (llm-jp uses 8 for Japanese)")
    user_defined_symbols: list[str] = option(
        factory=lambda: ["<CLS>", "<SEP>", "<EOD>", "<MASK>", "\n"],
        doc="pieces always kept whole; the newline piece lets documents keep their lines")
    input_sentence_size: int = option(
        3_000_000, "lines sampled (reservoir, so RAM stays bounded at any corpus size) to train on")
    max_sentence_length: int = option(16384, "longer lines are cut into pieces of this many bytes for training")
    num_threads: int = option(0, "training threads (0: all cores)")
    train_extremely_large_corpus: bool = option(False, "SentencePiece's flag for >10M-sentence inputs (more RAM)")
    pretokenize: Literal["none", "morpheme"] = option(
        "none", "morpheme: pre-split Japanese with fugashi+unidic-lite (extra [ja]) so pieces never cross "
        "morpheme boundaries; the tokenizer still encodes raw text without the analyzer")
    heldout_documents: int = option(200, "documents kept out of training to verify SP==HF ids and measure compression")
    seed: int = option(1234, "seed for sampling lines and picking held-out documents")

    def check(self) -> list[tuple[str, str]]:
        problems = []
        if not 100 <= self.vocab_size <= 1_000_000:
            problems.append(("vocab_size", f"must be between 100 and 1,000,000, got {self.vocab_size}"))
        if not 0.9 <= self.character_coverage <= 1.0:
            problems.append(("character_coverage", "must be between 0.9 and 1.0"))
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
        return problems
