"""The planner's memory model: bytes per device for one training configuration, and the budget they must fit.

`estimate_memory` counts what torch's allocator hands out on each device (GPU, or CPU rank): weights,
gradients and optimizer states under the ZeRO stage, activations with or without checkpointing, and logits;
bench/bench_train.py compares it with the measured peak allocation. Activation bytes per token are the
tensors autograd keeps for each block and the loss's are its peak, both as measured on CPU in bf16
(tests/test_train_plan.py); Liger's kernels are counted from their source. What the allocator never reports (the CUDA
context, NCCL's buffers, the caching allocator's fragmentation) and the estimate's own error are not
predicted: `memory_budget` leaves them as headroom, so a plan a few percent off does not run out of memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from gptpipe.train.model import Shape

GIB = 1024**3
ZERO_BUCKET = 50_000_000  # elements; reduce/allgather bucket sizes in the DeepSpeed template, ZeRO-3's prefetch
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


def optimizer_bytes_per_parameter(precision: str, zero_stage: int) -> int:
    """AdamW: m and v in fp32, plus an fp32 master copy of the weights when the model is bf16/fp16 or, in fp32
    runs, under ZeRO >= 1 (its optimizer keeps its own fp32 partition beside the model's weights)."""
    return 8 + (4 if bytes_per_value(precision) == 2 or zero_stage >= 1 else 0)


def gradient_bytes(precision: str, zero_stage: int, fp32_gradients: bool) -> int:
    """Bytes per gradient value as accumulated and all-reduced: fp32 for bf16 runs with train.fp32_gradients
    (DeepSpeed has no fp32 accumulation for bf16 at ZeRO-0), else the model's precision."""
    fp32 = fp32_gradients and precision == "bf16" and zero_stage >= 1
    return 4 if fp32 else bytes_per_value(precision)


# The unfused loss (transformers' cross-entropy over the full logits) per logit element: at the start of
# backward the fp32 log-softmax kept by forward, the fp32 gradient arriving at it and the fp32 gradient it
# produces are live together (the logits themselves, and their fp32 upcast, are freed by then).
LOSS_BYTES_PER_LOGIT = 12


def activation_bytes_per_token(shape: Shape, precision: str, fused_kernels: bool) -> float:
    """Bytes autograd keeps per token and block, as torch.autograd.graph.saved_tensors_hooks records them
    (tests/test_train_plan.py measures them on 1- and 2-layer models). `fused_kernels`: Liger's RMSNorm (and,
    for llama, SwiGLU) replace transformers' eager ones (apply_liger in train/engine.py). A base model's block
    (model.init_from: mistral, qwen2/3, gemma2/3) is counted as llama's, measured for llama only."""
    p = bytes_per_value(precision)
    h, f, kv, heads = shape.hidden_size, shape.ffn_hidden_size, shape.kv_dim, shape.num_attn_heads
    q = heads * shape.head_dim  # = h, except for base models with their own head_dim (Gemma, Qwen3)
    attention = p * (2 * q + 2 * kv) + 4 * heads  # q, k, v into attention, its output, fp32 log-sum-exp per head
    if shape.arch == "gpt2":
        # 2 LayerNorms (input and output, mean and rstd), attention, and the MLP's activation input and
        # output (gelu_pytorch_tanh: one kernel saving its input only).
        return 2 * (2 * p * h + 2 * p) + attention + 2 * p * f
    # RMSNorm: eager keeps the fp32 upcast of its input, rsqrt, the normalized and the weighted output;
    # Liger's keeps its input, the fp32 rstd and the output.
    norm = (2 * p * h + 4) if fused_kernels else (4 * h + 4 + 2 * p * h)
    if shape.arch == "mixtral":
        e, k = shape.num_experts, shape.experts_top_k
        # router softmax (fp32 and cast), routing indices and weights, each routed token's input, gate/up,
        # activation, product and expert output (the MLP always eager: Liger's mixtral patch has no SwiGLU)
        mlp = e * (4 + p) + 4 + 48 * k + 2 * k * h * p + 4 * k * f * p
    else:
        mlp = (3 if fused_kernels else 4) * f * p  # gate, up, (eager: silu,) product
    return 2 * norm + attention + mlp


def estimate_memory(shape: Shape, parameters: int, seq_len: int, precision: str, dp: int, settings: EngineSettings,
                    fused_loss: bool, fp32_gradients: bool) -> Memory:
    """Per-device bytes the allocator hands out for one configuration (see the module doc).

    `fused_loss`: Liger's kernels are applied (devices.loss_path): its fused loss and its smaller activations.
    """
    p = bytes_per_value(precision)
    g = gradient_bytes(precision, settings.zero_stage, fp32_gradients)
    n = parameters
    h, V = shape.hidden_size, shape.vocab_size
    weights = n * p / (dp if settings.zero_stage == 3 else 1)
    gradients = n * g / (dp if settings.zero_stage >= 2 else 1)
    if settings.zero_stage == 1 and g != p:
        gradients += n * p  # the model's own bf16 gradients, accumulated into the fp32 ones
    optimizer = (0.0 if settings.offload else
                 n * optimizer_bytes_per_parameter(precision, settings.zero_stage)
                 / (dp if settings.zero_stage >= 1 else 1))
    if settings.zero_stage >= 1:
        gradients += min(n, (1 if settings.zero_stage == 3 else 2) * ZERO_BUCKET) * g  # reduce buckets
    if settings.zero_stage == 3:
        # The gathered working set: the prefetch bucket, the largest module being computed (a block or the
        # embedding) and, under the fused loss, lm_head's weight gathered for the whole model
        # (register_external_parameter in train/engine.py).
        block = (n - V * h * (1 if shape.tie_word_embeddings else 2)) / shape.num_layers
        weights += (min(n, ZERO_BUCKET) + max(block, V * h) + (V * h if fused_loss else 0)) * p
    tokens = settings.micro_batch * seq_len
    per_layer = activation_bytes_per_token(shape, precision, fused_loss) * tokens
    if settings.checkpointing:
        activations = shape.num_layers * tokens * h * p + per_layer  # block inputs + one block
    else:
        activations = shape.num_layers * per_layer
    if fused_loss:
        # Liger's chunked loss: the gradient of its input and a chunk of ~tokens x hidden logits, the fp32 loss
        # per token, and lm_head's gradient computed in forward
        logits = tokens * (2 * h * p + 4) + V * h * p
    else:
        logits = tokens * V * LOSS_BYTES_PER_LOGIT
    return Memory(weights, gradients, optimizer, activations, logits)
