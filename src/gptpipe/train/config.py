"""Stage 3 settings: the `model:`, `train:` and `logging:` sections of config.yaml.

Key names follow the original pipeline's config.yaml where it had them (num_layers, hidden_size,
num_attn_heads, init_std, seq_len, global_batch_size, lr, min_lr, zero_stage, train_tokens, save_interval).
`train:` is LoopConfig (the keys stage 7's fine-tuning shares: batch, schedule, optimizer, engine, intervals)
plus pretraining's own keys.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from gptpipe.config.core import Url, option
from gptpipe.data.config import DataConfig, TokenizeConfig
from gptpipe.storage import StorageConfig


# Stage 3's schedule defaults (TrainConfig.resolve_schedule).
SCRATCH_LR = 6.0e-4
SCRATCH_WARMUP_FRACTION = 0.01
CONTINUED_LR = 2.5e-5
CONTINUED_WARMUP_STEPS = 1000

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
    router_aux_loss_coef: float = option(
        0.01, "mixtral: weight of each layer's load-balancing loss (1.0 when balanced; the mean is logged)")
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
        25.0, "with a bucket output_model_dir: how long a SIGTERM save may wait for its upload before exit 75 "
              "(GCE spot and Kubernetes give ~30 s, AWS spot 120 s)")
    seq_len: int = option(2048, "tokens per sample")
    global_batch_size: int = option(128, "samples per optimizer step, over all GPUs and accumulation steps")
    micro_batch_size: int | None = option(
        None, "samples per GPU per forward pass (None: the planner picks the largest that fits)")
    train_epochs: float = option(1.0, "stop after this many passes over the train split, when train_tokens is null")
    train_iters: int | None = option(None, "hard cap on optimizer steps, for quick experiments (None: no cap)")
    lr: float = option(6.0e-4, "peak learning rate")
    min_lr: float = option(6.0e-5, "learning rate at the last step")
    warmup_fraction: float = option(0.01, "share of the run spent warming up linearly from 0")
    weight_decay: float = option(0.1, "AdamW weight decay (not applied to norms, biases, embeddings)")
    adam_beta1: float = option(0.9, "AdamW beta1")
    adam_beta2: float = option(0.95, "AdamW beta2")
    adam_eps: float = option(1.0e-8, "AdamW epsilon")
    grad_clip: float = option(1.0, "clip the global gradient norm to this (0: off)")
    precision: Literal["bf16", "fp16", "fp32"] = option("bf16", "one precision for model, engine and logs")
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
        return problems

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
class TrainConfig(LoopConfig):
    """How long, how fast and on what engine settings to pretrain (the loop's keys, then stage 3's own).

    lr, min_lr and the warmup default by what is trained (`resolve_schedule`): from scratch 6e-4 to 6e-5 after a
    1% warmup; continued pretraining (model.init_from) re-warms over 1,000 steps to 2.5e-5 and decays to a tenth
    of it, the scale of public continual-pretraining recipes (e.g. Ibrahim et al. 2024, "Simple and Scalable
    Strategies to Continually Pre-train Large Language Models": re-warm, peak well below the original's, decay).
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

    train_tokens: int | None = option(
        None, "stop after this many tokens (count_tokens.py writes it; None: use train_epochs)")
    train_tokens_counted_for: str | None = option(
        None, "written by count_tokens.py beside train_tokens: the datasets and settings it counted; training "
        "refuses a train_tokens counted for other data (None: train_tokens is a budget you chose)")
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
    eval_tasks_limit: int | None = option(
        200, "score at most the first N documents of each task at each evaluation, sharded over the ranks "
             "(None: all)")
    eval_tasks_tolerance: float = option(
        0.02, "warn (a console line) when a task's main metric (its first, e.g. acc) falls more than this below "
              "its reference, in the metric's own units (0.02: two points of accuracy)")
    sample_prompts: list[str] = option(factory=lambda: ["日本の首都は", "このコマンドは"],
                                       doc="prompts generated from at each evaluation")
    sample_tokens: int = option(32, "tokens generated per sample prompt")

    def check(self) -> list[tuple[str, str]]:
        problems = super().check()
        if self.eval_iters < 1:
            problems.append(("eval_iters", "must be >= 1"))
        if self.train_tokens is not None and self.train_tokens < 1:
            problems.append(("train_tokens", "must be >= 1 (or null to use train_epochs)"))
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


@dataclass
class LoggingConfig:
    """Where training figures go besides the console line and metrics.jsonl."""

    wandb: bool = option(True, "log to Weights & Biases (offline, into the run folder, when no API key is set)")
    wandb_project: str | None = option(None, "wandb project (None: the template's wandb.project)")
    wandb_run_name: str | None = option(None, "wandb run name (None: the run folder's name)")
    tensorboard: bool = option(True, "write TensorBoard event files under <run dir>/tensorboard")


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
