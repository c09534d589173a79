"""Status lines of every stage: `logging.getLogger("gptpipe.<stage>")`, printed as "[<stage>] message" on stderr.

stdout stays clean for results a script may parse (a folder, a URL, a count table). The handler looks up
sys.stderr when it writes, so a notebook, pytest's capture or tqdm's redirection all see the lines, and a
line goes through tqdm.write so it never breaks a progress bar. `GPTPIPE_LOG_LEVEL=DEBUG` shows more.
"""

from __future__ import annotations

import logging
import os
import sys


class _StderrHandler(logging.Handler):
    """Writes each record to the current sys.stderr above any tqdm bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


class _StageFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stage = record.name.removeprefix("gptpipe").lstrip(".")
        prefix = f"[{stage}] " if stage else ""
        level = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
        return prefix + level + record.getMessage()


def get_logger(stage: str) -> logging.Logger:
    """The logger of one stage or command (e.g. "train", "convert"); the package's handler is set up once."""
    root = logging.getLogger("gptpipe")
    if not root.handlers:
        handler = _StderrHandler()
        handler.setFormatter(_StageFormatter())
        root.addHandler(handler)
        root.setLevel(os.environ.get("GPTPIPE_LOG_LEVEL", "INFO").upper())
        root.propagate = False  # an application's root handler would print every line twice
    return logging.getLogger(f"gptpipe.{stage}")
