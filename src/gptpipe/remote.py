"""A stage's outputs at a URL: fetched into a verified local cache, or published from a local folder.

Stage outputs in a bucket keep the local layout (gptpipe.stages): a dataset's <prefix>.bin/.idx with
<prefix>.manifest.json beside them, a tokenizer or HF folder with manifest.json inside. The manifest is the
commit: a bucket has no rename, so ``publish`` uploads every output, then the resolved config, then the
manifest, and withdraws an older manifest before replacing anything. A reader trusts nothing else.

``fetch`` copies what a stage needs into ``<system temp>/gptpipe-cache/<digest of the URL>/`` (``TMPDIR``
moves it): each file lands under a temporary name, its size is checked against the manifest and its mtime set
to the recorded one, then it is renamed, and the manifest is written last. The cached copy is therefore a
local stage output that ``Stage.require`` accepts as is, and it is reused while the bucket's manifest is
byte-for-byte the cached one and the cached files match it; a killed download leaves only temporaries.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Iterator

from gptpipe.config.core import to_plain
from gptpipe.log import get_logger
from gptpipe.stage import Manifest, StageInputError, StageResult, file_fingerprint, run_stage, write_text_atomic
from gptpipe.storage import cache_folder, filesystem, is_url, join

if TYPE_CHECKING:
    from gptpipe.stages import Stage

log = get_logger("storage")


def layout(stage: Stage, location: str) -> tuple[str, str]:
    """(the URL of the folder holding the manifest and the outputs it lists, the manifest's name)."""
    location = location.rstrip("/")
    if stage.beside_prefix:
        folder, name = location.rsplit("/", 1)
        return folder, stage.manifest_path(Path(name)).name
    return location, stage.manifest_path(Path("x")).name


def cache_location(stage: Stage, url: str) -> Path:
    """The local stand-in for ``url``: where ``fetch`` puts it and where a stage publishing to it writes first."""
    url = url.rstrip("/")
    folder, _ = layout(stage, url)
    root = cache_folder(folder)
    return root / url.rsplit("/", 1)[1] if stage.beside_prefix else root


def staging(stage: Stage, location: Any) -> Path:
    """Where a stage writes ``location``: the path itself, or the local stand-in of a URL."""
    return cache_location(stage, str(location)) if is_url(location) else Path(location)


def _safe(name: str) -> bool:
    """A manifest's output name must stay inside its folder (a bucket's manifest is not trusted with paths)."""
    parts = PurePosixPath(name).parts
    return bool(parts) and not PurePosixPath(name).is_absolute() and ".." not in parts


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One fetch per cache folder at a time: ranks on one machine download once, the others then reuse."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def read_remote_manifest(stage: Stage, url: str, fs: Any) -> tuple[Manifest, bytes] | None:
    """The manifest at ``url`` and its bytes; None when there is none."""
    folder, name = layout(stage, url)
    fs.invalidate_cache()  # another process may have published since this one listed
    try:
        data = fs.cat_file(join(folder, name))
    except FileNotFoundError:
        return None
    try:
        return Manifest(**json.loads(data)), data
    except (json.JSONDecodeError, TypeError, UnicodeDecodeError) as exc:
        raise StageInputError(f"{join(folder, name)} is not a valid manifest ({exc}). "
                              f"{stage.hint(force=True)}") from None


def remote_problems(stage: Stage, url: str, manifest: Manifest, fs: Any) -> list[str]:
    """Why the outputs a bucket manifest lists cannot be used (empty: every file is there with its size)."""
    folder, _ = layout(stage, url)
    problems = [] if manifest.complete else ["the manifest is not marked complete"]
    for name, recorded in manifest.outputs.items():
        if not _safe(name):
            problems.append(f"the manifest lists {name!r}, a path outside {folder}")
            continue
        try:
            size = int(fs.info(join(folder, name))["size"])
        except FileNotFoundError:
            problems.append(f"{join(folder, name)} is missing")
            continue
        if size != recorded["size"]:
            problems.append(f"{join(folder, name)} has {size:,} bytes, its manifest records {recorded['size']:,}")
    if not problems and stage.usable:
        problems += stage.usable(manifest)
    return problems


def fetch(stage: Stage, url: str, only: Callable[[str], bool] | None = None) -> Path:
    """``stage``'s outputs at ``url`` in the verified local cache (module doc); the local location returned
    stands for ``url`` (a dataset prefix or a folder). ``only`` picks the outputs to download (count_tokens
    needs the .idx alone); every listed output must still be in the bucket with its size."""
    url = url.rstrip("/")
    fs = filesystem(url)
    folder, name = layout(stage, url)
    found = read_remote_manifest(stage, url, fs)
    if found is None:
        raise StageInputError(f"{join(folder, name)} not found: the {stage.title} outputs at {url} are missing or "
                              f"incomplete (a run or an upload that did not finish writes no manifest). {stage.hint()}")
    manifest, data = found
    local = cache_location(stage, url)
    root = local.parent if stage.beside_prefix else local
    wanted = {n: r for n, r in manifest.outputs.items() if only is None or only(n)}
    with _locked(root):
        cached = root / name
        if cached.is_file() and cached.read_bytes() == data and all(
                (root / n).is_file() and file_fingerprint(root / n) == r for n, r in wanted.items()):
            return local
        problems = remote_problems(stage, url, manifest, fs)
        if problems:
            raise StageInputError(f"{stage.title} outputs at {url} are not usable: {'; '.join(problems)}. "
                                  f"{stage.hint(force=True)}")
        cached.unlink(missing_ok=True)  # nothing here vouches for files while they are replaced
        started, fetched = time.monotonic(), 0
        for n, recorded in wanted.items():
            target = root / n
            if target.is_file() and file_fingerprint(target) == recorded:
                continue  # already fetched (a count that needed the .idx only, or an interrupted fetch)
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.part-{os.getpid()}")
            try:
                fs.get_file(join(folder, n), str(tmp))
                if tmp.stat().st_size != recorded["size"]:
                    raise StageInputError(f"{join(folder, n)} changed while it was downloaded "
                                          f"({tmp.stat().st_size:,} bytes, the manifest records {recorded['size']:,})")
                os.utime(tmp, ns=(recorded["mtime_ns"], recorded["mtime_ns"]))  # the fingerprint it vouches for
                os.replace(tmp, target)
            finally:
                tmp.unlink(missing_ok=True)
            fetched += recorded["size"]
        write_text_atomic(cached, data.decode("utf-8"))
    log.info(f"fetched {url} ({len(wanted)} of {len(manifest.outputs)} file(s), {fetched / 2**20:,.1f} MiB in "
             f"{time.monotonic() - started:.1f} s) into {local}")
    return local


def publish(stage: Stage, local: Path, url: str) -> None:
    """Upload the finished local output ``local`` to ``url``: outputs, the resolved config, the manifest last.
    Nothing is sent when the bucket already holds this very manifest and its files."""
    url = url.rstrip("/")
    fs = filesystem(url)
    folder, name = layout(stage, url)
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
    if found is not None:  # withdrawn first: the old manifest must not vouch for files being replaced
        fs.rm_file(join(folder, name))
    started = time.monotonic()
    config = manifest_path.with_name(manifest_path.name.replace("manifest.json", "config.yaml"))
    for n in [*manifest.outputs, *([config.name] if config.is_file() else [])]:
        fs.put_file(str(manifest_path.parent / n), join(folder, n))
    problems = remote_problems(stage, url, manifest, fs)
    if problems:
        raise OSError(f"after the upload to {url}: {'; '.join(problems)}; the manifest was not written")
    fs.pipe_file(join(folder, name), data)
    size = sum(r["size"] for r in manifest.outputs.values())
    log.info(f"uploaded {len(manifest.outputs)} file(s) ({size / 2**20:,.1f} MiB in {time.monotonic() - started:.1f} "
             f"s) and then the manifest to {url}")


def run_stage_at(stage: Stage, location: Any, config: Any, inputs: dict[str, Any], work: Callable[[], StageResult],
                 force: bool = False, versions: tuple[str, ...] = ()) -> Manifest:
    """``run_stage`` for an output that may be a URL: skipped when the bucket's manifest is current (same config
    and inputs, files there); else made in ``staging(stage, location)`` (``work`` writes there) and published."""
    if not is_url(location):
        return run_stage(stage, Path(location), config, inputs, work, force=force, versions=versions)
    url = str(location)
    if not force:
        fs = filesystem(url)
        found = read_remote_manifest(stage, url, fs)
        if found is not None:
            old = found[0]
            if old.config == to_plain(config) and old.inputs == inputs and not remote_problems(stage, url, old, fs):
                log.info(f"{url} is up to date (same inputs and config); nothing to do. Use --force to redo.")
                return old
    local = staging(stage, url)
    manifest = run_stage(stage, local, config, inputs, work, force=force, versions=versions)
    publish(stage, local, url)
    return manifest
