"""Where stage 0's tasks run: worker processes on this machine, or Ray tasks on a cluster.

A task is a module-level function `task(config, item, work)` run once per item (a shard to judge, a shard to
bucket or filter, a partition to search for duplicates: corpus/firstpass.py, corpus/dedup.py); `Executor.each`
hands back each task's small return value as it finishes. The results themselves are files under `work`
(output_dir/.work, which every Ray node must see at the same path), so the order tasks finish in changes
nothing. Ray, not a protocol of our own, places the tasks, restarts those of a lost node and carries the
records back; datatrove's Ray executor would add its pipeline model on top of the same Ray.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from itertools import islice
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

from gptpipe.corpus.config import CorpusConfig
from gptpipe.corpus.firstpass import ShardResult, judge_shard
from gptpipe.corpus.shards import Shard
from gptpipe.log import get_logger
from gptpipe.stage import StageFailed, StageInputError

log = get_logger("prepare")
Item = TypeVar("Item")
Result = TypeVar("Result")
Task = Callable[[CorpusConfig, Item, Path], Result]


def local_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class Executor:
    """Stage 0's engine for one run: joins the Ray cluster once (executor: ray) for all of the run's steps and
    leaves it as it found it, or starts local worker processes step by step."""

    def __init__(self, config: CorpusConfig) -> None:
        self.config = config
        self._ray: Any = None
        self._started = False

    def __enter__(self) -> Self:
        if self.config.executor == "ray":
            try:
                import ray
            except ImportError:
                raise StageInputError("corpus.executor: ray needs Ray installed: pip install -e .[ray]") from None
            self._ray, self._started = ray, not ray.is_initialized()
            if self._started:
                ray.init(address=self.config.ray_address, include_dashboard=False, log_to_driver=True)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self._started:
            self._ray.shutdown()

    def each(self, task: Task, items: list[Item], work: Path, what: str) -> Iterator[Result]:
        """`task(config, item, work)` for every item, yielding each return value as its task finishes; `what`
        names the items for the log (e.g. "shard(s) to judge")."""
        if not items:
            return
        if self._ray is not None:
            yield from self._on_ray(task, items, work, what)
            return
        workers = min(self.config.workers or local_cores(), len(items))
        log.info(f"{len(items):,} {what}, {workers} worker process(es)")
        if workers == 1:  # no processes to start, no records to pass around
            for item in items:
                yield task(self.config, item, work)
            return
        # fork starts workers in milliseconds with everything already imported; elsewhere spawn is the safe choice.
        context = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
        # An executor, not multiprocessing.Pool: when a worker dies (the OOM killer) it raises instead of waiting
        # forever for the lost item.
        pool = ProcessPoolExecutor(workers, mp_context=context)
        try:
            pending = {pool.submit(task, self.config, item, work) for item in items}
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    yield future.result()
        except BrokenProcessPool:
            raise StageFailed("a stage-0 worker process died (killed for memory?); the shards it finished are kept: "
                              "rerun to continue, with fewer corpus.workers or a lower corpus.shard_mb") from None
        finally:
            pool.shutdown(cancel_futures=True)

    def _on_ray(self, task: Task, items: list[Item], work: Path, what: str) -> Iterator[Result]:
        ray = self._ray
        cpus = int(ray.cluster_resources().get("CPU", 1))
        # Ray places one task per CPU by itself; `workers` caps the tasks in flight below that.
        limit = min(self.config.workers or len(items), len(items))
        log.info(f"{len(items):,} {what} on Ray ({len(ray.nodes())} node(s), {cpus} CPU(s)), at most {limit} at "
                 "once")
        remote = ray.remote(num_cpus=1)(_in_folder)
        queue = iter(items)
        pending = [remote.remote(os.getcwd(), task, self.config, item, work) for item in islice(queue, limit)]
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            yield ray.get(done[0])
            pending += [remote.remote(os.getcwd(), task, self.config, item, work) for item in islice(queue, 1)]


def _in_folder(folder: str, task: Task, config: CorpusConfig, item: Any, work: Path) -> Any:
    """The task in the driver's folder: the config's relative paths mean the same on every node."""
    os.chdir(folder)
    return task(config, item, work)


def judged(engine: Executor, shards: list[Shard], work: Path) -> Iterator[ShardResult]:
    """Judge `shards` into `work` (corpus/firstpass.py), yielding each completion record as its shard finishes."""
    return engine.each(judge_shard, shards, work, "shard(s) to judge")
