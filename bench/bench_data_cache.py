"""A stage-2 dataset in a bucket: gptpipe's verified local cache vs megatron-core's own S3 reader.

Writes a synthetic dataset (uint16 tokens, --documents of 200-1,800 tokens) with its manifest, publishes it to
moto's S3 server on a loopback port (pip install s3fs "moto[server]"), then reads --samples random documents
(training's shuffled order jumps like this) two ways:

  gptpipe   fetch once into the cache (gptpipe.remote.fetch), then megatron-core's IndexedDataset on the copy
  megatron  IndexedDataset("s3://…", object_storage_config=ObjectStorageConfig(bin_chunk_nbytes=…)), which
            streams the .bin in chunks of that size through boto3

    .venv/bin/python bench/bench_data_cache.py [--documents 40000] [--samples 200]
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import tempfile
import time
from pathlib import Path

import numpy as np

from gptpipe.ports import free_port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=40_000)
    parser.add_argument("--samples", type=int, default=200)
    args = parser.parse_args()
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = free_port()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL_S3=f"http://127.0.0.1:{port}")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    work = Path(tempfile.mkdtemp(prefix="bench-data-cache-"))
    tempfile.tempdir = str(work)  # the fetch cache goes there too

    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.object_storage_utils import ObjectStorageConfig

    from gptpipe.data.indexed import IndexedDatasetWriter, bin_path, idx_path
    from gptpipe.remote import fetch, publish
    from gptpipe.stage import StageResult, run_stage
    from gptpipe.artifacts import TOKENIZE
    from gptpipe.storage import filesystem

    rng = np.random.default_rng(0)
    sizes = rng.integers(200, 1800, args.documents).astype(np.int32)
    prefix = work / "source" / "ds"
    prefix.parent.mkdir()

    def write() -> StageResult:
        part = work / "tokens.bin"
        rng.integers(0, 32_000, int(sizes.sum())).astype(np.uint16).tofile(part)
        writer = IndexedDatasetWriter(bin_path(prefix), np.dtype(np.uint16))
        writer.add_raw(part, sizes)
        writer.close()
        writer.finalize(idx_path(prefix))
        return StageResult([bin_path(prefix), idx_path(prefix)],
                           {"dtype": "uint16", "documents": args.documents, "tokens": int(sizes.sum())})

    run_stage(TOKENIZE, prefix, {}, {}, write)
    filesystem("s3://bench").mkdir("bench")
    publish(TOKENIZE, prefix, "s3://bench/ds")
    mib = bin_path(prefix).stat().st_size / 2**20
    picks = random.Random(0).sample(range(args.documents), args.samples)
    print(f"| {args.documents:,} documents, {mib:.0f} MiB .bin, {args.samples} random documents | |\n|---|---|")

    started = time.perf_counter()
    local = fetch(TOKENIZE, "s3://bench/ds")
    fetched = time.perf_counter() - started
    started = time.perf_counter()
    dataset = IndexedDataset(str(local))
    for i in picks:
        dataset[i]
    print(f"| gptpipe: fetch into the cache (once per machine) | {fetched:.1f} s ({mib / fetched:.0f} MiB/s) |")
    print(f"| gptpipe: then per document, from the cached copy | "
          f"{(time.perf_counter() - started) / args.samples * 1e3:.2f} ms |")
    for chunk in (1 << 20, 16 << 20, 256 << 20):
        config = ObjectStorageConfig(path_to_idx_cache=str(work / f"idx-{chunk}"), bin_chunk_nbytes=chunk)
        started = time.perf_counter()
        dataset = IndexedDataset("s3://bench/ds", mmap=False, object_storage_config=config)
        for i in picks:
            dataset[i]
        print(f"| megatron-core S3 reader, {chunk >> 20} MiB chunks: per document | "
              f"{(time.perf_counter() - started) / args.samples * 1e3:.1f} ms |")
    server.stop()


if __name__ == "__main__":
    main()
