"""How later stages read a finished stage-1 tokenizer: only through its complete manifest."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gptpipe.stage import StageInputError, require_manifest

MANIFEST = "manifest.json"
HF_DIR = "hf"
HOW_TO_MAKE = "python 1_train_sentencepiece_tokenizer.py"


@dataclass(frozen=True)
class TokenizerInfo:
    """The files and ids a stage-1 run produced; eod_id is the document separator (eos, as Megatron does)."""

    model_path: Path
    hf_dir: Path
    vocab_size: int
    unk_id: int
    bos_id: int
    eos_id: int
    pad_id: int
    eod_id: int


def read_tokenizer_info(folder: Path) -> TokenizerInfo:
    """The tokenizer in ``folder`` (a stage-1 output_dir), after checking its manifest and files."""
    folder = Path(folder)
    manifest = require_manifest(folder / MANIFEST, "train-tokenizer", HOW_TO_MAKE)
    models = [name for name in manifest.outputs if name.endswith(".model")]
    if len(models) != 1:
        raise StageInputError(f"{folder / MANIFEST} lists {len(models)} .model files, expected one. "
                              f"Run: {HOW_TO_MAKE} --force")
    counts = manifest.counts
    return TokenizerInfo(model_path=folder / models[0], hf_dir=folder / HF_DIR, vocab_size=counts["vocab_size"],
                         unk_id=counts["unk_id"], bos_id=counts["bos_id"], eos_id=counts["eos_id"],
                         pad_id=counts["pad_id"], eod_id=counts["eod_id"])
