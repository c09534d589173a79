"""Continued pretraining (`model.init_from`): the open model a run starts from, and the checks that it is the one
trained.

A base model is a local HF folder: its config.json decides the architecture, its weights initialise a run that
has no checkpoint yet, and its tokenizer must be the one stage 2 encoded the data with. Before the first step:
the data's manifests name this tokenizer as transformers builds it (`check_data`), the engine's step-0 loss
equals transformers' own (`reference_loss`), the tokenizer re-encodes the data's documents (`tokenizer_problems`,
naming the likely cause when it does not); the folder's files are recorded (`fingerprint`), and a resumed run
or export refuses a folder that changed since (`folder_changes`).

The tokenizer may be the base's extended by stage 1 (tokenize.tokenizer_dir: its output_dir or hf/; see
data/base_tokenizer.py's Extension): the model then has the extended vocabulary's rows (padded to
model.VOCAB_MULTIPLE where it outgrows the base's; model.extend_vocabulary fills them) and the step-0 gate
compares what an extension leaves exact. On the first validation sample with each new id spelled in the base ids
it stands for (text the base reads as it always did), the engine's log-softmax over the base's own rows (all of
its rows but the spare ones new ids took) must give the loss the base's does over the same rows in transformers
in fp32: the new rows only add terms to the softmax's sum over the whole vocabulary, which this leaves out. And
each new row must be the mean of the base's rows for its ids (`new_row_problems`), as the engine computes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptpipe.data.base_tokenizer import (FILES, Extension, PretrainedTokenizer, expand, read_extension,
                                         read_pretrained_tokenizer)
from gptpipe.stage import StageInputError, file_sha256
from gptpipe.storage import is_url

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

# model_type → the causal-LM class transformers loads it with (Gemma 3's text-only model is "gemma3_text").
SUPPORTED = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
             "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
             "gpt2": "GPT2LMHeadModel", "mixtral": "MixtralForCausalLM"}
# Files of a base folder that are weights or the model card: the export writes its own; every other file
# (tokenizer files, generation_config.json, licence) is copied into the export byte for byte.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".gguf")
NOT_COPIED = ("config.json", "README.md")
# A base folder's files that describe its tokenizer: an export with an extended tokenizer ships the extension's.
TOKENIZER_FILES = (*FILES, "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
# The step-0 gate's sample: the first validation sample, cut to this many tokens (the fp32 reference runs on
# the host, where a long sample of a large model would take minutes).
GATE_TOKENS = 512
# Documents the gate's tokenizer check encodes (source texts, or held-out documents decoded), and the longest
# held-out one used (whole documents only: a cut inside a word may merge differently).
ROUND_TRIP_DOCUMENTS = 8
ROUND_TRIP_MAX_TOKENS = 4096
BASE_STATE_KEY = "base_model"  # the key of gptpipe_state.json holding the base's record
# The boundaries' keys that name the tokenizer transformers builds of the folder's files, not the files.
BUILD_KEYS = ("tokenizer_class", "encoder_sha256", "rebuilt")
# Random hidden states the gate's output-row check passes through the output matrix (any wrong row shows).
PROBES = 8
# A probe's logit in bf16 is a sum of rounded products over the hidden size, the parts' logits averaged after:
# allowed four bf16 steps of the largest logit (measured: 1.5 on the tests' tiny models); a wrong row is off by
# the order of the logit itself.
PROBE_ROUNDINGS = 4
PROBE_CHUNK = 1024  # new ids whose input rows the gate checks at once (their base ids' rows gathered)


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

    from gptpipe.train.model import padded_vocab_size

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


# --- the folder's record --------------------------------------------------------------------------------------
def fingerprint(folder: Path, previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """{relative path: {size, mtime_ns, sha256}} of every file under `folder`. A file whose size and mtime equal
    `previous`'s record keeps its recorded hash (rewriting a file changes its mtime), so a resumed run rehashes
    only what may have changed."""
    previous = previous or {}
    files = {}
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file() and ".cache" not in p.parts):
        name, st = path.relative_to(folder).as_posix(), path.stat()
        old = previous.get(name)
        same = old and old["size"] == st.st_size and old["mtime_ns"] == st.st_mtime_ns
        files[name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                       "sha256": old["sha256"] if same else file_sha256(path)}
    return files


def base_record(base: BaseModel) -> dict[str, Any]:
    """What a run records of its base model (gptpipe_state.json's `base_model`), and of the tokenizer extension
    its rows were grown for: stage 4 reads it back."""
    extension = base.extension
    return {"folder": str(base.folder), "model_type": base.model_type, "files": fingerprint(base.folder),
            **({"extension": {"folder": str(extension.folder), "files": fingerprint(extension.folder)}}
               if extension else {})}


def folder_changes(record: dict[str, Any], folder: Path) -> list[str]:
    """How `folder` differs from the base `record`ed when the run initialised (empty: the same files)."""
    if not Path(folder).is_dir():
        return [f"{folder} does not exist"]
    recorded = record["files"]
    now = fingerprint(folder, recorded)
    changes = [f"{name} is new" for name in now if name not in recorded]
    changes += [f"{name} is gone" for name in recorded if name not in now]
    changes += [f"{name} changed (size {recorded[name]['size']:,} → {now[name]['size']:,}, sha256 "
                f"{recorded[name]['sha256'][:12]} → {now[name]['sha256'][:12]})"
                for name in now if name in recorded and now[name]["sha256"] != recorded[name]["sha256"]]
    return changes


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
    """Whether a top-level file of the base folder goes into the export unchanged (see NOT_COPIED)."""
    return not (name.endswith(WEIGHT_SUFFIXES) or name.endswith(".index.json") or name in NOT_COPIED
                or name.startswith("."))


def exported_files(base: BaseModel) -> dict[str, Path]:
    """The files an export of a run continued from `base` copies byte for byte, by their name there: the base
    folder's (is_copied); with a tokenizer extension, its hf/ files instead of the base's tokenizer files (any
    of data/base_tokenizer.py's FILES, or the slow vocab.json/merges.txt, which lack the new pieces)."""
    folder = base.folder
    files = {p.name: p for p in sorted(folder.iterdir()) if p.is_file() and is_copied(p.name)}
    if base.extension is None:
        return files
    tokenizer = base.extension.tokenizer_dir
    replaced = {*TOKENIZER_FILES, *(p.name for p in tokenizer.iterdir())}
    return {**{name: path for name, path in files.items() if name not in replaced},
            **{p.name: p for p in sorted(tokenizer.iterdir()) if p.is_file()}}


# --- the model ------------------------------------------------------------------------------------------------
def gate_batch(valid_data: Any, extension: Extension | None = None) -> dict[str, torch.Tensor]:
    """The step-0 gate's batch: the first validation sample (the first of every evaluation), cut to GATE_TOKENS;
    with a tokenizer extension, each new id spelled in the base ids it stands for (text the base reads)."""
    import torch

    from gptpipe.train.data import collate

    batch = collate(valid_data, range(1), "cpu")
    length = min(GATE_TOKENS, batch["input_ids"].shape[1])  # the re-spelled sample too: within seq_len's positions
    if extension is not None:
        # the sample's tokens (inputs and the last label) re-spelled, then shifted again as the dataset does
        stream = expand(batch["input_ids"][0].tolist() + batch["labels"][0, -1:].tolist(), extension.new_rows)
        tokens = torch.tensor([stream[:length + 1]])
        return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    return {k: v[:, :length] for k, v in batch.items()}


def old_rows_loss(logits: torch.Tensor, labels: torch.Tensor, old_rows: torch.Tensor) -> float:
    """The mean next-token loss of `logits` over the base's rows that `old_rows` marks (a bool mask of the base's
    rows), the softmax taken over those alone: an extended model's new and padding rows left out."""
    import torch

    rows = logits[..., :len(old_rows)].float().masked_fill(~old_rows.to(logits.device), float("-inf"))
    return float(torch.nn.functional.cross_entropy(rows.reshape(-1, rows.shape[-1]), labels.reshape(-1),
                                                   ignore_index=-100))


def reference_loss(folder: Path, batch: dict[str, torch.Tensor], old_rows: torch.Tensor | None = None) -> float:
    """The folder's loss on `batch` through transformers alone: from_pretrained in fp32 on the host, eager
    attention; `old_rows`: over those of its rows only (old_rows_loss). Call before Liger patches the model
    classes (build_engine), so the reference stays unpatched."""
    import torch
    from transformers import AutoModelForCausalLM

    from gptpipe.train.model import lm_forward

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        if old_rows is not None:
            return old_rows_loss(model(input_ids=batch["input_ids"], use_cache=False).logits, batch["labels"],
                                 old_rows)
        out = lm_forward(model, batch)
    return float(out.loss)


def new_row_problems(model: Any, extension: Extension, precision: str) -> tuple[list[str], str]:
    """(the problems, what was checked) of a model's new rows against the means of the base's rows for the ids
    each stands for, as the model's own modules compute them: its input embedding on the ids, its output matrix
    on PROBES random hidden states (each new id's logit must be the mean of its base ids' logits). Collective
    under ZeRO-3 (the modules gather their weights): every rank calls it."""
    import torch

    from gptpipe.tolerance import logits_tolerance

    dtype = "fp32" if precision == "fp32" else "bf16"  # fp16 rounds finer than bf16: its tolerance covers it
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    weight = embedding.weight
    device = weight.device
    hidden = getattr(weight, "ds_shape", weight.shape)[-1]
    probes = torch.randn(PROBES, hidden, generator=torch.Generator().manual_seed(0)).to(device, weight.dtype)
    logits = head(probes).float()
    new_ids = sorted(extension.new_rows)
    worst = {"input": (0.0, 0.0), "output": (0.0, 0.0)}  # (max |Δ|, largest magnitude compared)
    for start in range(0, len(new_ids), PROBE_CHUNK):
        chunk = new_ids[start:start + PROBE_CHUNK]
        parts = [extension.new_rows[i] for i in chunk]
        flat = torch.tensor([i for ids in parts for i in ids], device=device)
        owner = torch.repeat_interleave(torch.arange(len(chunk), device=device),
                                        torch.tensor([len(ids) for ids in parts], device=device))
        counts = torch.bincount(owner, minlength=len(chunk)).unsqueeze(-1).float()
        rows = embedding(torch.tensor(chunk, device=device)).float()
        means = torch.zeros_like(rows).index_add_(0, owner, embedding(flat).float()) / counts
        columns = logits[:, chunk]
        mean_columns = torch.zeros_like(columns).index_add_(1, owner, logits[:, flat]) / counts.T
        for name, got, want in (("input", rows, means), ("output", columns, mean_columns)):
            diff, scale = (got - want).abs().max().item(), want.abs().max().item()
            worst[name] = (max(worst[name][0], diff), max(worst[name][1], scale))
    problems, checked = [], []
    for name, (diff, scale) in worst.items():
        tolerance = logits_tolerance(scale if name == "input" else PROBE_ROUNDINGS * scale, dtype)
        where = ("input embedding rows" if name == "input" else f"output rows (logits of {PROBES} random hidden "
                 "states)")
        line = f"max |Δ| {diff:.2g} from the means of their base ids' {where} (tolerance {tolerance:.2g})"
        checked.append(line)
        if not diff <= tolerance:
            problems.append(f"the {len(new_ids):,} new rows are not the means of the base's: {line}")
    return problems, f"its {len(new_ids):,} new rows: " + "; ".join(checked)


def source_texts(manifest: Any, count: int = ROUND_TRIP_DOCUMENTS) -> list[str] | None:
    """The texts of a stage-2 dataset's first `count` documents, read back from the jsonl it was encoded from the
    way stage 2 read it (data/jsonl.py's record_text, NULs stripped); None when that cannot be done exactly: a
    merged or sharded dataset, lines that became no document (skipped), or an input that is gone or changed."""
    from gptpipe.data.jsonl import record_text
    from gptpipe.stage import file_fingerprint

    counts, files = manifest.counts, (manifest.inputs.get("files") or {})
    if counts.get("documents") != counts.get("lines") or "shard" in counts or not files:
        return None
    texts: list[str] = []
    for name, recorded in files.items():
        path = Path(name)
        if not path.is_file() or any(file_fingerprint(path)[k] != recorded.get(k) for k in ("size", "mtime_ns")):
            return None
        with open(path, "rb") as fh:
            for line in fh:
                text, _ = record_text(line, manifest.config.get("text_key", "text"))
                texts.append(text)
                if len(texts) == count:
                    return texts
    return texts


def reencode_problems(tokenizer: Any, texts: list[str], documents: list[list[int]], bos_id: int | None,
                      eod_id: int) -> list[str]:
    """Documents of the data whose source text `tokenizer` encodes to other ids than the data holds (between the
    base's BOS, where its tokenizer adds one, and EOS): the data was encoded with another tokenizer."""
    problems = []
    for n, (text, doc) in enumerate(zip(texts, documents)):
        ids = ([bos_id] if bos_id is not None else []) + tokenizer(text, add_special_tokens=False)["input_ids"]
        ids.append(eod_id)
        if ids != doc:
            at = next((i for i, (a, b) in enumerate(zip(ids, doc)) if a != b), min(len(ids), len(doc)))
            problems.append(f"document {n}: the data has ids {doc[at:at + 5]} at token {at}, the tokenizer "
                            f"gives {ids[at:at + 5]} for its text")
    return problems


def first_documents(prefix: Path, count: int) -> list[list[int]]:
    """The first `count` documents of a dataset prefix, as ids."""
    from gptpipe.data.indexed import IndexedDataset

    reader = IndexedDataset(prefix)
    return [reader[i].tolist() for i in range(min(count, len(reader)))]


def tokenizer_problems(tokenizer: Any, base: BaseModel, prefix: Path, split: str, seed: int) -> tuple[list[str], str]:
    """(the problems, what was checked) of the base's tokenizer against the data in `prefix`: the first documents'
    source texts re-encoded (`source_texts`), else held-out documents decoded and re-encoded (a weaker check: a
    tokenizer with some pieces' ids swapped decodes and re-encodes consistently)."""
    from gptpipe.artifacts import read_dataset
    from gptpipe.data.split import unseen_document_ids

    bos, eod = base.tokenizer.bos_id, base.tokenizer.eod_id
    dataset = read_dataset(prefix)  # a URL prefix: its verified local copy
    texts = source_texts(dataset.manifest)
    if texts:
        problems = reencode_problems(tokenizer, texts, first_documents(dataset.prefix, len(texts)), bos, eod)
        checked = f"re-encodes the source text of {len(texts)} documents to the data's ids"
    else:
        documents = unseen_document_ids(dataset.prefix, ROUND_TRIP_DOCUMENTS, split, seed,
                                        max_tokens=ROUND_TRIP_MAX_TOKENS)
        problems = round_trip_problems(tokenizer, documents, bos, eod)
        checked = (f"decodes and re-encodes {len(documents)} held-out documents to the data's ids (their source "
                   "jsonl is not readable as it was encoded)")
    if problems:
        problems.append(mismatch_cause(base.tokenizer, dataset.manifest.counts.get("boundaries") or {}))
    return problems, checked


def mismatch_cause(tokenizer: PretrainedTokenizer, recorded: dict[str, Any]) -> str:
    """The likely cause of data ids that the base's tokenizer does not give, from what stage 2 `recorded` of the
    tokenizer it encoded with (check_data has refused a recorded one that differs from the base's)."""
    built = tokenizer.tokenizer_class + (f" ({tokenizer.rebuilt})" if tokenizer.rebuilt else "")
    if "encoder_sha256" not in recorded:
        return (f"likely cause: the data's manifest records no tokenizer class, so an older gptpipe wrote it, encoding "
                f"with tokenizer.json as the file has it (or an older transformers' conversion of tokenizer.model); "
                f"AutoTokenizer now loads {tokenizer.folder} as {built}. Rerun stage 2 with --force (gptpipe "
                "tokenize --force) to write the ids AutoTokenizer gives")
    return (f"stage 2 recorded the tokenizer AutoTokenizer builds now ({built}, encoder sha256 "
            f"{recorded['encoder_sha256'][:12]}), so the data's ids were changed after it wrote them, or its manifest "
            "is not theirs; rerun stage 2 with --force (gptpipe tokenize --force)")


def round_trip_problems(tokenizer: Any, documents: list[list[int]], bos_id: int | None, eod_id: int) -> list[str]:
    """Documents of the data (ids, with their BOS/EOS) that `tokenizer` does not re-encode to the same ids after
    decoding them: the data was encoded with another tokenizer."""
    problems = []
    for n, doc in enumerate(documents):
        body = doc[1:] if bos_id is not None and doc[:1] == [bos_id] else doc
        body = body[:-1] if body[-1:] == [eod_id] else body
        text = tokenizer.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        again = tokenizer(text, add_special_tokens=False)["input_ids"]
        if again != body:
            at = next((i for i, (a, b) in enumerate(zip(again, body)) if a != b), min(len(again), len(body)))
            problems.append(f"held-out document {n}: the data has ids {body[at:at + 5]} at token {at}, the "
                            f"tokenizer gives {again[at:at + 5]} for the same text")
    return problems


def stage3_model(config: Any) -> tuple[Any, Any, BaseModel | None]:
    """(tokenizer facts, transformers config, base model or None) of the model stage 3 trains: model.init_from's
    folder, its data checked against its tokenizer; else a new model of model.arch/preset on the stage-1
    tokenizer."""
    from gptpipe.artifacts import read_dataset, read_tokenizer
    from gptpipe.train.model import build_model_config

    if config.model.init_from is not None:
        base = open_base(config.model.init_from, config.tokenize.tokenizer_dir)
        check_data(base, {str(p): read_dataset(p).manifest for p in config.data.prefixes})
        return base.tokenizer, base.config, base
    tokenizer = read_tokenizer(config.tokenize.tokenizer_dir)
    check_new_model_data(config.tokenize.tokenizer_dir,
                         {str(p): read_dataset(p).manifest for p in config.data.prefixes})
    return tokenizer, build_model_config(config.model, tokenizer, config.train.seq_len), None


def check_new_model_data(tokenizer_dir: Path | str, manifests: dict[str, Any]) -> None:
    """Refuse datasets (prefix → its stage-2 manifest) that the stage-1 tokenizer a new model is built for did not
    encode, or encoded before stage 1 last ran: the model's vocabulary and the export's tokenizer come from
    tokenize.tokenizer_dir, the ids from wherever data.prefixes points, and nothing else would notice."""
    from gptpipe.artifacts import TRAIN_TOKENIZER

    want = TRAIN_TOKENIZER.fingerprint(tokenizer_dir)
    problems = [f"{prefix}: encoded with {manifest.config.get('tokenizer_dir')}"
                + (" as it was before stage 1 last wrote it" if str(manifest.config.get("tokenizer_dir")) ==
                   str(tokenizer_dir) else "")
                for prefix, manifest in manifests.items() if manifest.inputs.get("tokenizer") != want]
    if problems:
        raise StageInputError(f"the data was not tokenized with tokenize.tokenizer_dir {tokenizer_dir}, the "
                              f"tokenizer the new model is built for (point tokenize.tokenizer_dir at the data's "
                              f"tokenizer, or rerun stage 2 with this one):\n  - " + "\n  - ".join(problems))
