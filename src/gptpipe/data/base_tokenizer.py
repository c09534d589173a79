"""A base model's own HF tokenizer (a folder with tokenizer.json, or with only a SentencePiece tokenizer.model
that transformers converts) as stage 2's tokenizer, and its conventions.

Continued pretraining keeps the base model's tokenizer: byte-level BPE (GPT-2, Llama 3, Qwen) or
SentencePiece-based (Llama 2, Gemma, Mistral), of any vocabulary size. Stage 2 encodes exactly as the tokenizer
``AutoTokenizer.from_pretrained(folder)`` builds: transformers picks its class (config.json's model_type may
decide it: a qwen2 folder gets Qwen2Tokenizer whatever tokenizer_config.json says), and that class may rebuild
the folder's tokenizer.json (Qwen2Tokenizer puts in its own pre-tokenizer, which splits digits one by one) or
convert its tokenizer.model. The pipeline it built is serialised and encoded with the `tokenizers` library,
the backend of transformers' fast tokenizer. Documents are separated the way the base model was trained to
read them: its BOS before each document when its tokenizer adds one, its EOS after each. The convention is read
off the tokenizer itself (what ``tokenizer(text)`` adds around ``tokenizer(text, add_special_tokens=False)``)
and recorded in the dataset's manifest with the class and what it changed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gptpipe.stage import StageInputError, tree_fingerprint

TOKENIZER_JSON = "tokenizer.json"
SENTENCEPIECE_MODEL = "tokenizer.model"
# The files that decide the ids: the fingerprint a dataset records of its tokenizer.
FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")
# The parts of a tokenizer.json that decide the ids of a text without special tokens.
ID_PARTS = ("normalizer", "pre_tokenizer", "model", "added_tokens")


def _sha256(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


@dataclass(frozen=True)
class PretrainedTokenizer:
    """A base model's tokenizer folder, the tokenizer transformers builds of it and the document boundaries its
    model expects."""

    folder: Path
    vocab_size: int  # one above the largest id the tokenizer can produce, added tokens included
    bos_id: int | None  # put before every document when the tokenizer adds it to a text
    eod_id: int  # its EOS, after every document
    tokenizer_class: str  # the class AutoTokenizer chose
    encoder: str = field(repr=False)  # the tokenizer.json of the pipeline that class built: stage 2 encodes with it
    rebuilt: str | None  # what that class changed of the folder's tokenizer.json, if anything

    def tokenizer_json(self, scratch: Path) -> Path:
        """The tokenizer.json to encode with (the pipeline transformers built), written into `scratch`."""
        path = Path(scratch) / TOKENIZER_JSON
        path.write_text(self.encoder, encoding="utf-8")
        return path

    def fingerprint(self) -> dict[str, Any]:
        """Stage 2's record of its tokenizer: the folder's files, and the pipeline transformers builds of them
        (another transformers, or a config.json added beside them, may build another one)."""
        files = tree_fingerprint([self.folder / name for name in FILES if (self.folder / name).is_file()])
        return {**files, "encoder": {"class": self.tokenizer_class, "sha256": _sha256(self.encoder)}}

    def boundaries(self) -> dict[str, Any]:
        """What the manifest records, for stage 3 to check against the model it trains: the conventions and the
        tokenizer's identity, wherever the folder lies: the hash of its tokenizer.json (of the conversion when it
        has none), the class transformers loads it as, the hash of the pipeline that class built and encodes
        with, and what that class changed of the file."""
        source = self.folder / TOKENIZER_JSON
        return {"tokenizer": "hf", "bos_id": self.bos_id, "eod_id": self.eod_id, "vocab_size": self.vocab_size,
                "tokenizer_sha256": _sha256(source.read_bytes() if source.is_file() else self.encoder),
                "tokenizer_class": self.tokenizer_class, "encoder_sha256": _sha256(self.encoder),
                "rebuilt": self.rebuilt}


def is_pretrained_tokenizer(folder: Path) -> bool:
    """An HF tokenizer folder: tokenizer.json, or a SentencePiece tokenizer.model beside tokenizer_config.json."""
    folder = Path(folder)
    return (folder / TOKENIZER_JSON).is_file() or \
        ((folder / SENTENCEPIECE_MODEL).is_file() and (folder / "tokenizer_config.json").is_file())


def _rebuilt(folder: Path, tokenizer_class: str, encoder: str) -> str | None:
    """What the class transformers chose changed of `folder`'s tokenizer.json, in the parts that decide the ids
    (None: nothing, or the folder has none). Both sides are serialised by the `tokenizers` library, so only
    what differs in content counts."""
    from tokenizers import Tokenizer

    path = Path(folder) / TOKENIZER_JSON
    if not path.is_file():
        return None
    own, built = json.loads(Tokenizer.from_file(str(path)).to_str()), json.loads(encoder)
    changed = [part for part in ID_PARTS if own.get(part) != built.get(part)]
    return f"transformers' {tokenizer_class} changed tokenizer.json's {', '.join(changed)}" if changed else None


def read_pretrained_tokenizer(folder: Path, key: str = "tokenize.tokenizer_dir") -> PretrainedTokenizer:
    """The tokenizer AutoTokenizer builds of the HF folder ``folder`` and its conventions; a clear error naming
    the config ``key`` when it cannot separate documents (no EOS token)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:  # transformers raises many kinds for a broken folder
        raise StageInputError(f"{key} {folder}: its tokenizer does not load ({exc})") from None
    if not tokenizer.is_fast:
        raise StageInputError(f"{key} {folder}: not a fast tokenizer ({TOKENIZER_JSON} is needed)")
    if tokenizer.eos_token_id is None:
        raise StageInputError(f"{key} {folder}: the tokenizer has no EOS token, so documents "
                              f"cannot be separated; set eos_token in its tokenizer_config.json")
    name, encoder = type(tokenizer).__name__, tokenizer.backend_tokenizer.to_str()
    sample = "Tokyo 東京"
    plain = tokenizer(sample, add_special_tokens=False)["input_ids"]
    full = tokenizer(sample)["input_ids"]
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and len(full) > len(plain) and full[0] == bos and full[1:len(plain) + 1] == plain
    vocab_size = max(tokenizer.get_vocab().values()) + 1
    return PretrainedTokenizer(Path(folder), vocab_size, bos if adds_bos else None, tokenizer.eos_token_id, name,
                               encoder, _rebuilt(folder, name, encoder))
