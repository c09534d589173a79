"""Where stage 0's tasks run (gptpipe/taskpool.py: worker processes on this machine, or Ray tasks on a cluster).

A stage-0 task is a module-level function `task(config, item, work)` run once per item (a shard to judge, a
shard to bucket or filter, a partition to search for duplicates: corpus/firstpass.py, corpus/dedup.py); its
results are files under `work` (output_dir/.work, which every Ray node must see at the same path), so the order
tasks finish in changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from gptpipe.corpus.config import CorpusConfig
from gptpipe.corpus.firstpass import ShardResult, judge_shard
from gptpipe.corpus.shards import Shard
from gptpipe.log import get_logger
from gptpipe.taskpool import TaskPool

log = get_logger("prepare")
Item = TypeVar("Item")
Result = TypeVar("Result")


class Executor(TaskPool):
    """Stage 0's task pool for one run, as corpus.executor, corpus.workers and corpus.ray_address say."""

    def __init__(self, config: CorpusConfig) -> None:
        super().__init__(config.executor, config.workers, config.ray_address, log,
                         "the shards it finished are kept: rerun to continue, with fewer corpus.workers or a lower "
                         "corpus.shard_mb")
        self.config = config

    def run(self, task: Callable[[CorpusConfig, Any, Path], Result], items: list[Item], work: Path,
            what: str) -> Iterator[Result]:
        """`task(config, item, work)` for every item, each return value as its task finishes."""
        return self.each(partial(_call, task, self.config, work), items, what)


def _call(task: Callable[[CorpusConfig, Any, Path], Any], config: CorpusConfig, work: Path, item: Any) -> Any:
    return task(config, item, work)


def judged(engine: Executor, shards: list[Shard], work: Path) -> Iterator[ShardResult]:
    """Judge `shards` into `work` (corpus/firstpass.py), yielding each completion record as its shard finishes."""
    return engine.run(judge_shard, shards, work, "shard(s) to judge")
