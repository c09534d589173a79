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

A base's tokenizer extended by stage 1 (tokenizer/extend.py) is such a folder too (its output_dir's hf/); its
`Extension` record names the base it extends and the base ids each new piece stands for, which stage 3 reads to
grow the base's embedding matrices.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gptpipe.artifacts import EXTEND_TOKENIZER, TOKENIZER_HF_DIR
from gptpipe.stage import Manifest, StageInputError, tree_fingerprint

TOKENIZER_JSON = "tokenizer.json"
SENTENCEPIECE_MODEL = "tokenizer.model"
# The files that decide the ids: the fingerprint a dataset records of its tokenizer.
FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")
# The parts of a tokenizer.json that decide the ids of a text without special tokens.
ID_PARTS = ("normalizer", "pre_tokenizer", "model", "added_tokens")
NEW_PIECES_FILE = "new_pieces.jsonl"  # an extension's new pieces: id, string, merge, base ids


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
    chars_per_token: float | None = None  # not measured for a base's tokenizer (stage 1 measures its own)

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


def expand(ids: list[int], new: dict[int, tuple[int, ...]]) -> list[int]:
    """``ids`` with every new id replaced by the base ids it stands for."""
    return [i for token in ids for i in new.get(token, (token,))]


@dataclass(frozen=True)
class Extension:
    """A base model's tokenizer extended by stage 1: its output_dir, the base's tokenizer it was built from (as
    transformers builds it: class and pipeline hash) and, for each new id, the base ids of its text."""

    folder: Path  # stage 1's output_dir (manifest.json, new_pieces.jsonl, hf/)
    base_vocab_size: int  # the base tokenizer's ids; the new ones follow
    base_encoder: dict[str, str]  # {"class", "sha256"} of the base's tokenizer as the extension read it
    new_rows: dict[int, tuple[int, ...]] = field(repr=False)

    @property
    def tokenizer_dir(self) -> Path:
        return self.folder / TOKENIZER_HF_DIR

    def check_base(self, base: PretrainedTokenizer) -> None:
        """Refuse a base whose tokenizer is not the one this extension extends, naming both."""
        encoder = base.fingerprint()["encoder"]
        if encoder != self.base_encoder or base.vocab_size != self.base_vocab_size:
            raise StageInputError(
                f"tokenize.tokenizer_dir {self.tokenizer_dir} extends another tokenizer than model.init_from "
                f"{base.folder}'s: stage 1 extended {self.base_encoder['class']} (pipeline sha256 "
                f"{self.base_encoder['sha256'][:12]}, {self.base_vocab_size:,} ids), the base has {encoder['class']} "
                f"({encoder['sha256'][:12]}, {base.vocab_size:,} ids); rerun stage 1 with base_tokenizer={base.folder}")


def read_extension(folder: Path) -> Extension | None:
    """The extension whose tokenizer `folder` is (stage 1's output_dir, or its hf/), None for any other folder."""
    folder = Path(folder)
    for root in (folder, folder.parent) if folder.name == TOKENIZER_HF_DIR else (folder,):
        path = EXTEND_TOKENIZER.manifest_path(root)
        if path.is_file() and Manifest.read(path).stage == EXTEND_TOKENIZER.name:
            break
    else:
        return None
    manifest = EXTEND_TOKENIZER.require(root)
    pieces = root / NEW_PIECES_FILE
    try:
        rows = [json.loads(line) for line in pieces.read_text(encoding="utf-8").splitlines()]
        new_rows = {int(row["id"]): tuple(int(i) for i in row["base_ids"]) for row in rows}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StageInputError(f"{pieces}: not stage 1's list of new pieces ({exc}); rerun stage 1 with --force") \
            from None
    base_size = int(manifest.counts["base_vocab_size"])
    if sorted(new_rows) != list(range(base_size, base_size + len(new_rows))) or \
            any(not ids or max(ids) >= base_size for ids in new_rows.values()):
        raise StageInputError(f"{pieces}: the new ids are not {base_size:,}.. in order, each for base ids below "
                              f"{base_size:,}; rerun stage 1 with --force")
    return Extension(root, base_size, manifest.inputs["base_tokenizer"]["encoder"], new_rows)


def tokenizer_folder(folder: Path) -> Path:
    """The HF tokenizer folder that `folder` names: itself, or the hf/ of an extension's output_dir."""
    extension = read_extension(folder)
    return extension.tokenizer_dir if extension is not None else Path(folder)
