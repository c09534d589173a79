"""Stage 4: a checkpoint → a verified HuggingFace folder (4_convert_to_HF.sh, convert_config.yaml).

The folder holds safetensors weights, config.json, generation_config.json, the tokenizer files, a model card
with a loss curve, and manifest.json with the verification report. Its source (source.py) is the run the
checkpoint belongs to: a stage-3 run (its stage-1 tokenizer, or the base model it continued from, whose files
are kept byte for byte) or a stage-7 fine-tune (its tokenizer, task.json, validation rows). The gate
(verify.py) runs before the folder replaces an older one; a folder that fails it is still written, for
inspection, but its manifest says ``verified: false`` and stage 6 refuses to upload it.
"""

from __future__ import annotations

import shutil
from typing import Any

from gptpipe.export.card import LOSS_CURVE, CardFacts, plot_loss_curve, render_card
from gptpipe.export.config import ConvertConfig
from gptpipe.export.source import ExportSource, open_source
from gptpipe.log import get_logger
from gptpipe.remote import staging
from gptpipe.stage import Manifest, StageFailed, StageInputError, StageResult, atomic_dir, write_text_atomic
from gptpipe.artifacts import CONVERT, EXIT_OK
from gptpipe.runtime.bucket import local_checkpoint_source
from gptpipe.runtime.checkpoint import Checkpoint, consolidate, find_checkpoint, model_from_checkpoint
from gptpipe.runtime.lora import ADAPTER_MARK
from gptpipe.runtime.metrics_rows import read_metrics

log = get_logger("convert")

# What the export depends on (the card names the repository); privacy and branch can change without a re-export.
EXPORT_KEYS = ("input_model_dir", "checkpoint_step", "output_tokenizer_and_model_dir", "dtype",
               "max_shard_size", "lora_export", "test_prompt_text", "huggingface_name", "hugging_face_name",
               "organization")


def reference_models(checkpoint: Checkpoint, state_dict: dict[str, Any], dtype: str,
                     adapter: bool) -> tuple[Any, Any]:
    """(the checkpoint's model in the export dtype, the same in fp32): what the exported folder must match. A
    LoRA fine-tune's fp32 reference keeps its adapters apart, as it trained, so the gate checks the merge the
    export writes too; its bf16 one is merged, then cast, as the export is (like with like), or, exported as an
    adapter folder, kept apart and cast."""
    from gptpipe.export.verify import TORCH_DTYPES, cast_parameters

    reference_fp32 = model_from_checkpoint(checkpoint, state_dict, merge=False)
    if dtype == "fp32":
        return reference_fp32, reference_fp32
    reference = cast_parameters(model_from_checkpoint(checkpoint, state_dict, merge=not adapter), TORCH_DTYPES[dtype])
    if adapter:  # peft loads bf16 adapters upcast to fp32 (autocast_adapter_dtype): so does the reference
        for name, param in reference.named_parameters():
            if ADAPTER_MARK in name:
                param.data = param.data.float()
    return reference, reference_fp32


def export(config: ConvertConfig, source: ExportSource) -> StageResult:
    """The stage-4 folder of `source`'s checkpoint, verified, with its card."""
    from gptpipe.export.adapter import save_adapter
    from gptpipe.export.verify import TORCH_DTYPES, cast_parameters, verify_export

    out, checkpoint = staging(CONVERT, config.output_tokenizer_and_model_dir), source.checkpoint
    adapter = config.lora_export == "adapter"
    if adapter and not checkpoint.lora:
        raise StageInputError(f"lora_export: adapter, but {checkpoint.path} is not a LoRA fine-tune's checkpoint "
                              "(train.lora.rank 0): export it merged")
    log.info(f"consolidating {checkpoint.path} (step {checkpoint.step}) with DeepSpeed's zero_to_fp32")
    state_dict = consolidate(checkpoint)
    reference, reference_fp32 = reference_models(checkpoint, state_dict, config.dtype, adapter)
    exported = model_from_checkpoint(checkpoint, state_dict, merge=not adapter)
    if source.vocab_size is not None:
        exported.resize_token_embeddings(source.vocab_size, mean_resizing=False)
    generation = source.generation_config(exported.config)
    if generation is not None:
        (exported.get_base_model() if adapter else exported).generation_config = generation
    cast_parameters(exported, TORCH_DTYPES[config.dtype])
    parameters = exported.num_parameters()

    with atomic_dir(out) as tmp:
        if adapter:
            log.info(f"writing the {config.dtype} LoRA adapters to {out} (on the base {checkpoint.lora_base})")
            save_adapter(exported, tmp, checkpoint.lora_base)
        else:
            log.info(f"writing {config.dtype} safetensors (shards above {config.max_shard_size}) to {out}")
            exported.save_pretrained(tmp, max_shard_size=config.max_shard_size)
        for name, path in source.copied_files().items():  # a base's generation_config.json replaces the own
            shutil.copy2(path, tmp / name)
        for name, text in source.written_files().items():
            write_text_atomic(tmp / name, text)
        report = verify_export(tmp, reference, reference_fp32, source.gate(), config.dtype)
        rows = read_metrics(checkpoint.run_dir / "metrics.jsonl", checkpoint.step)
        blocks, source_counts = source.card(tmp, rows)
        facts = CardFacts(title=config.repo_name or out.name, model_config=exported.config, parameters=parameters,
                          step=checkpoint.step, verification=report, blocks=blocks,
                          has_loss_curve=plot_loss_curve(rows, tmp / LOSS_CURVE))
        repo_id = f"{config.organization or 'YOUR_HF_USER'}/{config.repo_name or out.name}"
        write_text_atomic(tmp / "README.md", render_card(facts, repo_id))
        files = sorted(p.relative_to(tmp) for p in tmp.rglob("*") if p.is_file())
    counts = {"checkpoint": str(checkpoint.path), "step": checkpoint.step, "parameters": parameters, **source_counts,
              "files": len(files), "bytes": sum((out / f).stat().st_size for f in files), **report}
    return StageResult(outputs=files, counts=counts)


def convert(config: ConvertConfig, checkpoint: Checkpoint, force: bool) -> Manifest:
    """Stage 4 on `checkpoint`: skipped while the folder is current for the same inputs and settings."""
    source = open_source(config, checkpoint)
    settings = {k: getattr(config, k) for k in EXPORT_KEYS}
    return CONVERT.run(config.output_tokenizer_and_model_dir, settings, source.inputs(),
                       lambda: export(config, source), force=force, versions=source.versions,
                       input_paths={"input_model_dir": config.input_model_dir})


def run(config: ConvertConfig, args: Any) -> int:
    source = local_checkpoint_source(config.input_model_dir, config.checkpoint_step)
    checkpoint = find_checkpoint(source, config.checkpoint_step)
    manifest = convert(config, checkpoint, args.force)
    out = config.output_tokenizer_and_model_dir
    counts = manifest.counts
    if not counts.get("verified"):
        raise StageFailed(f"{out} did not pass verification (marked verified: false in "
                          f"{CONVERT.manifest_path(staging(CONVERT, out))}; it will not be uploaded):\n  - "
                          + "\n  - ".join(counts.get("failures", [])))
    log.info(f"{out}: verified (logits max |Δ| {counts['logits_max_abs_diff']:.2g} in {counts['dtype']}, "
             f"{counts['tokenizer_texts']} texts tokenized identically). "
             f"Greedy sample: {counts.get('greedy_sample')!r}")
    print(out)
    return EXIT_OK
