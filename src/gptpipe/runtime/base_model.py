"""A base model's folder (`model.init_from`, the start of a continued run and of its export): what transformers
makes of it, the tokenizer the data must have been encoded with, the record of its files that a resumed run or an
export checks it against, and which of its files an export copies.

The tokenizer may be the base's extended by stage 1 (tokenize.tokenizer_dir: its output_dir or hf/; see
data/base_tokenizer.py's Extension): the model then has the extended vocabulary's rows, padded to
model.VOCAB_MULTIPLE where it outgrows the base's. The checks before a continued run's first step are
train/continued.py's; whether the base's tokenizer encodes the data, data/tokenizer_check.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from collections.abc import Callable

from gptpipe.artifacts import MANIFEST
from gptpipe.data.base_tokenizer import FILES, Extension, PretrainedTokenizer, read_extension, read_pretrained_tokenizer
from gptpipe.stage import StageInputError, folder_changes, folder_fingerprint
from gptpipe.storage import is_url

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

# model_type → the causal-LM class transformers loads it with (Gemma 3's text-only model is "gemma3_text").
SUPPORTED = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
             "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
             "gpt2": "GPT2LMHeadModel", "mixtral": "MixtralForCausalLM"}
# A base folder's files that describe its tokenizer: an export with an extended tokenizer ships the extension's.
TOKENIZER_FILES = (*FILES, "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
# The files of a base folder an export copies byte for byte: its tokenizer, generation settings and licence terms.
# Nothing else goes (the export writes its own weights, config.json and card; a base folder may hold notes,
# scripts or credentials that were never meant to be published with the model).
COPIED = (*TOKENIZER_FILES, "spiece.model", "vocab.txt", "generation_config.json")
LICENCE_PREFIXES = ("license", "licence", "notice", "copying", "use_policy")
BASE_STATE_KEY = "base_model"  # the key of gptpipe_state.json holding the base's record
# The boundaries' keys that name the tokenizer transformers builds of the folder's files, not the files.
BUILD_KEYS = ("tokenizer_class", "encoder_sha256", "rebuilt")


@dataclass(frozen=True)
class BaseModel:
    """A base model's folder, its transformers config and its tokenizer's conventions."""

    folder: Path
    config: PretrainedConfig  # its vocab_size: the rows trained (an extension's, padded, where more than the base's)
    tokenizer: PretrainedTokenizer  # the data's: the base's, or as stage 1 extended it
    extension: Extension | None = None
    base_rows: int = 0  # the embedding rows of the base's own config.json

    @property
    def model_type(self) -> str:
        return self.config.model_type

    @property
    def export_rows(self) -> int:
        """The embedding rows an export keeps: the base's (its spare rows too), or the extended tokenizer's where
        more; the padding rows stage 3 added are never in the data, so they are dropped, as a from-scratch run's
        are (llama.cpp and vLLM then get one row per token, config.json the true vocabulary)."""
        return max(self.base_rows, self.tokenizer.vocab_size)

    def old_rows(self) -> torch.Tensor:
        """The base's rows that keep their meaning (a bool mask over them): all but the spare ones new ids took."""
        import torch

        mask = torch.ones(self.base_rows, dtype=torch.bool)
        if self.extension is not None:
            mask[[i for i in self.extension.new_rows if i < self.base_rows]] = False
        return mask


def open_base(folder: Path, tokenizer_dir: Path | None = None) -> BaseModel:
    """The base model in `folder` (model.init_from); a clear error when it is no supported HF model folder.
    `tokenizer_dir` (tokenize.tokenizer_dir): where it holds the base's tokenizer extended by stage 1, the model
    has that vocabulary (its config's vocab_size grown, padded to VOCAB_MULTIPLE, where the base's rows are too
    few); an extension of another tokenizer is refused."""
    from transformers import AutoConfig

    from gptpipe.runtime.model import padded_vocab_size

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise StageInputError(f"model.init_from {folder}: not a HuggingFace model folder (no config.json there)")
    try:
        config = AutoConfig.from_pretrained(folder)
    except Exception as exc:  # transformers raises many kinds for a broken config.json
        raise StageInputError(f"model.init_from {folder}: its config.json does not load ({exc})") from None
    if config.model_type not in SUPPORTED:
        raise StageInputError(f"model.init_from {folder}: model_type {config.model_type!r} is not supported; "
                              f"supported: {', '.join(SUPPORTED)}")
    tokenizer, rows = read_pretrained_tokenizer(folder), config.vocab_size
    extension = read_extension(tokenizer_dir) if tokenizer_dir is not None and not is_url(tokenizer_dir) else None
    if extension is None:
        return BaseModel(folder, config, tokenizer, None, rows)
    extension.check_base(tokenizer)
    tokenizer = read_pretrained_tokenizer(extension.tokenizer_dir)
    if tokenizer.vocab_size > rows:
        config.vocab_size = padded_vocab_size(tokenizer.vocab_size)
    return BaseModel(folder, config, tokenizer, extension, rows)


def check_data(base: BaseModel, manifests: dict[str, Any]) -> None:
    """Refuse datasets (prefix → its stage-2 manifest) not encoded with the base's tokenizer, naming both. A
    manifest of an older gptpipe records no class or encoder: the step-0 gate's re-encoding judges those."""
    want = base.tokenizer.boundaries()
    problems = []
    for prefix, manifest in manifests.items():
        got = manifest.counts.get("boundaries") or {}
        keys = [key for key, value in want.items() if key in got and got[key] != value]
        differ = [f"{key} {got[key]!r} in the data, {want[key]!r} in the base" for key in keys]
        if "tokenizer_sha256" not in keys and set(keys) & set(BUILD_KEYS):
            differ.append("the same tokenizer files, which transformers builds into another tokenizer for the base "
                          "(it picks the class by the folder's config.json model_type, and by its own version)")
        if got.get("tokenizer") != "hf":
            differ = [f"it was encoded with a {got.get('tokenizer', 'unrecorded')} tokenizer, not an HF folder's"]
        if differ:
            problems.append(f"{prefix}: " + "; ".join(differ))
    if problems:
        extended = f" as stage 1 extended it in {base.tokenizer.folder}" if base.extension else ""
        raise StageInputError(f"the data was not tokenized with model.init_from {base.folder}'s tokenizer{extended} "
                              f"(set tokenize.tokenizer_dir to that folder and rerun stage 2):\n  - "
                              + "\n  - ".join(problems))
    if base.tokenizer.vocab_size > base.config.vocab_size:
        raise StageInputError(f"model.init_from {base.folder}: its tokenizer has {base.tokenizer.vocab_size} ids, "
                              f"its config.json vocab_size only {base.config.vocab_size} embedding rows")


# --- the base's own training ----------------------------------------------------------------------------------
# Where a base folder may record the rate its training ended at: transformers' Trainer (save_state) and a gptpipe
# stage-4 export (its manifest's final_lr: the rate of the checkpoint's last step).
TRAINER_STATE = "trainer_state.json"


def recorded_end_lr(folder: Path) -> tuple[float, str] | None:
    """(the learning rate the base's training ended at, where the folder records it), or None where it records
    none: trainer_state.json's last log_history entry with a learning_rate, else a gptpipe export's manifest.json
    counts.final_lr. An unreadable file counts as no record (the plan says that it fell back)."""
    import json

    folder = Path(folder)
    try:
        state = json.loads((folder / TRAINER_STATE).read_text(encoding="utf-8"))
        logged = [row for row in state.get("log_history", []) if isinstance(row.get("learning_rate"), (int, float))]
        if logged:
            step = logged[-1].get("step", state.get("global_step", "?"))
            return float(logged[-1]["learning_rate"]), f"{folder / TRAINER_STATE}: learning_rate at step {step}"
    except (OSError, ValueError, AttributeError):
        pass
    try:
        counts = json.loads((folder / MANIFEST).read_text(encoding="utf-8")).get("counts", {})
        if isinstance(counts.get("final_lr"), (int, float)):
            return float(counts["final_lr"]), (f"{folder / MANIFEST}: final_lr of the gptpipe export of step "
                                               f"{counts.get('step', '?')}")
    except (OSError, ValueError, AttributeError):
        pass
    return None


# --- the folder's record --------------------------------------------------------------------------------------
def base_record(base: BaseModel) -> dict[str, Any]:
    """What a run records of its base model (gptpipe_state.json's `base_model`), and of the tokenizer extension
    its rows were grown for: stage 4 reads it back."""
    extension = base.extension
    return {"folder": str(base.folder), "model_type": base.model_type, "files": folder_fingerprint(base.folder),
            **({"extension": {"folder": str(extension.folder), "files": folder_fingerprint(extension.folder)}}
               if extension else {})}


def check_unchanged(record: dict[str, Any], base: BaseModel, where: str) -> None:
    """Refuse a base folder (and tokenizer extension) whose files differ from the run's record (`where`: the
    record's file)."""
    changes = folder_changes(record, base.folder)
    recorded, extension = record.get("extension"), base.extension
    if recorded is not None or extension is not None:
        if recorded is None or extension is None:
            now = f"tokenize.tokenizer_dir {base.tokenizer.folder} is " + ("" if extension else "no ")
            changes.append(now + "a tokenizer extension, " + ("none was" if recorded is None else
                                                             f"{recorded['folder']} was"))
        else:
            changes += [f"extension {change}" for change in folder_changes(recorded, extension.folder)]
    if changes:
        raise StageInputError(f"model.init_from {base.folder} is not the base model this run initialised from "
                              f"({record['folder']}, recorded in {where}): " + "; ".join(changes[:5])
                              + (f"; and {len(changes) - 5} more" if len(changes) > 5 else "")
                              + ". Restore the folder, or start a new run (train.output_model_dir)")


def is_copied(name: str) -> bool:
    """Whether a top-level file of the base folder goes into the export unchanged (COPIED, licence terms)."""
    return name in COPIED or name.lower().startswith(LICENCE_PREFIXES)


def _own_files(folder: Path, keep: Callable[[str], bool]) -> dict[str, Path]:
    """The regular files directly in `folder` that `keep` names; a link is followed only where it stays inside
    the folder (a link out of it could publish any file of the machine)."""
    root = folder.resolve()
    return {p.name: p for p in sorted(folder.iterdir())
            if keep(p.name) and p.is_file() and p.resolve().parent == root}


def exported_files(base: BaseModel) -> dict[str, Path]:
    """The files an export of a run continued from `base` copies byte for byte, by their name there: the base
    folder's (is_copied); with a tokenizer extension, its hf/ files instead of the base's tokenizer files (any
    of data/base_tokenizer.py's FILES, or the slow vocab.json/merges.txt, which lack the new pieces)."""
    files = _own_files(base.folder, is_copied)
    if base.extension is None:
        return files
    tokenizer = base.extension.tokenizer_dir
    replaced = {*TOKENIZER_FILES, *(p.name for p in tokenizer.iterdir())}
    return {**{name: path for name, path in files.items() if name not in replaced},
            **_own_files(tokenizer, lambda name: not name.startswith("."))}
