"""The pipeline's stages in one place: what each one writes, where its manifest lives, what to run to make it.

A later stage reads an upstream artifact only through this module: ``Stage.require(location)`` accepts it
when its manifest is complete, every file it lists is unchanged and the stage's own rule holds (stage 4:
the folder passed verification), and the typed readers below (``read_corpus``, ``read_tokenizer``,
``read_dataset``, ``read_export``) turn the manifest into the values callers use. Every refusal ends with
the stage's "Run: …" hint. The exit codes of every command live here too, so library modules never import
the CLI.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

from gptpipe.stage import (Manifest, StageInputError, StageResult, file_fingerprint, manifest_fingerprint,
                           outputs_intact, run_local)
from gptpipe.storage import is_url

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2  # config or input problem, reported before any work
EXIT_PREEMPTED = 75  # saved on SIGTERM/SIGINT; run the same command again to resume (EX_TEMPFAIL)

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Stage:
    """One stage's artifact: the command that makes it and the rules a later stage applies before using it."""

    number: str
    name: str  # the `gptpipe` subcommand, or the mode of one (its log's name)
    script: str  # what a user runs
    output_key: str  # the config key (or option) naming where it writes, for the refusals that name it
    output_file: str | None = None  # the file name it writes, where a later stage reads one file
    beside_prefix: bool = False  # manifest at <prefix>.manifest.json (a dataset) instead of <folder>/manifest.json
    usable: Callable[[Manifest], list[str]] | None = None  # the stage's own acceptance rule, beyond completeness

    @property
    def title(self) -> str:
        return f"{self.name} (stage {self.number})"

    def hint(self, force: bool = False) -> str:
        return f"Run: {self.script}" + (" --force" if force else "")

    def manifest_path(self, location: Path) -> Path:
        location = Path(location)
        if self.beside_prefix:
            return location.with_name(location.name + "." + MANIFEST)
        return location / MANIFEST

    def has_manifest(self, location: Path) -> bool:
        return self.manifest_path(location).is_file()

    def run(self, location: Path | str, config: Any, inputs: dict[str, Any], work: Callable[[], StageResult],
            force: bool = False, versions: tuple[str, ...] = (), input_paths: dict[str, Any] | None = None
            ) -> Manifest:
        """Make this stage's outputs at ``location`` with ``work`` unless they are current (same config and
        inputs, usable); ``force`` redoes them. The manifest is marked incomplete first and written last. A URL
        is made in a local staging folder (``work`` writes there) and published (gptpipe.remote). A local
        ``location`` that is not the stage's to replace (stage.output_place_problems; ``input_paths``: config
        key → path of each input) is refused first."""
        if is_url(location):
            from gptpipe.remote import run_published

            return run_published(self, str(location), config, inputs, work, force, versions)
        return run_local(self, Path(location), config, inputs, work, force, versions, input_paths)

    def local_copy(self, location: Path | str, only: Callable[[str], bool] | None = None) -> Path:
        """``location`` itself, or for a URL (s3://, gs://...) its outputs downloaded into the verified local
        cache (gptpipe.remote; ``only`` picks which outputs are downloaded, the manifest always is)."""
        if not is_url(location):
            return Path(location)
        from gptpipe.remote import fetch

        return fetch(self, str(location), only)

    def fingerprint(self, location: Path | str) -> dict[str, Any]:
        """This stage's output at ``location`` as a later stage's input: it changes whenever this stage reruns
        (a URL's manifest is the same bytes as the local one it was published from)."""
        return manifest_fingerprint(self.manifest_path(self.local_copy(location, only=lambda name: False)))

    def problems(self, manifest: Manifest, root: Path) -> list[str]:
        """Why a finished manifest's outputs cannot be used (empty: they can)."""
        problems = [] if manifest.complete else [f"the manifest is not marked complete (a run started "
                                                 f"{manifest.created or 'there'} did not finish)"]
        problems += outputs_intact(manifest, root)
        if not problems and self.usable:
            problems += self.usable(manifest)
        return problems

    def require(self, location: Path | str) -> Manifest:
        """The manifest of this stage's finished output at ``location`` (a URL: of its verified local copy, see
        ``local``); a clear StageInputError otherwise."""
        location = self.local_copy(location)
        path = self.manifest_path(location)
        if not path.is_file():
            raise StageInputError(f"{path} not found: the {self.title} outputs are missing. {self.hint()}")
        try:
            manifest = Manifest.read(path)
        except (json.JSONDecodeError, TypeError) as exc:
            raise StageInputError(f"{path} is not a valid manifest ({exc}). {self.hint(force=True)}") from None
        problems = self.problems(manifest, path.parent)
        if problems:
            raise StageInputError(f"{self.title} outputs at {location} are not usable: {'; '.join(problems)}. "
                                  f"{self.hint(force=True)}")
        return manifest


def _verified(manifest: Manifest) -> list[str]:
    if manifest.counts.get("verified"):
        return []
    reasons = "; ".join(manifest.counts.get("failures", [])) or "no verification result recorded"
    return [f"it did not pass verification ({reasons})"]


PREPARE = Stage("0", "prepare", "python 0_prepare_corpus.py", "corpus.output_dir", output_file="corpus.jsonl")
TRAIN_TOKENIZER = Stage("1", "train-tokenizer", "python 1_train_sentencepiece_tokenizer.py", "output_dir")
# stage 1 with base_tokenizer set: a base model's tokenizer extended (gptpipe.tokenizer.extend)
EXTEND_TOKENIZER = Stage("1", "extend-tokenizer", "python 1_train_sentencepiece_tokenizer.py", "output_dir")
TOKENIZE = Stage("2", "tokenize", "bash 2_tokenize.sh", "tokenize.output_prefix", beside_prefix=True)
# checkpoints carry markers, no manifest
TRAIN = Stage("3", "train", "bash 3_train_node1.sh", "train.output_model_dir")
CONVERT = Stage("4", "convert", "bash 4_convert_to_HF.sh", "output_tokenizer_and_model_dir", usable=_verified)
GGUF = Stage("4", "gguf", "gptpipe gguf", "--output")
DEMO_TASK = Stage("7", "make-demo-task", "gptpipe make-demo-task", "demo_task.output_dir")
EVALUATE = Stage("7", "evaluate", "gptpipe evaluate", "output_dir")
EVALUATION_FOLDER = "evaluation"  # evaluate's default output folder in a model folder; upload keeps the name on the hub


def check_input_files(patterns: list[Path], key: str, upstream: Stage) -> tuple[list[Path], dict[str, Any]]:
    """The plain jsonl files that config key ``key`` lists, checked before any work, and their fingerprints
    for the manifest's inputs. Every stage reading jsonl takes its input through here.

    ``patterns`` are paths or glob patterns (each expanded in sorted order), or the upstream stage's output
    folder, which stands for the files its complete manifest lists, in order (stage 0's corpus shards; its
    fingerprint is the manifest's). Any readable file will do, a user's own jsonl too, whatever its name,
    except an upstream stage's output that its manifest does not vouch for: a file beside that stage's manifest
    (a run writes one marked incomplete before its outputs, see ``Stage.run``) must be listed, intact, by a
    complete manifest. Its fingerprint then also holds the manifest's hash, so rerunning the upstream stage
    reruns this one.
    """
    files: list[Path] = []
    problems: list[str] = []
    fingerprints: dict[str, Any] = {}
    listed: set[Path] = set()  # files a manifest of a folder in `patterns` vouches for
    for pattern in patterns:
        if Path(pattern).is_dir():
            if not upstream.has_manifest(pattern):
                problems.append(f"{key}: {pattern} is a folder without a {upstream.title} manifest: name its "
                                f"jsonl files (or a glob pattern), or run {upstream.script} with it as output")
                continue
            try:
                manifest = upstream.require(pattern)
            except StageInputError as exc:
                problems.append(f"{key}: {exc}")
                continue
            folder_files = corpus_files(Path(pattern), manifest)
            files += folder_files
            listed.update(folder_files)
            # the files' bytes too: `gptpipe merge` compares shard runs by input size (paths differ by machine)
            fingerprints[str(pattern)] = {"size": sum(path.stat().st_size for path in folder_files),
                                          **manifest_fingerprint(upstream.manifest_path(pattern))}
        elif any(ch in str(pattern) for ch in "*?["):
            matched = sorted(p for p in Path(pattern.anchor).glob(str(pattern.relative_to(pattern.anchor)))
                             if p.is_file())
            if not matched:
                problems.append(f"{key}: {pattern} matches no file")
            files += matched
        else:
            files.append(pattern)
    for path in files:
        if path in listed:
            continue
        manifest_path = upstream.manifest_path(path.parent)
        if manifest_path.is_file():
            try:
                manifest = upstream.require(path.parent)
            except StageInputError as exc:
                problems.append(f"{key}: {path} is beside {manifest_path}, so it is taken as an output of "
                                f"{upstream.title}, accepted only with that run's complete manifest (your own "
                                f"jsonl? keep it in another folder): {exc}")
                continue
            if path.name not in manifest.outputs:
                problems.append(f"{key}: {path} is not an output of the {upstream.title} run recorded in "
                                f"{manifest_path} "
                                f"(it lists {', '.join(manifest.outputs)}); keep your own files out of that folder")
                continue
            fingerprints[str(path)] = {**file_fingerprint(path), **manifest_fingerprint(manifest_path)}
        elif not path.is_file():
            problems.append(f"{key}: {path} not found. {upstream.hint()} (or list your own jsonl files in {key})")
            continue
        else:
            fingerprints[str(path)] = file_fingerprint(path)
        try:
            with open(path, "rb") as f:
                if f.read(2) == b"\x1f\x8b":
                    problems.append(f"{key}: {path} is gzip-compressed; this stage reads plain jsonl (stage 2 "
                                    "splits it into byte ranges). Decompress it, or list it as a jsonl source of "
                                    "stage 0")
        except OSError as exc:
            problems.append(f"{key}: {path} cannot be read ({exc.strerror})")
    if problems:
        raise StageInputError("\n  ".join(problems))
    return files, fingerprints


# --- typed outputs ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CorpusInfo:
    """A finished stage-0 corpus: its jsonl file(s) and what they hold."""

    folder: Path
    files: tuple[Path, ...]
    documents: int
    manifest: Manifest


def read_corpus(folder: Path) -> CorpusInfo:
    manifest = PREPARE.require(folder)
    return CorpusInfo(Path(folder), tuple(corpus_files(folder, manifest)), int(manifest.counts.get("documents", 0)),
                      manifest)


def corpus_sources(folder: Path, manifest: Manifest) -> dict[str, list[Path]] | None:
    """A stage-0 manifest's corpus files by source label, in order (None for a joined corpus.jsonl, whose
    file mixes its sources)."""
    sources = manifest.counts.get("sources", {})
    if not sources or any("files" not in counts for counts in sources.values()):
        return None
    return {label: [Path(folder) / name for name in counts["files"]] for label, counts in sources.items()}


def corpus_files(folder: Path, manifest: Manifest) -> list[Path]:
    """A stage-0 manifest's corpus files, in order. The outputs in subfolders (dropped/<reason>.jsonl) are
    samples of what stage 0 dropped, not corpus."""
    return [Path(folder) / name for name in manifest.outputs if name.endswith(".jsonl") and "/" not in name]


TOKENIZER_HF_DIR = "hf"


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
    chars_per_token: float | None
    manifest: Manifest


def read_tokenizer(folder: Path | str) -> TokenizerInfo:
    """The tokenizer in ``folder`` (a stage-1 output_dir, or its URL: then its local copy), after checking its
    manifest and files."""
    folder = TRAIN_TOKENIZER.local_copy(folder)
    manifest = TRAIN_TOKENIZER.require(folder)
    if manifest.stage == EXTEND_TOKENIZER.name:
        raise StageInputError(f"{folder} holds a base model's extended tokenizer: point tokenize.tokenizer_dir at "
                              f"its {TOKENIZER_HF_DIR}/ folder, {folder / TOKENIZER_HF_DIR}")
    models = [name for name in manifest.outputs if name.endswith(".model")]
    if len(models) != 1:
        raise StageInputError(f"{TRAIN_TOKENIZER.manifest_path(folder)} lists {len(models)} .model files, expected "
                              f"one. {TRAIN_TOKENIZER.hint(force=True)}")
    c = manifest.counts
    return TokenizerInfo(model_path=folder / models[0], hf_dir=folder / TOKENIZER_HF_DIR, vocab_size=c["vocab_size"],
                         unk_id=c["unk_id"], bos_id=c["bos_id"], eos_id=c["eos_id"], pad_id=c["pad_id"],
                         eod_id=c["eod_id"], chars_per_token=c.get("chars_per_token"), manifest=manifest)


@dataclass(frozen=True)
class DatasetInfo:
    """A finished stage-2 dataset prefix (<prefix>.bin/.idx): its token type and totals. ``prefix`` is local
    (a URL's cached copy); ``source`` is the prefix as the config names it."""

    prefix: Path
    dtype: str
    documents: int
    tokens: int
    manifest: Manifest
    source: str

    def card_facts(self) -> dict[str, Any]:
        """What the model card quotes of this dataset."""
        return {"prefix": self.source, "documents": self.documents, "tokens": self.tokens, "dtype": self.dtype}


def read_dataset(prefix: Path | str) -> DatasetInfo:
    local = TOKENIZE.local_copy(prefix)
    manifest = TOKENIZE.require(local)
    c = manifest.counts
    return DatasetInfo(local, c["dtype"], int(c["documents"]), int(c["tokens"]), manifest, str(prefix))


@dataclass(frozen=True)
class ExportInfo:
    """A verified stage-4 HuggingFace folder: the files it wrote and what it was exported from."""

    folder: Path
    files: tuple[str, ...]
    step: int | None
    dtype: str
    test_prompt_text: str
    manifest: Manifest


def read_export(folder: Path | str) -> ExportInfo:
    """A stage-4 folder whose files are intact and which passed the verification gate (a URL: its verified
    local copy, which ``folder`` of the result names)."""
    local = CONVERT.local_copy(folder)
    manifest = CONVERT.require(local)
    c = manifest.counts
    return ExportInfo(local, tuple(sorted(manifest.outputs)), c.get("step"), c.get("dtype", ""),
                      manifest.config.get("test_prompt_text", ""), manifest)


def export_problems(folder: Path) -> list[str]:
    """Why a local folder is not a verified stage-4 export (empty when it is); never raises."""
    try:
        read_export(folder)
    except StageInputError as exc:
        return [str(exc)]
    return []
