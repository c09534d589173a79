"""Where a stage's independent tasks run: worker processes on this machine, or Ray tasks on a cluster (stages 0
and 2: `executor: local | ray`, `workers`, `ray_address`).

A task is a picklable callable of one item (a module-level function, or a functools.partial of one); its
return value is small (a completion record), its real output files the stage reads afterwards. Ray, not a
protocol of our own, places the tasks, restarts those of a lost node and carries the records back; with Ray
every node must see the stage's input and output folders at the same paths (a shared filesystem).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from itertools import islice
from logging import Logger
from types import TracebackType
from typing import Any, Literal, Self, TypeVar

from gptpipe.stage import StageFailed, StageInputError

Item = TypeVar("Item")
Result = TypeVar("Result")


def local_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def pool_context() -> multiprocessing.context.BaseContext:
    # fork starts workers in milliseconds with everything already imported; elsewhere spawn is the safe choice.
    return multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")


class TaskPool:
    """One stage run's engine: joins the Ray cluster once for all of the run's steps (kind "ray") and leaves it
    as it found it, or starts local worker processes step by step. `died`: what to tell the user when a local
    worker process dies (the OOM killer), after "a worker process died (killed for memory?); "."""

    def __init__(self, kind: Literal["local", "ray"], workers: int, ray_address: str | None, log: Logger,
                 died: str) -> None:
        self.kind, self.workers, self.ray_address, self.log, self.died = kind, workers, ray_address, log, died
        self._ray: Any = None
        self._started = False

    def __enter__(self) -> Self:
        if self.kind == "ray":
            try:
                import ray
            except ImportError:
                raise StageInputError("executor: ray needs Ray installed: pip install -e .[ray]") from None
            self._ray, self._started = ray, not ray.is_initialized()
            if self._started:
                ray.init(address=self.ray_address, include_dashboard=False, log_to_driver=True)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self._started:
            self._ray.shutdown()

    @property
    def capacity(self) -> int:
        """How many tasks run at once: `workers`, or (0) every core of this machine, every CPU of the cluster."""
        if self.workers:
            return self.workers
        return int(self._ray.cluster_resources().get("CPU", 1)) if self._ray is not None else local_cores()

    def each(self, task: Callable[[Item], Result], items: list[Item], what: str,
             in_order: bool = False) -> Iterator[Result]:
        """`task(item)` for every item, yielding each return value as its task finishes (`in_order`: in the
        items' order); `what` names the items for the log (e.g. "shard(s) to judge")."""
        if not items:
            return
        if self._ray is not None:
            yield from self._on_ray(task, items, what, in_order)
            return
        workers = min(self.capacity, len(items))
        self.log.info(f"{len(items):,} {what}, {workers} worker process(es)")
        if workers == 1:  # no processes to start, no records to pass around
            yield from map(task, items)
            return
        # An executor, not multiprocessing.Pool: when a worker dies it raises instead of waiting forever for
        # the lost item.
        pool = ProcessPoolExecutor(workers, mp_context=pool_context())
        try:
            if in_order:
                yield from pool.map(task, items)
                return
            pending = {pool.submit(task, item) for item in items}
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    yield future.result()
        except BrokenProcessPool:
            raise StageFailed(f"a worker process died (killed for memory?); {self.died}") from None
        finally:
            pool.shutdown(cancel_futures=True)

    def _on_ray(self, task: Callable[[Item], Result], items: list[Item], what: str,
                in_order: bool) -> Iterator[Result]:
        ray = self._ray
        cpus = int(ray.cluster_resources().get("CPU", 1))
        # Ray places one task per CPU by itself; `workers` caps the tasks in flight below that.
        limit = min(self.workers or len(items), len(items))
        self.log.info(f"{len(items):,} {what} on Ray ({len(ray.nodes())} node(s), {cpus} CPU(s)), at most {limit} "
                      "at once")
        remote = ray.remote(num_cpus=1)(_in_folder)
        queue: Iterable[Item] = iter(items)
        pending = deque(remote.remote(os.getcwd(), task, item) for item in islice(queue, limit))
        while pending:
            if in_order:
                done = pending.popleft()
            else:
                [done], rest = ray.wait(list(pending), num_returns=1)
                pending = deque(rest)
            yield ray.get(done)
            pending.extend(remote.remote(os.getcwd(), task, item) for item in islice(queue, 1))


def _in_folder(folder: str, task: Callable[[Any], Any], item: Any) -> Any:
    """The task in the driver's folder: the config's relative paths mean the same on every node."""
    os.chdir(folder)
    return task(item)
