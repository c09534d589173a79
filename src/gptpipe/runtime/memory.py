"""The planner's memory model: bytes per device for one training configuration, and the budget they must fit.

`estimate_memory` counts what torch's allocator hands out on each device (GPU, or CPU rank): weights,
gradients and optimizer states under the ZeRO stage, activations with or without checkpointing, and logits;
bench/bench_train.py compares it with the measured peak allocation. Activation bytes per token are the
tensors autograd keeps for each block of each architecture, with the attention kernel CUDA runs, and the loss's
are its peak, both as measured on CPU in bf16 and fp32 (tests/test_train_plan.py); Liger's kernels are counted
from their source (liger-kernel 0.8). What the allocator never reports (the CUDA context, NCCL's buffers, the
caching allocator's fragmentation) and the estimate's own error are not predicted: `memory_budget` leaves them
as headroom, so a plan a few percent off does not run out of memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from gptpipe.runtime.model import MOE_ARCHS, Shape

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


def model_state_bytes(parameters: int, trained: int, precision: str, dp: int, zero_stage: int, offload: bool,
                      fp32_gradients: bool) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) per device of a model of `parameters` weights of which `trained`
    train (all of them, or a LoRA run's adapters: the frozen rest has neither gradients nor optimizer state),
    under the ZeRO stage over `dp` ranks (ZeRO's buckets and ZeRO-3's gathered working set are not included)."""
    p, g = bytes_per_value(precision), gradient_bytes(precision, zero_stage, fp32_gradients)
    weights = parameters * p / (dp if zero_stage == 3 else 1)
    gradients = trained * g / (dp if zero_stage >= 2 else 1)
    if zero_stage == 1 and g != p:
        gradients += trained * p  # the model's own bf16 gradients, accumulated into the fp32 ones
    optimizer = (0.0 if offload else
                 trained * optimizer_bytes_per_parameter(precision, zero_stage) / (dp if zero_stage >= 1 else 1))
    return weights, gradients, optimizer


# The unfused loss (transformers' cross-entropy over the full logits) per logit element: at the start of
# backward the fp32 log-softmax kept by forward, the fp32 gradient arriving at it and the fp32 gradient it
# produces are live together (the logits themselves, and their fp32 upcast, are freed by then).
LOSS_BYTES_PER_LOGIT = 12


@dataclass(frozen=True)
class Block:
    """What sets the tensors one block of an architecture keeps for backward, beyond its sizes."""

    norms: int  # per block: Gemma's four (input, post-attention, pre- and post-feedforward), else two
    norm: str  # "llama", "gemma" or "layer" (GPT-2's LayerNorm): how the eager norm computes
    qk_norm: bool = False  # a per-head RMSNorm on q and on k (Qwen3, Gemma 3)


# Mistral's and Qwen2's blocks are Llama's (Qwen2's q/k/v biases are parameters: nothing more is kept); Gemma
# 2's GeGLU (gelu_pytorch_tanh) keeps what Llama's SwiGLU does, as does Liger's GeGLU what its SwiGLU does.
BLOCKS = {"llama": Block(2, "llama"), "mistral": Block(2, "llama"), "qwen2": Block(2, "llama"),
          "qwen3": Block(2, "llama", qk_norm=True), "gemma2": Block(4, "gemma"),
          "gemma3_text": Block(4, "gemma", qk_norm=True), "gpt2": Block(2, "layer"), "mixtral": Block(2, "llama"),
          "ernie4_5_moe": Block(2, "llama")}


def _norm_bytes(kind: str, p: int, n: int, rows: int, fused: bool) -> int:
    """What one norm over n values per token, in `rows` rows (1, or q's/k's heads), keeps, its output aside
    (kept by the linear that reads it, where one does)."""
    if fused:
        return p * n + 4 * rows  # Liger's RMSNorm (Gemma's offset too): its input and the fp32 rstd
    if kind == "llama":
        return 4 * n + 4 * rows + p * n  # fp32 input (its upcast in bf16), rstd, the normalized cast back
    if kind == "gemma":
        return 8 * n + 4 * rows  # fp32 throughout: input, rstd and normalized, which the weight multiplies
    return p * n + 8 * rows  # LayerNorm: input, fp32 mean and rstd (on CUDA; bf16 on CPU)


def _attention_bytes(shape: Shape, p: int, seq_len: int, windowed: bool) -> int:
    """What the attention itself keeps per token (its output, o_proj's input, aside), on CUDA as transformers
    calls it: SDPA with is_causal and enable_gqa (k and v at their own heads) when no mask is passed."""
    heads, q, kv = shape.num_attn_heads, shape.num_attn_heads * shape.head_dim, shape.kv_dim
    if shape.eager_attention:
        # Gemma 2's eager, soft-capped attention: q, and k and v repeated to every head; per score tanh's output
        # and the fp32 softmax, plus its cast back in bf16 (the fp32 softmax is its own cast): 8 bytes either way.
        return 3 * q * p + 8 * heads * seq_len
    if windowed:
        # A sliding window no longer than the sequence: transformers passes a mask, repeats k and v to every head,
        # and the kernel (CUDA's memory-efficient one: flash takes no mask) keeps the mask, cast to the dtype,
        # per layer ([batch, 1, seq, seq]).
        return 3 * q * p + 4 * heads + seq_len * p
    if p == 4 and kv < q:
        # fp32 with grouped-query attention: flash runs bf16/fp16 only and the memory-efficient kernel takes no
        # GQA (torch's sdp_utils), so SDPA falls back to its math composite: q, k and v expanded to every
        # head, and the fp32 softmax per score. (fp32 without GQA: memory-efficient, as below.)
        return 3 * q * p + 4 * heads * seq_len
    return p * (q + 2 * kv) + 4 * heads  # flash / memory-efficient: q, k, v and the fp32 log-sum-exp per head


def windowed_layers(shape: Shape, seq_len: int) -> int:
    """The layers given a mask: those whose sliding window is no longer than the sequence (transformers only
    relies on SDPA's is_causal where the window covers it)."""
    return shape.sliding_layers if shape.sliding_window is not None and shape.sliding_window <= seq_len else 0


def activation_bytes_per_token(shape: Shape, precision: str, fused_kernels: bool, seq_len: int,
                               windowed: bool = False) -> float:
    """Bytes autograd keeps per token for one block on CUDA, as torch.autograd.graph.saved_tensors_hooks
    records them (tests/test_train_plan.py measures every architecture's on 1- and 2-layer models on CPU).
    `fused_kernels`: Liger's RMSNorm, RoPE and SwiGLU/GeGLU replace transformers' eager ones (apply_liger in
    runtime/engine.py; Mixtral's experts stay eager, GPT-2 has no patch). `windowed`: a sliding-window layer
    given a mask (windowed_layers). RoPE keeps nothing per block either way (its cos/sin are the model's).
    Measured on CUDA too (an H200, torch 2.11, transformers 5.23, liger-kernel 0.8.5), eager and with Liger's
    kernels, bf16 and fp32: every architecture within 0.2% of these figures."""
    p = bytes_per_value(precision)
    h, f = shape.hidden_size, shape.ffn_hidden_size
    heads, q, kv = shape.num_attn_heads, shape.num_attn_heads * shape.head_dim, shape.kv_dim
    block = BLOCKS[shape.arch]
    fused = fused_kernels and shape.arch != "gpt2"
    # The inputs the linears keep: q/k/v's and the MLP's (the norms' outputs), o_proj's (attention's output)
    linear_inputs = p * (2 * h + q)
    norms = block.norms * _norm_bytes(block.norm, p, h, 1, fused)
    if block.qk_norm:
        norms += (_norm_bytes(block.norm, p, q, heads, fused)
                  + _norm_bytes(block.norm, p, kv, shape.num_kv_heads, fused))
    attention = _attention_bytes(shape, p, seq_len, windowed)
    if shape.arch in MOE_ARCHS:
        e, k = shape.num_experts, shape.experts_top_k
        # router softmax (fp32 and cast), routing indices and weights, each routed token's input, gate/up,
        # activation, product and expert output (the MLP always eager: Liger's mixtral patch has no SwiGLU)
        mlp = e * (4 + p) + 4 + 48 * k + 2 * k * h * p + 4 * k * f * p
        if shape.arch == "ernie4_5_moe" and p != 4:
            mlp += 4 * h  # Ernie's router multiplies in fp32: its input's fp32 copy
    elif shape.arch == "gpt2":
        # gelu_pytorch_tanh (build_model_config's): one kernel keeping its input, and its output (c_proj's input);
        # a base GPT-2's gelu_new is a Python composite that keeps its input, tanh's output, 0.5x and 1+tanh
        mlp = (5 if shape.activation == "gelu_new" else 2) * f * p
    else:
        mlp = (3 if fused else 4) * f * p  # gate, up, (eager: the activation's output,) product (down's input)
    return linear_inputs + norms + attention + mlp


def fp8_cast_bytes(tokens: int, out_features: int, in_features: int) -> int:
    """The float8 copies one torchao Float8Linear (runtime/fp8.py) holds while it computes, for `tokens` rows:
    forward's input (tokens x in) and weight (out x in), backward's output gradient (tokens x out), each also
    in the transposed layout the other products need, one byte a value (the scales are a few values per row
    at most). Transient: the layer saves its bf16 input and weight for backward, not the casts, so a run's
    activations are a bf16 run's and only the largest converted layer's casts are live at once. Estimated from
    torchao 0.18's code (float8_linear.py), not measured."""
    return 2 * (tokens * in_features + out_features * in_features + tokens * out_features)


def estimate_memory(shape: Shape, parameters: int, seq_len: int, precision: str, dp: int, settings: EngineSettings,
                    fused_loss: bool, fp32_gradients: bool, document_mask: bool = False,
                    fp8_layer: tuple[int, int] | None = None) -> Memory:
    """Per-device bytes the allocator hands out for one configuration (see the module doc).

    `precision`: the engine's (an fp8 run's is bf16). `fused_loss`: Liger's kernels are applied
    (devices.loss_path): its fused loss and its smaller activations. `document_mask`: transformers passes every
    layer a mask (the documents' block-causal one) and SDPA keeps it, as it does a sliding window's.
    `fp8_layer`: an fp8 run's largest converted linear (out, in), whose casts (`fp8_cast_bytes`) are counted with
    the activations.
    """
    p = bytes_per_value(precision)
    g = gradient_bytes(precision, settings.zero_stage, fp32_gradients)
    n = parameters
    h, V = shape.hidden_size, shape.vocab_size
    weights, gradients, optimizer = model_state_bytes(n, n, precision, dp, settings.zero_stage, settings.offload,
                                                      fp32_gradients)
    if settings.zero_stage >= 1:
        gradients += min(n, (1 if settings.zero_stage == 3 else 2) * ZERO_BUCKET) * g  # reduce buckets
    if settings.zero_stage == 3:
        # The gathered working set: the prefetch bucket, the largest module being computed (a block or the
        # embedding) and, under the fused loss, lm_head's weight gathered for the whole model
        # (register_external_parameter in runtime/engine.py).
        block = (n - V * h * (1 if shape.tie_word_embeddings else 2)) / shape.num_layers
        weights += (min(n, ZERO_BUCKET) + max(block, V * h) + (V * h if fused_loss else 0)) * p
    tokens = settings.micro_batch * seq_len
    windowed = shape.num_layers if document_mask else windowed_layers(shape, seq_len)
    blocks = [(shape.num_layers - windowed, activation_bytes_per_token(shape, precision, fused_loss, seq_len)),
              (windowed, activation_bytes_per_token(shape, precision, fused_loss, seq_len, windowed=True))]
    if settings.checkpointing:  # block inputs + the largest block, recomputed in backward
        activations = tokens * (shape.num_layers * h * p + max(per_token for n, per_token in blocks if n))
    else:
        activations = tokens * sum(n * per_token for n, per_token in blocks)
    if fp8_layer:
        activations += fp8_cast_bytes(tokens, *fp8_layer)
    if fused_loss:
        # Liger's chunked loss (fused_linear_cross_entropy_forward, liger-kernel 0.8.5) at its peak: the gradient
        # of its input, the fp32 loss per token and lm_head's gradient, summed over the chunks in forward (in
        # fp32 with fp32 gradients: accum_dtype, engine.fused_loss_kwargs); with them either
        # - a chunk of ~tokens x hidden logits, in which the kernel writes their gradient, and in fp32 runs each
        #   chunk's product with lm_head's input, a V x h temporary (the addmm into the sum is for bf16/fp16), or
        # - after the chunks, the fp32 sum's cast to the weight's dtype (bf16 with fp32 gradients).
        chunk = tokens * h * p + (V * h * p if p == 4 else 0)
        cast = V * h * p if g != p else 0
        logits = tokens * (h * p + 4) + V * h * g + max(chunk, cast)
    else:
        logits = tokens * V * LOSS_BYTES_PER_LOGIT
    return Memory(weights, gradients, optimizer, activations, logits)
