"""The model card (README.md) and its curves (PNG): what a reader of the hub page needs to trust the model.

One template; its source supplies optional blocks: the pretraining corpus (datasets, tokenizer, validation
loss), the base model a run continued from, a fine-tune's task (label set or chat template, the validation
metrics of the exported step beside the majority baseline and the baselines, the metric curve). Stage 6 adds the
results `gptpipe evaluate` wrote for the export (`with_evaluation`): they come after the export, so stage 4's
verified README.md cannot hold them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gptpipe.finetune.task_kind import TaskFacts, TaskKind
from gptpipe.runtime.metrics_rows import EVALUATIONS, Row, TaskEvalRow, TrainRow, of_kind

LOSS_CURVE = "loss_curve.png"
ARCHITECTURE = "## Architecture"  # the section an evaluation table goes before
METRIC_CURVE = "metric_curve.png"


@dataclass
class CorpusBlock:
    """What a pretraining run trained on (a continued run's too)."""

    corpus: list[str]  # one line per source
    datasets: list[dict[str, Any]]  # {"prefix", "documents", "tokens"}
    tokenizer: dict[str, Any]  # vocab_size, chars_per_token, ...
    tokens_seen: int | None
    final_val_loss: float | None


@dataclass
class BaseBlock:
    """The base model a continued pretraining run started from."""

    name: str
    model_type: str


@dataclass
class TaskBlock:
    """What a fine-tune was tuned for and how well it does it."""

    task: TaskFacts  # the checkpoint's task.json, local paths cut
    total_steps: int | None
    best: dict[str, Any] | None  # {"step", "value", "metrics"}: the best evaluation of the run so far
    metrics: dict[str, Any] | None  # the validation metrics of the exported step (None: not evaluated there)
    rows: dict[str, Any]  # {"train", "validation"} row counts, {"skipped": {reason: n}} when recorded
    comparison: dict[str, dict[str, float]] | None = None  # the run summary's: model and baselines side by side
    has_metric_curve: bool = False
    chat_template: str | None = None  # a chat model's template (the folder's tokenizer carries it)
    lora_export: str | None = None  # a LoRA run's export: "merged" or "adapter" (None: every weight was tuned)


@dataclass
class CardBlocks:
    """The source-specific part of a card."""

    training_config: dict[str, Any]  # the settings shown under Training / Fine-tuning
    corpus: CorpusBlock | None = None
    base: BaseBlock | None = None
    task: TaskBlock | None = None


@dataclass
class CardFacts:
    """Everything the card states, gathered by the convert stage."""

    title: str
    model_config: Any  # the exported transformers config
    parameters: int
    step: int
    verification: dict[str, Any]
    blocks: CardBlocks
    has_loss_curve: bool = False


def _number(value: Any) -> bool:
    return isinstance(value, (int, float))


def plot_loss_curve(rows: list[Row], png: Path) -> bool:
    """Train (and validation) loss against steps; False when the logs hold no loss to draw."""
    train = [(r.step, r.loss) for r in of_kind(rows, TrainRow) if _number(r.loss)]
    val = [(r.step, r.val_loss) for r in of_kind(rows, EVALUATIONS) if _number(r.val_loss)]
    if not train and not val:
        return False
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for points, label in ((train, "train loss"), (val, "validation loss")):
        if points:
            ax.plot(*zip(*points), label=label, marker="o" if len(points) < 30 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, metadata={"Software": None})  # no version stamp: same logs, same bytes
    plt.close(fig)
    return True


def plot_metric_curve(rows: list[Row], kind: TaskKind, png: Path) -> bool:
    """The task's validation metrics against steps, with the majority baseline dashed (classification);
    False when no evaluation was logged."""
    evals = [(r.step, r.metrics) for r in of_kind(rows, TaskEvalRow)
             if any(_number(r.metrics.get(m.key)) for m in kind.metrics)]
    if not evals:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for key, label in ((m.key, m.label) for m in kind.metrics):
        points = [(step, m[key]) for step, m in evals if _number(m.get(key))]
        line, = ax.plot(*zip(*points), label=f"validation {label}", marker="o" if len(points) < 30 else None)
        baseline = [(step, m[f"majority_{key}"]) for step, m in evals if f"majority_{key}" in m]
        if baseline:
            ax.plot(*zip(*baseline), linestyle="--", color=line.get_color(), label=f"majority baseline {label}")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, metadata={"Software": None})
    plt.close(fig)
    return True


def final_val_loss(state: dict[str, Any], rows: list[Row]) -> float | None:
    """The checkpoint's own figure (final, else latest evaluation), else the last validation loss in the logs."""
    for key in ("final_val_loss", "val_loss"):
        if _number(state.get(key)):
            return float(state[key])
    val = [r.val_loss for r in of_kind(rows, EVALUATIONS) if _number(r.val_loss)]
    return float(val[-1]) if val else None


def public_settings(value: Any) -> Any:
    """A run's settings as a published card shows them: a path of the training machine or a bucket URL becomes
    `…/<its last component>` (what was used, not where it lay or which bucket held it)."""
    if isinstance(value, dict):
        return {key: public_settings(item) for key, item in value.items()}
    if isinstance(value, list):
        return [public_settings(item) for item in value]
    if isinstance(value, str) and (value.startswith(("/", "~")) or "://" in value):
        return "…/" + value.rstrip("/").rsplit("/", 1)[-1]
    return value


def _architecture_rows(config: Any, parameters: int) -> list[tuple[str, Any]]:
    get = config.to_dict().get
    rows = [("architecture", f"{config.architectures[0] if config.architectures else config.model_type}"),
            ("parameters", f"{parameters:,}"),
            ("layers", get("num_hidden_layers", get("n_layer"))),
            ("hidden size", get("hidden_size", get("n_embd"))),
            ("attention heads", get("num_attention_heads", get("n_head"))),
            ("key-value heads", get("num_key_value_heads")),
            ("MLP width", get("intermediate_size", get("n_inner"))),
            ("experts / active per token", f"{get('num_local_experts')} / {get('num_experts_per_tok')}"
             if get("num_local_experts") else None),
            ("experts / active per token", f"{get('moe_num_experts')} / {get('moe_k')}, balanced by a selection "
             "bias" if get("moe_num_experts") else None),  # Ernie 4.5's names
            ("vocabulary", get("vocab_size")),
            ("context length", get("max_position_embeddings", get("n_positions"))),
            ("dtype", get("dtype"))]
    return [(k, v) for k, v in rows if v is not None]


def _verification_text(report: dict[str, Any]) -> str:
    if not report.get("verified"):
        return "**Verification FAILED**: " + "; ".join(report.get("failures", []))
    same = report.get("greedy_matches_checkpoint")
    tokenizer = f"tokenizer ids identical to {report['tokenizer_reference']} on {report['tokenizer_texts']} texts"
    if "base_files" in report:
        tokenizer = f"the base model's files copied byte for byte ({', '.join(report['base_files'])}); {tokenizer}"
    if report.get("chat_template_identical"):
        tokenizer += "; the chat template the run's, identical in chat_template.jinja and tokenizer_config.json"
    return (f"Exported by `gptpipe convert` and checked against the checkpoint it was exported from on "
            f"{report['heldout_source']}: logits max |Δ| = {report['logits_max_abs_diff']:.3g} ({report['dtype']}, "
            f"tolerance {report['logits_tolerance']:.3g}); {tokenizer}; greedy generation picks the fp32 "
            f"checkpoint's top token at every step up to near-ties (largest gap {report['greedy_max_gap']:.3g}, "
            f"near-tie allowance {report['greedy_gap_tolerance']:.3g}). Verified.\n\n"
            f"For information (not part of the check): the greedy sample is {report['greedy_sample']!r}"
            + ("" if same is None else f", {'the same' if same else 'not the same'} output as the checkpoint's") + ".")


def _intro(facts: CardFacts) -> str:
    """The card's first sentence: what the model is and how it was made."""
    b, cfg = facts.blocks, facts.model_config
    size = f"A {facts.parameters / 1e6:,.1f}M-parameter {cfg.model_type}"
    if b.task:
        task, best = b.task.task, b.task.best or {}
        return (f"{size} model fine-tuned with gptpipe from `{task.pretrained_model}` for {task.kind}: "
                f"step {facts.step:,}" + (f" of {b.task.total_steps:,}" if b.task.total_steps else "")
                + (f", the best by validation {task.best_metric}" if best.get("step") == facts.step else "")
                + ".")
    how = (f"continued from the base model `{b.base.name}` ({b.base.model_type}) with gptpipe: {facts.step:,} more "
           "steps" if b.base else f"pretrained from scratch with gptpipe for {facts.step:,} steps")
    tokens = b.corpus.tokens_seen if b.corpus else None
    return f"{size} language model {how}" + (f" ({tokens:,} tokens trained)." if tokens else ".")


def _corpus_rows(corpus: CorpusBlock, base: BaseBlock | None) -> list[str]:
    lines = ["## Data", ""]
    lines += [f"- corpus: {c}" for c in corpus.corpus] or ["- corpus: (not recorded)"]
    for d in corpus.datasets:
        lines.append(f"- tokenized dataset `{Path(d['prefix']).name}`: {d.get('documents', '?'):,} documents, "
                     f"{d.get('tokens', '?'):,} tokens")
    tok = corpus.tokenizer
    if base:
        lines.append(f"- tokenizer: the base model's ({tok.get('vocab_size', '?'):,} ids), its files unchanged")
    else:
        lines.append(f"- tokenizer: SentencePiece, {tok.get('vocab_size', '?'):,} pieces"
                     + (f", {tok['chars_per_token']:.2f} characters per token" if tok.get("chars_per_token") else "")
                     + "; shipped here as a fast tokenizer (tokenizer.json) with identical ids and as the "
                     "SentencePiece model itself (tokenizer.model; no space prefix)")
    return [*lines, ""]


def _task_rows(block: TaskBlock) -> list[str]:
    from gptpipe.finetune.kinds import task_kind

    task, rows = block.task, block.rows
    lines = ["## Task", "", f"- kind: {task.kind}"]
    if block.chat_template is not None:
        template = task_kind(task.kind).describe_template(block.chat_template)
        lines += [f"- chat template: {template}, in chat_template.jinja and tokenizer_config.json (loss on the "
                  "assistant turns only; each ends with EOS, where generation stops):", "", "```jinja",
                  block.chat_template, "```", ""]
    else:
        lines.append(f"- prompt template (the answer follows it, then EOS): `{task.prompt!r}`")
    if task.labels:
        lines.append(f"- label set ({len(task.labels)}, most frequent first): "
                     + ", ".join(f"`{label}`" for label in task.labels))
    if rows.get("train"):
        lines.append(f"- rows: {rows['train']:,} training, {rows.get('validation', 0):,} validation"
                     f" (from `{task.train_file}`)")
    if rows.get("skipped"):
        lines.append("- rows skipped while reading: " + ", ".join(f"{n} {reason}" for reason, n in
                                                                   rows["skipped"].items()))
    return [*lines, ""]


def _lora_rows(block: TaskBlock) -> list[str]:
    """How a LoRA fine-tune was made and what this folder holds of it."""
    lora, base = block.task.lora or {}, block.task.pretrained_model
    lines = ["## LoRA", "", f"- adapters of rank {lora['rank']} (alpha {lora['alpha']:g}, dropout {lora['dropout']:g})"
             f" on {', '.join(f'`{m}`' for m in lora['target_modules'])} ({lora['targets_from']}); the base "
             f"model `{base}` stayed frozen"]
    if block.lora_export == "adapter":
        lines.append(f"- this folder holds the adapters only (adapter_config.json, adapter_model.safetensors), to "
                     f"load onto the base `{base}` (adapter_config.json's base_model_name_or_path; the sha256 of "
                     "each of its files is in task.json and manifest.json): peft's PeftModel, or vLLM with LoRA")
    else:
        lines.append("- merged into the base's weights (peft's merge_and_unload): a plain model, loaded as any")
    return [*lines, ""]


def _metric_rows(block: TaskBlock, step: int) -> list[str]:
    """The metrics table: model beside the majority baseline (classification), then per-class figures."""
    m, task = block.metrics, block.task
    if not m:
        return [f"Step {step} was not evaluated on the validation rows (the run's evaluations are in "
                "its metrics.jsonl)."]
    from gptpipe.finetune.kinds import task_kind

    kind = task_kind(task.kind)
    figures = kind.metrics
    if kind.labelled:
        lines = ["| validation metric | this model | majority baseline |", "| --- | --- | --- |"]
        lines += [f"| {x.label} | {x.show(m[x.key])} | {x.show(m['majority_' + x.key])} |" for x in figures]
        lines += ["", f"The majority baseline always answers the most frequent training label "
                      f"({task.majority_label!r})."]
        if m.get("per_class"):
            lines += ["", "| label | precision | recall | F1 | rows |", "| --- | --- | --- | --- | --- |"]
            lines += [f"| {label} | {c['precision']:.3f} | {c['recall']:.3f} | {c['f1']:.3f} | {c['support']} |"
                      for label, c in m["per_class"].items()]
    else:
        lines = ["| validation metric | this model |", "| --- | --- |"]
        lines += [f"| {x.label} | {x.show(m[x.key])} |" for x in figures]
    if _number(m.get("val_loss")):
        lines += ["", f"Validation loss on {kind.loss_scores.format(m['val_loss'])}."]
    if block.comparison:
        lines += _comparison_rows(block.comparison, kind, task.best_metric)
    best = block.best or {}
    if best.get("step") not in (None, step):
        lines += ["", f"(The run's best evaluation was step {best['step']}, {task.best_metric} "
                      f"{best['value']:.4f}; this export is step {step}.)"]
    return lines


def _comparison_rows(comparison: dict[str, dict[str, float]], kind: TaskKind, best_metric: str | None
                     ) -> list[str]:
    """The run's best checkpoint beside its baselines (finetune_config.yaml `baseline:`), on the same rows."""
    from gptpipe.finetune.run_files import BASELINE_DESCRIPTIONS

    keys = list(dict.fromkeys(k for figures in comparison.values() for k in figures))
    lines = ["", f"Compared with baselines on the same validation rows (the run's best checkpoint by {best_metric}):",
             "", "| | " + " | ".join(keys) + " |", "| --- |" + " --- |" * len(keys)]
    for name, figures in comparison.items():
        label = "this model" if name == "model" else f"{name}: {BASELINE_DESCRIPTIONS.get(name, name)}"
        shown = [kind.metric(k).show(figures[k]) if k in figures else "-" for k in keys]
        lines.append(f"| {label} | " + " | ".join(shown) + " |")
    return lines


def _usage_rows(facts: CardFacts, name: str, pipeline_tag: str) -> list[str]:
    task = facts.blocks.task
    if task is not None and task.lora_export == "adapter":
        loader = "AutoPeftModelForSeq2SeqLM" if task.task.seq2seq else "AutoPeftModelForCausalLM"
        return ["## Usage", "", "```python", f"from peft import {loader}", "from transformers import AutoTokenizer",
                "", f'tokenizer = AutoTokenizer.from_pretrained("{name}")  # or a local copy\'s path',
                f'model = {loader}.from_pretrained("{name}")  # the base named in adapter_config.json, '
                "with these adapters", "```", "",
                "or, from a clone of the repository: `gptpipe predict predict.model=PATH` and `gptpipe chat "
                "chat.model=PATH` take the merged export (lora_export: merged) instead.", ""]
    lines = ["## Usage", "", "```python", "from transformers import pipeline", ""]
    if task is None:
        return [*lines, f'generator = pipeline("text-generation", model="{name}")  # or a local copy\'s path',
                'print(generator("こんにちは、", max_new_tokens=64, do_sample=True, temperature=0.8, top_p=0.95)'
                '[0]["generated_text"])', "```", "",
                "or, from a clone of the repository: `gptpipe generate --model PATH --interactive`.", ""]
    if task.chat_template is not None:
        return [*lines[:3], "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                f'tokenizer = AutoTokenizer.from_pretrained("{name}")  # or a local copy\'s path',
                f'model = AutoModelForCausalLM.from_pretrained("{name}")',
                'messages = [{"role": "user", "content": "ls コマンドは何をしますか?"}]',
                "ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors=\"pt\", "
                "return_dict=True)",
                "out = model.generate(**ids)  # greedy; generation_config.json stops at the end of the turn",
                'print(tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))', "```", "",
                "or chat with it (multi-turn, streaming; `/reset` starts again), from a clone of the repository: "
                "`gptpipe chat chat.model=PATH`.", ""]
    samples = facts.verification.get("greedy_samples") or [{"input": "..."}]
    example = task.task.prompt.format(input=samples[0]["input"])
    return [*lines, f'model = pipeline("{pipeline_tag}", model="{name}")  # or a local copy\'s path',
            f"prompt = {example!r}  # the task's template around your input",
            "print(model(prompt, do_sample=False, max_new_tokens=16"
            + ("" if pipeline_tag == "text2text-generation" else ", return_full_text=False")
            + ')[0]["generated_text"])', "```", "",
            "or, from a clone of the repository, beam search over a TSV/jsonl file (task.json in this folder "
            "holds the prompt and the label set): `gptpipe predict predict.model=PATH --input rows.tsv`.", ""]


def _serving_rows(facts: CardFacts) -> list[str]:
    """How to run a causal LM outside transformers: each runtime's line (export/runtimes/)."""
    from gptpipe.export.runtimes import serving_lines

    task = facts.blocks.task
    adapter_rank = task.task.lora["rank"] if task is not None and task.lora_export == "adapter" else None
    return ["## Run it elsewhere", "", *serving_lines(facts.model_config.architectures or [], adapter_rank), ""]


def render_card(facts: CardFacts, repo_id: str | None) -> str:
    cfg, b = facts.model_config, facts.blocks
    task = b.task.task if b.task else None
    pipeline_tag = "text2text-generation" if task and task.seq2seq else "text-generation"
    kind = (["fine-tuned", task.kind] if task else
            ["continued-pretraining" if b.base else "pretrained-from-scratch"])
    adapter = b.task is not None and b.task.lora_export == "adapter"
    base = b.base.name if b.base else task.pretrained_model if adapter and task else None
    front = {"language": ["ja"], "library_name": "peft" if adapter else "transformers", "pipeline_tag": pipeline_tag,
             "tags": ["gptpipe", cfg.model_type, *kind, *(["lora"] if task and task.lora else [])],
             **({"base_model": base} if base else {})}
    lines = ["---", yaml.safe_dump(front, allow_unicode=True, sort_keys=False).strip(), "---", "",
             f"# {facts.title}", "", _intro(facts), ""]
    if b.corpus:
        lines += _corpus_rows(b.corpus, b.base)
    if b.task:
        lines += _task_rows(b.task)
        if b.task.lora_export:
            lines += _lora_rows(b.task)
    lines += ["## Results", ""]
    if b.corpus:
        loss = b.corpus.final_val_loss
        lines.append(f"Final validation loss {loss:.4f} (perplexity {math.exp(min(loss, 50)):,.2f})."
                     if loss is not None else "No validation loss was recorded for this checkpoint.")
    if b.task:
        lines += _metric_rows(b.task, facts.step)
    for shown, png, title in ((facts.has_loss_curve, LOSS_CURVE, "loss curve"),
                              (b.task is not None and b.task.has_metric_curve, METRIC_CURVE, "validation metrics")):
        if shown:
            lines += ["", f"![{title}]({png})"]
    lines += ["", ARCHITECTURE, "", "| | |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in _architecture_rows(cfg, facts.parameters)]
    if b.training_config:
        lines += ["", "## Fine-tuning" if task else "## Training", "", "```yaml",
                  yaml.safe_dump(public_settings(b.training_config), allow_unicode=True, sort_keys=False).strip(),
                  "```"]
    lines += ["", "## Verification", "", _verification_text(facts.verification), ""]
    lines += _usage_rows(facts, repo_id or facts.title, pipeline_tag)
    if pipeline_tag == "text-generation":
        lines += _serving_rows(facts)
    return "\n".join(lines).rstrip() + "\n"


def with_evaluation(card: str, results: dict[str, Any], table: str, folder: str) -> str:
    """`card` with an Evaluation section before its Architecture: `table` (gptpipe evaluate's results.md) and how
    it was made (`results`: its results.json), the full results in `folder` of the repository."""
    limit = f", the first {results['limit']} documents of each task" if results.get("limit") else ""
    section = ["## Evaluation", "",
               f"lm-evaluation-harness through `gptpipe evaluate` ({results.get('device')}, {results.get('dtype')}"
               f"{limit}); every figure with its standard error, multiple-choice tasks beside the accuracy "
               f"of always answering their most frequent label. Per-task settings and versions: "
               f"[{folder}/results.json]({folder}/results.json).", "", table.strip(), "", ""]
    head, marker, tail = card.partition(ARCHITECTURE)
    if not marker:  # a card of an older gptpipe: the section goes last
        return card.rstrip() + "\n\n" + "\n".join(section).rstrip() + "\n"
    return head + "\n".join(section) + marker + tail
