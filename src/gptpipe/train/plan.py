"""Preflight for stage 3 (`gptpipe plan`, and automatically before training).

From config.yaml, the tokenizer and the dataset's .idx alone it works out the run: parameters (checked
against the real model's `num_parameters()`), FLOPs per token, steps and LR schedule from the token
count, per-GPU memory for weights, gradients and optimizer states under the chosen ZeRO stage,
activations with and without checkpointing, logits, host RAM for the dataset index and disk per
checkpoint. A run that will not fit is refused before launch, with the change that makes it fit.

Memory figures are estimates (activation bytes per token follow the tensors autograd keeps for each
block; allocator slack is a flat margin); the GPU benchmark records how close they come.
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gptpipe.config.pipeline import PipelineConfig
from gptpipe.stage import say
from gptpipe.stages import EXIT_BAD_INPUT
from gptpipe.storage import is_url
from gptpipe.data.count import DatasetCounts, count_dataset, train_plan
from gptpipe.train.data import (
    DataError,
    available_host_ram,
    blend_weights,
    check_splits,
    index_bytes,
)
from gptpipe.train.logging import read_metrics
from gptpipe.train.model import Shape, count_parameters, flops_per_token, resolve_shape
from gptpipe.train.schedule import Schedule

GIB = 1024**3
PROCESS_BASELINE = 0.6 * GIB  # RSS of one CPU rank with torch, deepspeed, transformers and megatron loaded
GPU_RANK_HOST_RAM = 2.5 * GIB  # host RSS of one GPU rank (CUDA libraries, pinned buffers)
GPU_CONTEXT = 0.75 * GIB  # CUDA context, NCCL buffers and kernels' workspace
ALLOCATOR_SLACK = 0.08  # the caching allocator's fragmentation, as a share of the rest
ZERO_BUCKET = 50_000_000  # elements; reduce/allgather bucket sizes in the DeepSpeed template
ASSUMED_MFU = 0.40  # for the expected tokens/s before anything was measured on this setup

# Dense bf16/fp16 peak FLOP/s per GPU by model name (fp32 runs count TF32 at half of it).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0,
               "V100": 125.0}


class PlanError(ValueError):
    """The run as configured cannot work; the message says what to change."""


@dataclass(frozen=True)
class Memory:
    """Bytes per device for one configuration."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    overhead: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits + self.overhead


@dataclass(frozen=True)
class Engine:
    """The knobs the planner may turn to make a run fit."""

    micro_batch: int
    zero_stage: int
    checkpointing: bool
    offload: bool

    def describe(self, dp: int, global_batch: int) -> str:
        return (f"micro_batch_size={self.micro_batch} (gradient accumulation "
                f"{global_batch // (self.micro_batch * dp)}), zero_stage={self.zero_stage}, "
                f"activation_checkpointing={str(self.checkpointing).lower()}, "
                f"offload_optimizer={str(self.offload).lower()}")


@dataclass
class Plan:
    """Everything stage 3 derives before it starts."""

    shape: Shape
    parameters: int
    flops_per_token: float
    dp: int
    on_gpu: bool
    device_name: str
    device_memory: float
    engine: Engine
    accumulation: int
    memory: Memory
    memory_checkpointed: Memory
    stats: list[DatasetCounts]
    weights: list[float] | None
    tokens_per_step: int
    steps: int
    schedule: Schedule
    train_samples: int
    eval_samples: int
    index_ram: float
    host_ram_needed: float
    host_ram: float
    checkpoint_bytes: float
    peak_flops: float | None
    measured_tokens_per_s: float | None  # from this run folder's metrics.jsonl (an earlier segment of the run)

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


def measured_tokens_per_s(run_dir: Path, tokens_per_step: int, last: int = 20) -> float | None:
    """Median tokens/s of the last `last` log steps in `run_dir`/metrics.jsonl that ran with the same tokens
    per step (an earlier segment of this run, before a resume); None where there are none."""
    speeds = [float(row["tokens_per_s"]) for row in read_metrics(run_dir / "metrics.jsonl")
              if row.get("tokens_per_s") and row.get("step") and row.get("tokens") == row["step"] * tokens_per_step]
    return statistics.median(speeds[-last:]) if speeds else None


def bytes_per_value(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def activation_values_per_token(shape: Shape) -> float:
    """Values autograd keeps per token and block (norm inputs/outputs, projections, MLP intermediates)."""
    h, f, kv = shape.hidden_size, shape.ffn_hidden_size, shape.kv_dim
    if shape.arch == "gpt2":
        return 2 * h + 3 * h + h + h + 2 * h + 2 * f  # ln1, qkv, attention out, residual, ln2, fc + gelu
    mlp = 4 * f * shape.experts_top_k + (shape.num_experts if shape.num_experts > 1 else 0)
    # 2 RMSNorm (fp32 upcast inside: ~3 values each), q/k/v, roped q/k, attention out, gate/up/act/product
    return 6 * h + (h + 2 * kv) + (h + kv) + h + mlp


def estimate_memory(shape: Shape, parameters: int, seq_len: int, precision: str, dp: int, engine: Engine,
                    on_gpu: bool, fused_loss: bool) -> Memory:
    """Per-device bytes of one configuration (see the module doc for what is and is not exact)."""
    p = bytes_per_value(precision)
    n = parameters
    weights = n * p / (dp if engine.zero_stage == 3 else 1)
    gradients = n * p / (dp if engine.zero_stage >= 2 else 1)
    # AdamW: m and v in fp32, plus fp32 master weights when the model itself is bf16/fp16.
    optimizer_per_param = 8 + (4 if p == 2 else 0)
    optimizer = 0.0 if engine.offload else n * optimizer_per_param / (dp if engine.zero_stage >= 1 else 1)
    if engine.zero_stage in (1, 2):
        gradients += min(n, 2 * ZERO_BUCKET) * p  # reduce buckets
    tokens = engine.micro_batch * seq_len
    per_layer = activation_values_per_token(shape) * tokens * p
    if engine.checkpointing:
        activations = shape.num_layers * tokens * shape.hidden_size * p + per_layer  # block inputs + one block
    else:
        activations = shape.num_layers * per_layer
    if fused_loss:
        logits = 2 * tokens * shape.hidden_size * 4  # Liger's chunked loss never holds the full logits
    else:
        logits = tokens * shape.vocab_size * (p + 4 + 4)  # logits, fp32 upcast, fp32 gradient
    subtotal = weights + gradients + optimizer + activations + logits
    overhead = (GPU_CONTEXT if on_gpu else PROCESS_BASELINE) + ALLOCATOR_SLACK * subtotal
    return Memory(weights, gradients, optimizer, activations, logits, overhead)


def detect_device() -> tuple[bool, str, float]:
    """(on_gpu, name, bytes of memory) of this machine's first accelerator, or of host RAM on CPU."""
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return True, props.name, float(props.total_memory)
    except ImportError:
        pass
    return False, "CPU", float(available_host_ram())


def peak_flops(device_name: str, precision: str, override_tflops: float | None) -> float | None:
    """Dense peak FLOP/s of one GPU for MFU (None on CPU or an unknown GPU without an override)."""
    if override_tflops:
        return override_tflops * 1e12
    for key, tflops in PEAK_TFLOPS.items():
        if key in device_name.upper():
            return tflops * 1e12 / (2 if precision == "fp32" else 1)
    return None


def world_size() -> int:
    """Data-parallel ranks of the current launch (the launcher's WORLD_SIZE; 1 when run directly)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def make_plan(config: PipelineConfig, vocab_size: int, dp: int | None = None, device_memory_gib: float | None = None,
              device_name: str | None = None, fused_loss: bool | None = None) -> Plan:
    """Work out the run and check it fits; raises PlanError (or DataError) with a concrete fix."""
    train, data = config.train, config.data
    dp = dp or world_size()
    on_gpu, detected_name, detected_memory = detect_device()
    name = device_name or detected_name
    on_gpu = on_gpu or device_name is not None
    memory_budget = (device_memory_gib or train.gpu_memory_gib or 0) * GIB
    if not memory_budget:
        if device_name and device_name != detected_name:
            raise PlanError(f"planning for {device_name} from {detected_name}: give its memory (--gpu-memory GIB "
                            "or train.gpu_memory_gib)")
        # CPU ranks of one machine share its RAM
        memory_budget = detected_memory if on_gpu else detected_memory / _ranks_per_node(dp)
    if fused_loss is None:
        fused_loss = on_gpu and train.liger_kernels and liger_available()

    shape = resolve_shape(config.model, vocab_size)
    parameters = count_parameters(shape, train.seq_len)

    if train.global_batch_size % dp:
        raise PlanError(f"train.global_batch_size {train.global_batch_size} is not divisible by the {dp} "
                        f"data-parallel ranks. Fix: set train.global_batch_size="
                        f"{max(dp, train.global_batch_size // dp * dp)}")
    per_rank = train.global_batch_size // dp
    if train.micro_batch_size and per_rank % train.micro_batch_size:
        raise PlanError(f"train.micro_batch_size {train.micro_batch_size} does not divide the "
                        f"{per_rank} samples per rank and step (global_batch_size / {dp} ranks). Fix: set "
                        f"train.micro_batch_size={max(d for d in _divisors(per_rank) if d <= train.micro_batch_size)}")

    stats = [count_dataset(p, data.split, data.seed) for p in data.prefixes]
    check_splits(stats, data.split, train.seq_len)
    weights = blend_weights(data, stats)
    tokens_per_step = train.global_batch_size * train.seq_len
    by_epochs = train_plan(stats, train.seq_len, train.global_batch_size, train.train_epochs)  # count_tokens' rule
    epoch_samples = by_epochs.samples_per_epoch
    if train.train_tokens is not None:
        wanted_samples = train.train_tokens // train.seq_len
        how = f"train.train_tokens={train.train_tokens:,}"
    else:
        wanted_samples = by_epochs.train_samples
        how = f"train.train_epochs={train.train_epochs:g} of {epoch_samples:,} samples"
    full_steps = wanted_samples // train.global_batch_size
    if full_steps < 1:
        raise PlanError(f"{how} is less than one global batch ({train.global_batch_size} × {train.seq_len} "
                        f"tokens). Fix: lower train.global_batch_size or raise train.train_tokens/train_epochs.")
    steps = min(full_steps, train.train_iters or full_steps)
    schedule = Schedule.for_run(train, steps)
    eval_samples = train.eval_iters * train.global_batch_size
    # The dataset is built for the uncapped run: a train_iters cap (or changing it on resume) then never
    # changes which samples come in which order.
    sizes = [full_steps * train.global_batch_size, eval_samples, eval_samples]
    index_ram = index_bytes(stats, weights, sizes, train.seq_len)

    def memory_of(engine: Engine) -> Memory:
        return estimate_memory(shape, parameters, train.seq_len, train.precision, dp, engine, on_gpu, fused_loss)

    def fits(engine: Engine) -> bool:
        return memory_of(engine).total <= memory_budget

    engine = Engine(train.micro_batch_size or per_rank, train.zero_stage, train.activation_checkpointing,
                    train.offload_optimizer)
    if train.micro_batch_size is None:  # the planner's choice: the largest micro-batch that fits
        engine = next((replace(engine, micro_batch=m) for m in sorted(_divisors(per_rank), reverse=True)
                       if fits(replace(engine, micro_batch=m))), replace(engine, micro_batch=1))
    if not fits(engine):
        raise PlanError(_refusal(memory_of(engine), memory_budget, name, engine, per_rank, dp,
                                 train.global_batch_size, fits, memory_of))

    offloaded = parameters * (8 + (4 if train.precision != "fp32" else 0)) / dp if engine.offload else 0
    host_needed = index_ram + _ranks_per_node(dp) * (offloaded + (GPU_RANK_HOST_RAM if on_gpu else 0))
    host_ram = float(available_host_ram())
    if host_needed > 0.9 * host_ram:
        raise PlanError(
            f"host RAM: this run needs ~{host_needed / GIB:.1f} GiB (dataset index {index_ram / GIB:.1f} GiB for "
            f"{sizes[0]:,} samples = {sizes[0] / max(epoch_samples, 1):,.1f} epochs) but {host_ram / GIB:.1f} GiB is available. Fix: lower train.train_tokens or train.train_epochs"
            + (", or set train.offload_optimizer=false" if engine.offload else ""))

    p = bytes_per_value(train.precision)
    checkpoint_bytes = parameters * (p + 8 + (4 if engine.zero_stage > 0 or p == 2 else 0))
    return Plan(shape=shape, parameters=parameters, flops_per_token=flops_per_token(shape, train.seq_len), dp=dp,
                on_gpu=on_gpu, device_name=name, device_memory=memory_budget, engine=engine,
                accumulation=per_rank // engine.micro_batch, memory=memory_of(replace(engine, checkpointing=False)),
                memory_checkpointed=memory_of(replace(engine, checkpointing=True)), stats=stats, weights=weights,
                tokens_per_step=tokens_per_step, steps=steps, schedule=schedule, train_samples=sizes[0],
                eval_samples=eval_samples, index_ram=index_ram, host_ram_needed=host_needed, host_ram=host_ram,
                checkpoint_bytes=checkpoint_bytes,
                peak_flops=peak_flops(name, train.precision, train.peak_tflops) if on_gpu else None,
                measured_tokens_per_s=None if is_url(train.output_model_dir) else
                measured_tokens_per_s(train.output_model_dir, tokens_per_step))


def _ranks_per_node(dp: int) -> int:
    return min(dp, int(os.environ.get("LOCAL_WORLD_SIZE", dp)))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _refusal(memory: Memory, budget: float, device: str, engine: Engine, per_rank: int, dp: int, global_batch: int,
             fits: Any, memory_of: Any) -> str:
    """The refusal message: what does not fit, and the first changes (cheapest first) that make it fit."""
    candidates: list[tuple[str, Engine]] = []
    smaller = [m for m in sorted(_divisors(per_rank), reverse=True) if m < engine.micro_batch]
    candidates += [(f"train.micro_batch_size={m}", replace(engine, micro_batch=m)) for m in smaller]
    if not engine.checkpointing:
        candidates += [(f"train.activation_checkpointing=true train.micro_batch_size={m}",
                        replace(engine, checkpointing=True, micro_batch=m))
                       for m in [engine.micro_batch, *smaller]]
    if dp > 1:
        for stage in range(engine.zero_stage + 1, 4):
            candidates += [(f"train.zero_stage={stage} train.activation_checkpointing=true train.micro_batch_size={m}",
                            Engine(m, stage, True, engine.offload)) for m in [engine.micro_batch, *smaller]]
    if not engine.offload:
        stage = max(engine.zero_stage, 1)
        candidates += [(f"train.offload_optimizer=true train.zero_stage={stage} train.activation_checkpointing=true "
                        f"train.micro_batch_size={m}", Engine(m, stage, True, True))
                       for m in [engine.micro_batch, *smaller]]
    fix = next(((text, e) for text, e in candidates if fits(e)), None)
    lines = [f"the run does not fit: it needs ~{memory.total / GIB:.1f} GiB per device but {device} has "
             f"{budget / GIB:.1f} GiB (weights {memory.weights / GIB:.1f}, gradients {memory.gradients / GIB:.1f}, "
             f"optimizer {memory.optimizer / GIB:.1f}, activations {memory.activations / GIB:.1f}, "
             f"logits {memory.logits / GIB:.1f}, overhead {memory.overhead / GIB:.1f} GiB) with "
             f"{engine.describe(dp, global_batch)}."]
    if fix:
        lines.append(f"Fix: set {fix[0]} (~{memory_of(fix[1]).total / GIB:.1f} GiB per device; the global batch "
                     f"stays {global_batch} through gradient accumulation).")
    else:
        lines.append("Nothing the planner can change fits it on this many devices. Fix: use more GPUs with "
                     "train.zero_stage=3, a smaller model (model.preset) or a shorter train.seq_len.")
    return "\n".join(lines)


def liger_available() -> bool:
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        return False
    return True


def check_parameter_count(plan: Plan, hf_config: Any) -> int:
    """Instantiate the model on the meta device (no memory) and compare its size with the plan's."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        actual = AutoModelForCausalLM.from_config(hf_config).num_parameters()
    if actual != plan.parameters:
        raise PlanError(f"planner bug: it counts {plan.parameters:,} parameters, the model has {actual:,}")
    return actual


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h" if seconds < 48 * 3600 else f"{seconds / 86400:.1f} days"


def format_plan(plan: Plan, config: PipelineConfig) -> str:
    """The plan as the table printed before training."""
    s, train = plan.shape, config.train
    g = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    m, c = plan.memory, plan.memory_checkpointed
    chosen = c if plan.engine.checkpointing else m
    rows = [
        ("model", f"{s.arch} {config.model.preset}: {s.num_layers} layers, hidden {s.hidden_size}, "
                  f"{s.num_attn_heads} heads ({s.num_kv_heads} KV), FFN {s.ffn_hidden_size}"
                  + (f", {s.num_experts} experts top-{s.experts_top_k}" if s.num_experts > 1 else "")),
        ("parameters", f"{plan.parameters:,} (vocab {s.vocab_size:,} padded to a multiple of 128)"),
        ("FLOPs per token", f"{plan.flops_per_token:.3g} (6·N + 12·L·h·s, training)"),
        ("data", ", ".join(f"{st.prefix.name}: {st.documents:,} docs, {st.tokens:,} tokens" for st in plan.stats)
         + (f"; weights {[round(w / sum(plan.weights), 3) for w in plan.weights]}" if plan.weights else "")),
        ("split", f"{config.data.split}: train/valid/test documents "
                  f"{'/'.join(str(sum(st.split_documents[i] for st in plan.stats)) for i in range(3))}"),
        ("batch", f"global {train.global_batch_size} = micro {plan.engine.micro_batch} × accumulation "
                  f"{plan.accumulation} × {plan.dp} data-parallel ranks; {plan.tokens_per_step:,} tokens/step"),
        ("run", f"{plan.steps:,} steps, {plan.train_tokens:,} tokens"
                + (f" (capped by train.train_iters={train.train_iters})" if train.train_iters else "")),
        ("lr", f"{plan.schedule.kind}: warmup {plan.schedule.warmup_steps} steps to {train.lr:g}, "
               f"{train.min_lr:g} at step {plan.steps}" if plan.schedule.kind != "constant" else f"constant {train.lr:g}"),
        ("engine", f"{train.precision}, {plan.engine.describe(plan.dp, train.global_batch_size)}"),
        (f"memory/{'GPU' if plan.on_gpu else 'process'}",
         f"weights {g(m.weights)}, gradients {g(m.gradients)}, optimizer {g(m.optimizer)}, "
         f"logits {g(m.logits)}, overhead {g(chosen.overhead)}"),
        ("activations", f"{g(m.activations)} without checkpointing, {g(c.activations)} with"),
        ("total", f"~{g(chosen.total)} of {g(plan.device_memory)} on {plan.device_name}"),
        ("host RAM", f"dataset index {g(plan.index_ram)}; ~{g(plan.host_ram_needed)} needed of "
                     f"{g(plan.host_ram)} available"),
        ("disk", f"~{g(plan.checkpoint_bytes)} per checkpoint, keeping {train.keep_checkpoints}"),
    ]
    speed = plan.expected_tokens_per_s
    if speed:
        source = (f"measured: median of the last log steps in {train.output_model_dir / 'metrics.jsonl'}"
                  if plan.measured_tokens_per_s else
                  f"assumed {ASSUMED_MFU:.0%} MFU of {plan.peak_flops / 1e12:.0f} TFLOP/s per GPU; no measured figure yet")
        rows.append(("expected speed", f"~{speed:,.0f} tokens/s ({source}); the whole run "
                                       f"≈ {_duration(plan.train_tokens / speed)}"))
    if is_url(train.output_model_dir):
        from gptpipe.train.mirror import describe_run_folder

        line, warning = describe_run_folder(str(train.output_model_dir), train.local_dir, plan.checkpoint_bytes,
                                            train.save_interval, plan.tokens_per_step / speed if speed else None)
        rows.append(("run folder", line))
        if warning:
            rows.append(("warning", warning))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def run(config: PipelineConfig, args: argparse.Namespace) -> int:
    """`gptpipe plan`: print the plan; exit 2 when the run would not fit."""
    from gptpipe.stages import read_tokenizer
    from gptpipe.train.model import build_model_config

    tokenizer = read_tokenizer(config.tokenize.tokenizer_dir)
    try:
        plan = make_plan(config, tokenizer.vocab_size, dp=args.gpus, device_memory_gib=args.gpu_memory,
                         device_name=args.gpu_name)
    except (PlanError, DataError) as exc:
        say(f"gptpipe plan: refused: {exc}")
        return EXIT_BAD_INPUT
    check_parameter_count(plan, build_model_config(config.model, tokenizer, config.train.seq_len))
    say(f"[plan] stage 3 with {args.config}:\n{format_plan(plan, config)}")
    return 0

