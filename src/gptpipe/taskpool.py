"""Where a stage's independent tasks run: worker processes on this machine, or Ray tasks on a cluster (stages 0
and 2: `executor: local | ray`, `workers`, `ray_address`).

A task is a picklable callable of one item (a module-level function, or a functools.partial of one); its
return value is small (a completion record), its real output files the stage reads afterwards. Ray, not a
protocol of our own, places the tasks, restarts those of a lost node and carries the records back; with Ray
every node must see the stage's input and output folders at the same paths (a shared filesystem).

Each task's CPU and wall seconds are measured where it runs and logged per step (the CPU seconds summed, the
longest task, the processes that ran them): CPU time grows far less than wall time with the machine's load,
so it tells an engine's own cost (a process's set-up, a task's imbalance) from a busy machine's.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from functools import partial
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


@dataclass(frozen=True)
class Spent:
    """One task's cost, measured in the process that ran it."""

    cpu_s: float
    wall_s: float
    pid: int
    host: str


@dataclass
class StepCost:
    """The tasks of one step of a run (`what`): their CPU seconds, in all and per process that ran them."""

    what: str
    tasks: int = 0
    longest_s: float = 0.0  # wall
    longest_cpu_s: float = 0.0
    per_process: dict[tuple[str, int], float] = field(default_factory=dict)

    def add(self, spent: Spent) -> None:
        self.tasks += 1
        self.longest_s = max(self.longest_s, spent.wall_s)
        self.longest_cpu_s = max(self.longest_cpu_s, spent.cpu_s)
        key = spent.host, spent.pid
        self.per_process[key] = self.per_process.get(key, 0.0) + spent.cpu_s

    @property
    def cpu_s(self) -> float:
        return sum(self.per_process.values())

    def __str__(self) -> str:
        # On idle cores a step takes at most cpu_s / processes + the longest task (tasks go to whichever process
        # is free), whatever the load now; the busiest process's share shows how the load split them.
        return (f"{self.tasks:,} {self.what}: {self.cpu_s:,.1f} CPU s in the tasks, in {len(self.per_process)} "
                f"process(es), the busiest {max(self.per_process.values(), default=0.0):,.1f} CPU s; the longest "
                f"task {self.longest_cpu_s:,.1f} CPU s, {self.longest_s:,.1f} s wall")


class TaskPool:
    """One stage run's engine: joins the Ray cluster once for all of the run's steps (kind "ray") and leaves it
    as it found it, or starts local worker processes step by step. `died`: what to tell the user when a local
    worker process dies (the OOM killer), after "a worker process died (killed for memory?); "."""

    def __init__(self, kind: Literal["local", "ray"], workers: int, ray_address: str | None, log: Logger,
                 died: str) -> None:
        self.kind, self.workers, self.ray_address, self.log, self.died = kind, workers, ray_address, log, died
        self._ray: Any = None
        self._started = False
        self.costs: list[StepCost] = []  # one per step (call of `each`), in the order they ran

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
        cost = StepCost(what)
        self.costs.append(cost)
        for result, spent in self._spent(partial(_measured, task), items, what, in_order):
            cost.add(spent)
            self.log.debug(f"a task of {what}: {spent.cpu_s:.2f} CPU s, {spent.wall_s:.2f} s wall, process "
                           f"{spent.pid} on {spent.host}")
            if cost.tasks == len(items):  # before the last yield: a caller may stop at the last result (zip)
                self.log.info(str(cost))
            yield result

    def _spent(self, task: Callable[[Item], tuple[Result, Spent]], items: list[Item], what: str,
               in_order: bool) -> Iterator[tuple[Result, Spent]]:
        """`each` without the accounting: the measured task's (result, cost) pairs, on Ray or locally."""
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


def _measured(task: Callable[[Item], Result], item: Item) -> tuple[Result, Spent]:
    """`task(item)` and its cost in this process."""
    cpu, wall = time.process_time(), time.perf_counter()
    result = task(item)
    return result, Spent(time.process_time() - cpu, time.perf_counter() - wall, os.getpid(), os.uname().nodename)
