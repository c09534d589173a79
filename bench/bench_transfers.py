"""Bucket transfers through gptpipe's committed folders (committed.py: put, commit, fetch), one stream against what
gptpipe does now, in one run on moto's S3 server on a loopback port, optionally behind a proxy that gives each TCP
connection a remote bucket's per-stream limits (bench/throttle_proxy.py).

    .venv/bin/python bench/bench_transfers.py [--mib 512] [--files 8] [--rounds 3] [--mib-per-s 12 --rtt-ms 20]

  one stream   one file at a time, each in one request (s3fs max_concurrency=1, its default parts): gptpipe before
               issue 44
  now          gptpipe's own filesystem (storage.filesystem) and committed.put / fetch as they are: uploads with
               storage.upload_options (up to 8 files at once, 16 parts of 16 MiB in flight in all), downloads
               FILES_AT_ONCE files at once, each large one in s3fs's own concurrent ranged parts (10 x 50 MiB)
Two payloads: a checkpoint-shaped folder (`--files` files of random bytes, `--mib` in all: one ZeRO shard per rank)
and one file of `--mib` (a stage-2 .bin). Rounds alternate the two kinds (each goes first in turn); the figure is the
median MiB/s. Without the proxy the store and the client share this machine's cores and every stream is CPU-bound;
with it (`--mib-per-s`), a stream is bound by its connection, as against a real bucket. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

from gptpipe import committed, storage
from gptpipe.ports import free_port

HERE = Path(__file__).resolve().parent

# moto's server, one change: a ranged GET reads only its range. moto answers one by reading the whole object and
# slicing it (responses.py, _handle_range_header cuts key.value), so a file fetched in N ranged parts costs it N
# whole reads where a real store pays for the ranges alone. Here an object's bytes are read once and kept (objects
# are written whole through the value setter, which drops the kept copy).
MOTO = """
from moto.s3.models import FakeKey
from moto.server import ThreadedMotoServer
import time
read, write = FakeKey.value.fget, FakeKey.value.fset
def kept(key):
    if '_bench_bytes' not in key.__dict__:
        key.__dict__['_bench_bytes'] = read(key)
    return key.__dict__['_bench_bytes']
def replaced(key, value):
    key.__dict__.pop('_bench_bytes', None)
    write(key, value)
FakeKey.value = property(kept, replaced)
ThreadedMotoServer(ip_address='127.0.0.1', port={port}, verbose=False).start()
time.sleep(1e9)
"""


def folder_of(work: Path, files: int, mib: int) -> dict[str, int]:
    """The checkpoint-shaped folder (or with one file, a .bin): its file names and sizes."""
    names = [f"zero_pp_rank_{i}_mp_rank_00_optim_states.pt" for i in range(files)] if files > 1 else ["text.bin"]
    sizes = {name: (mib << 20) // files for name in names}
    for name, size in sizes.items():
        with open(work / name, "wb") as fh:
            fh.write(os.urandom(size))
    return sizes


def transfer(url: str, work: Path, sizes: dict[str, int], one_stream: bool,
             read_timeout: float | None = None) -> tuple[float, float]:
    """(upload MiB/s, download MiB/s) of the folder through a committed folder at `url`. `read_timeout`: s3fs's
    defaults (storage.filesystem's concurrency) with this read timeout for both kinds, for files so large that
    moto's completion of a multipart upload outlasts storage.filesystem's 60 s."""
    import s3fs

    if one_stream or read_timeout:
        fs = s3fs.S3FileSystem(endpoint_url=os.environ["AWS_ENDPOINT_URL"], skip_instance_cache=True,
                               max_concurrency=1 if one_stream else 10,
                               config_kwargs={"read_timeout": read_timeout or 60})
    else:
        fs = storage.filesystem(url)
    folder = committed.CommittedFolder(url, "complete", fs)
    total = sum(sizes.values()) / 2**20
    with mock.patch.object(committed, "FILES_AT_ONCE", 1 if one_stream else committed.FILES_AT_ONCE), \
            mock.patch.object(committed, "upload_options",
                              (lambda fs, sizes: {}) if one_stream else committed.upload_options):
        started = time.perf_counter()
        folder.put(work, sizes)
        folder.commit(b"x", sizes)
        up = total / (time.perf_counter() - started)
        target = work.parent / f"down-{time.monotonic_ns()}"
        started = time.perf_counter()
        folder.fetch(sizes, target)
        down = total / (time.perf_counter() - started)
    shutil.rmtree(target)
    fs.rm(url, recursive=True)
    return up, down


@contextlib.contextmanager
def store(mib_per_s: float, rtt_ms: float) -> Iterator[None]:
    """moto's S3 server on a loopback port (its own process), behind the throttling proxy when `mib_per_s`, with
    the bucket `bench-transfers`; the environment points s3fs at it."""
    port = free_port()
    endpoint = port
    children = [subprocess.Popen([sys.executable, "-c", MOTO.replace("{port}", str(port))], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)]
    if mib_per_s:
        endpoint = free_port()
        children.append(subprocess.Popen([sys.executable, str(HERE / "throttle_proxy.py"), "--listen", str(endpoint),
                                          "--upstream", str(port), "--mib-per-s", str(mib_per_s),
                                          "--rtt-ms", str(rtt_ms)]))
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://127.0.0.1:{endpoint}")
    try:
        import s3fs

        for _ in range(100):
            try:
                s3fs.S3FileSystem(endpoint_url=os.environ["AWS_ENDPOINT_URL"], skip_instance_cache=True).mkdir(
                    "bench-transfers")
                break
            except OSError:
                time.sleep(0.1)
        yield
    finally:
        for child in children:
            child.kill()


def link(mib_per_s: float, rtt_ms: float) -> str:
    """The emulated link, in words."""
    return (f"each connection capped at {mib_per_s:g} MiB/s each way, {rtt_ms:g} ms round trip" if mib_per_s
            else "no cap")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="each payload's size")
    parser.add_argument("--files", type=int, default=8, help="the folder's number of files")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mib-per-s", type=float, default=0.0,
                        help="cap each TCP connection at this rate each way (a proxy in front of moto); 0: no proxy")
    parser.add_argument("--rtt-ms", type=float, default=20.0, help="the proxy's round-trip delay")
    args = parser.parse_args()
    payloads = {f"{args.files} files, {args.mib} MiB (a checkpoint)": args.files, f"1 file, {args.mib} MiB (a .bin)": 1}
    figures: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    loads = [os.getloadavg()[0]]
    with store(args.mib_per_s, args.rtt_ms), tempfile.TemporaryDirectory() as tmp:
        for p, (label, files) in enumerate(payloads.items()):
            work = Path(tmp) / f"payload{p}"
            work.mkdir()
            sizes = folder_of(work, files, args.mib)
            for round_ in range(args.rounds):
                for one_stream in (round_ % 2 == 0, round_ % 2 == 1):
                    got = transfer(f"s3://bench-transfers/p{p}-r{round_}-{one_stream}", work, sizes, one_stream)
                    figures.setdefault((label, one_stream), []).append(got)
                    loads.append(os.getloadavg()[0])
                    print(label, "one stream" if one_stream else "now", f"up {got[0]:.1f} down {got[1]:.1f} MiB/s",
                          f"load {loads[-1]:.1f}", file=sys.stderr, flush=True)
            shutil.rmtree(work)
    print(f"| loopback moto S3, {link(args.mib_per_s, args.rtt_ms)}; {os.cpu_count()} cores, load "
          f"{min(loads):.1f}-{max(loads):.1f}; median of {args.rounds} | one stream | now | now / one stream |\n"
          f"|---|---|---|---|")
    for label in payloads:
        for i, what in enumerate(("upload (put + commit)", "download (fetch)")):
            one = statistics.median(f[i] for f in figures[(label, True)])
            now = statistics.median(f[i] for f in figures[(label, False)])
            print(f"| {label}: {what}, MiB/s | {one:.1f} | {now:.1f} | {now / one:.2f}x |")


if __name__ == "__main__":
    main()
