"""A base model's own HF tokenizer (a folder with tokenizer.json, or with only a SentencePiece tokenizer.model
that transformers converts) as stage 2's tokenizer, and its conventions.

Continued pretraining keeps the base model's tokenizer: byte-level BPE (GPT-2, Llama 3, Qwen) or
SentencePiece-based (Llama 2, Gemma, Mistral), of any vocabulary size. Stage 2 encodes with the folder's
tokenizer.json through the `tokenizers` library (the backend of transformers' fast tokenizer, so the ids are
the ones ``AutoTokenizer`` gives; a folder without tokenizer.json is encoded with the conversion transformers
makes of its tokenizer.model when it loads the folder), and separates documents the way the base model was
trained to read them: its BOS before each document when its tokenizer adds one, its EOS after each. The
convention is read off the tokenizer itself (what ``tokenizer(text)`` adds around
``tokenizer(text, add_special_tokens=False)``) and recorded in the dataset's manifest.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptpipe.stage import StageInputError, tree_fingerprint

TOKENIZER_JSON = "tokenizer.json"
SENTENCEPIECE_MODEL = "tokenizer.model"
# The files that decide the ids: the fingerprint a dataset records of its tokenizer.
FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class PretrainedTokenizer:
    """A base model's tokenizer folder and the document boundaries its model expects."""

    folder: Path
    vocab_size: int  # one above the largest id the tokenizer can produce, added tokens included
    bos_id: int | None  # put before every document when the tokenizer adds it to a text
    eod_id: int  # its EOS, after every document
    converted: str | None = None  # transformers' tokenizer.json made from tokenizer.model, if the folder has none

    def tokenizer_json(self, scratch: Path) -> Path:
        """The tokenizer.json to encode with: the folder's own, or the conversion written into `scratch`."""
        if self.converted is None:
            return self.folder / TOKENIZER_JSON
        path = Path(scratch) / TOKENIZER_JSON
        path.write_text(self.converted, encoding="utf-8")
        return path

    def fingerprint(self) -> dict[str, Any]:
        return tree_fingerprint([self.folder / name for name in FILES if (self.folder / name).is_file()])

    def boundaries(self) -> dict[str, Any]:
        """What the manifest records, for stage 3 to check against the model it trains: the conventions and
        the tokenizer's identity (the hash of the tokenizer.json it encodes with, wherever the folder lies)."""
        encoded = self.converted.encode() if self.converted is not None else \
            (self.folder / TOKENIZER_JSON).read_bytes()
        return {"tokenizer": "hf", "bos_id": self.bos_id, "eod_id": self.eod_id, "vocab_size": self.vocab_size,
                "tokenizer_sha256": hashlib.sha256(encoded).hexdigest()}


def is_pretrained_tokenizer(folder: Path) -> bool:
    """An HF tokenizer folder: tokenizer.json, or a SentencePiece tokenizer.model beside tokenizer_config.json."""
    folder = Path(folder)
    return (folder / TOKENIZER_JSON).is_file() or \
        ((folder / SENTENCEPIECE_MODEL).is_file() and (folder / "tokenizer_config.json").is_file())


def read_pretrained_tokenizer(folder: Path) -> PretrainedTokenizer:
    """The tokenizer in the HF folder ``folder`` and its conventions; a clear error when it cannot separate
    documents (no EOS token)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:  # transformers raises many kinds for a broken folder
        raise StageInputError(f"tokenize.tokenizer_dir {folder}: its tokenizer does not load ({exc})") from None
    if not tokenizer.is_fast:
        raise StageInputError(f"tokenize.tokenizer_dir {folder}: not a fast tokenizer ({TOKENIZER_JSON} is needed)")
    if tokenizer.eos_token_id is None:
        raise StageInputError(f"tokenize.tokenizer_dir {folder}: the tokenizer has no EOS token, so documents "
                              f"cannot be separated; set eos_token in its tokenizer_config.json")
    sample = "Tokyo 東京"
    plain = tokenizer(sample, add_special_tokens=False)["input_ids"]
    full = tokenizer(sample)["input_ids"]
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and len(full) > len(plain) and full[0] == bos and full[1:len(plain) + 1] == plain
    vocab_size = max(tokenizer.get_vocab().values()) + 1
    converted = None if (Path(folder) / TOKENIZER_JSON).is_file() else tokenizer.backend_tokenizer.to_str()
    return PretrainedTokenizer(Path(folder), vocab_size, bos if adds_bos else None, tokenizer.eos_token_id, converted)
