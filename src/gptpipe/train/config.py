"""Stage 3 settings: the `model:`, `train:` and `logging:` sections of config.yaml.

Key names follow the original pipeline's config.yaml where it had them (num_layers, hidden_size,
num_attn_heads, init_std, seq_len, global_batch_size, lr, min_lr, zero_stage, train_tokens, save_interval).
`model:` and `logging:` are runtime/config.py's; `train:` is its LoopConfig (the keys stage 7's fine-tuning shares:
batch, schedule, optimizer, engine, intervals) plus pretraining's own keys.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from gptpipe.config.core import Url, option
from gptpipe.data.config import DataConfig, TokenizeConfig
from gptpipe.runtime.config import LoggingConfig, LoopConfig, ModelConfig
from gptpipe.storage import StorageConfig


# Stage 3's schedule defaults (TrainConfig.resolve_schedule).
SCRATCH_LR = 6.0e-4
SCRATCH_WARMUP_FRACTION = 0.01
CONTINUED_LR = 2.5e-5
CONTINUED_WARMUP_STEPS = 1000
# What the plan suggests for continued pretraining, from bench/bench_vocab_extension.py's sweep (docs/benchmarks.md,
# "Continued pretraining: replay share and peak rate"; held-out English +3% at a 25% replay share with a peak of
# 3x or 10x the base's end rate, +9% and +18% at 5%): the share of the base's own language blended in, the
# smallest share measured to keep held-out English within 5%, and the largest peak measured to, as a multiple of
# the base's end rate the re-warm starts from.
CONTINUED_REPLAY = 0.25
CONTINUED_REPLAY_MIN = 0.25
CONTINUED_PEAK_RATIO_MAX = 10.0


@dataclass
class TrainConfig(LoopConfig):
    """How long, how fast and on what engine settings to pretrain (the loop's keys, then stage 3's own).

    lr, min_lr and the warmup default by what is trained (`resolve_schedule`): from scratch 6e-4 to 6e-5 after a
    1% warmup; continued pretraining (model.init_from) re-warms over 1,000 steps from the base's recorded end rate
    (start_lr) to 2.5e-5 and decays to a tenth of it, the scale of public continual-pretraining recipes (e.g.
    Ibrahim et al. 2024, "Simple and Scalable Strategies to Continually Pre-train Large Language Models": re-warm,
    peak well below the original's, decay).
    """

    lr: float | None = option(
        None, f"peak learning rate (None: {SCRATCH_LR:g} from scratch, {CONTINUED_LR:g} with model.init_from)")
    min_lr: float | None = option(None, "learning rate at the last step (None: a tenth of lr)")
    warmup_fraction: float | None = option(
        None, f"share of the run spent warming up linearly from 0 (None: {SCRATCH_WARMUP_FRACTION:g} from scratch; "
              "with model.init_from, warmup_steps applies)")
    warmup_steps: int | None = option(
        None, f"warmup length in optimizer steps, instead of warmup_fraction (None: from warmup_fraction; with "
              f"model.init_from and neither set, {CONTINUED_WARMUP_STEPS:,}); capped at the run's steps - 1")
    start_lr: float | None = option(
        None, "the rate the warmup rises from, linearly to lr (None: 0 from scratch; with model.init_from, the "
              "base's end rate as its folder records it, so the run re-warms from where the base's decay ended: "
              "trainer_state.json's last logged learning_rate (transformers' Trainer), else the final_lr of a "
              "gptpipe export's manifest.json; a folder recording neither: min_lr). The plan and the run log say "
              "which it took")

    train_tokens: int | None = option(
        None, "stop after this many tokens (count_tokens.py writes it; None: use train_epochs)")
    train_tokens_counted_for: str | None = option(
        None, "written by count_tokens.py beside train_tokens: the datasets and settings it counted; training "
        "refuses a train_tokens counted for other data (None: train_tokens is a budget you chose)")
    document_mask: bool = option(
        False, "attention within each document only: a sample's positions restart after every end-of-document "
               "token (as the exported model sees a document alone) and the token after one is not trained; off: "
               "one causal mask over the whole packed sample, the original's")
    lr_schedule: Literal["cosine", "wsd", "constant"] = option(
        "cosine", "decay after warmup; wsd: warmup-stable-decay, decaying over the last lr_decay_fraction")
    lr_decay_fraction: float = option(0.2, "wsd only: share of the run spent decaying at the end")
    embedding_warmup_steps: int = option(
        0, "a first phase of this many optimizer steps that trains only the token embedding and output matrices "
           "(one when tied), the rest of the model at a learning rate of 0 (unchanged, exactly), e.g. for the new "
           "rows of a tokenizer stage 1 extended; they follow the schedule throughout, the rest joins it where it "
           "then is (0: off). The steps cost full ones: backward still runs through every layer")
    gpu_memory_gib: float | None = option(
        None, "memory per device the planner fits the run into (None: detected; on CPU the available host RAM)")
    peak_tflops: float | None = option(
        None, "dense peak TFLOP/s per GPU for MFU (None: from the GPU's name, e.g. H100 989 bf16)")
    eval_iters: int = option(
        10, "validation global batches per evaluation (the same eval_iters x global_batch_size samples each time)")
    eval_tasks: list[str] = option(
        factory=list, doc="lm-eval task or group names (as `gptpipe evaluate` takes them; hub datasets need the "
                          "network) scored zero-shot on the live model at each evaluation, the first (before step 1) "
                          "the reference; rows kind eval_tasks in metrics.jsonl")
    eval_task_yamls: list[Path] = option(
        factory=list, doc="local lm-eval task YAMLs scored like eval_tasks (e.g. the demo task make-demo-task "
                          "writes, data/finetune/manpage_section/manpage_section.yaml); relative data_files in them "
                          "are relative to the YAML")
    eval_task_dirs: list[Path] = option(
        factory=list, doc="folders of llm-jp-eval task files scored like eval_tasks (as gptpipe evaluate's "
                          "task_dirs; few-shot only where a file's num_few_shots asks)")
    eval_tasks_limit: int | None = option(
        200, "score at most the first N documents of each task at each evaluation, sharded over the ranks "
             "(None: all)")
    eval_tasks_tolerance: float = option(
        0.02, "warn (a console line) when a task's main metric (its first, e.g. acc) falls more than this below "
              "its reference, in the metric's own units (0.02: two points of accuracy)")
    sample_prompts: list[str] = option(factory=lambda: ["日本の首都は", "このコマンドは"],
                                       doc="prompts generated from at each evaluation")
    sample_tokens: int = option(32, "tokens generated per sample prompt")

    @property
    def scores_tasks(self) -> bool:
        """Whether lm-eval tasks are scored at each evaluation (any of eval_tasks, eval_task_yamls, eval_task_dirs)."""
        return bool(self.eval_tasks or self.eval_task_yamls or self.eval_task_dirs)

    def check(self) -> list[tuple[str, str]]:
        problems = super().check()
        if self.eval_iters < 1:
            problems.append(("eval_iters", "must be >= 1"))
        if self.train_tokens is not None and self.train_tokens < 1:
            problems.append(("train_tokens", "must be >= 1 (or null to use train_epochs)"))
        if self.start_lr is not None and self.start_lr < 0:
            problems.append(("start_lr", "must be >= 0 (or null)"))
        if self.warmup_steps is not None and self.warmup_steps < 0:
            problems.append(("warmup_steps", "must be >= 0 (or null)"))
        if self.eval_tasks_limit is not None and self.eval_tasks_limit < 1:
            problems.append(("eval_tasks_limit", "must be >= 1 or null"))
        if self.embedding_warmup_steps < 0:
            problems.append(("embedding_warmup_steps", "must be >= 0"))
        if self.warmup_steps is not None and self.warmup_fraction is not None:
            problems.append(("warmup_steps", "set warmup_steps or warmup_fraction, not both"))
        if self.lr_schedule == "wsd" and not 0 < self.lr_decay_fraction <= 1 - (self.warmup_fraction or 0.0):
            problems.append(("lr_decay_fraction", "must be in (0, 1 - warmup_fraction]"))
        if self.gpu_memory_gib is not None and self.gpu_memory_gib <= 0:
            problems.append(("gpu_memory_gib", "must be > 0 (or null to detect)"))
        if self.preempt_grace_seconds < 0:
            problems.append(("preempt_grace_seconds", "must be >= 0"))
        if isinstance(self.output_model_dir, Url):
            from gptpipe.storage import check_url

            problems += [("output_model_dir", p) for p in check_url(self.output_model_dir)]
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            problems.append(("peak_tflops", "must be > 0 (or null)"))
        if self.precision == "fp8" and self.seq_len % 16:
            problems.append(("seq_len", f"{self.seq_len}: precision fp8 needs a multiple of 16 (FP8 matmuls on "
                                        "CUDA need each dimension, a micro-batch's tokens too, divisible by 16)"))
        return problems

    def resolve_schedule(self, continued: bool) -> list[tuple[str, str]]:
        """Fill the unset lr, min_lr and warmup with the defaults of a from-scratch or a continued (`continued`)
        run (see the class doc) and check the result; called once the whole config.yaml is known."""
        if self.lr is None:
            self.lr = CONTINUED_LR if continued else SCRATCH_LR
        if self.min_lr is None:
            self.min_lr = self.lr / 10
        if self.warmup_steps is None and self.warmup_fraction is None:
            if continued:
                self.warmup_steps = CONTINUED_WARMUP_STEPS
            else:
                self.warmup_fraction = SCRATCH_WARMUP_FRACTION
        return self.schedule_problems()



def plan_arguments(parser: argparse.ArgumentParser) -> None:
    """`gptpipe plan` options: plan for a machine other than this one."""
    parser.add_argument("--gpus", type=int, default=None,
                        help="data-parallel ranks to plan for (default: this launch's WORLD_SIZE, else 1)")
    parser.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                        help="memory per device to plan for (default: train.gpu_memory_gib or detected)")
    parser.add_argument("--gpu-name", default=None,
                        help="plan for this GPU model (e.g. H100) from another machine; needs --gpu-memory")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="ranks sharing one node's host RAM (default: the launcher's LOCAL_WORLD_SIZE or "
                             "LOCAL_SIZE, else this machine's GPU count, else --gpus)")



class TrainingRun(Protocol):
    """What stage 3 (and its planner) reads of config.yaml (pipeline.PipelineConfig is one: the stage need not
    import it)."""

    tokenize: TokenizeConfig
    data: DataConfig
    model: ModelConfig
    train: TrainConfig
    logging: LoggingConfig
    storage: StorageConfig
