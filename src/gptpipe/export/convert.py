"""Stage 4: a stage-3 checkpoint → a verified HuggingFace folder (4_convert_to_HF.sh, convert_config.yaml).

The folder holds safetensors weights, config.json (the tokenizer's vocabulary and special ids, the trained
context length), generation_config.json, the stage-1 fast tokenizer, a model card with a loss curve, and
manifest.json with the verification report. The gate (verify.py) runs before the folder replaces an
older one; a folder that fails it is still written, for inspection, but its manifest says
``verified: false`` and stage 6 refuses to upload it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import yaml

from gptpipe.cli import EXIT_OK
from gptpipe.export.card import LOSS_CURVE, CardFacts, final_val_loss, plot_loss_curve, render_card
from gptpipe.export.checkpoint import Checkpoint, build_model, consolidate, find_checkpoint
from gptpipe.export.config import ConvertConfig
from gptpipe.stage import (Manifest, StageFailed, StageInputError, StageResult, atomic_dir, manifest_fingerprint,
                           run_stage, say, tree_fingerprint, write_text_atomic)
from gptpipe.train.logging import read_metrics

MANIFEST = "manifest.json"
HELDOUT_DOCUMENTS = 32
# What the export depends on (the card names the repository); privacy and branch can change without a re-export.
EXPORT_KEYS = ("input_model_dir", "checkpoint_step", "pipeline_config", "output_tokenizer_and_model_dir", "dtype",
               "max_shard_size", "test_prompt_text", "huggingface_name", "hugging_face_name", "organization")
GENERATION_DEFAULTS = {"do_sample": True, "temperature": 0.8, "top_p": 0.95, "max_new_tokens": 128}


def _ids(value: Any) -> set[int]:
    return set(value) if isinstance(value, list) else {value}


def check_tokenizer_fits(checkpoint: Checkpoint, tokenizer: Any) -> None:
    """Refuse early when the tokenizer is not the one the model was trained with."""
    cfg = checkpoint.hf_config
    problems = []
    if not tokenizer.vocab_size <= cfg["vocab_size"] < tokenizer.vocab_size + 128:
        problems.append(f"the model has {cfg['vocab_size']} embedding rows, the tokenizer {tokenizer.vocab_size} "
                        "pieces (stage 3 pads the vocabulary by less than 128)")
    for name in ("bos", "eos", "pad"):
        trained, told = cfg.get(f"{name}_token_id"), getattr(tokenizer, f"{name}_id")
        if told not in _ids(trained):
            problems.append(f"{name} id is {trained} in the checkpoint, {told} in the tokenizer")
    if problems:
        raise StageInputError(f"tokenizer {tokenizer.hf_dir.parent} does not match checkpoint {checkpoint.path}: "
                              + "; ".join(problems))


def heldout_documents(prefix: Path, count: int, separator: int, split: str, seed: int) -> Any:
    """Up to `count` documents that training never saw: the first of the valid/test splits, which training cut
    from the `data.seed` shuffle of the documents (see gptpipe.data.count.document_order)."""
    from gptpipe.data.count import document_order, split_bounds
    from gptpipe.data.indexed import IndexedDataset
    from gptpipe.export.verify import HeldOut

    reader = IndexedDataset(prefix)
    train = split_bounds(split, len(reader))[0]
    unseen = document_order(len(reader), seed)[train[1] if train else 0:][:count]
    docs = [[t for t in reader[int(i)].tolist() if t != separator] for i in unseen]
    return HeldOut([d for d in docs if d], f"{len(docs)} validation/test documents of {prefix.name}")


def _training_config(config: ConvertConfig) -> dict[str, Any]:
    """The pipeline config.yaml the model was trained with (for the card's data and training sections)."""
    path = config.pipeline_config
    return (yaml.safe_load(path.read_text(encoding="utf-8")) or {}) if path.is_file() else {}


def _corpus_lines(training: dict[str, Any]) -> list[str]:
    sources = (training.get("corpus") or {}).get("sources") or []
    return [" ".join(str(v) for k, v in s.items() if v not in (None, "") and k in ("type", "path", "name", "subset"))
            for s in sources if isinstance(s, dict)]


def reference_models(checkpoint: Checkpoint, state_dict: dict[str, Any], dtype: str) -> tuple[Any, Any]:
    """(the checkpoint's model in the export dtype, the same in fp32): what the exported folder must match."""
    from gptpipe.export.verify import TORCH_DTYPES, cast_parameters

    reference_fp32 = build_model(checkpoint, state_dict)
    if dtype == "fp32":
        return reference_fp32, reference_fp32
    return cast_parameters(build_model(checkpoint, state_dict), TORCH_DTYPES[dtype]), reference_fp32


def export(config: ConvertConfig, checkpoint: Checkpoint, tokenizer: Any, datasets: list[tuple[Path, Manifest]],
           heldout: Any) -> StageResult:
    from transformers import GenerationConfig

    from gptpipe.export.verify import TORCH_DTYPES, cast_parameters, verify_export

    out = config.output_tokenizer_and_model_dir
    dtype = TORCH_DTYPES[config.dtype]
    say(f"[convert] consolidating {checkpoint.path} (step {checkpoint.step}) with DeepSpeed's zero_to_fp32")
    state_dict = consolidate(checkpoint)
    reference, reference_fp32 = reference_models(checkpoint, state_dict, config.dtype)

    exported = build_model(checkpoint, state_dict)
    # The padding rows past the tokenizer's vocabulary were never trained: drop them so sampling cannot pick them.
    exported.resize_token_embeddings(tokenizer.vocab_size, mean_resizing=False)
    cast_parameters(exported, dtype)
    exported.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id,
        **GENERATION_DEFAULTS)
    parameters = exported.num_parameters()

    with atomic_dir(out) as tmp:
        say(f"[convert] writing {config.dtype} safetensors (shards above {config.max_shard_size}) to {out}")
        exported.save_pretrained(tmp, max_shard_size=config.max_shard_size)
        for f in sorted(tokenizer.hf_dir.iterdir()):
            if f.is_file():
                shutil.copy2(f, tmp / f.name)
        report = verify_export(tmp, reference, reference_fp32, tokenizer, heldout, config.test_prompt_text,
                               config.dtype)
        rows = read_metrics(checkpoint.run_dir / "metrics.jsonl", checkpoint.step)
        training = _training_config(config)
        facts = CardFacts(
            title=config.repo_name or out.name, model_config=exported.config, parameters=parameters,
            step=checkpoint.step, tokens_seen=checkpoint.state.get("tokens"), corpus=_corpus_lines(training),
            datasets=[{"prefix": str(p), **m.counts} for p, m in datasets],
            tokenizer={"vocab_size": tokenizer.vocab_size, **_tokenizer_counts(tokenizer)},
            training_config={k: training[k] for k in ("model", "train", "data") if k in training},
            final_val_loss=final_val_loss(checkpoint.state, rows), verification=report,
            has_loss_curve=plot_loss_curve(rows, tmp / LOSS_CURVE))
        repo_id = f"{config.organization or 'YOUR_HF_USER'}/{config.repo_name or out.name}"
        write_text_atomic(tmp / "README.md", render_card(facts, repo_id))
        files = sorted(p.relative_to(tmp) for p in tmp.rglob("*") if p.is_file())
    counts = {"checkpoint": str(checkpoint.path), "step": checkpoint.step, "parameters": parameters,
              "final_val_loss": facts.final_val_loss, "files": len(files),
              "bytes": sum((out / f).stat().st_size for f in files), **report}
    return StageResult(outputs=files, counts=counts)


def _tokenizer_counts(tokenizer: Any) -> dict[str, Any]:
    """The figures stage 1 measured that the card quotes (compression on held-out text)."""
    counts = Manifest.read(tokenizer.hf_dir.parent / MANIFEST).counts
    return {k: counts[k] for k in ("chars_per_token",) if k in counts}


def data_split(checkpoint: Checkpoint) -> tuple[str, int]:
    """data.split and data.seed of the run (checkpoints from before gptpipe recorded them: the defaults)."""
    from gptpipe.data.config import DataConfig

    default = DataConfig()
    return checkpoint.state.get("data_split", default.split), checkpoint.state.get("data_seed", default.seed)


def run(config: ConvertConfig, args: Any) -> int:
    from gptpipe.data.indexed import manifest_path as dataset_manifest_path
    from gptpipe.data.indexed import read_dataset_manifest
    from gptpipe.tokenizer.info import read_tokenizer_info

    checkpoint = find_checkpoint(config.input_model_dir, config.checkpoint_step)
    tokenizer = read_tokenizer_info(Path(checkpoint.state["tokenizer_dir"]))
    check_tokenizer_fits(checkpoint, tokenizer)
    prefixes = [Path(p) for p in checkpoint.state["dataset_prefixes"]]
    datasets = [(p, read_dataset_manifest(p)) for p in prefixes]
    out = config.output_tokenizer_and_model_dir
    manifest_path = out / MANIFEST
    inputs = {
        "checkpoint": {"path": str(checkpoint.path),
                       **tree_fingerprint([p for p in checkpoint.path.rglob("*") if p.is_file()])},
        "tokenizer": manifest_fingerprint(tokenizer.hf_dir.parent / MANIFEST),
        "datasets": [manifest_fingerprint(dataset_manifest_path(p)) for p in prefixes],
    }
    # A folder that failed verification is redone even when nothing changed: the fix may be in the software.
    failed_before = manifest_path.is_file() and not Manifest.read(manifest_path).counts.get("verified", False)
    settings = {k: getattr(config, k) for k in EXPORT_KEYS}
    manifest = run_stage(
        "convert", manifest_path, settings, inputs,
        lambda: export(config, checkpoint, tokenizer, datasets,
                       heldout_documents(prefixes[0], HELDOUT_DOCUMENTS, tokenizer.eod_id, *data_split(checkpoint))),
        force=args.force or failed_before,
        versions=("torch", "transformers", "deepspeed", "safetensors", "tokenizers", "sentencepiece"))
    counts = manifest.counts
    if not counts.get("verified"):
        raise StageFailed(f"{out} did not pass verification (marked verified: false in {manifest_path}; it "
                          "will not be uploaded):\n  - " + "\n  - ".join(counts.get("failures", [])))
    say(f"[convert] {out}: verified (logits max |Δ| {counts['logits_max_abs_diff']:.2g} in {counts['dtype']}, "
        f"{counts['tokenizer_texts']} texts tokenized identically). Greedy sample: {counts.get('greedy_sample')!r}")
    print(out)
    return EXIT_OK
