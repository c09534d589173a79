"""Learning-rate schedule derived from the run's actual length (the original's was fixed at 300B tokens).

Optimizer step s (0-based) of a run of T steps uses `lr_at(s)`: a linear warmup over the first W steps from
start_lr to the peak (step s at start_lr + (peak - start_lr)·(s+1)/W: from 0 for a new model, the first step a
W-th of the way up; from the base's end rate for continued pretraining, the re-warm of Ibrahim et al. 2024), then
cosine, linear (fine-tuning) or warmup-stable-decay down to exactly min_lr at s = T-1, the last step. The
schedule is a `LambdaLR` handed to `deepspeed.initialize`, so DeepSpeed saves and restores its position; every
rate is a function of the step alone, so a resume lands on the rate the uninterrupted run had.

An embedding warm-up (stage 3's train.embedding_warmup_steps) trains only the token embedding and output
matrices for its first steps: their optimizer groups (model.VOCAB_GROUP) follow `lr_at`, every other group's
rate is 0 until then and `lr_at` after. AdamW with a rate of 0 leaves a weight exactly as it is (its decay is
scaled by the rate too), so the engine's own optimizer and checkpoints do it: the frozen groups' moments still
accumulate their gradients, and a resume lands on the same rates, since each is a function of the step alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Schedule:
    total_steps: int
    warmup_steps: int
    peak_lr: float
    min_lr: float
    kind: str = "cosine"  # cosine | linear | wsd | constant
    decay_steps: int = 0  # wsd: steps of the final decay
    frozen_steps: int = 0  # the first steps, in which only the VOCAB_GROUP groups train (embedding warm-up)
    start_lr: float = 0.0  # where the warmup starts (continued pretraining: the base's end rate)
    start_origin: str = ""  # where start_lr comes from, for the plan and the log ("": a warmup from 0)

    @classmethod
    def for_run(cls, train_cfg, total_steps: int, start: tuple[float, str] | None = None) -> Schedule:
        """Warmup and decay as fractions of `total_steps` (what the run will really do), or the warmup as
        train.warmup_steps says (stage 3), capped at the run's length; the warmup from `start` (rate, where it
        comes from; None: from 0)."""
        fixed = getattr(train_cfg, "warmup_steps", None)  # fine-tuning's config has no warmup_steps
        if fixed is not None:
            warmup = min(fixed, total_steps - 1)
        else:
            warmup = min(round(train_cfg.warmup_fraction * total_steps), total_steps - 1)
            if train_cfg.warmup_fraction > 0 and total_steps > 1:
                warmup = max(warmup, 1)
        # Fine-tuning's config has no wsd schedule, hence no lr_decay_fraction.
        decay = max(1, round(getattr(train_cfg, "lr_decay_fraction", 0.0) * total_steps))
        return cls(total_steps=total_steps, warmup_steps=warmup, peak_lr=train_cfg.lr, min_lr=train_cfg.min_lr,
                   kind=train_cfg.lr_schedule, decay_steps=min(decay, total_steps - warmup),
                   frozen_steps=getattr(train_cfg, "embedding_warmup_steps", 0),  # stage 3's key only
                   start_lr=start[0] if start else 0.0, start_origin=start[1] if start else "")

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            return self.start_lr + (self.peak_lr - self.start_lr) * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.peak_lr
        last = self.total_steps - 1
        if self.kind == "wsd":
            start = max(self.warmup_steps, last - self.decay_steps + 1)
            if step < start:
                return self.peak_lr
            span = last - start
            progress = 1.0 if span <= 0 else (step - start) / span
            return self.peak_lr + (self.min_lr - self.peak_lr) * min(progress, 1.0)  # linear to min_lr
        span = last - self.warmup_steps
        progress = 1.0 if span <= 0 else min((step - self.warmup_steps) / span, 1.0)
        if self.kind == "linear":
            return self.peak_lr + (self.min_lr - self.peak_lr) * progress
        return self.min_lr + (self.peak_lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def scheduler_factory(self):
        """A callable optimizer → LambdaLR, the form `deepspeed.initialize(lr_scheduler=...)` accepts
        when DeepSpeed builds the optimizer itself."""
        from torch.optim.lr_scheduler import LambdaLR

        from gptpipe.runtime.model import VOCAB_GROUP

        def multiplier(step: int) -> float:
            return self.lr_at(step) / self.peak_lr

        def frozen_multiplier(step: int) -> float:
            return 0.0 if step < self.frozen_steps else multiplier(step)

        def make(optimizer: torch.optim.Optimizer) -> LambdaLR:
            # The optimizer's lr is the peak (DeepSpeed config), so the lambda is a multiplier of it.
            if not self.frozen_steps:
                return LambdaLR(optimizer, multiplier)
            return LambdaLR(optimizer, [multiplier if group.get(VOCAB_GROUP) else frozen_multiplier
                                        for group in optimizer.param_groups])

        return make
