"""DeepSpeed around a transformers model: process group, config from the template, one training step.

On CUDA: NCCL, SDPA attention, Liger's fused kernels (devices.LIGER_ARCHS) when installed (RMSNorm, RoPE, SwiGLU
and the fused linear cross-entropy, so the vocab-sized logits never materialize), torch's fused AdamW, optional
torch.compile and activation checkpointing, and with train.precision fp8 torchao's float8 linears (runtime/fp8.py)
inside the bf16 engine. On CPU: gloo, torch's fused AdamW, OMP_NUM_THREADS set.
No C++ extension is built at run time: the optimizer is torch's ("torch_adam": true, not DeepSpeed's
JIT-built FusedAdam/CPUAdam), and DeepSpeed's CPU shared-memory allreduce op, which JIT-builds on first
use, is switched off (gloo's allreduce does the same job). Liger and torch.compile are Triton, which compiles
a small C launcher at first use: devices.triton_missing checks for its compiler and headers first, and
without them the run trains unfused/uncompiled and logs why.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterable

import torch

from gptpipe.log import get_logger
from gptpipe.ports import free_port
from gptpipe.runtime import fp8
from gptpipe.runtime.config import LoopConfig
from gptpipe.runtime.devices import LIGER_ARCHS, LossPath, host_threads_per_rank, loss_path, triton_missing
from gptpipe.runtime.memory import gradient_bytes
from gptpipe.runtime.model import RouterStats, build_model, expert_biases, lm_forward, parameter_groups, router_loss
from gptpipe.runtime.schedule import Schedule

# Package data, so a plain `pip install .` has it too; original_codes/ds_config_gpt_TEMPLATE.json links here.
TEMPLATE = Path(__file__).resolve().parent / "ds_config_gpt_TEMPLATE.json"
# Keys config.yaml owns: the template must leave them "auto" (or agree), so precision and batch
# size can never disagree between the two files as they did in the original (bf16 vs fp16).
AUTO = "auto"

log = get_logger("engine")


# Start-up notices of the libraries under training that say nothing about this run, silenced here because
# train.py imports this module before either library is loaded (each is filtered by its exact text, so the
# libraries' other warnings still show):
# - megatron-core (train/data.py's datasets) warns four times on import that Transformer Engine and Apex are
#   missing; gptpipe uses neither (the model is transformers', the optimizer torch's AdamW through DeepSpeed);
# - DeepSpeed logs "Setting accelerator to CPU" as a warning on every CPU run; the printed plan already names
#   the device it plans for.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed", category=UserWarning,
                        module=r"megatron\.core")


class _NoCpuAcceleratorNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Setting accelerator to CPU.")


logging.getLogger("DeepSpeed").addFilter(_NoCpuAcceleratorNotice())


class EngineConfigError(ValueError):
    """The DeepSpeed template contradicts config.yaml or misses a value."""


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_distributed() -> Dist:
    """Join (or, run directly, create) the process group: NCCL on GPUs, gloo on CPU."""
    import deepspeed

    # Run without a launcher: a 1-rank group, so the same code path serves every launch.
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    local_rank = int(os.environ["LOCAL_RANK"])
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        # fp32 runs use TF32 tensor cores (the planner's fp32 peak assumes them); bf16/fp16 are unaffected.
        torch.set_float32_matmul_precision("high")
    else:
        # The deepspeed launcher leaves OMP_NUM_THREADS unset: every rank would use every core (ZeRO-3
        # steps get 5-10x slower). Split the cores between the ranks of this node.
        threads = int(os.environ.get("OMP_NUM_THREADS") or host_threads_per_rank(int(os.environ["WORLD_SIZE"])))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
        device = torch.device("cpu")
        _disable_shm_comm_build()
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo", verbose=False)
    return Dist(torch.distributed.get_rank(), torch.distributed.get_world_size(), local_rank, device)


def _disable_shm_comm_build() -> None:
    """DeepSpeed JIT-compiles a C++ shared-memory allreduce for CPU on first use (~60 s, a compiler
    needed); mark it unavailable so gloo's allreduce is used instead."""
    import deepspeed.ops

    compatible = deepspeed.ops.__compatible_ops__
    compatible["deepspeed_shm_comm"] = False


def deepspeed_config(train: LoopConfig, micro_batch: int, accumulation: int, dp: int,
                     on_gpu: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(DeepSpeed config, the template's wandb block) from the template plus config.yaml.

    Every "auto" in the template is filled from config.yaml; a concrete template value that disagrees
    with config.yaml is an error. The wandb block is returned for our logger (DeepSpeed's own wandb
    monitor would open a second run).
    """
    path = train.ds_config_template or TEMPLATE
    try:
        template = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EngineConfigError(f"DeepSpeed template {path} not found (train.ds_config_template)") from None
    except json.JSONDecodeError as exc:
        raise EngineConfigError(f"DeepSpeed template {path} is not valid JSON: {exc}") from None
    config = copy.deepcopy(template)
    wandb_block = config.pop("wandb", {}) or {}
    precision = train.engine_precision  # fp8: a bf16 engine, runtime/fp8.py converts the linears
    owned: dict[str, Any] = {
        "train_batch_size": micro_batch * accumulation * dp,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accumulation,
        "steps_per_print": train.log_interval,
        "gradient_clipping": train.grad_clip,
        "zero_optimization.stage": train.zero_stage,
        "zero_optimization.offload_optimizer": (
            {"device": "cpu", "pin_memory": on_gpu} if train.offload_optimizer else {"device": "none"}),
        "fp16.enabled": precision == "fp16",
        "bf16.enabled": precision == "bf16",
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": train.lr, "betas": [train.adam_beta1, train.adam_beta2], "eps": train.adam_eps,
                "weight_decay": train.weight_decay,
                "torch_adam": True,  # torch's AdamW: DeepSpeed's FusedAdam would JIT-compile C++
                # torch's fused kernel, on GPU and on CPU alike: one pass over the states instead of ~10
                # (11x faster on a 2-core machine, where the foreach path is memory-bound)
                "fused": True,
            },
        },
    }
    problems = []
    for dotted, value in owned.items():
        node = config
        *parents, key = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        current = node.get(key, AUTO)
        if current != AUTO and current != value:
            problems.append(f"{dotted} is {json.dumps(current)} in the template but config.yaml makes it "
                            f"{json.dumps(value)}: write \"auto\" there (config.yaml owns it)")
        node[key] = value
    leftover = [k for k, v in _flatten(config).items() if v == AUTO]
    if leftover:
        problems.append(f"no value for {', '.join(leftover)} (still \"auto\")")
    if problems:
        raise EngineConfigError(f"DeepSpeed template {path}: " + "; ".join(problems))
    if gradient_bytes(precision, train.zero_stage, train.fp32_gradients) == 4 and precision == "bf16":
        # fp32 accumulation and all-reduce of bf16 gradients (DeepSpeed's default is bf16 for both)
        config.setdefault("data_types", {})["grad_accum_dtype"] = "fp32"
        config["communication_data_type"] = "fp32"
    if train.offload_optimizer:
        config["zero_force_ds_cpu_optimizer"] = False  # torch's AdamW on the host, no CPUAdam build
    # DeepSpeed's throughput timer is on by default and synchronizes the device in every forward and every
    # step() when no dataloader is handed to it (ours is not): two full syncs per micro-batch, the GPU idle
    # while the host builds the next batch. The train line measures throughput itself, on log steps. A
    # template that sets "timers" keeps its own.
    config.setdefault("timers", {"throughput": {"enabled": False, "synchronized": False}})
    return config, wandb_block


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def apply_liger(arch: str) -> None:
    """Patch transformers' classes with Liger's Triton kernels for `arch` (one of devices.LIGER_ARCHS, where
    devices.loss_path decided the fused loss runs), before the model is built: then logits never materialize
    in training."""
    import liger_kernel.transformers

    name, mlp = LIGER_ARCHS[arch]
    patch = getattr(liger_kernel.transformers, f"apply_liger_kernel_to_{name}")
    patch(rope=True, rms_norm=True, cross_entropy=False, fused_linear_cross_entropy=True,
          **({mlp: True} if mlp else {"swiglu": False}))


def fused_loss_kwargs(train: LoopConfig) -> dict[str, Any]:
    """What every forward with labels passes to a model whose loss is Liger's fused linear cross-entropy.

    skip_logits: Liger skips the logits only in training mode unless told (evaluation's would not fit).
    accum_dtype: Liger sums lm_head's gradient over its chunks of tokens in the weight's dtype unless told
    otherwise: bf16, one rounding per chunk (32 chunks for 125m at micro-batch 64). With train.fp32_gradients
    the sum is fp32, as every other gradient's (memory.estimate_memory counts the fp32 buffer)."""
    fp32 = gradient_bytes(train.engine_precision, train.zero_stage, train.fp32_gradients) == 4
    return {"skip_logits": True, **({"accum_dtype": torch.float32} if fp32 else {})}


def forward_kwargs(train: LoopConfig, loss: LossPath) -> dict[str, Any]:
    """The keyword arguments every forward with labels passes on the loss path `loss` (devices.loss_path;
    build_engine returns them): `fused_loss_kwargs` where Liger's fused linear cross-entropy computes the loss,
    else none. A loop without an engine (the GPU bench's plain loop) takes them from here too."""
    return fused_loss_kwargs(train) if loss.fused else {}


def build_engine(train: LoopConfig, arch: str, hf_config: Any, ds_config: dict[str, Any], schedule: Schedule,
                 device: torch.device, make_model: Callable[[], Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """The model (freshly initialized from the current RNG state, or `make_model()`'s, e.g. pretrained
    weights for fine-tuning) inside a DeepSpeed engine, and the keyword arguments every forward with labels
    passes (`forward_kwargs`: Liger's fused loss needs them; train_step's `forward` must pass them).

    The LR scheduler goes into `deepspeed.initialize`, so DeepSpeed checkpoints it. `make_model` is called
    after Liger has patched the model classes, so its model gets the fused kernels too.
    """
    import deepspeed

    on_gpu = device.type == "cuda"
    if train.deterministic:
        # cuBLAS reads its workspace setting when its handle is created, at the first matmul: still ahead.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    loss = loss_path(arch, on_gpu, train.liger_kernels)
    main = torch.distributed.get_rank() == 0
    if on_gpu and main:
        log.info(f"loss: {loss.why}")
    if loss.fused:
        apply_liger(arch)
    if on_gpu and train.offload_optimizer:
        # torchrun starts each rank with one thread: the host AdamW step of the offload would run on one core.
        torch.set_num_threads(host_threads_per_rank(torch.distributed.get_world_size()))
    model = make_model() if make_model else build_model(hf_config, device)
    if train.precision == "fp8":
        choices = fp8.convert(model, train.fp8_recipe)
        if main:
            log.info(f"fp8: {fp8.describe(choices, train.fp8_recipe)}; MFU counts against the dense bf16 peak")
            log.debug("fp8 layer by layer:\n  " + "\n  ".join(c.line() for c in choices))
    if loss.fused and train.zero_stage == 3:
        # Liger reads lm_head.weight outside lm_head's forward: ZeRO-3 must gather it for the whole model.
        deepspeed.zero.register_external_parameter(model, model.lm_head.weight)
    if train.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # An embedding warm-up's frozen groups are the schedule's (schedule.py): the embedding and output matrices in
    # groups of their own.
    groups = parameter_groups(model, train.weight_decay, vocab_apart=schedule.frozen_steps > 0)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_config,
                                      lr_scheduler=schedule.scheduler_factory())
    why_not = uncompiled_because(train, on_gpu, loss.fused)
    if train.compile:
        if why_not is None:
            engine.compile(backend=train.compile_backend)
        elif main:
            log.warning(f"train.compile: running uncompiled: {why_not}")
    if train.precision == "fp8" and not (train.compile and why_not is None):
        # torchao's casts and scales are separate kernels unless compiled: compile the converted linears alone,
        # so Liger's kernels around them stay eager (uncompiled_because: under inductor they gave a NaN loss)
        inductor = train.compile_backend == "inductor"
        missing = ("inductor compiles for CUDA only" if inductor and not on_gpu else
                   triton_missing() if inductor else None)
        if missing and main:
            log.warning(f"fp8: the float8 linears run uncompiled (slower casts): {missing}")
        elif not missing:
            count = fp8.compile_converted(engine.module, train.compile_backend)
            if main:
                log.info(f"fp8: {count} float8 linears compiled on their own ({train.compile_backend})")
    return engine, forward_kwargs(train, loss)


def uncompiled_because(train: LoopConfig, on_gpu: bool, liger: bool) -> str | None:
    """Why train.compile cannot compile this run, None when it can."""
    inductor = train.compile_backend == "inductor"
    if inductor and not on_gpu:
        return "inductor compiles for CUDA only"
    if inductor and liger:
        # Seen on an H200 (bench/gpu_check.sh, docs/benchmarks.md): inductor cannot analyse Liger's RMSNorm kernel
        # (its float eps) and the tiny llama's loss went NaN within 13 steps; uncompiled, the same run trains.
        return ("Liger's Triton kernels under torch.compile gave a NaN loss (torch 2.11, liger-kernel 0.8.5); "
                "set train.liger_kernels=false to compile instead")
    missing = triton_missing() if inductor else None
    return f"torch.compile's inductor needs Triton: {missing}" if missing else None


def forward_loss(engine: Any, batch: dict[str, torch.Tensor],
                 **loss_kwargs: Any) -> tuple[torch.Tensor, RouterStats | None]:
    """(loss to backpropagate, the router's statistics or None) of model.lm_forward; `loss_kwargs` are
    build_engine's. `engine` may also be the plain model (bench/bench_liger.py, bench_train.py's plain loop).

    A mixture of experts asks for its router logits here (its saved config leaves them off) and adds each
    layer's load-balancing loss (model.router_loss) with the config's router_aux_loss_coef (0 where a selection
    bias balances instead: the statistics then count the biased choices)."""
    config = getattr(engine, "module", engine).config
    moe = hasattr(config, "output_router_logits")
    out = lm_forward(engine, batch, **loss_kwargs, **({"output_router_logits": True} if moe else {}))
    if not moe:
        return out.loss, None
    stats = router_loss(out.router_logits, config.num_experts_per_tok, expert_biases(engine))
    return out.loss + config.router_aux_loss_coef * stats.losses.sum(), stats


class StopFlag:
    """Set by the SIGTERM/SIGINT handler; checked between micro-batches, agreed across ranks.

    Ranks may see a signal at different micro-batches; the flag is OR-reduced over a gloo group (a CPU
    tensor: no device sync) so that all of them stop at the same point.
    """

    def __init__(self, world_size: int):
        self._event = threading.Event()
        self.signal_name = ""
        self.at: float | None = None  # time.monotonic() when this rank first learnt of the stop: its grace runs
        self._group = torch.distributed.new_group(backend="gloo") if world_size > 1 else None

    @property
    def group(self) -> Any:
        """The ranks' gloo group (None on one rank): CPU collectives about stopping."""
        return self._group

    def set(self, signal_name: str) -> None:
        if self.at is None:
            self.at = time.monotonic()
        self.signal_name = signal_name
        self._event.set()

    def agreed(self) -> bool:
        if self._group is None:
            return self._event.is_set()
        flag = torch.tensor([1 if self._event.is_set() else 0], dtype=torch.int32)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._group)
        if flag.item() and not self._event.is_set():
            self.set("a signal on another rank")
        return bool(flag.item())


@dataclass
class StepResult:
    loss: torch.Tensor  # mean over micro-batches, on device (read only on log steps)
    aux_loss: RouterStats | None  # a mixture of experts' routing, averaged over the micro-batches
    applied: bool  # False: DeepSpeed found non-finite gradients and skipped the update


def train_step(engine: Any, batches: Iterable[dict[str, torch.Tensor]], stop: StopFlag,
               forward: Callable[[Any, dict[str, torch.Tensor]], tuple[torch.Tensor, RouterStats | None]]
               ) -> StepResult | None:
    """One optimizer step over `batches` (the micro-batches of one global batch on this rank); `forward`
    gives each micro-batch's (loss, aux loss): pretraining's is forward_loss with build_engine's loss arguments,
    fine-tuning passes its own. No default: a bare forward_loss left them out (the GPU bench summed lm_head's
    gradient in bf16 where `gptpipe train` sums it in fp32).

    Returns None when a stop was requested before the step finished: the model and optimizer are then
    exactly as after the previous step, and that is what gets saved.
    """
    loss_sum: torch.Tensor | None = None
    aux_sum: RouterStats | None = None
    count = 0
    for batch in batches:
        if stop.agreed():
            return None
        loss, aux = forward(engine, batch)
        engine.backward(loss)
        engine.step()  # DeepSpeed applies the update only at the accumulation boundary
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        if aux is not None:
            aux_sum = aux.detach() if aux_sum is None else aux_sum + aux.detach()
        count += 1
    assert loss_sum is not None, "a step needs at least one micro-batch"
    return StepResult(loss_sum / count, None if aux_sum is None else aux_sum / count, engine.was_step_applied())
