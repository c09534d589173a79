"""Preflight for stage 3 (`gptpipe plan`, and automatically before training).

From config.yaml, the tokenizer and the dataset's .idx alone it works out the run: parameters (checked
against the real model's `num_parameters()`), FLOPs per token, steps and LR schedule from the token
count, per-GPU memory (runtime/memory.py) against the device's budget, host RAM for the dataset index and
disk per checkpoint. A run that will not fit is refused before launch, with the change that makes it fit.
The printed table and the `gptpipe plan` command are train/plan_report.py's.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from collections.abc import Callable

from gptpipe.train.config import TrainingRun
from gptpipe.data.count import DatasetCounts, count_dataset, epoch_schedule, stale_train_tokens
from gptpipe.storage import is_url
from gptpipe.runtime.devices import available_host_ram, LossPath, detect_device, loss_path, peak_flops, ranks_per_node
from gptpipe.train.data import blend_weights, check_splits, index_build_bytes, index_bytes
from gptpipe.runtime.metrics_rows import SpeedSetup, TrainRow, of_kind, read_metrics
from gptpipe.runtime.memory import (GIB, GPU_RANK_HOST_RAM, Budget, EngineSettings, Memory, bytes_per_value,
                                    estimate_memory, memory_budget, optimizer_bytes_per_parameter)
from gptpipe.runtime import fp8
from gptpipe.runtime.model import Shape, base_shape, count_parameters, flops_per_token, meta_parameters, resolve_shape
from gptpipe.runtime.schedule import Schedule


ASSUMED_MFU = 0.40  # for the expected tokens/s before anything was measured on this setup


class PlanError(ValueError):
    """The run as configured cannot work; the message says what to change."""


@dataclass
class Plan:
    """Everything stage 3 derives before it starts."""

    shape: Shape
    parameters: int
    flops_per_token: float
    dp: int
    on_gpu: bool
    device_name: str
    budget: Budget
    settings: EngineSettings
    accumulation: int
    memory: Memory
    memory_checkpointed: Memory
    loss: LossPath
    fp8: list[fp8.LayerChoice] | None  # train.precision fp8: each linear and whether it converts (runtime/fp8.py)
    ranks_per_node: int
    stats: list[DatasetCounts]
    weights: list[float] | None
    tokens_per_step: int
    steps: int
    run_length: str  # where the number of steps comes from (train_tokens counted or chosen, or train_epochs)
    schedule: Schedule
    train_samples: int
    eval_samples: int
    index_ram: float
    index_build_ram: int  # bytes the builder of the indices holds at its peak (once per cache folder, cold start)
    rank_index_ram: int  # bytes of split indices each rank holds itself (the cached ones are mapped)
    host_ram_needed: float
    host_ram: float
    checkpoint_bytes: float
    peak_flops: float | None
    setup: SpeedSetup  # what a measured speed depends on: model shape, precision, sequence length, device and ranks
    measured_tokens_per_s: float | None  # from this run folder's metrics.jsonl, measured under the same setup
    measured_elsewhere: str | None  # the setup of the run folder's speeds when they are not this plan's

    @property
    def planned_memory(self) -> Memory:
        """Per-device memory with the chosen settings (activation checkpointing on or off)."""
        return self.memory_checkpointed if self.settings.checkpointing else self.memory

    @property
    def train_tokens(self) -> int:
        return self.steps * self.tokens_per_step

    @property
    def expected_tokens_per_s(self) -> float | None:
        """The measured speed where this run folder has one, else the assumed MFU's on GPU."""
        if self.measured_tokens_per_s:
            return self.measured_tokens_per_s
        if not self.peak_flops:
            return None
        return ASSUMED_MFU * self.peak_flops * self.dp / self.flops_per_token


def measured_tokens_per_s(run_dir: Path, tokens_per_step: int, setup: SpeedSetup,
                          last: int = 20) -> tuple[float | None, str | None]:
    """(median tokens/s of the last `last` log steps in `run_dir`/metrics.jsonl measured under `setup` with the
    same tokens per step (an earlier segment of this run, before a resume), the other setup the folder's speeds
    were measured under when none matches); (None, None) where it has none."""
    rows = [row for row in of_kind(read_metrics(run_dir / "metrics.jsonl"), TrainRow) if row.tokens_per_s and row.step]
    speeds = [float(row.tokens_per_s) for row in rows
              if row.setup == str(setup) and row.tokens == row.step * tokens_per_step]
    if speeds:
        return statistics.median(speeds[-last:]), None
    return None, (rows[-1].setup or "an unrecorded setup") if rows else None


def world_size() -> int:
    """Data-parallel ranks of the current launch (the launcher's WORLD_SIZE; 1 when run directly)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def make_plan(config: TrainingRun, vocab_size: int, dp: int | None = None, device_memory_gib: float | None = None,
              device_name: str | None = None, gpus_per_node: int | None = None, base_config: Any = None,
              model_config: Any = None, stats: list[DatasetCounts] | None = None) -> Plan:
    """Work out the run and check it fits; raises PlanError (or DataError) with a concrete fix.

    `base_config`: the transformers config of model.init_from's folder, which then decides the shape (its
    parameters counted on the meta device, its vocabulary unpadded). `model_config`: the transformers config of
    the model the run trains, needed with train.precision fp8 (which linears convert is read from its layers).
    `stats`: the datasets' counts where the caller has them (training counts on one rank for all), else counted."""
    train, data = config.train, config.data
    dp = dp or world_size()
    node_ranks = min(dp, gpus_per_node or ranks_per_node(dp))
    on_gpu, detected_name, detected_memory = detect_device()
    name = device_name or detected_name
    other_machine = device_name is not None and device_name != detected_name
    on_gpu = on_gpu or device_name is not None
    device_bytes = (device_memory_gib or train.gpu_memory_gib or 0) * GIB
    if not device_bytes:
        if device_name and device_name != detected_name:
            raise PlanError(f"planning for {device_name} from {detected_name}: give its memory (--gpu-memory GIB "
                            "or train.gpu_memory_gib)")
        # CPU ranks of one machine share its RAM
        device_bytes = detected_memory if on_gpu else detected_memory / node_ranks
    budget = memory_budget(device_bytes, on_gpu)
    if base_config is not None:
        shape, parameters = base_shape(base_config), meta_parameters(base_config)
    else:
        shape = resolve_shape(config.model, vocab_size)
        parameters = count_parameters(shape, train.seq_len)
    loss = loss_path(shape.arch, on_gpu, train.liger_kernels, other_machine)
    fp8_choice = None
    if train.precision == "fp8":
        fp8_choice = fp8.model_choice(model_config, train.fp8_recipe)
        nothing = fp8.nothing_converts(fp8_choice, shape.arch)
        if nothing:
            raise PlanError(f"train.precision fp8: {nothing}")
    fp8_layer = fp8.largest_converted(fp8_choice) if fp8_choice else None

    if train.global_batch_size % dp:
        raise PlanError(f"train.global_batch_size {train.global_batch_size} is not divisible by the {dp} "
                        f"data-parallel ranks. Fix: set train.global_batch_size="
                        f"{max(dp, train.global_batch_size // dp * dp)}")
    per_rank = train.global_batch_size // dp
    if train.micro_batch_size and per_rank % train.micro_batch_size:
        raise PlanError(f"train.micro_batch_size {train.micro_batch_size} does not divide the "
                        f"{per_rank} samples per rank and step (global_batch_size / {dp} ranks). Fix: set "
                        f"train.micro_batch_size={max(d for d in _divisors(per_rank) if d <= train.micro_batch_size)}")

    if stats is None:
        stats = [count_dataset(p, data.split, data.seed, data.cache_dir) for p in data.prefixes]
    check_splits(stats, data.split, train.seq_len)
    weights = blend_weights(data, stats)
    tokens_per_step = train.global_batch_size * train.seq_len
    by_epochs = epoch_schedule(stats, train.seq_len, train.global_batch_size, train.train_epochs)  # count_tokens' rule
    epoch_samples = by_epochs.samples_per_epoch
    stale = stale_train_tokens(config)
    if stale:
        raise PlanError(stale)
    if train.train_tokens is not None:
        wanted_samples = train.train_tokens // train.seq_len
        how = f"train.train_tokens={train.train_tokens:,}"
        run_length = how + (" (counted by count_tokens.py for these data)" if train.train_tokens_counted_for
                            else " (a token budget set in the config)")
    else:
        wanted_samples = by_epochs.train_samples
        how = f"train.train_epochs={train.train_epochs:g} of {epoch_samples:,} samples"
        run_length = how
    full_steps = wanted_samples // train.global_batch_size
    if full_steps < 1:
        raise PlanError(f"{how} is less than one global batch ({train.global_batch_size} × {train.seq_len} "
                        f"tokens). Fix: lower train.global_batch_size or raise train.train_tokens/train_epochs.")
    steps = min(full_steps, train.train_iters or full_steps)
    schedule = Schedule.for_run(train, steps, warmup_start(train, config.model.init_from))
    eval_samples = train.eval_iters * train.global_batch_size
    # The dataset is built for the uncapped run: a train_iters cap (or changing it on resume) then never
    # changes which samples come in which order.
    sizes = [full_steps * train.global_batch_size, eval_samples, eval_samples]
    index_ram = index_bytes(stats, weights, sizes, train.seq_len)

    def memory_of(settings: EngineSettings) -> Memory:
        return estimate_memory(shape, parameters, train.seq_len, train.engine_precision, dp, settings, loss.fused,
                               train.fp32_gradients, train.document_mask, fp8_layer)

    def fits(settings: EngineSettings) -> bool:
        return memory_of(settings).total <= budget.usable

    settings = EngineSettings(train.micro_batch_size or per_rank, train.zero_stage, train.activation_checkpointing,
                              train.offload_optimizer)
    if train.micro_batch_size is None:
        settings = largest_micro_batch(settings, per_rank, fits)
    if not fits(settings):
        raise PlanError(_refusal(memory_of(settings), budget, name, settings, per_rank, dp,
                                 train.global_batch_size, fits, memory_of))

    offloaded = (parameters * optimizer_bytes_per_parameter(train.engine_precision, settings.zero_stage) / dp
                 if settings.offload else 0)
    # megatron's index arrays (and the split order) are built once per cache folder (each node's own where the nodes
    # share none: train/index_cache.py) and memory-mapped by the node's ranks, so the page cache holds them once.
    # What each rank holds itself: megatron-core's arange of each split's document numbers (int32), one at a time.
    # A cold start's builder holds the indices and the split order's temporaries at once (index_build_bytes).
    rank_index = 4 * max(max(s.split_documents) for s in stats)
    build_ram = index_build_bytes(stats, index_ram)
    host_needed = build_ram + node_ranks * (rank_index + offloaded + (GPU_RANK_HOST_RAM if on_gpu else 0))
    host_ram = float(available_host_ram())
    if host_needed > 0.9 * host_ram:
        raise PlanError(
            f"host RAM: this run needs ~{host_needed / GIB:.1f} GiB (dataset index {index_ram / GIB:.1f} GiB for "
            f"{sizes[0]:,} samples = {sizes[0] / max(epoch_samples, 1):,.1f} epochs) but {host_ram / GIB:.1f} GiB "
            "is available. Fix: lower train.train_tokens or train.train_epochs"
            + (", or set train.offload_optimizer=false" if settings.offload else ""))

    precision = f"fp8 {train.fp8_recipe}" if train.precision == "fp8" else train.precision
    setup = SpeedSetup(shape, precision, train.seq_len, name, dp)
    measured, elsewhere = ((None, None) if is_url(train.output_model_dir) else
                           measured_tokens_per_s(train.output_model_dir, tokens_per_step, setup))
    p = bytes_per_value(train.engine_precision)
    checkpoint_bytes = parameters * (p + 8 + (4 if settings.zero_stage > 0 or p == 2 else 0))
    return Plan(shape=shape, parameters=parameters, dp=dp,
                flops_per_token=flops_per_token(shape, train.seq_len, parameters),
                on_gpu=on_gpu, device_name=name, budget=budget, settings=settings,
                accumulation=per_rank // settings.micro_batch,
                memory=memory_of(replace(settings, checkpointing=False)),
                memory_checkpointed=memory_of(replace(settings, checkpointing=True)), loss=loss, fp8=fp8_choice,
                ranks_per_node=node_ranks, stats=stats, weights=weights,
                tokens_per_step=tokens_per_step, steps=steps, run_length=run_length, schedule=schedule,
                train_samples=sizes[0],
                eval_samples=eval_samples, index_ram=index_ram, index_build_ram=build_ram, rank_index_ram=rank_index,
                host_ram_needed=host_needed, host_ram=host_ram,
                checkpoint_bytes=checkpoint_bytes,
                # fp8 runs too: MFU against the dense bf16 peak (the FP8 matmuls' own peak is twice it)
                peak_flops=peak_flops(name, train.engine_precision, train.peak_tflops) if on_gpu else None,
                setup=setup, measured_tokens_per_s=measured, measured_elsewhere=elsewhere)


def warmup_start(train: Any, init_from: Path | None) -> tuple[float, str] | None:
    """(the rate stage 3's warmup starts from, where it comes from): train.start_lr where set; else 0 for a new
    model (None); with model.init_from, the base's end rate its folder records (re-warm), or train.min_lr where it
    records none."""
    from gptpipe.runtime.base_model import recorded_end_lr

    if train.start_lr is not None:
        return train.start_lr, "train.start_lr"
    if init_from is None:
        return None
    recorded = None if is_url(init_from) else recorded_end_lr(init_from)
    return recorded or (train.min_lr, f"train.min_lr: {init_from} records no end rate of the base's training (no "
                                      "trainer_state.json learning_rate, no gptpipe export manifest final_lr)")


def continued_suggestions(plan: Plan, config: TrainingRun) -> list[str]:
    """What the plan suggests for a continued run (model.init_from): `suggestions` on its datasets' shares and
    schedule; nothing for a new model."""
    if config.model.init_from is None:
        return []
    shares = [w / sum(plan.weights) for w in plan.weights] if plan.weights else None
    return suggestions([st.prefix.name for st in plan.stats], shares, plan.schedule)


def suggestions(names: list[str], shares: list[float] | None, schedule: Schedule) -> list[str]:
    """A continued run's replay share or peak rate outside what bench/bench_vocab_extension.py measured to keep
    the base's language (CONTINUED_* in train/config.py): one dataset (`names`; nothing replays the base's
    language), the smallest blended share (`shares`, taken for the replay) below CONTINUED_REPLAY_MIN, a peak
    above CONTINUED_PEAK_RATIO_MAX times the base's recorded end rate."""
    from gptpipe.train.config import CONTINUED_PEAK_RATIO_MAX, CONTINUED_REPLAY, CONTINUED_REPLAY_MIN

    found = []
    measured = "bench/bench_vocab_extension.py, docs/benchmarks.md"
    if len(names) == 1:
        found.append(f"no replay: only {names[0]} is trained on, and a continued model forgets the base's language "
                     f"fast; blend ~{CONTINUED_REPLAY:.0%} of text like the base's (a second data.prefixes entry, "
                     f"data.weights [{1 - CONTINUED_REPLAY:g}, {CONTINUED_REPLAY:g}]; {measured})")
    elif shares:
        smallest = min(range(len(shares)), key=shares.__getitem__)
        if shares[smallest] < CONTINUED_REPLAY_MIN:
            found.append(f"the smallest share, {names[smallest]} at {shares[smallest]:.1%}, is below the "
                         f"{CONTINUED_REPLAY_MIN:.0%} replay measured to keep the base's language: if it is the "
                         f"replay, raise its data.weights share ({measured})")
    start, peak = schedule.start_lr, schedule.peak_lr
    # the ratio was measured from the base's own end rate: not judged against a start set or fallen back to
    recorded = not schedule.start_origin.startswith("train.")
    if recorded and start > 0 and peak > CONTINUED_PEAK_RATIO_MAX * start:
        found.append(f"train.lr {peak:g} is {peak / start:.1f}x the rate the re-warm starts from ({start:g}); peaks "
                     f"above {CONTINUED_PEAK_RATIO_MAX:g}x it forgot more of the base's language ({measured})")
    return found


def largest_micro_batch(settings: EngineSettings, per_rank: int,
                        fits: Callable[[EngineSettings], bool]) -> EngineSettings:
    """The planner's choice when train.micro_batch_size is unset: `settings` with the largest micro-batch that
    divides the rank's samples per step and fits (1 when none does: the refusal then says what to change)."""
    return next((replace(settings, micro_batch=m) for m in sorted(_divisors(per_rank), reverse=True)
                 if fits(replace(settings, micro_batch=m))), replace(settings, micro_batch=1))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _refusal(memory: Memory, budget: Budget, device: str, settings: EngineSettings, per_rank: int, dp: int,
             global_batch: int, fits: Callable[[EngineSettings], bool],
             memory_of: Callable[[EngineSettings], Memory]) -> str:
    """The refusal message: what does not fit, and the first changes (cheapest first) that make it fit."""
    candidates: list[tuple[str, EngineSettings]] = []
    smaller = [m for m in sorted(_divisors(per_rank), reverse=True) if m < settings.micro_batch]
    candidates += [(f"train.micro_batch_size={m}", replace(settings, micro_batch=m)) for m in smaller]
    if not settings.checkpointing:
        candidates += [(f"train.activation_checkpointing=true train.micro_batch_size={m}",
                        replace(settings, checkpointing=True, micro_batch=m))
                       for m in [settings.micro_batch, *smaller]]
    if dp > 1:
        for stage in range(settings.zero_stage + 1, 4):
            candidates += [(f"train.zero_stage={stage} train.activation_checkpointing=true train.micro_batch_size={m}",
                            EngineSettings(m, stage, True, settings.offload))
                           for m in [settings.micro_batch, *smaller]]
    if not settings.offload:
        stage = max(settings.zero_stage, 1)
        candidates += [(f"train.offload_optimizer=true train.zero_stage={stage} train.activation_checkpointing=true "
                        f"train.micro_batch_size={m}", EngineSettings(m, stage, True, True))
                       for m in [settings.micro_batch, *smaller]]
    fix = next(((text, s) for text, s in candidates if fits(s)), None)
    lines = [f"the run does not fit: it needs ~{memory.total / GIB:.1f} GiB per device (weights "
             f"{memory.weights / GIB:.1f}, gradients {memory.gradients / GIB:.1f}, optimizer "
             f"{memory.optimizer / GIB:.1f}, activations {memory.activations / GIB:.1f}, logits "
             f"{memory.logits / GIB:.1f} GiB) with {settings.describe(dp, global_batch)}; {device}: "
             f"{budget.describe()}."]
    if fix:
        lines.append(f"Fix: set {fix[0]} (~{memory_of(fix[1]).total / GIB:.1f} GiB per device; the global batch "
                     f"stays {global_batch} through gradient accumulation).")
    else:
        lines.append("Nothing the planner can change fits it on this many devices. Fix: use more GPUs with "
                     "train.zero_stage=3, a smaller model (model.preset) or a shorter train.seq_len.")
    return "\n".join(lines)


def check_parameter_count(plan: Plan, hf_config: Any) -> int:
    """Instantiate the model on the meta device (no memory) and compare its size with the plan's."""
    actual = meta_parameters(hf_config)
    if actual != plan.parameters:
        raise PlanError(f"planner bug: it counts {plan.parameters:,} parameters, the model has {actual:,}")
    return actual
