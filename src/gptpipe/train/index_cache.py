"""megatron-core's index cache (data.cache_dir): built once per folder, by one process, mapped by every rank.

megatron-core builds its document, sample and shuffle indices on global rank 0 and has every other rank load them
from `path_to_cache` after a barrier; a rank that shares no cache folder with rank 0 (nodes staging on disks of
their own) finds nothing there and fails. Here the ranks first find out who sees the same folder (`builds_here`):
the lowest rank of each folder builds the indices, in a child process in a group of its own (megatron then builds
and saves every index itself, and the rank's own memory never holds the build's arrays), into a temporary sibling
renamed into place when complete (a temporary that a killed builder left is removed by the next builder on its
host). Every rank then opens the indices through megatron-core, all cache hits, each
array memory-mapped: the page cache of a node holds them once, whatever its number of ranks.

The cached indices sit in a folder named by what they are derived from (`indices_folder`): the datasets' stage-2
manifests, the split, the seed, the sample counts and the sequence length; a rerun of stage 2 or another setting
gets a new folder, so a stale cache is never read.

Where the data lives in a bucket (data.prefixes are URLs), the indices live there too (`bucket_copy`): the first
builder uploads them, with the split orders they were cut from, beside the first dataset, and every later builder
(another node, a restart on a fresh machine) downloads them in parallel parts instead of building (`provide`).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from gptpipe.artifacts import TOKENIZE
from gptpipe.committed import CommittedFolder
from gptpipe.data.split import ORDER_FILE_PREFIX, order_file
from gptpipe.lock import owner_suffix, process_gone, temporary_owner
from gptpipe.log import get_logger
from gptpipe.stage import StageInputError
from gptpipe.storage import is_url
from gptpipe.trust import check_index_cache

log = get_logger("train")
TEMPORARY = ".tmp-"  # a builder's folder until complete: indices-<key>.tmp-<nonce>-<pid>@<host> (lock.owner_suffix)
COPY_RECORD = "indices.json"  # a bucket copy's record, written last: {"files": {name: size}} (gptpipe.committed)


def indices_folder(cache_dir: Path, prefixes: list[Any], settings: dict[str, Any]) -> Path:
    """The folder of `cache_dir` for the indices of these datasets (by their manifests) built with `settings`."""
    key = json.dumps({"datasets": [TOKENIZE.fingerprint(p) for p in prefixes], **settings}, sort_keys=True,
                     default=str)
    return cache_dir / f"indices-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def builds_here(folder: Path) -> bool:
    """Whether this process builds `folder`'s indices: the lowest rank among those that see the same folder (one
    per job where the ranks share it, one per node where each node has its own). Every rank must call it."""
    import torch.distributed as td

    if not td.is_initialized():
        return True
    nonce: list[Any] = [uuid.uuid4().hex]
    td.broadcast_object_list(nonce, src=0)
    folder.parent.mkdir(parents=True, exist_ok=True)
    probe = folder.parent / f".probe-{nonce[0]}-{td.get_rank()}"
    probe.write_text("")
    td.barrier()
    seen = [int(p.name.rsplit("-", 1)[1]) for p in folder.parent.glob(f".probe-{nonce[0]}-*")]
    td.barrier()  # every rank has looked before any probe goes
    probe.unlink()
    return min(seen) == td.get_rank()


def bucket_copy(prefixes: list[Any], folder: Path, local_paths: list[str]) -> CommittedFolder | None:
    """Where `folder`'s indices are kept in the bucket: beside the first dataset when it is a URL
    (`<prefix URL>.indices/<folder name>-<digest>`), else None. megatron-core names its index files by the local
    paths it reads the datasets from (`local_paths`), so the digest covers them: nodes that stage the data at the
    same paths (the same user and TMPDIR: gptpipe.storage.local_folder) share a copy, others build their own."""
    if not is_url(str(prefixes[0])):
        return None
    digest = hashlib.sha256(json.dumps(local_paths).encode()).hexdigest()[:10]
    return CommittedFolder(f"{str(prefixes[0]).rstrip('/')}.indices/{folder.name}-{digest}", COPY_RECORD)


def provide(folder: Path, copy: CommittedFolder | None, orders: list[tuple[int, int]], build: Any,
            *args: Any) -> None:
    """`folder`'s indices, unless it exists: the bucket copy's where there is one (`copy`), else built by
    `build_in_child` and then uploaded to `copy` with the split orders (documents, seed) they were cut from, for
    the next node or restart. A copy that cannot be read or uploaded costs a build, never the run."""
    if folder.is_dir():
        return
    remove_killed_builds(folder.parent)  # a killed download leaves its temporary as a killed build does
    if copy is not None and fetch_copy(copy, folder):
        return
    build_in_child(folder, build, *args)
    if copy is not None:
        try:
            publish_copy(copy, folder, sorted({order_file(folder.parent, *order) for order in orders}))
        except OSError as exc:
            log.warning(f"the dataset indices were not uploaded to {copy.url} ({exc}); the next node builds its own")


def fetch_copy(copy: CommittedFolder, folder: Path) -> bool:
    """Download the committed copy into `folder` (its split orders beside it, in the cache folder), through a
    temporary sibling renamed into place; False where there is none or it cannot be used (said why)."""
    record = copy.read_record()
    if record is None:
        return False
    try:
        files = {str(name): int(size) for name, size in json.loads(record)["files"].items()}
        problems = copy.problems(files)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        problems = [f"its record {copy.path(copy.record)} is not one gptpipe wrote ({exc!r})"]
    if problems:
        log.warning(f"not using the dataset indices at {copy.url}: {problems[0]}; building them here")
        return False
    temporary = _temporary(folder)
    started = time.monotonic()
    try:
        copy.fetch(files, temporary)
        check_index_cache(temporary)  # loaded with allow_pickle: a planted object array would run code
        for order in temporary.glob(f"{ORDER_FILE_PREFIX}*"):
            os.replace(order, folder.parent / order.name)  # the same bytes wherever an order was computed
        _into_place(temporary, folder)
    except (OSError, StageInputError) as exc:
        shutil.rmtree(temporary, ignore_errors=True)
        log.warning(f"not using the dataset indices at {copy.url}: {exc}; building them here")
        return False
    log.info(f"fetched the dataset indices from {copy.url} ({sum(files.values()) / 2**20:,.1f} MiB in "
             f"{time.monotonic() - started:.1f} s) into {folder}")
    return True


def publish_copy(copy: CommittedFolder, folder: Path, orders: list[Path]) -> None:
    """Upload `folder`'s files and the split orders `orders` to `copy`, the record last; nothing when another
    builder committed it first (the same key: the same indices)."""
    if copy.read_record() is not None:
        return
    started = time.monotonic()
    indices = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    copy.put(folder, indices)
    copy.put(folder.parent, [p.name for p in orders])
    files = {**indices, **{p.name: p.stat().st_size for p in orders}}
    copy.commit(json.dumps({"files": files}, sort_keys=True).encode(), files)
    log.info(f"uploaded the dataset indices to {copy.url} ({sum(files.values()) / 2**20:,.1f} MiB in "
             f"{time.monotonic() - started:.1f} s) for the next node or restart")


def _temporary(folder: Path) -> Path:
    """A sibling of `folder` of this process's own (another job sharing the cache folder may be making the same
    indices right now), named with the process that removes it if it fails, for the next builder to tell
    whether it was killed."""
    temporary = folder.with_name(f"{folder.name}{TEMPORARY}{uuid.uuid4().hex[:8]}-{owner_suffix()}")
    temporary.mkdir(parents=True)
    return temporary


def _into_place(temporary: Path, folder: Path) -> None:
    try:
        os.rename(temporary, folder)
    except OSError:  # another job sharing this cache folder finished the same indices first
        if not folder.is_dir():
            raise
        shutil.rmtree(temporary, ignore_errors=True)


def build_in_child(folder: Path, build: Any, *args: Any) -> None:
    """Build `folder` by calling build(*args, path_to_cache) in a child Python process, rank 0 of a process group
    of its own, into a temporary sibling renamed into place when complete."""
    temporary = _temporary(folder)
    log.info(f"building the dataset indices into {folder}")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    job = pickle.dumps((build, (*args, temporary)))
    try:
        subprocess.run([sys.executable, "-m", "gptpipe.train.index_cache"], input=job, env=env, check=True)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    _into_place(temporary, folder)


def remove_killed_builds(cache_dir: Path) -> None:
    """Remove the temporaries in `cache_dir` of builders (or downloads of a bucket copy) on this host that were
    killed mid-way (one that fails removes its own; SIGKILL, an OOM kill or a node's crash leave them, each as
    large as the indices)."""
    for path in cache_dir.glob(f"indices-*{TEMPORARY}*"):
        owner = temporary_owner(path.name)
        if owner is not None and process_gone(*owner):
            log.info(f"removing {path}: left by a build that was killed (pid {owner[1]})")
            shutil.rmtree(path, ignore_errors=True)


def _child() -> None:
    import warnings

    # megatron-core's import notices, silenced as in the ranks (runtime/engine.py says why)
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed", category=UserWarning,
                            module=r"megatron\.core")
    build, args = pickle.loads(sys.stdin.buffer.read())  # the bytes build_in_child wrote
    import torch.distributed as td

    # A group of this one process: megatron's blended dataset asks for the rank where its GPT datasets check
    # first whether there is a group, and as rank 0 of its own group the child builds every index.
    td.init_process_group("gloo", store=td.HashStore(), rank=0, world_size=1)
    try:
        build(*args)
    finally:
        td.destroy_process_group()


if __name__ == "__main__":
    _child()
