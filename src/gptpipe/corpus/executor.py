"""Where stage 0's shards are judged: worker processes on this machine, or Ray tasks on a cluster.

Both run corpus/firstpass.py's `judge_shard` once per shard and hand back its completion record as each
finishes; the shards' folders are the results (under output_dir, which every Ray node must see at the same
path), so the order they finish in changes nothing. Ray, not a protocol of our own, places the tasks, restarts
those of a lost node and carries the records back; datatrove's Ray executor would add its pipeline model on top
of the same Ray.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from itertools import islice
from pathlib import Path

from gptpipe.corpus.config import CorpusConfig
from gptpipe.corpus.firstpass import ShardResult, judge_shard
from gptpipe.corpus.shards import Shard
from gptpipe.log import get_logger
from gptpipe.stage import StageFailed, StageInputError

log = get_logger("prepare")


def local_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def judged(config: CorpusConfig, shards: list[Shard], work: Path) -> Iterator[ShardResult]:
    """Judge `shards` into `work`, yielding each completion record as its shard finishes."""
    if not shards:
        return
    if config.executor == "ray":
        yield from _on_ray(config, shards, work)
        return
    workers = min(config.workers or local_cores(), len(shards))
    log.info(f"{len(shards):,} shard(s) to judge, {workers} worker process(es)")
    if workers == 1:  # no processes to start, no records to pass around
        for shard in shards:
            yield judge_shard(config, shard, work)
        return
    # fork starts workers in milliseconds with everything already imported; elsewhere spawn is the safe choice.
    context = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    # An executor, not multiprocessing.Pool: when a worker dies (the OOM killer) it raises instead of waiting
    # forever for the lost shard.
    pool = ProcessPoolExecutor(workers, mp_context=context)
    try:
        pending = {pool.submit(judge_shard, config, shard, work) for shard in shards}
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                yield future.result()
    except BrokenProcessPool:
        raise StageFailed("a stage-0 worker process died (killed for memory?); the shards it finished are kept: "
                          "rerun to continue, with fewer corpus.workers or a lower corpus.shard_mb") from None
    finally:
        pool.shutdown(cancel_futures=True)


def _in_folder(folder: str, config: CorpusConfig, shard: Shard, work: Path) -> ShardResult:
    """judge_shard in the driver's folder: the config's relative paths mean the same on every node."""
    os.chdir(folder)
    return judge_shard(config, shard, work)


def _on_ray(config: CorpusConfig, shards: list[Shard], work: Path) -> Iterator[ShardResult]:
    try:
        import ray
    except ImportError:
        raise StageInputError("corpus.executor: ray needs Ray installed: pip install -e .[ray]") from None
    started = not ray.is_initialized()
    if started:
        ray.init(address=config.ray_address, include_dashboard=False, log_to_driver=True)
    try:
        cpus = int(ray.cluster_resources().get("CPU", 1))
        # Ray places one task per CPU by itself; `workers` caps the tasks in flight below that.
        limit = min(config.workers or len(shards), len(shards))
        log.info(f"{len(shards):,} shard(s) to judge on Ray ({len(ray.nodes())} node(s), {cpus} CPU(s)), at "
                 f"most {limit} at once")
        task = ray.remote(num_cpus=1)(_in_folder)
        queue = iter(shards)
        pending = [task.remote(os.getcwd(), config, shard, work) for shard in islice(queue, limit)]
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            yield ray.get(done[0])
            pending += [task.remote(os.getcwd(), config, shard, work) for shard in islice(queue, 1)]
    finally:
        if started:
            ray.shutdown()
