"""Stage 3's start-up on a synthetic dataset of many documents: process start → the first training batch, per rank.

Writes a stage-2 dataset of --documents tiny documents (1-15 uint16 tokens) straight in the .idx format
(gptpipe.data.indexed.write_index) beside a sparse .bin (the ids are never read but for the first batch), with its
manifest, then starts --ranks processes on this machine (a gloo process group, as torchrun would) that each do what
`gptpipe train` does before its first step minus the model: rank 0 counts the splits for the plan and gives the
counts to all, every rank builds the datasets (`build_datasets`: one builder per cache folder, the others map its
indices) and collates its first micro-batch. Each rank prints the seconds from its process start to that batch
and its peak RSS (VmHWM); the builder also its child's. A cold start (empty cache folder) then a warm one (cache there).

    .venv/bin/python bench/bench_startup.py --documents 10_000_000 --ranks 1 4 [--work /tmp/bench-startup]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SEQ_LEN, SPLIT, SEED, SAMPLES, MICRO = 256, "969,30,1", 1234, [4096, 256, 256], 4


def write_dataset(prefix: Path, documents: int) -> float:
    """The synthetic dataset and its manifest; returns the seconds it took."""
    import numpy as np

    from gptpipe.artifacts import TOKENIZE
    from gptpipe.data.indexed import bin_path, idx_path, write_index
    from gptpipe.stage import StageResult

    started = time.perf_counter()

    def write() -> StageResult:
        sizes = np.random.default_rng(0).integers(1, 16, documents, dtype=np.int32)
        write_index(idx_path(prefix), np.dtype(np.uint16), sizes)
        with open(bin_path(prefix), "wb") as fh:  # sparse: zeros, nothing on disk
            fh.truncate(2 * int(sizes.sum(dtype=np.int64)))
        return StageResult([bin_path(prefix), idx_path(prefix)], {"dtype": "uint16", "documents": documents})

    prefix.parent.mkdir(parents=True, exist_ok=True)
    TOKENIZE.run(prefix, {}, {}, write)
    return time.perf_counter() - started


def rank_main(prefix: Path, cache: Path, started: float) -> None:
    """One rank: the plan's counts (rank 0, broadcast), the datasets, the first micro-batch; a JSON line."""
    import torch
    import torch.distributed as td

    from gptpipe.data.config import DataConfig
    from gptpipe.data.count import count_dataset
    from gptpipe.train.data import build_datasets, collate

    td.init_process_group("gloo")
    joined = time.time()
    counts: list = [None]
    if td.get_rank() == 0:
        counts = [[count_dataset(prefix, SPLIT, SEED, cache)]]
    td.broadcast_object_list(counts, src=0)
    counted = time.time()
    train, _, _ = build_datasets(DataConfig(prefixes=[prefix], split=SPLIT, seed=SEED), counts[0], SEQ_LEN,
                                 SAMPLES, cache, 32000, 0)
    built = time.time()
    rank, world = td.get_rank(), td.get_world_size()
    batch = collate(train, range(rank * MICRO, (rank + 1) * MICRO), torch.device("cpu"))
    assert batch["input_ids"].shape == (MICRO, SEQ_LEN)
    first = time.time()
    td.barrier()
    # VmHWM: this process image's own peak (ru_maxrss would keep the launcher's, forked before the exec); the
    # builder's child is an upper bound (it counts the rank's image forked before its exec)
    hwm = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM"))
    peak_mb = {"rank_peak_rss_mb": int(hwm.split()[1]) / 1024,
               "child_peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}
    print(json.dumps({"rank": rank, "world": world, "to_first_batch_s": first - started,
                      "python_and_imports_s": joined - started, "counts_s": counted - joined,
                      "datasets_s": built - counted, "cpu_s": sum(os.times()[:2]), **peak_mb}), flush=True)
    td.destroy_process_group()


def launch(prefix: Path, cache: Path, ranks: int) -> list[dict]:
    from gptpipe.ports import free_port

    port = free_port()
    runs = []
    for rank in range(ranks):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONWARNINGS": "ignore", "BENCH_STARTED": repr(time.time())}
        runs.append(subprocess.Popen([sys.executable, __file__, "--rank", str(prefix), str(cache)], env=env,
                                     stdout=subprocess.PIPE, text=True))
    lines = [run.communicate()[0] for run in runs]
    assert all(run.returncode == 0 for run in runs), lines
    return [json.loads(line.strip().splitlines()[-1]) for line in lines]


def main() -> None:
    if sys.argv[1:2] == ["--rank"]:
        return rank_main(Path(sys.argv[2]), Path(sys.argv[3]), float(os.environ["BENCH_STARTED"]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=lambda s: int(s.replace("_", "")), default=10_000_000)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-startup-"))
    prefix = work / "data" / "synthetic_text_document"
    try:
        print(f"# {args.documents:,} documents: written in {write_dataset(prefix, args.documents):.1f} s; "
              f"load average {os.getloadavg()[0]:.2f}", flush=True)
        for ranks in args.ranks:
            cache = work / f"cache-{ranks}"
            for start in ("cold", "warm"):
                rows = launch(prefix, cache, ranks)
                print(json.dumps({"ranks": ranks, "start": start, "load": os.getloadavg()[0], "rows": rows}),
                      flush=True)
            shutil.rmtree(cache)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
