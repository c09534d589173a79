"""gptpipe/taskpool.py's accounting: each task's CPU seconds measured in the process that ran it, per step."""

from __future__ import annotations

import gzip
import logging
import os
import time
import zlib
from pathlib import Path

import pytest

from gptpipe.taskpool import TaskPool

MAN1 = Path("/usr/share/man/ja/man1")


def packed_size(page: Path) -> int:
    """CPU-bound work on a real man page: its text compressed at every level (enough of it that the tasks' CPU
    seconds stand well above the driver's for starting the workers: at 500 copies a CI run saw 0.40 s to 0.10)."""
    text = gzip.decompress(page.read_bytes())
    return sum(len(zlib.compress(text * 2000, level)) for level in range(1, 10))


@pytest.fixture
def pages() -> list[Path]:
    found = sorted(MAN1.glob("*.1.gz"))[:12]
    if len(found) < 12:
        pytest.skip("needs the Japanese man pages (apt-get install manpages-ja)")
    return found


def test_two_local_workers_account_their_tasks_cpu_where_they_ran(pages: list[Path],
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("gptpipe.test")
    with caplog.at_level(logging.INFO, logger="gptpipe.test"), TaskPool("local", 2, None, log, "") as pool:
        here = time.process_time()
        sizes = sorted(pool.each(packed_size, pages, "page(s) to pack"))
        driver = time.process_time() - here
    assert sizes == sorted(map(packed_size, pages))  # measured or not, the same results
    [cost] = pool.costs
    assert cost.tasks == len(pages)
    assert 1 <= len(cost.per_process) <= 2 and all(pid != os.getpid() for _, pid in cost.per_process)
    assert cost.cpu_s > 4 * driver  # the work was the workers', not this process's
    assert 0 < cost.longest_cpu_s <= max(cost.per_process.values()) <= cost.cpu_s
    assert f"{len(pages)} page(s) to pack: {cost.cpu_s:,.1f} CPU s in the tasks, in {len(cost.per_process)} " \
           f"process(es), the busiest {max(cost.per_process.values()):,.1f} CPU s; the longest task " \
           f"{cost.longest_cpu_s:,.1f} CPU s" in caplog.text


def test_one_worker_runs_and_accounts_the_tasks_in_this_process(pages: list[Path],
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("gptpipe.test")
    with caplog.at_level(logging.INFO, logger="gptpipe.test"), TaskPool("local", 1, None, log, "") as pool:
        here = time.process_time()
        list(pool.each(packed_size, pages[:4], "page(s) to pack"))
        # A caller that stops at the last result (as zip does) still gets the step's line.
        list(zip(range(2), pool.each(packed_size, pages[4:6], "page(s) to pack again")))
        spent = time.process_time() - here
    assert [(c.what, c.tasks) for c in pool.costs] == [("page(s) to pack", 4), ("page(s) to pack again", 2)]
    for cost in pool.costs:
        assert [pid for _, pid in cost.per_process] == [os.getpid()]
        assert f"{cost.tasks} {cost.what}: {cost.cpu_s:,.1f} CPU s in the tasks, in 1 process(es)" in caplog.text
    assert 0 < sum(c.cpu_s for c in pool.costs) <= spent
