"""The planner's memory model: bytes per device for one training configuration, and the budget they must fit.

`estimate_memory` counts what torch's allocator hands out on each device (GPU, or CPU rank): weights,
gradients and optimizer states under the ZeRO stage, activations with or without checkpointing, and logits;
bench/bench_train.py compares it with the measured peak allocation. Activation bytes per token follow the
tensors autograd keeps for each block, so they are estimates. What the allocator never reports (the CUDA
context, NCCL's buffers, the caching allocator's fragmentation) and the estimate's own error are not
predicted: `memory_budget` leaves them as headroom, so a plan a few percent off does not run out of memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from gptpipe.train.model import Shape

GIB = 1024**3
ZERO_BUCKET = 50_000_000  # elements; reduce/allgather bucket sizes in the DeepSpeed template
GPU_RANK_HOST_RAM = 2.5 * GIB  # host RSS of one GPU rank (CUDA libraries, pinned buffers)

# Headroom: device memory the planner never fills.
# - A fixed reserve for what lives outside torch's allocator: on GPU the CUDA context with torch's kernels
#   loaded (~0.5 GiB), NCCL's communication buffers (grows with the ranks: about 1 GiB on 8 GPUs) and
#   cuBLAS/Triton workspaces; on a CPU rank the process's own RSS with torch, deepspeed, transformers and
#   megatron loaded.
# - A share of the device for the caching allocator's fragmentation (blocks reserved but not in use,
#   typically 5-10% of what it holds) and for the estimate itself being a few percent off: a plan that
#   filled the device to the byte (the 1b preset on 80 GB GPUs was planned at 98%) would fail on the first
#   imprecision.
GPU_RESERVE = 2.0 * GIB
CPU_RANK_RESERVE = 0.6 * GIB
FRAGMENTATION_SHARE = 0.10


@dataclass(frozen=True)
class EngineSettings:
    """The DeepSpeed engine settings that decide memory: the knobs the planner may turn to make a run fit."""

    micro_batch: int
    zero_stage: int
    checkpointing: bool
    offload: bool

    def describe(self, dp: int, global_batch: int) -> str:
        return (f"micro_batch_size={self.micro_batch} (gradient accumulation "
                f"{global_batch // (self.micro_batch * dp)}), zero_stage={self.zero_stage}, "
                f"activation_checkpointing={str(self.checkpointing).lower()}, "
                f"offload_optimizer={str(self.offload).lower()}")


@dataclass(frozen=True)
class Memory:
    """Bytes the allocator hands out per device for one configuration."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits


@dataclass(frozen=True)
class Budget:
    """What a plan may fill of one device: its memory less the headroom."""

    device: float
    reserve: float
    reserved_for: str
    fragmentation: float

    @property
    def headroom(self) -> float:
        return self.reserve + self.fragmentation

    @property
    def usable(self) -> float:
        return self.device - self.headroom

    def describe(self) -> str:
        return (f"budget {self.usable / GIB:.2f} of {self.device / GIB:.2f} GiB, "
                f"headroom {self.headroom / GIB:.2f} GiB "
                f"({self.reserve / GIB:.2f} for {self.reserved_for}, {self.fragmentation / GIB:.2f} for fragmentation "
                "and estimate error)")


def memory_budget(device_bytes: float, on_gpu: bool) -> Budget:
    """The budget of one device (a GPU, or a CPU rank's share of host RAM): see the headroom constants."""
    if on_gpu:
        return Budget(device_bytes, GPU_RESERVE, "the CUDA context and NCCL", FRAGMENTATION_SHARE * device_bytes)
    return Budget(device_bytes, CPU_RANK_RESERVE, "the process's libraries", FRAGMENTATION_SHARE * device_bytes)


def bytes_per_value(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def optimizer_bytes_per_parameter(precision: str) -> int:
    """AdamW: m and v in fp32, plus fp32 master weights when the model itself is bf16/fp16."""
    return 8 + (4 if bytes_per_value(precision) == 2 else 0)


def activation_values_per_token(shape: Shape) -> float:
    """Values autograd keeps per token and block (norm inputs/outputs, projections, MLP intermediates)."""
    h, f, kv = shape.hidden_size, shape.ffn_hidden_size, shape.kv_dim
    if shape.arch == "gpt2":
        return 2 * h + 3 * h + h + h + 2 * h + 2 * f  # ln1, qkv, attention out, residual, ln2, fc + gelu
    mlp = 4 * f * shape.experts_top_k + (shape.num_experts if shape.num_experts > 1 else 0)
    # 2 RMSNorm (fp32 upcast inside: ~3 values each), q/k/v, roped q/k, attention out, gate/up/act/product
    return 6 * h + (h + 2 * kv) + (h + kv) + h + mlp


def estimate_memory(shape: Shape, parameters: int, seq_len: int, precision: str, dp: int, settings: EngineSettings,
                    fused_loss: bool) -> Memory:
    """Per-device bytes the allocator hands out for one configuration (see the module doc)."""
    p = bytes_per_value(precision)
    n = parameters
    weights = n * p / (dp if settings.zero_stage == 3 else 1)
    gradients = n * p / (dp if settings.zero_stage >= 2 else 1)
    optimizer = (0.0 if settings.offload else
                 n * optimizer_bytes_per_parameter(precision) / (dp if settings.zero_stage >= 1 else 1))
    if settings.zero_stage in (1, 2):
        gradients += min(n, 2 * ZERO_BUCKET) * p  # reduce buckets
    tokens = settings.micro_batch * seq_len
    per_layer = activation_values_per_token(shape) * tokens * p
    if settings.checkpointing:
        activations = shape.num_layers * tokens * shape.hidden_size * p + per_layer  # block inputs + one block
    else:
        activations = shape.num_layers * per_layer
    if fused_loss:
        logits = 2 * tokens * shape.hidden_size * 4  # Liger's chunked loss never holds the full logits
    else:
        logits = tokens * shape.vocab_size * (p + 4 + 4)  # logits, fp32 upcast, fp32 gradient
    return Memory(weights, gradients, optimizer, activations, logits)
