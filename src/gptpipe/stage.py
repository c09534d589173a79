"""The contract every stage follows: check inputs, write atomically, manifest last, skip when current.

A stage's outputs are accepted by later stages only through its entry in :mod:`gptpipe.artifacts`
(``Stage.require``), which checks that the manifest exists, says ``complete``, and that every output file it
lists still has the recorded size and modification time. A run killed at any point therefore leaves nothing a
later stage would accept: a run first replaces the manifest with one marked incomplete, outputs are written
under temporary names and renamed, and the complete manifest is written after the renames.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol
from collections.abc import Callable, Iterator

import yaml

from gptpipe.config.core import to_plain
from gptpipe.log import get_logger
from gptpipe.storage import is_url

MANIFEST_VERSION = 1


class StageInputError(RuntimeError):
    """A stage's input is missing, incomplete or does not fit; the message says which and what to run."""


class StageFailed(RuntimeError):
    """A stage could not finish (nothing it wrote is accepted); the message says why and what to do."""


def file_fingerprint(path: Path) -> dict[str, Any]:
    """Size and mtime: cheap at any size, and changes whenever the file is rewritten."""
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def file_sha256(path: Path) -> str:
    """The hex sha256 of a file's bytes, read in blocks (a model's weights can be many GB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def tree_fingerprint(paths: list[Path]) -> dict[str, Any]:
    """One fingerprint for many files (e.g. 1,800 man pages): a hash over their names, sizes and mtimes."""
    digest = hashlib.sha256()
    total = 0
    for p in sorted(paths):
        st = p.stat()
        total += st.st_size
        digest.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return {"files": len(paths), "size": total, "sha256": digest.hexdigest()}


def folder_fingerprint(folder: Path, previous: dict[str, Any] | None = None) -> dict[str, Any]:
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


def folder_changes(record: dict[str, Any], folder: Path) -> list[str]:
    """How `folder` differs from the base `record`ed when the run initialised (empty: the same files)."""
    if not Path(folder).is_dir():
        return [f"{folder} does not exist"]
    recorded = record["files"]
    now = folder_fingerprint(folder, recorded)
    changes = [f"{name} is new" for name in now if name not in recorded]
    changes += [f"{name} is gone" for name in recorded if name not in now]
    changes += [f"{name} changed (size {recorded[name]['size']:,} → {now[name]['size']:,}, sha256 "
                f"{recorded[name]['sha256'][:12]} → {now[name]['sha256'][:12]})"
                for name in now if name in recorded and now[name]["sha256"] != recorded[name]["sha256"]]
    return changes


def manifest_fingerprint(manifest_path: Path) -> dict[str, Any]:
    """An upstream stage's output, identified by its manifest's hash: it changes whenever that stage reruns."""
    return {"manifest_sha256": file_sha256(manifest_path)}


def package_versions(names: tuple[str, ...] = ()) -> dict[str, str]:
    versions = {"python": platform.python_version(), "gptpipe": _version("gptpipe")}
    versions.update({n: _version(n) for n in names})
    return versions


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


@dataclass
class Manifest:
    """What a finished stage wrote: enough to decide whether it is current and to trust its outputs."""

    stage: str
    config: dict[str, Any]
    inputs: dict[str, Any]
    outputs: dict[str, Any] = field(default_factory=dict)
    counts: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    created: str = ""
    complete: bool = True
    version: int = MANIFEST_VERSION

    @classmethod
    def read(cls, path: Path) -> Manifest:
        return cls(**json.loads(path.read_text(encoding="utf-8")))


def write_text_atomic(path: Path, text: str) -> None:
    """Write to a temporary sibling, fsync, rename: readers see the old file or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` only if the block succeeds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()


@contextlib.contextmanager
def atomic_dir(path: Path) -> Iterator[Path]:
    """Build a whole directory under a temporary name, then swap it in place of ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def outputs_intact(manifest: Manifest, root: Path) -> list[str]:
    """Problems with the recorded outputs (missing or changed since the manifest was written)."""
    problems = []
    for rel, recorded in manifest.outputs.items():
        p = root / rel
        if not p.exists():
            problems.append(f"{p} is missing")
        elif file_fingerprint(p) != recorded:
            problems.append(f"{p} changed after the stage finished (size or mtime differ)")
    return problems


class StageRules(Protocol):
    """What the contract needs of a stage: a protocol, since gptpipe.artifacts.Stage (the one) builds on this
    module."""

    @property
    def name(self) -> str: ...

    @property
    def output_key(self) -> str: ...

    @property
    def beside_prefix(self) -> bool: ...

    def manifest_path(self, location: Path) -> Path: ...

    def problems(self, manifest: Manifest, root: Path) -> list[str]: ...


@dataclass
class StageResult:
    """What a stage's work function returns: files it wrote (relative to the manifest's folder) and counts."""

    outputs: list[Path]
    counts: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)


def resolved_config_path(manifest_path: Path, stage_name: str) -> Path:
    """The resolved config written beside a manifest, named for its stage (`prepare.resolved.yaml`,
    `<prefix>.tokenize.resolved.yaml`): no name a user's own file has, so a stage never replaces one."""
    return manifest_path.with_name(manifest_path.name.replace("manifest.json", f"{stage_name}.resolved.yaml"))


def output_place_problems(stage: StageRules, location: Path, input_paths: dict[str, Any]) -> list[str]:
    """Why `stage` must not write at `location`: a folder it did not write (no manifest of its own there) that holds
    files, the working directory or a folder above it, or a place that is, holds or lies inside one of its inputs
    (`input_paths`: config key → local path). A stage replaces its output folder whole, so any of these would
    delete what the user has there."""
    key, location = stage.output_key, Path(location)
    manifest_path = stage.manifest_path(location)
    root = manifest_path.parent
    ours = False
    if manifest_path.is_file():
        try:
            ours = Manifest.read(manifest_path).stage == stage.name
        except (json.JSONDecodeError, TypeError, UnicodeDecodeError):
            ours = False
    problems = []
    # What the stage replaces: the folder, or a dataset's files beside its prefix (in a folder others share).
    owned = [location.with_name(location.name + suffix) for suffix in (".bin", ".idx")] if stage.beside_prefix \
        else [root]
    if stage.beside_prefix:
        foreign = [p for p in owned if p.exists()] if not ours else []
    else:
        cwd = Path.cwd().resolve()
        if cwd.is_relative_to(root.resolve()):
            what = "is the working directory" if root.resolve() == cwd else f"holds the working directory {cwd}"
            problems.append(f"{key} {root} {what}; the {stage.name} stage replaces its output folder whole. Set "
                            f"{key} to a folder of its own")
        foreign = sorted(root.iterdir())[:3] if root.is_dir() and not ours else []
    if foreign and not problems:
        names = ", ".join(p.name for p in foreign)
        problems.append(f"{key} {location} holds files the {stage.name} stage did not write ({names}; no "
                        f"{manifest_path.name} of its own there), which it would replace. Set {key} to a new or "
                        "empty folder, or move those files away")
    for input_key, value in input_paths.items():
        if value is None or is_url(value):
            continue
        source = Path(value).resolve()
        for out in owned:
            out = out.resolve()
            if source.is_relative_to(out) or out.is_relative_to(source):
                relation = "is" if out == source else "holds" if source.is_relative_to(out) else "lies inside"
                problems.append(f"{key} {out} {relation} {input_key} {source}: the {stage.name} stage would "
                                f"overwrite its own input. Set {key} to a place apart from its inputs")
                break
    return problems


def run_local(
    stage: StageRules,
    location: Path,
    config: Any,
    inputs: dict[str, Any],
    work: Callable[[], StageResult],
    force: bool = False,
    versions: tuple[str, ...] = (),
    input_paths: dict[str, Any] | None = None,
) -> Manifest:
    """``Stage.run`` for a local ``location``: run ``work`` unless ``stage``'s outputs there are current for
    these inputs and this config.

    Current means: same config and inputs, and usable by a later stage (complete, files intact, the stage's
    own rule: a stage-4 folder that failed verification is redone even when nothing changed, since the fix
    may be in the software). ``work`` must write its outputs atomically; this function then writes the
    resolved config and, last, the manifest. Returns the manifest (the existing one when nothing had to be done).
    A place the stage must not write (output_place_problems) is refused before anything is touched.
    """
    place = output_place_problems(stage, location, input_paths or {})
    if place:
        raise StageInputError("; ".join(place))
    plain_config = to_plain(config)
    manifest_path = stage.manifest_path(location)
    root = manifest_path.parent
    if manifest_path.is_file() and not force:
        try:
            old = Manifest.read(manifest_path)
        except (json.JSONDecodeError, TypeError):
            old = None
        if old and old.config == plain_config and old.inputs == inputs and not stage.problems(old, root):
            get_logger(stage.name).info(f"outputs in {root} are up to date (same inputs and config); nothing "
                                        "to do. Use --force to redo.")
            return old
    # The old manifest is replaced first by one marked incomplete: a run killed from here on leaves a manifest
    # that vouches for nothing, yet still marks the files beside it as this stage's (check_input_files).
    first_run = not manifest_path.exists()
    before = _files(root)
    _write_manifest(manifest_path, Manifest(stage=stage.name, config=plain_config, inputs=inputs, complete=False,
                                            versions=package_versions(versions),
                                            created=time.strftime("%Y-%m-%dT%H:%M:%S%z")))
    started = time.time()
    try:
        result = work()
    except BaseException:
        # A first run that failed without writing anything (refused input, a dead worker) leaves the place as
        # it found it; one that wrote files keeps the incomplete manifest that marks them.
        after = _files(root) or {}
        after.pop(manifest_path.name, None)
        if first_run and after == (before or {}):
            manifest_path.unlink(missing_ok=True)
            if before is None and not any(root.iterdir()):
                root.rmdir()
        raise
    elapsed = time.time() - started
    manifest = Manifest(
        stage=stage.name,
        config=plain_config,
        inputs=inputs,
        outputs={str(p.relative_to(root) if p.is_absolute() else p): file_fingerprint(root / p)
                 for p in result.outputs},
        counts=result.counts,
        timings={"total_s": round(elapsed, 3), **result.timings},
        versions=package_versions(versions),
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    config_path = resolved_config_path(manifest_path, stage.name)
    write_text_atomic(config_path, yaml.safe_dump(plain_config, allow_unicode=True, sort_keys=False))
    _write_manifest(manifest_path, manifest)
    return manifest


def _files(folder: Path) -> dict[str, Any] | None:
    """{name: (size, mtime)} of the entries directly in ``folder`` (a folder's size counted as -1: stage 0's
    .work of finished shards is something a failed run wrote); None when it does not exist."""
    if not folder.is_dir():
        return None
    return {p.name: (-1 if p.is_dir() else st.st_size, st.st_mtime_ns) for p in folder.iterdir() if (st := p.stat())}


def _write_manifest(path: Path, manifest: Manifest) -> None:
    write_text_atomic(path, json.dumps(manifest.__dict__, ensure_ascii=False, indent=2) + "\n")
