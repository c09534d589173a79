"""Stage 7 settings: finetune_config.yaml, read by `gptpipe finetune` and `gptpipe predict`.

The `train:` section is stage 3's LoopConfig (the same keys: batch, schedule, optimizer, engine, intervals,
checkpoints) with fine-tuning's defaults, plus lr_schedule and best_metric, so the same training loop, DeepSpeed
template, schedule and checkpoint code serve both stages; `logging:` is stage 3's section unchanged.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar, Literal

from gptpipe.config.core import option
from gptpipe.runtime.config import LoggingConfig, LoopConfig

AUTO = "auto"  # train.seq_len resolved from the training rows (finetune/task.py's load_task)

# Metrics a classification / generation run can select its best checkpoint by; all higher-is-better but val_loss.


@dataclass
class FinetuneModelConfig:
    """The pretrained model to start from: the stage-4 folder or any local HuggingFace folder."""

    path: Path = option(Path("models/hf/demo"), "HF folder with the model and its tokenizer (stage 4 writes "
                                                "models/hf/demo)")
    kind: Literal["auto", "causal", "seq2seq"] = option(
        "auto", "causal LM (llama, gpt2, ...) or encoder-decoder (T5, ByT5, BART); auto: from the folder's config")


@dataclass
class FinetuneDataConfig:
    """Labelled rows: `input<TAB>label` TSV or jsonl objects; bad rows are counted and skipped."""

    train: Path = option(Path("data/finetune/manpage_section/train.tsv"), "training rows (.tsv or .jsonl)")
    validation: Path | None = option(
        Path("data/finetune/manpage_section/validation.tsv"),
        "validation rows (null: split validation_proportion of the training rows off, seeded)")
    validation_proportion: float = option(0.1, "share of the training rows held out when validation is null")
    test: Path | None = option(Path("data/finetune/manpage_section/test.tsv"),
                               "test rows: `gptpipe predict`'s default input (null: none)")
    format: Literal["auto", "tsv", "jsonl"] = option("auto", "file format (auto: by suffix, .jsonl/.json is jsonl)")
    input_key: str = option("input", "jsonl key of the input text; a TSV first line `input_key<TAB>label_key` "
                                     "is a header and skipped")
    label_key: str = option("label", "jsonl key of the label")
    messages_key: str = option("messages", "task.kind chat: jsonl key of a row's turns ([{role, content}, ...]); "
                                           "rows with instruction/input/output keys instead are read as one "
                                           "user and one assistant turn")
    seed: int = option(1234, "seed of the validation split")
    too_long: Literal["truncate", "drop"] = option(
        "truncate", "rows longer than train.seq_len tokens: cut the input's end or drop the row (counted)")


@dataclass
class TaskConfig:
    """What the model learns to produce after the prompt."""

    kind: str = option(
        "classification", "classification: the label set comes from the training rows and evaluation scores "
                          "every label; generation: free-form output scored by exact match and chrF; chat: "
                          "jsonl conversations (causal LMs), the loss on the assistant's turns, scored by "
                          "the assistant-token loss and chrF of generated answers; preference: jsonl rows of a "
                          "prompt and a chosen and a rejected answer (causal LMs, through the chat template), "
                          "DPO against the starting model, scored by the held-out pairs' reward accuracy; or "
                          "module:Class, your own TaskKind subclass (importable where gptpipe runs)")
    prompt: str = option("{input}\n答え:", "prompt template; {input} is the row's input, the label follows it")
    chat_template: str = option(
        "auto", "chat: auto (the model tokenizer's own template, else gptpipe's), gptpipe (ユーザー:/アシスタント: "
                "turns), alpaca_ja (### 指示: / ### 応答:) or a .jinja file; installed into the run's tokenizer")
    chat_eval_rows: int = option(32, "chat: validation conversations whose last answer is generated for chrF "
                                     "at each evaluation (the first ones; the loss uses every row); preference: "
                                     "validation prompts answered greedily for greedy_chosen")
    beta: float = option(0.1, "preference: DPO's beta, how far the tuned model may move from the reference (the "
                              "starting model): the loss is -log sigmoid(beta x the chosen answer's log-ratio "
                              "margin over the rejected one's); larger keeps it closer")
    rpo_alpha: float = option(
        1.0, "preference: weight of the chosen answer's negative log-likelihood per token added to the DPO loss "
             "(RPO; TRL's loss_type [sigmoid, sft] with loss_weights [1, rpo_alpha]): keeps the chosen answers "
             "likely while the margin grows; 0: DPO alone")
    label_smoothing: float = option(
        0.0, "preference: the share of pairs assumed mislabelled (conservative DPO): the loss is (1 - e) x DPO's "
             "plus e x the loss of the swapped pair; in [0, 0.5)")
    generate_labels: bool = option(
        False, "classification: also generate the label at evaluation and map it onto the nearest label by "
               "edit distance (reported with how many needed mapping)")

    def check(self) -> list[tuple[str, str]]:
        problems = [("beta", f"must be > 0, got {self.beta}")] if not self.beta > 0 else []
        if not self.rpo_alpha >= 0:
            problems.append(("rpo_alpha", f"must be >= 0, got {self.rpo_alpha}"))
        if not 0 <= self.label_smoothing < 0.5:
            problems.append(("label_smoothing", f"must be in [0, 0.5), got {self.label_smoothing}"))
        return problems


@dataclass
class LoraConfig:
    """LoRA (peft): the pretrained weights stay frozen and low-rank adapters on `target_modules` are trained, so
    the optimizer holds (and checkpoints save) only the adapters; the export merges them into the weights, or
    writes them as an adapter folder (convert_config.yaml's lora_export)."""

    rank: int = option(0, "adapter rank r (0: off, every weight is fine-tuned)")
    alpha: float = option(16.0, "scaling: an adapter's update is multiplied by alpha / rank")
    dropout: float = option(0.05, "dropout on an adapter's input while training")
    target_modules: list[str] | None = option(
        None, "names (last part) of the linear layers that get adapters; null: chosen by the model's type "
              "(Llama, Mistral, Qwen2/3, Gemma: q/k/v/o_proj and gate/up/down_proj; Mixtral: q/k/v/o_proj; GPT-2: "
              "c_attn, c_proj, c_fc; T5: q, k, v, o), logged and written to task.json; another type must name them")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def check(self) -> list[tuple[str, str]]:
        problems = [("rank", f"must be >= 0, got {self.rank}")] if self.rank < 0 else []
        if not 0 <= self.dropout < 1:
            problems.append(("dropout", f"must be in [0, 1), got {self.dropout}"))
        if self.target_modules is not None and not self.target_modules:
            problems.append(("target_modules", "must name at least one module (or be null: chosen by the model's "
                                               "type)"))
        return problems


@dataclass
class FinetuneTrainConfig(LoopConfig):
    """How long and how fast to fine-tune: stage 3's loop and engine keys (defaults for fine-tuning below),
    then the schedule and the best-checkpoint metric."""

    output_model_dir: Path = option(Path("runs/finetune-demo"),
                                    "run folder: checkpoints, metrics.jsonl, tokenizer, summary, predictions")
    seq_len: int | Literal["auto"] = option(
        AUTO, "max tokens of prompt + label + EOS (longer rows: data.too_long); auto: what the longest training "
              "row needs (or seq_len_percentile's share of them), at most the model's positions; printed, and "
              "recorded in the run")
    seq_len_percentile: float = option(
        100.0, "seq_len auto: the share of training rows (%, the shortest first) kept whole; the rest follow "
               "data.too_long (100: every row)")
    global_batch_size: int = option(16, "rows per optimizer step, over all ranks and accumulation steps")
    micro_batch_size: int | None = option(None, "rows per rank per forward pass (null: global_batch_size / ranks)")
    train_epochs: float = option(3.0, "passes over the training rows")
    lr: float = option(1.0e-4, "peak learning rate")
    min_lr: float = option(0.0, "learning rate at the last step")
    warmup_fraction: float = option(0.06, "share of the run spent warming up linearly from 0")
    weight_decay: float = option(0.01, "AdamW weight decay (not on norms, biases, embeddings)")
    adam_beta2: float = option(0.999, "AdamW beta2")
    save_interval: int = option(100, "steps between checkpoints")
    keep_checkpoints: int = option(2, "keep this many newest checkpoints (the best one is kept besides)")
    lr_schedule: Literal["linear", "cosine", "constant"] = option("linear", "decay after warmup")
    group_by_length: bool = option(
        True, "put training rows of similar length in the same micro-batch, so less of it is padding: the "
              "epoch's seeded order is sorted by length within pools of 64 micro-batches and the micro-batches "
              "are shuffled (false: each micro-batch is a random draw)")
    packing: bool = option(
        False, "causal LMs: concatenate each micro-batch's rows into as few sequences of up to seq_len tokens "
               "as fit, attention and position ids kept within each row; same rows, loss and steps, less padding "
               "(an encoder-decoder is refused)")
    best_metric: str = option("auto", "validation metric that picks the best checkpoint: classification "
                                      "accuracy | macro_f1 | val_loss; generation exact_match | chrf | val_loss; "
                                      "chat chrf | val_loss; preference reward_accuracy | reward_margin | "
                                      "greedy_chosen | val_loss; auto: macro_f1, chrf, val_loss, greedy_chosen "
                                      "by task.kind")
    lora: LoraConfig = option(factory=LoraConfig, doc="LoRA adapters instead of fine-tuning every weight")

    def check(self) -> list[tuple[str, str]]:
        # The loop's checks, but seq_len's own here: it may be auto, resolved once the rows are read.
        problems = LoopConfig.check(replace(self, seq_len=1))
        if self.seq_len != AUTO and self.seq_len < 1:
            problems.append(("seq_len", f"must be auto or an integer >= 1, got {self.seq_len}"))
        if not 0 < self.seq_len_percentile <= 100:
            problems.append(("seq_len_percentile", f"must be in (0, 100], got {self.seq_len_percentile}"))
        if self.precision == "fp8":
            # runtime/fp8.py converts stage 3's linears; LoRA's adapters wrap the same layers (peft's lora.Linear),
            # and fine-tuning's small batches would not pay for the casts
            problems.append(("precision", "fp8 is for pretraining (gptpipe train) only: use bf16 for fine-tuning"))
        return problems


@dataclass
class BaselineConfig:
    """What the fine-tuned model is compared with on the same rows, so a pretraining that did not help shows."""

    model: Literal["none", "scratch", "base"] = option(
        "none", "also fine-tune a baseline model with the same settings and rows, in <run>/baselines/<kind>, and "
                "report it beside the model: scratch = model.path's architecture from random initialisation; "
                "base = the model a continued-pretraining export (model.path) started from, as its manifest "
                "records it")
    classical: bool = option(
        True, "classification: also fit character 1-4-gram TF-IDF + logistic regression (scikit-learn, seconds) "
              "on the training rows and score the validation rows with the same metrics")


@dataclass
class PredictConfig:
    """`gptpipe predict`: which model, which rows, how to search."""

    model: Path | None = option(
        None, "a fine-tune run folder (its best checkpoint), one checkpoint folder, or an exported HF folder "
              "(null: the best checkpoint of train.output_model_dir)")
    input: Path | None = option(None, "rows to predict, TSV/jsonl; labels optional (null: data.test; "
                                      "--input - reads stdin, one input per line)")
    output: Path | None = option(None, "predictions jsonl (null: <run>/predictions/<input name>.jsonl)")
    num_beams: int = option(1, "1: greedy; more: beam search")
    max_new_tokens: int = option(32, "tokens generated per input at most")
    length_penalty: float = option(1.0, "beam search: score / length**length_penalty (0: plain log-likelihood)")
    batch_size: int = option(8, "inputs generated together per rank (left-padded)")

    def check(self) -> list[tuple[str, str]]:
        problems = [(n, "must be >= 1") for n in ("num_beams", "max_new_tokens", "batch_size") if getattr(self, n) < 1]
        return problems


@dataclass
class ChatConfig:
    """`gptpipe chat`: which model, what it is told, how it answers."""

    model: Path | None = option(
        None, "a chat fine-tune run folder (its best checkpoint), one checkpoint folder, or an HF folder whose "
              "tokenizer has a chat template (null: the best checkpoint of train.output_model_dir)")
    system: str | None = option(None, "system prompt opening every conversation (null: none)")
    max_new_tokens: int = option(128, "tokens per answer at most")
    sample: bool = option(False, "false: greedy; true: sample with temperature and top_p")
    temperature: float = option(0.7, "sampling temperature")
    top_p: float = option(0.9, "nucleus sampling: the smallest set of tokens with this probability")
    seed: int = option(1234, "seed of the sampling")

    def check(self) -> list[tuple[str, str]]:
        problems = [("max_new_tokens", "must be >= 1")] if self.max_new_tokens < 1 else []
        if self.temperature <= 0 or not 0 < self.top_p <= 1:
            problems.append(("temperature", "must be > 0, with top_p in (0, 1]"))
        return problems


@dataclass
class FinetuneConfig:
    """finetune_config.yaml: stage 7 (fine-tune and predict)."""

    model: FinetuneModelConfig = option(factory=FinetuneModelConfig, doc="pretrained model")
    data: FinetuneDataConfig = option(factory=FinetuneDataConfig, doc="labelled rows")
    task: TaskConfig = option(factory=TaskConfig, doc="task kind and prompt")
    train: FinetuneTrainConfig = option(factory=FinetuneTrainConfig, doc="schedule and engine")
    logging: LoggingConfig = option(factory=LoggingConfig, doc="wandb and TensorBoard")
    baseline: BaselineConfig = option(factory=BaselineConfig, doc="what the model is compared with")
    predict: PredictConfig = option(factory=PredictConfig, doc="gptpipe predict")
    chat: ChatConfig = option(factory=ChatConfig, doc="gptpipe chat")

    # task.kind's own checks (its prompt rule, its figures for train.best_metric): the kind's module imports
    # this one, so config/core.py runs them by name.
    checked_by: ClassVar[str] = "gptpipe.finetune.kinds:config_problems"

    def check(self) -> list[tuple[str, str]]:
        problems = []
        if self.train.lora.enabled and self.baseline.model == "scratch":
            problems.append(("baseline.model", "scratch cannot be LoRA-tuned: its random frozen weights are "
                                               "saved nowhere, so its checkpoints could not be rebuilt"))
        if self.data.validation is None and not 0 < self.data.validation_proportion < 1:
            problems.append(("data.validation_proportion", "must be in (0, 1) when data.validation is null"))
        return problems


def predict_arguments(parser: argparse.ArgumentParser) -> None:
    """`gptpipe predict` options beside the config keys."""
    parser.add_argument("--input", default=None, metavar="PATH",
                        help="rows to predict (TSV/jsonl), or - for stdin (one input per line); "
                             "default: predict.input, else data.test")
    parser.add_argument("--output", type=Path, default=None, metavar="PATH",
                        help="predictions jsonl (default: predict.output, else <run>/predictions/<input>.jsonl)")
