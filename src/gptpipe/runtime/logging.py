"""What a run shows and records: a console line per log step under a progress bar with ETA, `metrics.jsonl`
(one runtime/metrics_rows.py row per log step or evaluation, appended across resumes), TensorBoard and wandb
(offline into the run folder when no WANDB_API_KEY is set). Only the main rank writes anything.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from tqdm import tqdm

from gptpipe.config.core import to_plain
from gptpipe.runtime.metrics_rows import Row, SamplesRow


class RunLogger:
    """One run's outputs; every method is a no-op on ranks other than 0."""

    def __init__(self, run_dir: Path, config: Any, total_steps: int, start_step: int, wandb_block: dict[str, Any],
                 enabled: bool, rotate_tensorboard_s: float | None = None):
        self.enabled = enabled
        # A mirrored run uploads finished event files: the writer is closed (a new file begun) this often.
        self.rotate_tensorboard_s = rotate_tensorboard_s
        self.tensorboard_opened = time.monotonic()
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")
        self.tensorboard = None
        if config.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(run_dir / "tensorboard"))
        self.wandb = None
        if config.logging.wandb and wandb_block.get("enabled", True):
            self.wandb = _start_wandb(run_dir, config, wandb_block)
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", desc="train", file=sys.stderr,
                        dynamic_ncols=True, smoothing=0.1)

    def advance(self) -> None:
        if self.enabled:
            self.bar.update(1)

    def say(self, message: str) -> None:
        """A status line that does not break the progress bar."""
        if self.enabled:
            tqdm.write(message, file=sys.stderr)

    def _write(self, row: Row) -> dict[str, Any]:
        """Append `row` to metrics.jsonl, a figure that is not finite as null; returns its JSON object."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.to_json().items()}
        self.metrics.write(json.dumps(clean, ensure_ascii=False) + "\n")
        self.metrics.flush()
        return clean

    def record(self, row: Row, console: str) -> None:
        """Append `row` to metrics.jsonl, its numbers to TensorBoard and wandb; print `console` above the bar."""
        if not self.enabled:
            return
        clean = self._write(row)
        step = row.step
        numbers = {k: v for k, v in clean.items() if isinstance(v, (int, float)) and k != "step"}
        if self.tensorboard and numbers:
            for key, value in numbers.items():
                self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()
            if self.rotate_tensorboard_s is not None and \
                    time.monotonic() - self.tensorboard_opened >= self.rotate_tensorboard_s:
                self.tensorboard.close()
                self.tensorboard = type(self.tensorboard)(self.tensorboard.log_dir)
                self.tensorboard_opened = time.monotonic()
        if self.wandb and numbers:
            self.wandb.log(numbers, step=step)
        self.say(console)

    def samples(self, step: int, generations: list[tuple[str, str]]) -> None:
        """Sample generations: console, TensorBoard text, wandb table, metrics.jsonl."""
        if not self.enabled or not generations:
            return
        self._write(SamplesRow(step, [{"prompt": p, "text": t} for p, t in generations]))
        for prompt, text in generations:
            self.say(f"  sample | {prompt}{text}".replace("\n", "\\n"))
        if self.tensorboard:
            self.tensorboard.add_text("samples", "\n\n".join(f"**{p}**{t}" for p, t in generations), step)
        if self.wandb:
            import wandb

            self.wandb.log({"samples": wandb.Table(columns=["prompt", "text"], data=[list(g) for g in generations])},
                           step=step)

    def close(self) -> None:
        if not self.enabled:
            return
        self.bar.close()
        self.metrics.close()
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            self.wandb.finish()


def _start_wandb(run_dir: Path, config: Any, wandb_block: dict[str, Any]) -> Any:
    """A wandb run in `run_dir/wandb`: online with an API key, offline otherwise; resumed across restarts."""
    import wandb

    id_file = run_dir / "wandb_run_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
    id_file.write_text(run_id)
    mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
    return wandb.init(project=config.logging.wandb_project or wandb_block.get("project", "gptpipe"),
                      name=config.logging.wandb_run_name or run_dir.name, id=run_id, resume="allow",
                      dir=str(run_dir), mode=mode, config=to_plain(config))
