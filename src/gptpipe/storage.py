"""Object storage: which config values are URLs, and the fsspec filesystem that reads and writes them.

A config key typed ``Url | Path`` (config/core.py) holds either a local path or a URL such as
``s3://bucket/runs/ja-350m`` or ``gs://bucket/runs/ja-350m`` (any fsspec protocol whose package is installed:
s3fs for s3://, gcsfs for gs://). Credentials come only from the environment and each cloud's standard chain
(AWS_* variables and profiles, GOOGLE_APPLICATION_CREDENTIALS, the metadata servers); nothing here reads,
stores or prints one, and a URL carrying ``user:secret@`` is refused. S3-compatible stores (MinIO, R2, a
test server) are reached through ``storage.endpoint_url`` in config.yaml or the standard
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` variables, which boto3 and s3fs read themselves.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gptpipe.config.core import Url, has_scheme, option

# The package that serves each common protocol, for the "pip install" hint.
PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}
S3_PROTOCOLS = ("s3", "s3a")

# Uploads to S3 (s3fs's own concurrency: files at once, each of two parts or more a multipart upload of concurrent
# parts). A bucket limits each connection, so what counts is the requests in flight: UPLOAD_PARTS_IN_FLIGHT, shared
# by up to UPLOAD_FILES_AT_ONCE files (each at least 2 parts at once), over as many pooled connections. Parts are
# UPLOAD_PART (AWS suggests 8-16 MB; s3fs's own 50 MiB leave a 64 MiB ZeRO shard one PUT on one connection). s3fs
# reads a file's parts at once into memory (a file under two parts whole), so an upload holds at most
# UPLOAD_PARTS_IN_FLIGHT x UPLOAD_PART = 256 MiB. S3 takes at most S3_MAX_PARTS parts a file: a larger file (over
# 156 GiB) gets larger parts, and the bound grows with it.
UPLOAD_PART = 16 << 20
UPLOAD_PARTS_IN_FLIGHT = 16
UPLOAD_FILES_AT_ONCE = 8
S3_MAX_PARTS = 10_000


@dataclass
class StorageConfig:
    """How gptpipe reaches object storage (the credentials never go here: they come from the environment)."""

    endpoint_url: str | None = option(
        None, "S3-compatible endpoint (MinIO, R2...), e.g. http://127.0.0.1:9000 (None: AWS_ENDPOINT_URL_S3 / "
              "AWS_ENDPOINT_URL, else AWS itself)")

    def check(self) -> list[tuple[str, str]]:
        if self.endpoint_url is None:
            return []
        parts = urlsplit(self.endpoint_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return [("endpoint_url", f"expected http(s)://host[:port], got {self.endpoint_url!r}")]
        if parts.username or parts.password:
            return [("endpoint_url", "must not carry credentials: set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
                                     "in the environment instead")]
        return []

    def apply(self) -> None:
        """Make ``endpoint_url`` this process's S3 endpoint, and its children's (training ranks): as
        AWS_ENDPOINT_URL_S3, which s3fs, boto3 and megatron-core all read. cli.main calls it for every command."""
        if self.endpoint_url:
            os.environ["AWS_ENDPOINT_URL_S3"] = self.endpoint_url


def is_url(value: Any) -> bool:
    """True for a config value naming object storage (``scheme://…``), False for a local path."""
    return isinstance(value, Url) or has_scheme(value)


def protocol(url: str) -> str:
    return url.split("://", 1)[0].lower()


def check_url(url: str) -> list[str]:
    """Problems with ``url`` as a place to read or write (empty: usable), found before any work starts."""
    import fsspec

    problems = []
    parts = urlsplit(url)
    if "@" in parts.netloc:  # the URL itself is not repeated: it holds a secret
        return ["the URL carries credentials (user:secret@); put them in the environment (AWS_*, "
                "GOOGLE_APPLICATION_CREDENTIALS) and write the URL without them"]
    if not parts.netloc:
        problems.append(f"{url!r} names no bucket")
    proto = protocol(url)
    if proto not in fsspec.available_protocols():
        problems.append(f"{proto}:// is not a storage protocol fsspec knows")
    else:
        try:
            fsspec.get_filesystem_class(proto)
        except ImportError:
            problems.append(f"{proto}:// needs the package {PACKAGES.get(proto, 'that serves it')}: "
                            f"pip install {PACKAGES.get(proto, '')}".rstrip())
    return problems


def url_problems(config: object, keys: tuple[str, ...]) -> list[tuple[str, str]]:
    """check_url's problems with the URL values of a config's ``keys`` (one value or a list each), for its check()."""
    problems = []
    for key in keys:
        value = getattr(config, key)
        for i, item in enumerate(value) if isinstance(value, list) else [(None, value)]:
            if is_url(item):
                problems += [(key if i is None else f"{key}.{i}", p) for p in check_url(item)]
    return problems


def filesystem(url: str, endpoint_url: str | None = None) -> Any:
    """The fsspec filesystem for ``url``; ``endpoint_url`` (storage.endpoint_url) points s3:// elsewhere."""
    import fsspec

    proto = protocol(url)
    options: dict[str, Any] = {}
    # Fail fast and let the caller's retry loop (the mirror's backoff, with its console note) do the waiting:
    # a dead endpoint must show within a short SIGTERM grace, not after a client's own retries. The endpoint the
    # environment names is passed on explicitly: fsspec caches a filesystem per arguments, and one made for
    # another endpoint (the variable changed within the process) must not be served again.
    if proto in S3_PROTOCOLS:
        # One botocore attempt (s3fs still retries dropped connections and timeouts itself, ~2 s in all); the
        # read timeout only bounds the wait for the store's answer, not a transfer. The pool has a connection for
        # every part an upload has in flight (botocore's default is 10).
        options["config_kwargs"] = {"connect_timeout": 5, "read_timeout": 60,
                                    "retries": {"max_attempts": 1, "mode": "standard"},
                                    "max_pool_connections": UPLOAD_PARTS_IN_FLIGHT}
        endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint_url:
            options["endpoint_url"] = endpoint_url
    elif proto in ("gs", "gcs"):
        # gcsfs's own retries (6 tries, ~30 s of backoff) cannot be lowered; a hung request at least ends
        # (connect and per-read timeouts: a whole request, e.g. a download of a large .bin, may take long).
        import aiohttp

        options["requests_timeout"] = aiohttp.ClientTimeout(sock_connect=5, sock_read=60)
        if os.environ.get("STORAGE_EMULATOR_HOST"):
            options["endpoint_url"] = os.environ["STORAGE_EMULATOR_HOST"]
    elif proto == "file":  # a folder behind a URL: parent folders made as needed, as a bucket's keys need none
        options["auto_mkdir"] = True
    return fsspec.filesystem(proto, **options)


def upload_options(fs: Any, sizes: list[int]) -> dict[str, Any]:
    """The keyword arguments of ``fs.put`` that send files of ``sizes`` bytes at once, each in concurrent parts:
    s3fs's ``batch_size`` (files at once), ``chunksize`` and ``max_concurrency`` (parts at once per file), within
    UPLOAD_PARTS_IN_FLIGHT parts in all. Empty for other filesystems: gcsfs sends a file's chunks one after another
    (its ``chunksize`` would only make them smaller), a local one copies."""
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    if not sizes or not protocols & set(S3_PROTOCOLS):
        return {}
    files = min(UPLOAD_FILES_AT_ONCE, len(sizes))
    return {"batch_size": files, "chunksize": max(UPLOAD_PART, -(-max(sizes) // S3_MAX_PARTS)),
            "max_concurrency": max(2, UPLOAD_PARTS_IN_FLIGHT // files)}


def strip_protocol(url: str) -> str:
    """``s3://bucket/key`` → ``bucket/key``, the form fsspec's listings return."""
    return url.split("://", 1)[1].rstrip("/")


def join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *(p.strip("/") for p in parts)])


def local_name(url: str) -> str:
    """The last component of ``url`` (a run's name), for local folders that stand in for it."""
    return Path(strip_protocol(url)).name or "run"


def local_folder(url: str, kind: str) -> Path:
    """The local folder that stands for the bucket folder ``url``: ``<system temp>/<kind>-<uid>/<digest of the
    URL>/<its last component>`` (``TMPDIR`` moves it). ``kind`` keeps apart what a reader fetched
    (``gptpipe-cache``) and a training run's own staging folder (``gptpipe-runs``). The folder is the user's own
    (private_folder), so another user of the machine cannot plant files a later run would trust."""
    url = url.rstrip("/")
    digest = hashlib.sha256(url.encode()).hexdigest()[:10]
    return private_folder(Path(tempfile.gettempdir()) / f"{kind}-{os.getuid()}") / digest / local_name(url)


def private_folder(folder: Path) -> Path:
    """`folder`, made with mode 0700 if new; refused unless it is a real folder (no link) that this user owns
    and nobody else may write."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(folder)
    except OSError as exc:
        raise OSError(f"{folder}: cannot make the private cache folder ({exc.strerror})") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise OSError(f"{folder} is not a private folder of this user (owner uid {st.st_uid}, mode "
                      f"{stat.S_IMODE(st.st_mode):o}{', a link' if stat.S_ISLNK(st.st_mode) else ''}): another user "
                      "could plant files in it. Remove it, or set TMPDIR to a folder of your own")
    return folder


def cache_folder(url: str) -> Path:
    """Where a reader keeps its verified copy of the bucket folder ``url`` (stage outputs, a checkpoint)."""
    return local_folder(url, "gptpipe-cache")
