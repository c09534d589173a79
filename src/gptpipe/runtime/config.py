"""The settings stages 3 and 7 share: the model a run builds (`model:`), the training loop and its DeepSpeed
engine (`train:`'s LoopConfig keys) and where figures go (`logging:`). Each stage's own config extends them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gptpipe.config.core import Url, option


# The model keys a base model's folder decides (model.init_from): setting any of them with it is refused.
FOLDER_DECIDES = ("arch", "preset", "num_layers", "hidden_size", "num_attn_heads", "num_kv_heads", "ffn_hidden_size",
                  "init_std", "tie_word_embeddings")


@dataclass
class ModelConfig:
    """The transformers model class trained (so the HF export is exact) and its size, or the open model whose
    training continues (init_from)."""

    init_from: Path | None = option(
        None, "continued pretraining: a base model's local HF folder (config.json, weights, tokenizer.json; a hub "
              "model: `hf download <id> --local-dir <folder>` first, so its files can be hashed and copied). "
              "Architecture, weights and tokenizer are the folder's: arch, preset and "
              "the size keys below must then stay unset (refused when set), and num_experts, experts_top_k, "
              "router_aux_loss_coef, rope_theta, dropout are the folder's config.json's. Supported model types: "
              "llama, mistral, qwen2, qwen3, gemma2, gemma3_text (Gemma3ForCausalLM), gpt2, mixtral. The data must "
              "be tokenized with the folder's tokenizer (tokenize.tokenizer_dir: the same folder), or with it as "
              "stage 1 extended it (tokenize.tokenizer_dir: that output_dir; the embedding and output matrices "
              "grow, each new row the mean of its base ids' rows)")
    arch: Literal["llama", "gpt2", "mixtral"] | None = option(
        None, "llama (RoPE, RMSNorm, SwiGLU), gpt2 (the original's architecture) or mixtral (mixture of experts) "
              "(None: llama; with init_from: the folder's)")
    preset: Literal["tiny", "125m", "350m", "1b", "custom"] | None = option(
        None, "size preset; any field below that is set overrides it (custom: only the fields below) (None: tiny; "
              "with init_from: the folder's size)")
    num_layers: int | None = option(None, "transformer blocks (None: from the preset)")
    hidden_size: int | None = option(None, "model width (None: from the preset)")
    num_attn_heads: int | None = option(None, "attention heads (None: from the preset)")
    num_kv_heads: int | None = option(None, "llama/mixtral: key-value heads for GQA (None: = num_attn_heads)")
    ffn_hidden_size: int | None = option(None, "MLP width (None: from the preset / the architecture's rule)")
    num_experts: int = option(8, "mixtral: experts per layer")
    experts_top_k: int = option(2, "mixtral: experts each token is routed to")
    router_aux_loss_coef: float | None = option(
        None, "mixtral: weight of each layer's load-balancing loss (1.0 when balanced; the mean is logged) (None: "
              "0.01 with moe_balance aux_loss, 0 with bias, which refuses any other value: the bias replaces the loss)")
    moe_balance: Literal["aux_loss", "bias"] = option(
        "aux_loss", "mixtral: how the experts are kept in use: aux_loss (the per-layer load-balancing loss above) or "
                    "bias (DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the router's "
                    "scores for the top-k choice only, moved after each optimizer step by moe_bias_update_rate "
                    "towards the step's mean load; no loss term). bias trains transformers' "
                    "Ernie4_5_MoeForCausalLM (Mixtral's routing with that bias, e_score_correction_bias; model type "
                    "ernie4_5_moe), so the export routes as training did; not with init_from")
    moe_bias_update_rate: float = option(
        1e-2, "moe_balance bias: how far each expert's bias moves per optimizer step, towards an even load (when "
              "its load is more than a fifth off its layer's mean). The scores it "
              "shifts are softmax probabilities (1/num_experts on average), and an expert that collapsed early sits "
              "~0.2-0.3 below the chosen ones: 1e-2 revives it within ~100 steps of a demo-sized run, DeepSeek-V3's "
              "1e-3 (for runs of ~10^5 steps) within 150-250 (docs/benchmarks.md, \"Mixtral routing\"): lower it "
              "for long runs")
    init_std: float | None = option(None, "initializer std (None: from the preset; the original used 0.02 / 0.018)")
    rope_theta: float = option(10000.0, "llama/mixtral: RoPE base")
    dropout: float = option(0.0, "dropout everywhere (0 for pretraining)")
    tie_word_embeddings: bool | None = option(
        None, "share input embedding and output head (None: the architecture's default, tied only for gpt2)")

    def __post_init__(self) -> None:
        if self.init_from is None:  # from scratch: the documented defaults
            self.arch = self.arch or "llama"
            self.preset = self.preset or "tiny"

    def check(self) -> list[tuple[str, str]]:
        problems = []
        if self.init_from is not None:
            problems += [(name, f"is set together with model.init_from ({self.init_from}), whose config.json "
                                "decides the architecture and size: remove it")
                         for name in FOLDER_DECIDES if getattr(self, name) is not None]
        for name in ("num_layers", "hidden_size", "num_attn_heads", "num_kv_heads", "ffn_hidden_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.append((name, "must be >= 1"))
        if self.preset == "custom":
            for name in ("num_layers", "hidden_size", "num_attn_heads"):
                if getattr(self, name) is None:
                    problems.append((name, "required with preset: custom"))
        if self.hidden_size and self.num_attn_heads and self.hidden_size % self.num_attn_heads:
            problems.append(("hidden_size", f"{self.hidden_size} is not divisible by num_attn_heads "
                                            f"{self.num_attn_heads}"))
        if self.num_attn_heads and self.num_kv_heads and self.num_attn_heads % self.num_kv_heads:
            problems.append(("num_kv_heads", "must divide num_attn_heads"))
        if not 1 <= self.experts_top_k <= self.num_experts:
            problems.append(("experts_top_k", f"must be between 1 and num_experts ({self.num_experts})"))
        if not 0 <= self.dropout < 1:
            problems.append(("dropout", "must be in [0, 1)"))
        return problems + self.balance_problems()

    def balance_problems(self) -> list[tuple[str, str]]:
        """moe_balance bias: a mixtral from scratch, no load-balancing loss, no dropout (Ernie's attention has
        none), a positive update rate."""
        if self.moe_balance != "bias":
            return []
        problems = []
        if self.init_from is not None:
            problems.append(("moe_balance", f"bias trains a new Ernie4_5_MoeForCausalLM and cannot continue the base "
                                            f"model {self.init_from} (a Mixtral's router has no bias to carry); "
                                            "use aux_loss with init_from"))
        elif self.arch != "mixtral":
            problems.append(("moe_balance", f"bias balances a mixture of experts: needs arch mixtral, got {self.arch}"))
        if self.router_aux_loss_coef not in (None, 0):
            problems.append(("router_aux_loss_coef", f"is {self.router_aux_loss_coef} with moe_balance bias, which "
                                                     "replaces the load-balancing loss: set 0 or remove it"))
        if self.dropout:
            problems.append(("dropout", "must be 0 with moe_balance bias (Ernie4_5_MoeForCausalLM's attention has "
                                        "no dropout)"))
        if not self.moe_bias_update_rate > 0:
            problems.append(("moe_bias_update_rate", "must be > 0"))
        return problems


@dataclass
class LoopConfig:
    """The `train:` keys of the training loop and its DeepSpeed engine: stage 3 (config.yaml) and stage 7
    (finetune_config.yaml) share them, with the same names and meaning; each stage may change a default."""

    output_model_dir: Url | Path = option(
        Path("runs/demo"), "run folder: checkpoints, logs, metrics.jsonl, data cache; or a bucket URL (s3://..., "
                           "gs://...): trained in train.local_dir and mirrored there, resumable on any machine")
    local_dir: Path | None = option(
        None, "with a bucket output_model_dir: the local staging folder (None: under the system temp folder)")
    preempt_grace_seconds: float = option(
        25.0, "with a bucket output_model_dir: the seconds from a SIGTERM to exit 75 (GCE spot and Kubernetes give "
              "~30 s, AWS spot 120 s): the step is saved if the last save's time fits in them, and its upload "
              "waits for what is left")
    seq_len: int = option(2048, "tokens per sample")
    global_batch_size: int = option(128, "samples per optimizer step, over all GPUs and accumulation steps")
    micro_batch_size: int | None = option(
        None, "samples per GPU per forward pass (None: the planner picks the largest that fits)")
    train_epochs: float = option(1.0, "stop after this many passes over the train split, when train_tokens is null")
    train_iters: int | None = option(None, "optimizer steps, for quick experiments: a cap on pretraining's "
                                           "steps; a fine-tune runs exactly this many, train_epochs aside (None: "
                                           "as the data and epochs say)")
    lr: float = option(6.0e-4, "peak learning rate")
    min_lr: float = option(6.0e-5, "learning rate at the last step")
    warmup_fraction: float = option(0.01, "share of the run spent warming up linearly from 0")
    weight_decay: float = option(0.1, "AdamW weight decay (not applied to norms, biases, embeddings)")
    adam_beta1: float = option(0.9, "AdamW beta1")
    adam_beta2: float = option(0.95, "AdamW beta2")
    adam_eps: float = option(1.0e-8, "AdamW epsilon")
    grad_clip: float = option(1.0, "clip the global gradient norm to this (0: off)")
    precision: Literal["bf16", "fp16", "fp32", "fp8"] = option(
        "bf16", "one precision for model, engine and logs; fp8: the bf16 engine with torchao's float8 matmuls in "
                "the large linear layers (runtime/fp8.py; stage 3 only, llama/mixtral, an H100/H200/L4/RTX "
                "4090-class GPU and the [fp8] extra: refused elsewhere); weights, checkpoints and the export stay "
                "bf16/fp32 as in a bf16 run")
    fp8_recipe: Literal["tensorwise", "rowwise"] = option(
        "tensorwise", "with precision fp8: torchao's scaling, one scale per tensor (tensorwise: the fastest, "
                      "torchao's default) or per row (rowwise: more accurate with outliers, slower)")
    zero_stage: int = option(1, "DeepSpeed ZeRO stage 0-3")
    offload_optimizer: bool = option(False, "ZeRO: keep optimizer states in host RAM")
    fp32_gradients: bool = option(
        True, "bf16 with zero_stage >= 1: accumulate and all-reduce gradients in fp32, as Megatron does (the plan "
              "counts the memory: 4 instead of 2 bytes per gradient); false: in bf16, DeepSpeed's default. Changed on "
              "resume, DeepSpeed still loads the checkpoint (tried on CPU at ZeRO-1); keep it for exact resume")
    activation_checkpointing: bool = option(False, "recompute activations in backward (less memory, ~30% slower)")
    compile: bool = option(False, "torch.compile the model (CUDA; with compile_backend other than inductor, CPU too)")
    compile_backend: str = option(
        "inductor", "torch.compile backend: inductor (CUDA only; Triton) or one that generates no code, e.g. "
                    "aot_eager (to check a model compiles, on any device)")
    deterministic: bool = option(
        False, "CUDA: deterministic kernels (torch.use_deterministic_algorithms and cuBLAS's fixed workspace), so "
               "a resumed run repeats the uninterrupted one's losses bit for bit as CPU runs always do; slower "
               "(the cost is not measured yet)")
    liger_kernels: bool = option(True, "use Liger fused kernels on CUDA when the [gpu] extra is installed")
    ds_config_template: Path | None = option(
        None, "DeepSpeed config template (None: original_codes/ds_config_gpt_TEMPLATE.json of gptpipe); "
              "its \"auto\" values are filled from this file")
    seed: int = option(1234, "seed of weights init (fine-tuning: of the data order) and dropout")
    log_interval: int = option(10, "optimizer steps between console/metrics lines (gptpipe's only host-device "
                                   "syncs; DeepSpeed's overflow check and Liger's loss still sync once a step)")
    eval_interval: int = option(100, "steps between validation runs (and one at the end)")
    save_interval: int = option(1000, "steps between checkpoints")
    keep_checkpoints: int = option(3, "keep this many newest checkpoints")
    max_bad_steps: int = option(
        5, "stop after this many consecutive non-finite steps (each is skipped and counted; with zero_stage 0 "
           "in fp32/bf16 DeepSpeed does not check, and the run stops at the next log step instead)")

    def check(self) -> list[tuple[str, str]]:
        problems = []
        positive = ("seq_len", "global_batch_size", "log_interval", "eval_interval", "save_interval",
                    "keep_checkpoints", "max_bad_steps")
        problems += [(name, "must be >= 1") for name in positive if getattr(self, name) < 1]
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            problems.append(("micro_batch_size", "must be >= 1 (or null)"))
        if self.micro_batch_size and self.global_batch_size % self.micro_batch_size:
            problems.append(("micro_batch_size", f"{self.micro_batch_size} does not divide global_batch_size "
                                                 f"{self.global_batch_size}"))
        if self.train_epochs <= 0:
            problems.append(("train_epochs", "must be > 0"))
        if self.train_iters is not None and self.train_iters < 1:
            problems.append(("train_iters", "must be >= 1 (or null)"))
        problems += self.schedule_problems()
        if self.zero_stage not in (0, 1, 2, 3):
            problems.append(("zero_stage", f"must be 0, 1, 2 or 3, got {self.zero_stage}"))
        if self.offload_optimizer and self.zero_stage == 0:
            problems.append(("offload_optimizer", "needs zero_stage >= 1"))
        if self.precision == "fp8" and self.zero_stage == 3:
            # torchao's float8 is tested with FSDP2, not DeepSpeed's partitioned parameters (its ZeRO-3 replaces
            # F.linear and gathers weights in hooks Float8Linear's forward does not go through): not tried here
            problems.append(("precision", "fp8 with zero_stage 3 is not supported (torchao's float8 linears are "
                                          "untested under DeepSpeed's ZeRO-3 partitioned weights): use zero_stage "
                                          "0-2, or precision bf16 with zero_stage 3"))
        return problems

    @property
    def engine_precision(self) -> str:
        """The DeepSpeed engine's (and the weights') precision: fp8 runs a bf16 engine (runtime/fp8.py)."""
        return "bf16" if self.precision == "fp8" else self.precision

    def schedule_problems(self) -> list[tuple[str, str]]:
        """lr, min_lr and warmup_fraction; stage 3 leaves them None until PipelineConfig.check fills them in."""
        problems = []
        if self.lr is not None and self.lr <= 0:
            problems.append(("lr", "must be > 0"))
        if self.lr is not None and self.min_lr is not None and not 0 <= self.min_lr <= self.lr:
            problems.append(("min_lr", f"must be between 0 and lr ({self.lr}), got {self.min_lr}"))
        if self.warmup_fraction is not None and not 0 <= self.warmup_fraction < 1:
            problems.append(("warmup_fraction", "must be in [0, 1)"))
        return problems


@dataclass
class LoggingConfig:
    """Where training figures go besides the console line and metrics.jsonl."""

    wandb: bool = option(True, "log to Weights & Biases (offline, into the run folder, when no API key is set)")
    wandb_project: str | None = option(None, "wandb project (None: the template's wandb.project)")
    wandb_run_name: str | None = option(None, "wandb run name (None: the run folder's name)")
    tensorboard: bool = option(True, "write TensorBoard event files under <run dir>/tensorboard")
