"""The model card (README.md) and its loss-curve PNG: what a reader of the hub page needs to trust the model."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

LOSS_CURVE = "loss_curve.png"


@dataclass
class CardFacts:
    """Everything the card states, gathered by the convert stage."""

    title: str
    model_config: Any  # the exported transformers config
    parameters: int
    step: int
    tokens_seen: int | None
    corpus: list[str]  # one line per source
    datasets: list[dict[str, Any]]  # {"prefix", "documents", "tokens"}
    tokenizer: dict[str, Any]  # vocab_size, chars_per_token, ...
    training_config: dict[str, Any]
    final_val_loss: float | None
    verification: dict[str, Any]
    has_loss_curve: bool = False


def plot_loss_curve(rows: list[dict[str, Any]], png: Path) -> bool:
    """Train (and validation) loss against steps; False when the logs hold no loss to draw."""
    train = [(r["step"], r["loss"]) for r in rows if isinstance(r.get("loss"), (int, float))]
    val = [(r["step"], r["val_loss"]) for r in rows if isinstance(r.get("val_loss"), (int, float))]
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


def final_val_loss(state: dict[str, Any], rows: list[dict[str, Any]]) -> float | None:
    """The checkpoint's own figure (final, else latest evaluation), else the last validation loss in the logs."""
    for key in ("final_val_loss", "val_loss"):
        if isinstance(state.get(key), (int, float)):
            return float(state[key])
    val = [r["val_loss"] for r in rows if isinstance(r.get("val_loss"), (int, float))]
    return float(val[-1]) if val else None


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
            ("vocabulary", get("vocab_size")),
            ("context length", get("max_position_embeddings", get("n_positions"))),
            ("dtype", get("dtype"))]
    return [(k, v) for k, v in rows if v is not None]


def _verification_text(report: dict[str, Any]) -> str:
    if not report.get("verified"):
        return "**Verification FAILED**: " + "; ".join(report.get("failures", []))
    same = report.get("greedy_matches_checkpoint")
    return (f"Exported by `gptpipe convert` and checked against the training checkpoint on held-out data: "
            f"logits max |Δ| = {report['logits_max_abs_diff']:.3g} ({report['dtype']}, tolerance "
            f"{report['logits_tolerance']:.3g}); tokenizer ids identical to SentencePiece on "
            f"{report['tokenizer_texts']} texts; greedy generation picks the checkpoint's top token at every step "
            f"(largest gap {report['greedy_max_gap']:.3g}, tolerance {report['greedy_gap_tolerance']:.3g}). Verified.\n\n"
            f"For information (not part of the check): the greedy sample is {report['greedy_sample']!r}"
            + ("" if same is None else f", {'the same' if same else 'not the same'} text as the checkpoint's") + ".")


def render_card(facts: CardFacts, repo_id: str | None) -> str:
    cfg = facts.model_config
    front = {"language": ["ja"], "library_name": "transformers", "pipeline_tag": "text-generation",
             "tags": ["gptpipe", cfg.model_type, "pretrained-from-scratch"]}
    name = repo_id or facts.title
    loss = facts.final_val_loss
    lines = ["---", yaml.safe_dump(front, allow_unicode=True, sort_keys=False).strip(), "---", "",
             f"# {facts.title}", "",
             f"A {facts.parameters / 1e6:,.1f}M-parameter {cfg.model_type} language model pretrained from scratch "
             f"with gptpipe for {facts.step:,} steps"
             + (f" ({facts.tokens_seen:,} tokens)." if facts.tokens_seen else "."), ""]
    lines += ["## Data", ""]
    lines += [f"- corpus: {c}" for c in facts.corpus] or ["- corpus: (not recorded)"]
    for d in facts.datasets:
        lines.append(f"- tokenized dataset `{Path(d['prefix']).name}`: {d.get('documents', '?'):,} documents, "
                     f"{d.get('tokens', '?'):,} tokens")
    tok = facts.tokenizer
    lines += [f"- tokenizer: SentencePiece, {tok.get('vocab_size', '?'):,} pieces"
              + (f", {tok['chars_per_token']:.2f} characters per token" if tok.get("chars_per_token") else "")
              + "; shipped here as a fast tokenizer (tokenizer.json) with identical ids", ""]
    lines += ["## Architecture", "", "| | |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in _architecture_rows(cfg, facts.parameters)]
    lines += ["", "## Training", ""]
    if facts.training_config:
        lines += ["```yaml", yaml.safe_dump(facts.training_config, allow_unicode=True, sort_keys=False).strip(),
                  "```", ""]
    lines += ["## Results", ""]
    if loss is not None:
        lines.append(f"Final validation loss {loss:.4f} (perplexity {math.exp(min(loss, 50)):,.2f}).")
    else:
        lines.append("No validation loss was recorded for this checkpoint.")
    if facts.has_loss_curve:
        lines += ["", f"![loss curve]({LOSS_CURVE})"]
    lines += ["", "## Verification", "", _verification_text(facts.verification), ""]
    lines += ["## Usage", "", "```python", "from transformers import pipeline", "",
              f'generator = pipeline("text-generation", model="{name}")  # or a local copy\'s path',
              'print(generator("こんにちは、", max_new_tokens=64, do_sample=True, temperature=0.8, top_p=0.95)'
              '[0]["generated_text"])', "```", "",
              "or, from a clone of the repository: `gptpipe generate --model PATH --interactive`.", ""]
    return "\n".join(lines).rstrip() + "\n"
