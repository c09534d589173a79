"""A stage's outputs at a URL: fetched into a verified local cache, or published from a local folder.

Stage outputs in a bucket keep the local layout (gptpipe.artifacts): a dataset's <prefix>.bin/.idx with
<prefix>.manifest.json beside them, a tokenizer or HF folder with manifest.json inside. The folder holding
them is a committed folder (gptpipe.committed) whose record is the manifest: ``publish`` uploads every output
and the resolved config, then the manifest; ``fetch`` copies what a stage needs into
``<system temp>/gptpipe-cache-<uid>/<digest of the URL>/`` with each file's recorded mtime and the manifest last, so
the cached copy is a local stage output that ``Stage.require`` accepts as is. It is reused while the bucket's
manifest is byte-for-byte the cached one and the cached files match it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any, Protocol
from collections.abc import Callable, Iterator

from gptpipe.committed import CommittedFolder, local_matches
from gptpipe.config.core import to_plain
from gptpipe.log import get_logger
from gptpipe.stage import Manifest, StageInputError, StageResult, StageRules, resolved_config_path, run_local
from gptpipe.storage import cache_folder, filesystem, is_url

log = get_logger("storage")


class RemoteStage(StageRules, Protocol):
    """What a URL's outputs need of their stage besides the contract's: a protocol, since gptpipe.artifacts.Stage
    (the one) calls this module."""

    @property
    def title(self) -> str: ...

    @property
    def usable(self) -> Callable[[Manifest], list[str]] | None: ...

    def hint(self, force: bool = False) -> str: ...


def layout(stage: RemoteStage, location: str) -> tuple[str, str]:
    """(the URL of the folder holding the manifest and the outputs it lists, the manifest's name)."""
    location = location.rstrip("/")
    if stage.beside_prefix:
        folder, name = location.rsplit("/", 1)
        return folder, stage.manifest_path(Path(name)).name
    return location, stage.manifest_path(Path("x")).name


def cache_location(stage: RemoteStage, url: str) -> Path:
    """The local stand-in for ``url``: where ``fetch`` puts it and where a stage publishing to it writes first."""
    url = url.rstrip("/")
    folder, _ = layout(stage, url)
    root = cache_folder(folder)
    return root / url.rsplit("/", 1)[1] if stage.beside_prefix else root


def staging(stage: RemoteStage, location: Any) -> Path:
    """Where a stage writes ``location``: the path itself, or the local stand-in of a URL."""
    return cache_location(stage, str(location)) if is_url(location) else Path(location)


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One fetch per cache folder at a time: ranks on one machine download once, the others then reuse."""
    folder.mkdir(parents=True, exist_ok=True)
    # O_NOFOLLOW: a link planted at the lock's name cannot make us create or truncate another file.
    with os.fdopen(os.open(folder / ".lock", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def committed_folder(stage: RemoteStage, url: str, fs: Any = None) -> CommittedFolder:
    """The bucket folder holding ``stage``'s outputs at ``url``, with their manifest as its record."""
    folder, name = layout(stage, url.rstrip("/"))
    return CommittedFolder(folder, name, fs)


def _sizes(manifest: Manifest) -> dict[str, int]:
    return {name: recorded["size"] for name, recorded in manifest.outputs.items()}


def read_remote_manifest(stage: RemoteStage, url: str, fs: Any) -> tuple[Manifest, bytes] | None:
    """The manifest at ``url`` and its bytes; None when there is none."""
    folder = committed_folder(stage, url, fs)
    data = folder.read_record()
    if data is None:
        return None
    try:
        return Manifest(**json.loads(data)), data
    except (json.JSONDecodeError, TypeError, UnicodeDecodeError) as exc:
        raise StageInputError(f"{folder.path(folder.record)} is not a valid manifest ({exc}). "
                              f"{stage.hint(force=True)}") from None


def remote_problems(stage: RemoteStage, url: str, manifest: Manifest, fs: Any) -> list[str]:
    """Why the outputs a bucket manifest lists cannot be used (empty: every file is there with its size)."""
    problems = [] if manifest.complete else ["the manifest is not marked complete"]
    problems += committed_folder(stage, url, fs).problems(_sizes(manifest))
    if not problems and stage.usable:
        problems += stage.usable(manifest)
    return problems


def fetch(stage: RemoteStage, url: str, only: Callable[[str], bool] | None = None) -> Path:
    """``stage``'s outputs at ``url`` in the verified local cache (module doc); the local location returned
    stands for ``url`` (a dataset prefix or a folder). ``only`` picks the outputs to download (count_tokens
    needs the .idx alone); every listed output must still be in the bucket with its size."""
    url = url.rstrip("/")
    fs = filesystem(url)
    folder = committed_folder(stage, url, fs)
    found = read_remote_manifest(stage, url, fs)
    if found is None:
        raise StageInputError(f"{folder.path(folder.record)} not found: the {stage.title} outputs at {url} are "
                              f"missing or incomplete (a run or an upload that did not finish writes no manifest). "
                              f"{stage.hint()}")
    manifest, data = found
    local = cache_location(stage, url)
    root = local.parent if stage.beside_prefix else local
    wanted = {n: r for n, r in manifest.outputs.items() if only is None or only(n)}
    sizes, mtimes = {n: r["size"] for n, r in wanted.items()}, {n: r["mtime_ns"] for n, r in wanted.items()}
    with _locked(root):
        kept = root / folder.record
        if kept.is_file() and kept.read_bytes() == data and local_matches(root, sizes, mtimes):
            return local
        problems = remote_problems(stage, url, manifest, fs)
        if problems:
            raise StageInputError(f"{stage.title} outputs at {url} are not usable: {'; '.join(problems)}. "
                                  f"{stage.hint(force=True)}")
        started = time.monotonic()
        try:
            fetched = folder.fetch(sizes, root, record=data, keep=kept, mtimes=mtimes)
        except OSError as exc:
            raise StageInputError(f"{stage.title} outputs at {url}: {exc}. {stage.hint()}") from None
    log.info(f"fetched {url} ({len(wanted)} of {len(manifest.outputs)} file(s), {fetched / 2**20:,.1f} MiB in "
             f"{time.monotonic() - started:.1f} s) into {local}")
    return local


def publish(stage: RemoteStage, local: Path, url: str) -> None:
    """Upload the finished local output ``local`` to ``url``: outputs, the resolved config, the manifest last.
    Nothing is sent when the bucket already holds this very manifest and its files."""
    url = url.rstrip("/")
    fs = filesystem(url)
    folder = committed_folder(stage, url, fs)
    manifest_path = stage.manifest_path(local)
    data = manifest_path.read_bytes()
    manifest = Manifest.read(manifest_path)
    unusable = stage.problems(manifest, manifest_path.parent)
    if unusable:  # e.g. an export that failed verification: kept locally for inspection, never published
        log.warning(f"{local} is not uploaded to {url}: {'; '.join(unusable)}")
        return
    found = read_remote_manifest(stage, url, fs)
    if found is not None and found[1] == data and not remote_problems(stage, url, found[0], fs):
        return
    if found is not None:
        folder.withdraw()
    started = time.monotonic()
    config = resolved_config_path(manifest_path, stage.name)
    folder.put(manifest_path.parent, [*manifest.outputs, *([config.name] if config.is_file() else [])])
    try:
        folder.commit(data, _sizes(manifest))
    except OSError as exc:
        raise OSError(f"after the upload to {url}: {exc}; the manifest was not written") from None
    size = sum(r["size"] for r in manifest.outputs.values())
    log.info(f"uploaded {len(manifest.outputs)} file(s) ({size / 2**20:,.1f} MiB in {time.monotonic() - started:.1f} "
             f"s) and then the manifest to {url}")


def run_published(stage: RemoteStage, url: str, config: Any, inputs: dict[str, Any], work: Callable[[], StageResult],
                  force: bool = False, versions: tuple[str, ...] = ()) -> Manifest:
    """``Stage.run`` for a URL: skipped when the bucket's manifest is current (same config and inputs, files
    there); else made in ``staging(stage, url)`` (``work`` writes there) and published."""
    if not force:
        fs = filesystem(url)
        found = read_remote_manifest(stage, url, fs)
        if found is not None:
            old = found[0]
            if old.config == to_plain(config) and old.inputs == inputs and not remote_problems(stage, url, old, fs):
                log.info(f"{url} is up to date (same inputs and config); nothing to do. Use --force to redo.")
                return old
    local = staging(stage, url)
    manifest = run_local(stage, local, config, inputs, work, force=force, versions=versions)
    publish(stage, local, url)
    return manifest
