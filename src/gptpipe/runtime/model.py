"""The trained model: a plain `transformers` causal-LM class, so the HuggingFace export is exact.

Sizes come from a preset (tiny, 125m, 350m, 1b) with any field overridable in `model:`. The vocabulary
comes from the stage-1 tokenizer, padded up to a multiple of 128 so the embedding and output matmuls
use tensor-core-friendly shapes; the padding ids never occur in the data, so they are never learned
(and generation suppresses them). bos/eos/pad ids are the tokenizer's own, never GPT-2's 50256.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptpipe.runtime.config import ModelConfig

if TYPE_CHECKING:  # torch/transformers load only when a model is actually built
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

    from gptpipe.artifacts import TokenizerInfo

VOCAB_MULTIPLE = 128
ARCHITECTURES = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel", "mixtral": "MixtralForCausalLM",
                 "ernie4_5_moe": "Ernie4_5_MoeForCausalLM"}
# The mixtures of experts built from scratch: model.arch mixtral with moe_balance aux_loss, and with bias (Ernie 4.5's
# class: Mixtral's routing plus a per-expert selection bias, no shared experts, every layer a mixture).
MOE_ARCHS = ("mixtral", "ernie4_5_moe")


@dataclass(frozen=True)
class Preset:
    num_layers: int
    hidden_size: int
    num_attn_heads: int
    num_kv_heads: int
    init_std: float
    ffn_hidden_size: int | None = None  # None: the architecture's rule (gpt2 4h, llama ~8h/3)


# 125m and 350m are the original pipeline's shapes (12/768/12 and 24/1024/16, init 0.02 and 0.018);
# 1b is TinyLlama-1.1B's shape (22/2048/32, 4 KV heads, FFN 5632).
PRESETS = {
    "tiny": Preset(num_layers=4, hidden_size=128, num_attn_heads=4, num_kv_heads=4, init_std=0.02),
    "125m": Preset(num_layers=12, hidden_size=768, num_attn_heads=12, num_kv_heads=12, init_std=0.02),
    "350m": Preset(num_layers=24, hidden_size=1024, num_attn_heads=16, num_kv_heads=16, init_std=0.018),
    "1b": Preset(num_layers=22, hidden_size=2048, num_attn_heads=32, num_kv_heads=4, init_std=0.02,
                 ffn_hidden_size=5632),
}


@dataclass(frozen=True)
class Shape:
    """The resolved size of the model: preset plus overrides, with the architecture's defaults filled."""

    arch: str  # model.arch, or a base model's model_type (model.init_from)
    num_layers: int
    hidden_size: int
    num_attn_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int  # padded from scratch; a base model's own
    init_std: float
    tie_word_embeddings: bool
    num_experts: int  # 1 unless a mixture of experts (MOE_ARCHS)
    experts_top_k: int
    explicit_head_dim: int | None = None  # a base model's head_dim where it is not hidden / heads (Gemma, Qwen3)
    eager_attention: bool = False  # build_model runs the eager attention (Gemma 2), not SDPA
    sliding_window: int | None = None  # a base model's attention window (Mistral, Gemma, Qwen2/3 with it on)
    sliding_layers: int = 0  # the layers that use the window (Gemma: 5 of 6 or every other one)
    activation: str | None = None  # a base GPT-2's activation_function (gelu_new); None: the one this file sets

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_attn_heads

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim


def padded_vocab_size(vocab_size: int) -> int:
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def resolve_shape(model_cfg: ModelConfig, vocab_size: int) -> Shape:
    """Preset + overrides → every size the model and the planner need."""
    preset = PRESETS.get(model_cfg.preset)

    def pick(name: str, preset_name: str | None = None) -> Any:
        value = getattr(model_cfg, name)
        if value is not None:
            return value
        return getattr(preset, preset_name or name) if preset else None

    hidden = pick("hidden_size")
    heads = pick("num_attn_heads")
    # A custom head count invalidates the preset's GQA ratio: KV heads default to the attention heads.
    kv_heads = model_cfg.num_kv_heads or (preset.num_kv_heads if preset and model_cfg.num_attn_heads is None
                                          else heads)
    ffn = pick("ffn_hidden_size")
    if ffn is None:
        # gpt2: 4h. llama/mixtral: 8h/3 (same FLOPs as 4h with three matrices), rounded up to 256.
        ffn = 4 * hidden if model_cfg.arch == "gpt2" else -(-(8 * hidden // 3) // 256) * 256
    tie = model_cfg.tie_word_embeddings
    if tie is None:
        tie = model_cfg.arch == "gpt2"  # GPT-2 and Megatron's GPT share them; Llama does not
    if model_cfg.arch == "gpt2":
        kv_heads = heads  # GPT-2 has no grouped-query attention
    moe = model_cfg.arch == "mixtral"
    return Shape(
        arch="ernie4_5_moe" if moe and model_cfg.moe_balance == "bias" else model_cfg.arch,
        num_layers=pick("num_layers"),
        hidden_size=hidden,
        num_attn_heads=heads,
        num_kv_heads=kv_heads,
        ffn_hidden_size=ffn,
        vocab_size=padded_vocab_size(vocab_size),
        init_std=model_cfg.init_std if model_cfg.init_std is not None else (preset.init_std if preset else 0.02),
        tie_word_embeddings=tie,
        num_experts=model_cfg.num_experts if moe else 1,
        experts_top_k=model_cfg.experts_top_k if moe else 1,
    )


def base_shape(config: PretrainedConfig) -> Shape:
    """The shape of a base model (model.init_from) from its transformers config: vocabulary as it has it."""
    if config.model_type == "gpt2":
        heads = config.n_head
        return Shape(arch="gpt2", num_layers=config.n_layer, hidden_size=config.n_embd, num_attn_heads=heads,
                     num_kv_heads=heads, ffn_hidden_size=config.n_inner or 4 * config.n_embd,
                     vocab_size=config.vocab_size, init_std=config.initializer_range,
                     tie_word_embeddings=bool(config.tie_word_embeddings), num_experts=1, experts_top_k=1,
                     activation=config.activation_function)
    heads = config.num_attention_heads
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)  # none: Mistral's window is every layer's
    sliding = (sum(t == "sliding_attention" for t in layer_types) if layer_types else config.num_hidden_layers)
    return Shape(arch=config.model_type, num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
                 num_attn_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                 ffn_hidden_size=config.intermediate_size, vocab_size=config.vocab_size,
                 init_std=config.initializer_range, tie_word_embeddings=bool(config.tie_word_embeddings),
                 # Ernie 4.5 names them moe_num_experts (num_experts, through its attribute map)
                 num_experts=getattr(config, "num_local_experts", None) or getattr(config, "moe_num_experts", 1),
                 experts_top_k=getattr(config, "num_experts_per_tok", 1),
                 explicit_head_dim=getattr(config, "head_dim", None),
                 eager_attention=attention_implementation(config) == "eager",
                 sliding_window=window, sliding_layers=sliding if window else 0)


def meta_parameters(hf_config: PretrainedConfig) -> int:
    """The parameters of the model `hf_config` describes, counted on the meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config).num_parameters()


def count_parameters(shape: Shape, seq_len: int) -> int:
    """Parameters of the model `build_model_config` describes, computed from the shape alone."""
    h, f, kv, L, V = shape.hidden_size, shape.ffn_hidden_size, shape.kv_dim, shape.num_layers, shape.vocab_size
    embeddings = V * h
    head = 0 if shape.tie_word_embeddings else V * h
    if shape.arch == "gpt2":
        attention = h * 3 * h + 3 * h + h * h + h  # c_attn and c_proj, with biases
        mlp = h * f + f + f * h + h
        norms = 2 * 2 * h  # two LayerNorms (weight + bias) per block
        return embeddings + seq_len * h + L * (attention + mlp + norms) + 2 * h + head
    attention = h * h + 2 * h * kv + h * h  # q, k, v, o without biases
    norms = 2 * h  # two RMSNorm weights per block
    if shape.arch in MOE_ARCHS:
        mlp = shape.num_experts * 3 * h * f + h * shape.num_experts  # experts + router
        if shape.arch == "ernie4_5_moe":
            mlp += shape.num_experts  # the router's selection bias (e_score_correction_bias)
    else:
        mlp = 3 * h * f
    return embeddings + L * (attention + mlp + norms) + h + head


def active_matmul_parameters(shape: Shape, seq_len: int, total: int | None = None) -> int:
    """Parameters each token multiplies through: all but the embedding lookups and the unused experts.

    This is the N of "6·N FLOPs per token" used for FLOPs and MFU. `total`: all parameters where they are known
    (a base model's, counted by `meta_parameters`), else count_parameters(shape).
    """
    total = count_parameters(shape, seq_len) if total is None else total
    lookups = shape.vocab_size * shape.hidden_size * (0 if shape.tie_word_embeddings else 1)
    if shape.arch == "gpt2":
        lookups += seq_len * shape.hidden_size
    unused_experts = (shape.num_experts - shape.experts_top_k) * 3 * shape.hidden_size * shape.ffn_hidden_size
    return total - lookups - shape.num_layers * unused_experts


def flops_per_token(shape: Shape, seq_len: int, total: int | None = None, causal: bool = False) -> float:
    """Training FLOPs per token: 6·N for the matmuls plus 12·L·(heads·head_dim)·s for attention scores
    (forward+backward) over the full s×s square (the planner's, Megatron-LM's and llm-foundry's convention; the
    headline MFU's), or with `causal` 6·L·(heads·head_dim)·s, the lower triangle that causal flash attention
    computes; `total` as in active_matmul_parameters."""
    attention = (6 if causal else 12) * shape.num_layers * shape.num_attn_heads * shape.head_dim * seq_len
    return 6 * active_matmul_parameters(shape, seq_len, total) + attention


def build_model_config(model_cfg: ModelConfig, tokenizer_info: TokenizerInfo, seq_len: int) -> PretrainedConfig:
    """The transformers config of the model trained with `model_cfg` on `tokenizer_info`'s vocabulary.

    `tokenizer_info` is stage 1's: vocab_size, bos_id, eos_id, pad_id.
    """
    from transformers import Ernie4_5_MoeConfig, GPT2Config, LlamaConfig, MixtralConfig

    shape = resolve_shape(model_cfg, tokenizer_info.vocab_size)
    pad_id = tokenizer_info.pad_id if tokenizer_info.pad_id is not None and tokenizer_info.pad_id >= 0 else None
    ids = dict(bos_token_id=tokenizer_info.bos_id, eos_token_id=tokenizer_info.eos_id, pad_token_id=pad_id,
               architectures=[ARCHITECTURES[shape.arch]])
    if shape.arch == "gpt2":
        # gelu_pytorch_tanh is GPT-2's gelu_new as one kernel: gelu_new's Python composite keeps 5 tensors of the
        # MLP's width for backward instead of 2 (runtime/memory.py counts the single kernel's).
        return GPT2Config(
            vocab_size=shape.vocab_size, n_positions=seq_len, n_embd=shape.hidden_size, n_layer=shape.num_layers,
            n_head=shape.num_attn_heads, n_inner=shape.ffn_hidden_size, activation_function="gelu_pytorch_tanh",
            resid_pdrop=model_cfg.dropout, embd_pdrop=model_cfg.dropout, attn_pdrop=model_cfg.dropout,
            initializer_range=shape.init_std, tie_word_embeddings=shape.tie_word_embeddings, use_cache=True, **ids)
    common = dict(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.ffn_hidden_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_attn_heads,
        num_key_value_heads=shape.num_kv_heads, max_position_embeddings=seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": model_cfg.rope_theta},
        initializer_range=shape.init_std, attention_dropout=model_cfg.dropout,
        tie_word_embeddings=shape.tie_word_embeddings, rms_norm_eps=1e-5, use_cache=True, **ids)
    if shape.arch == "mixtral":
        # output_router_logits stays off in every saved config: with it on, generation with a padded batch fails
        # in transformers' load-balancing loss. Training asks for the router logits itself (engine.forward_loss).
        return MixtralConfig(num_local_experts=shape.num_experts, num_experts_per_tok=shape.experts_top_k,
                             router_aux_loss_coef=0.01 if model_cfg.router_aux_loss_coef is None
                             else model_cfg.router_aux_loss_coef, output_router_logits=False,
                             sliding_window=None, **common)
    if shape.arch == "ernie4_5_moe":
        # Mixtral's shape in Ernie 4.5's class: every layer a mixture (from layer 0, step 1), no shared experts,
        # no biases in the projections; its attention has no dropout (model.dropout must be 0). The router's
        # load-balancing loss is off: the selection bias balances (ExpertBias).
        common.pop("attention_dropout")
        return Ernie4_5_MoeConfig(moe_num_experts=shape.num_experts, moe_k=shape.experts_top_k,
                                  moe_intermediate_size=shape.ffn_hidden_size, moe_num_shared_experts=0,
                                  moe_layer_start_index=0, moe_layer_end_index=shape.num_layers - 1,
                                  moe_layer_interval=1, use_bias=False, hidden_act="silu", router_aux_loss_coef=0.0,
                                  output_router_logits=False, **common)
    return LlamaConfig(**common)


def attention_implementation(hf_config: PretrainedConfig) -> str:
    """The attention build_model runs: SDPA, except where Gemma 2 caps its attention scores
    (attn_logit_softcapping), which only the eager attention does."""
    return "eager" if getattr(hf_config, "attn_logit_softcapping", None) else "sdpa"


def lm_forward(model: Any, batch: dict[str, torch.Tensor], **kwargs: Any) -> Any:
    """A causal LM's forward on a stage-3 batch, loss included: the labels are already shifted by the dataset,
    so they go in as `shift_labels` (no token is lost to the model's own shift); no KV cache. `model` is a
    DeepSpeed engine or a bare model; `kwargs` are build_engine's loss arguments, output_router_logits, ...
    Training, validation, continued pretraining's step-0 gate and its reference loss all call it. Position ids
    come with a batch whose documents are masked from each other (train.document_mask)."""
    positions = {"position_ids": batch["position_ids"]} if "position_ids" in batch else {}
    return model(input_ids=batch["input_ids"], labels=batch["labels"], shift_labels=batch["labels"],
                 use_cache=False, **positions, **kwargs)


def load_pretrained(folder: Path, seq2seq: bool = False) -> PreTrainedModel:
    """The model of a HuggingFace folder in fp32 on the host, with the attention training runs
    (attention_implementation): the one loader of a pretrained folder for training, fine-tuning and predict."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    model_class = AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM
    attention = attention_implementation(AutoConfig.from_pretrained(folder))
    return expert_bias_buffers(model_class.from_pretrained(folder, dtype=torch.float32, attn_implementation=attention))


def extend_vocabulary(model: PreTrainedModel, vocab_size: int, new_rows: dict[int, tuple[int, ...]]) -> None:
    """A base model's embedding (and untied output) matrix grown to `vocab_size` rows for a tokenizer stage 1
    extended: each new id's row the mean of the base's rows of the ids it stands for (`new_rows`), in the input
    matrix and in the output matrix alike, so a new token's input starts as its parts' average and its logit as
    the average of theirs; a tied model has the one matrix. New ids start at the base tokenizer's size, which may
    lie below the base's rows (Qwen's spare rows): those rows are overwritten. Rows past the new ids (padding to
    VOCAB_MULTIPLE; never in the data) are the mean of all the base's rows, whose logit sits at the average one.
    Every other row keeps the base's values."""
    import torch

    def matrices() -> list[torch.Tensor]:
        tied = model.config.get_text_config().tie_word_embeddings
        return [model.get_input_embeddings().weight] + ([] if tied else [model.get_output_embeddings().weight])

    base_rows = model.get_input_embeddings().weight.shape[0]
    old = [matrix.detach().clone() for matrix in matrices()]
    if vocab_size > base_rows:
        # Its new rows are drawn from the RNG (mean_resizing=False: no covariance of a large matrix) and all
        # overwritten below.
        model.resize_token_embeddings(vocab_size, mean_resizing=False)
    ids = torch.tensor(sorted(new_rows))
    with torch.no_grad():
        for matrix, base in zip(matrices(), old):
            matrix[base_rows:] = base.mean(dim=0)
            matrix[ids] = torch.stack([base[list(new_rows[i])].mean(dim=0) for i in ids.tolist()])


def build_model(hf_config: PretrainedConfig, device: torch.device | str = "cpu", init_from: Path | None = None,
                new_rows: dict[int, tuple[int, ...]] | None = None) -> PreTrainedModel:
    """A freshly initialized model (weights drawn with initializer_range), or a base model's weights
    (`init_from`, whose config `hf_config` is), in fp32 on `device`; `new_rows`: a tokenizer extension's new ids
    and the base ids each stands for, the base's matrices grown to hf_config.vocab_size (extend_vocabulary).

    Every rank builds the whole model from the same seed; under ZeRO-3 `deepspeed.initialize` then
    partitions it (the presets fit one GPU whole in fp32, so `deepspeed.zero.Init` is not needed).
    """
    import torch
    from transformers import AutoModelForCausalLM

    attention = attention_implementation(hf_config)
    if init_from is not None:
        model = load_pretrained(init_from)
        if new_rows:
            extend_vocabulary(model, hf_config.vocab_size, new_rows)
        model = model.to(device)
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=attention, dtype=torch.float32)
    if hasattr(model, "router_aux_loss_coef"):
        # transformers adds its load-balancing loss, pooled over the layers, to the loss it returns; the
        # per-layer ones (router_loss) replace it, added by engine.forward_loss with the configured weight.
        model.router_aux_loss_coef = 0.0
    return expert_bias_buffers(model)


BIAS = "e_score_correction_bias"  # the selection bias of Ernie 4.5's router (in its Ernie4_5_MoeStatics)


def expert_bias_buffers(model: PreTrainedModel) -> PreTrainedModel:
    """`model` with each router's selection bias (Ernie 4.5's e_score_correction_bias, a parameter without a
    gradient) turned into an fp32 buffer of the same name, so the state dict and the export are unchanged.

    As a parameter, DeepSpeed would cast it to bf16 (an update of 1e-3 is lost on a bias of 0.5, where bf16's step
    is 2e-3), ZeRO-3 would partition it, and runtime/checkpoint.py would leave it out of a checkpoint as a frozen
    weight (LoRA's base). A buffer stays fp32 (DeepSpeed casts parameters only) and whole, and is saved with the
    module. Every other model is returned as it is."""
    for module in model.modules():
        bias = module._parameters.get(BIAS)
        if bias is not None:
            del module._parameters[BIAS]
            module.register_buffer(BIAS, bias.detach().float())
    return model


def expert_biases(model: Any) -> list[torch.Tensor] | None:
    """Each layer's selection bias ([1, experts]) of a model whose routers have one, in layer order; else None.
    `model` may be a DeepSpeed engine."""
    found = [module._buffers[BIAS] if BIAS in module._buffers else module._parameters[BIAS]
             for module in getattr(model, "module", model).modules()
             if BIAS in module._buffers or BIAS in module._parameters]
    return found or None


def inference_config(config: PretrainedConfig) -> PretrainedConfig:
    """`config` with the training-only switch output_router_logits off (a mixture of experts): with it on,
    transformers computes the load-balancing loss in every forward, and generation from a padded batch
    fails there (the attention mask spans the whole sequence, the router logits only the new tokens)."""
    if getattr(config, "output_router_logits", False):
        config.output_router_logits = False
    return config


@dataclass
class RouterStats:
    """A mixture of experts' routing in one forward pass: the load-balancing loss of each layer and each
    layer's count of top-k choices per expert. Sums and divides like a loss, so train_step averages it over
    the micro-batches of a step like any other aux loss."""

    losses: torch.Tensor  # [layers], with their graph until detached
    counts: torch.Tensor  # [layers, experts], float

    def detach(self) -> RouterStats:
        return RouterStats(self.losses.detach(), self.counts)

    def __add__(self, other: RouterStats) -> RouterStats:
        return RouterStats(self.losses + other.losses, self.counts + other.counts)

    def __truediv__(self, n: int) -> RouterStats:
        return RouterStats(self.losses / n, self.counts / n)

    def __float__(self) -> float:
        """The logged figure: the mean over the layers (1.0 when every layer routes evenly)."""
        return float(self.losses.mean())


def router_loss(router_logits: tuple[torch.Tensor, ...], top_k: int,
                biases: list[torch.Tensor] | None = None) -> RouterStats:
    """Switch Transformer's load-balancing loss of each layer, as Megatron-LM computes it:
    num_experts · Σ_i f_i · P_i, f_i the share of the layer's top-k choices that go to expert i and P_i its
    mean router probability; 1.0 when the layer routes uniformly. Training adds the sum over the layers
    times router_aux_loss_coef (Megatron attaches each layer's loss with the coefficient). `biases`
    (expert_biases): the choices are the top-k of probability plus bias, as Ernie 4.5's router makes them (the
    same fp32 softmax, so the same experts).

    transformers' load_balancing_loss_func pools the statistics of all layers by expert index instead, so
    expert i dying in one layer is paid for by expert i of another: the pooled loss sits at its minimum
    while a layer has dead experts. Per layer, every layer is pushed to use all of its experts.
    """
    import torch

    losses, counts = [], []
    for layer, logits in enumerate(router_logits):  # [tokens, experts] per layer
        probs = torch.softmax(logits.float(), dim=-1)
        scores = logits if biases is None else probs + biases[layer].squeeze()
        chosen = torch.topk(scores, top_k, dim=-1).indices.reshape(-1)
        # scatter_add, not bincount: no device-to-host sync for the output size
        count = torch.zeros(probs.shape[-1], device=probs.device).scatter_add_(
            0, chosen, torch.ones_like(chosen, dtype=torch.float32))
        losses.append(probs.shape[-1] * torch.sum(count / chosen.numel() * probs.mean(dim=0)))
        counts.append(count)
    return RouterStats(torch.stack(losses), torch.stack(counts))


# ExpertBias leaves an expert's bias where its step load is within this share of the layer's mean: a step's load
# near balance is mostly sampling noise (2,048 choices over 8 experts: ~6% per expert in the tests' runs).
BIAS_DEAD_BAND = 0.2


class ExpertBias:
    """DeepSeek-V3's auxiliary-loss-free load balancing (model.moe_balance bias): after each optimizer step every
    layer's selection bias moves by rate · sign(mean load − expert load) where the two differ by more than
    BIAS_DEAD_BAND of the mean, the load being the top-k choices of the whole step (all micro-batches, summed over
    the data-parallel ranks). An overloaded expert's bias falls, an idle one's rises, and only the choice of
    experts sees it: the gating weights stay the unbiased ones. DeepSeek-V3 moves every bias each step: on a step
    of a few thousand choices the load near balance is mostly noise, and moves on it walked a layer's biases off
    balance on held-out text (one expert at 1.8% of the choices after 200 steps; docs/benchmarks.md, "Mixtral
    routing")."""

    def __init__(self, biases: list[torch.Tensor], rate: float):
        self.biases, self.rate = biases, rate

    def update(self, counts: torch.Tensor) -> None:
        """Move the biases by this rank's RouterStats.counts of the step ([layers, experts]; any scale: each
        expert's difference from its layer's mean, relative to the mean, decides). Collective (an all-reduce); no
        host sync."""
        import torch

        load = counts.detach().float().clone()
        torch.distributed.all_reduce(load)
        mean = load.mean(dim=-1, keepdim=True)
        off = (mean - load).abs() > BIAS_DEAD_BAND * mean
        step = self.rate * torch.sign(mean - load) * off
        with torch.no_grad():
            for bias, delta in zip(self.biases, step):
                bias.add_(delta.to(bias.device).view_as(bias))


def expert_shares(counts: torch.Tensor) -> tuple[list[float], int]:
    """(each layer's smallest expert share of the top-k choices, the experts under a quarter of a fair
    share in all layers) from RouterStats.counts; one host-device sync."""
    import torch

    shares = counts / counts.sum(dim=-1, keepdim=True).clamp(min=1)
    fair = 1.0 / counts.shape[-1]
    smallest, starved = shares.min(dim=-1).values, (shares < fair / 4).sum()
    values = torch.cat([smallest, starved.reshape(1).to(smallest.dtype)]).tolist()
    return values[:-1], int(values[-1])


VOCAB_GROUP = "vocab"  # the key marking the optimizer groups of the token embedding and output matrices


def parameter_groups(model: torch.nn.Module, weight_decay: float, vocab_apart: bool = False) -> list[dict[str, Any]]:
    """AdamW groups: decay on weight matrices only, never on norms, biases or embedding tables. `vocab_apart`: the
    token embedding and the output matrix (one when tied) in groups of their own, first and marked VOCAB_GROUP,
    so that the schedule can train them alone (train.embedding_warmup_steps)."""
    import torch

    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    vocab = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)} if vocab_apart \
        else set()
    groups: dict[tuple[bool, bool], list[Any]] = {(v, d): [] for v in (True, False) for d in (True, False)}
    for param in model.parameters():
        if not param.requires_grad:
            continue
        # ds_shape: under ZeRO-3 the local tensor is a flat shard; the logical shape decides.
        ndim = len(getattr(param, "ds_shape", param.shape))
        groups[id(param) in vocab, not (ndim < 2 or id(param) in embeddings)].append(param)
    # A group without parameters is left out (DeepSpeed's ZeRO cannot flatten an empty one); the unsplit two
    # (decay, then no decay) are always there.
    return [{"params": params, "weight_decay": weight_decay if decay else 0.0,
             **({VOCAB_GROUP: True} if in_vocab else {})}
            for (in_vocab, decay), params in groups.items() if params or not in_vocab]
