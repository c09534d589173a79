"""Bucket transfers of a checkpoint-shaped folder through gptpipe's committed folders (committed.py: put, commit,
fetch), one stream against what gptpipe does now, in one run on moto's S3 server on a loopback port.

    .venv/bin/python bench/bench_transfers.py [--mib 512] [--files 8] [--rounds 3]

  one stream   one file at a time, each in one request (s3fs max_concurrency=1): gptpipe before this bench
  now          FILES_AT_ONCE files at once, each large one in s3fs's own concurrent ranged parts (its default)
The folder: `--files` files of random bytes, `--mib` in all (a ZeRO checkpoint: one shard per rank plus the model
states). Rounds alternate the two kinds (each goes first in turn); the figure is the median MiB/s. On loopback the
store and the client share this machine's cores, so the ratio here is a floor: a remote store's per-stream limit
(round trips, per-connection bandwidth) is what the concurrency hides. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

from gptpipe import committed
from gptpipe.ports import free_port

MOTO = ("from moto.server import ThreadedMotoServer; import time\n"
        "ThreadedMotoServer(ip_address='127.0.0.1', port={port}, verbose=False).start()\n"
        "time.sleep(1e9)")


def folder_of(work: Path, files: int, mib: int) -> dict[str, int]:
    """The checkpoint-shaped folder: its file names and sizes."""
    sizes = {f"zero_pp_rank_{i}_mp_rank_00_optim_states.pt": (mib << 20) // files for i in range(files)}
    for name, size in sizes.items():
        with open(work / name, "wb") as fh:
            fh.write(os.urandom(size))
    return sizes


def transfer(url: str, work: Path, sizes: dict[str, int], one_stream: bool) -> tuple[float, float]:
    """(upload MiB/s, download MiB/s) of the folder through a committed folder at `url`."""
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=os.environ["AWS_ENDPOINT_URL"], skip_instance_cache=True,
                           max_concurrency=1 if one_stream else 10)
    folder = committed.CommittedFolder(url, "complete", fs)
    total = sum(sizes.values()) / 2**20
    with mock.patch.object(committed, "FILES_AT_ONCE", 1 if one_stream else committed.FILES_AT_ONCE):
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="the folder's size")
    parser.add_argument("--files", type=int, default=8, help="its number of files")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    port = free_port()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    server = subprocess.Popen([sys.executable, "-c", MOTO.format(port=port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        import s3fs

        for _ in range(100):
            try:
                s3fs.S3FileSystem(endpoint_url=os.environ["AWS_ENDPOINT_URL"], skip_instance_cache=True).mkdir(
                    "bench-transfers")
                break
            except OSError:
                time.sleep(0.1)
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp) / "folder"
            work.mkdir()
            sizes = folder_of(work, args.files, args.mib)
            figures: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
            for round_ in range(args.rounds):
                for one_stream in (round_ % 2 == 0, round_ % 2 == 1):
                    figures[one_stream].append(transfer(f"s3://bench-transfers/r{round_}-{one_stream}", work, sizes,
                                                        one_stream))
    finally:
        server.kill()
    up = {k: statistics.median(f[0] for f in v) for k, v in figures.items()}
    down = {k: statistics.median(f[1] for f in v) for k, v in figures.items()}
    print(f"| {args.files} files, {args.mib} MiB, loopback moto S3, {os.cpu_count()} cores | one stream | now | now / "
          f"one stream |\n|---|---|---|---|")
    print(f"| upload (put + commit), MiB/s | {up[True]:.0f} | {up[False]:.0f} | {up[False] / up[True]:.2f}x |")
    print(f"| download (fetch), MiB/s | {down[True]:.0f} | {down[False]:.0f} | {down[False] / down[True]:.2f}x |")


if __name__ == "__main__":
    main()
