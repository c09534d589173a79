"""Stage 4: DeepSpeed checkpoint → verified HuggingFace folder, for every architecture, and its failure paths."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import SHIPPED, TINY_STEPS
from conftest import manifest_counts as counts
from gptpipe.cli import main
from gptpipe.export.checkpoint import consolidate, find_checkpoint
from gptpipe.export.convert import HELDOUT_DOCUMENTS, heldout_documents, reference_models
from gptpipe.export.verify import FP32_TOLERANCE, verify_export
from gptpipe.stage import StageInputError, file_fingerprint
from gptpipe.stages import read_tokenizer
from gptpipe.train.checkpoint import COMPLETE_MARKER, HF_CONFIG, STATE, complete_checkpoints


def convert(workspace: Path, run: Path, out: Path, *overrides: str) -> int:
    return main(["convert", "--config", str(workspace / "convert_config.yaml"), f"input_model_dir={run}",
                 f"output_tokenizer_and_model_dir={out}", *overrides])


@pytest.mark.parametrize("arch,zero,bf16,ranks,dtype", [
    ("llama", 1, False, 1, "fp32"),
    ("llama", 0, False, 1, "bf16"),  # ZeRO-0 keeps no partitioned master weights: read from the module
    ("gpt2", 2, True, 1, "bf16"),
    ("mixtral", 3, False, 2, "fp32"),  # mixture of experts, ZeRO-3 shards from two ranks
])
def test_export_gate_passes_for_every_architecture(tiny_run, workspace, tokenizer_dir, arch, zero, bf16, ranks,
                                                   dtype):
    from transformers import pipeline

    run = tiny_run(arch, zero, bf16, ranks)
    out = workspace / "models" / "hf" / f"{arch}-z{zero}-{dtype}"
    assert convert(workspace, run, out, f"dtype={dtype}") == 0
    report = counts(out)
    assert report["verified"] is True and report["failures"] == []
    assert report["logits_max_abs_diff"] <= report["logits_tolerance"]
    assert report["greedy_max_gap"] <= report["greedy_gap_tolerance"]
    if dtype == "fp32":
        assert report["logits_tolerance"] == FP32_TOLERANCE
    assert report["tokenizer_mismatches"] == 0 and report["tokenizer_texts"] > HELDOUT_DOCUMENTS // 2
    assert report["heldout_batch"][0] >= 1

    info = read_tokenizer(tokenizer_dir)
    trained = json.loads((find_checkpoint(run).path / "hf_config.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == arch
    assert config["vocab_size"] == info.vocab_size  # the 128-padding rows are gone
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        info.bos_id, info.eos_id, info.pad_id)
    positions = "n_positions" if arch == "gpt2" else "max_position_embeddings"
    assert config[positions] == trained[positions]
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == info.eos_id and generation["pad_token_id"] == info.pad_id
    with safe_open(out / "model.safetensors", "pt") as weights:
        tensors = [weights.get_tensor(k) for k in weights.keys()]
    assert {t.dtype for t in tensors} == {torch.float32 if dtype == "fp32" else torch.bfloat16}
    assert (out / "tokenizer.json").is_file() and not (out / "tokenizer.model").exists()

    card = (out / "README.md").read_text()
    assert f"{report['parameters']:,}" in card and "Final validation loss" in card
    assert "![loss curve](loss_curve.png)" in card and (out / "loss_curve.png").stat().st_size > 1000
    assert "Verified." in card and "pipeline(\"text-generation\"" in card

    generator = pipeline("text-generation", model=str(out))
    text = generator("日本語の", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    assert text.startswith("日本語の") and len(text) > len("日本語の")


def test_export_is_skipped_when_current_and_sharded_on_request(exported_model, trained_run, workspace, capsys):
    report = counts(exported_model)  # the main path: shipped convert_config.yaml on the stage-3 run
    steps = [step for step, _ in complete_checkpoints(trained_run / "checkpoints")]
    assert report["verified"] is True and report["dtype"] == "bf16" and report["step"] == steps[-1]
    assert report["final_val_loss"] == json.loads((find_checkpoint(trained_run).path / STATE).read_text())[
        "final_val_loss"]
    before = file_fingerprint(exported_model / "model.safetensors")
    assert main(["convert", "--config", str(workspace / "convert_config.yaml")]) == 0
    assert "up to date" in capsys.readouterr().err
    assert file_fingerprint(exported_model / "model.safetensors") == before

    sharded = workspace / "models" / "hf" / "sharded"
    assert convert(workspace, trained_run, sharded, "max_shard_size=5MB", f"checkpoint_step={steps[0]}") == 0
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1 and (sharded / "model.safetensors.index.json").is_file()
    assert counts(sharded)["verified"] is True and counts(sharded)["step"] == steps[0]


def _copy_run(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest)
    return dest


def test_checkpoint_choice(tiny_run, tmp_path):
    run = _copy_run(tiny_run(), tmp_path / "run")
    newest = find_checkpoint(run).path
    assert newest.name == f"global_step{TINY_STEPS}"
    # An interrupted later save (no completion marker), even when `latest` names it, is never picked.
    later = 2 * TINY_STEPS
    partial = run / "checkpoints" / f"global_step{later}"
    shutil.copytree(newest, partial)
    (partial / COMPLETE_MARKER).unlink()
    (run / "checkpoints" / "latest").write_text(f"global_step{later}")
    assert find_checkpoint(run).path == newest
    assert find_checkpoint(run / "checkpoints", step=TINY_STEPS).path == newest
    assert find_checkpoint(newest).step == TINY_STEPS
    with pytest.raises(StageInputError, match=f"no complete checkpoint for step {later} .*steps: {TINY_STEPS}"):
        find_checkpoint(run, step=later)
    with pytest.raises(StageInputError, match="incomplete"):
        find_checkpoint(partial)


def test_missing_checkpoint_is_a_clear_error(workspace, tmp_path, capsys):
    assert convert(workspace, tmp_path / "nowhere", tmp_path / "out") == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    assert convert(workspace, tmp_path / "empty", tmp_path / "out") == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_corrupt_shard_is_a_clear_error_and_writes_nothing(tiny_run, workspace, tmp_path, capsys):
    run = _copy_run(tiny_run(), tmp_path / "run")
    shard = next(find_checkpoint(run).path.glob("*optim_states.pt"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    assert convert(workspace, run, tmp_path / "out") == 2
    assert "missing or corrupt" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_tokenizer_the_model_was_not_trained_with_is_refused(tiny_run, workspace, tmp_path, capsys):
    """The checkpoint says it was trained with other ids and a bigger vocabulary than the tokenizer it names."""
    run = _copy_run(tiny_run(), tmp_path / "run")
    config_path = find_checkpoint(run).path / HF_CONFIG
    trained = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**trained, "vocab_size": trained["vocab_size"] + 256, "eos_token_id": 5}))
    assert convert(workspace, run, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "does not match checkpoint" in err and "embedding rows" in err and "eos id is 5" in err
    assert not (tmp_path / "out").exists()


def _tamper_tokenizer_json(folder: Path) -> None:
    """Make the HF tokenizer disagree with SentencePiece on Japanese text ('。' becomes '、')."""
    from tokenizers import Tokenizer, normalizers

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    steps = [normalizers.Replace("。", "、")] + ([tok.normalizer] if tok.normalizer else [])
    tok.normalizer = normalizers.Sequence(steps)
    tok.save(str(folder / "tokenizer.json"))


def run_gate(folder: Path, run: Path, tokenizer_dir: Path, dataset_prefix: Path) -> dict:
    """The verification gate on ``folder`` against the checkpoint it was exported from."""
    checkpoint = find_checkpoint(run)
    dtype = counts(folder)["dtype"]
    reference, reference_fp32 = reference_models(checkpoint, consolidate(checkpoint), dtype)
    info = read_tokenizer(tokenizer_dir)
    heldout = heldout_documents(dataset_prefix, HELDOUT_DOCUMENTS, info.eod_id, SHIPPED.data.split,
                                 SHIPPED.data.seed)
    return verify_export(folder, reference, reference_fp32, info, heldout, "こんにちは。", dtype)


def test_gate_compares_on_documents_training_never_saw(dataset_prefix, tokenizer_dir):
    from gptpipe.data.split import document_order, split_bounds
    from gptpipe.data.indexed import IndexedDataset

    eod = read_tokenizer(tokenizer_dir).eod_id
    split, seed = SHIPPED.data.split, SHIPPED.data.seed
    heldout = heldout_documents(dataset_prefix, HELDOUT_DOCUMENTS, eod, split, seed)
    reader = IndexedDataset(dataset_prefix)
    begin, end = split_bounds(split, len(reader))[0]
    train = {tuple(t for t in reader[int(i)].tolist() if t != eod) for i in document_order(len(reader), seed)[begin:end]}
    assert len(heldout.documents) == HELDOUT_DOCUMENTS
    assert not any(tuple(doc) in train for doc in heldout.documents)  # stage 0 removed duplicate documents


def test_gate_fails_on_a_tokenizer_that_differs_from_sentencepiece(exported_model, trained_run, tokenizer_dir,
                                                                   dataset_prefix, tmp_path):
    folder = tmp_path / "tampered"
    shutil.copytree(exported_model, folder)
    _tamper_tokenizer_json(folder)
    report = run_gate(folder, trained_run, tokenizer_dir, dataset_prefix)
    assert report["verified"] is False
    assert report["tokenizer_mismatches"] > 0
    assert any("tokenizer ids differ from SentencePiece" in f for f in report["failures"])
    assert report["logits_max_abs_diff"] <= report["logits_tolerance"]  # the weights themselves are still right


def test_gate_fails_on_weights_mapped_to_the_wrong_layer(exported_model, trained_run, tokenizer_dir, dataset_prefix,
                                                         tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "tampered"
    shutil.copytree(exported_model, folder)
    weights = load_file(folder / "model.safetensors")
    first, second = "model.layers.0.self_attn.o_proj.weight", "model.layers.1.self_attn.o_proj.weight"
    weights[first], weights[second] = weights[second], weights[first]  # a classic conversion-script bug
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    report = run_gate(folder, trained_run, tokenizer_dir, dataset_prefix)
    assert report["verified"] is False
    assert any("logits differ" in f for f in report["failures"])


def test_gate_fails_on_generation_settings_that_change_greedy_decoding(exported_model, trained_run, tokenizer_dir,
                                                                      dataset_prefix, tmp_path):
    """Right weights, wrong generation_config.json: what a user generates is not the trained model's choice."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gptpipe.export.verify import greedy_continuation

    folder = tmp_path / "tampered"
    shutil.copytree(exported_model, folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
    greedy, _ = greedy_continuation(model, AutoTokenizer.from_pretrained(folder), "こんにちは。")
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "suppress_tokens": sorted(set(greedy))}))
    report = run_gate(folder, trained_run, tokenizer_dir, dataset_prefix)
    assert report["verified"] is False
    assert any("not greedy under the checkpoint's model" in f for f in report["failures"]), report["failures"]
    assert report["greedy_max_gap"] > report["greedy_gap_tolerance"]
    assert report["logits_max_abs_diff"] <= report["logits_tolerance"]  # the weights themselves are still right


def test_failed_folder_is_marked_and_redone(tiny_run, workspace, tokenizer_dir, tmp_path, capsys):
    """End to end: a stage-1 folder whose HF files disagree with its .model gives a folder marked failed."""
    bad_tokenizer = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_dir, bad_tokenizer)
    _tamper_tokenizer_json(bad_tokenizer / "hf")
    manifest_path = bad_tokenizer / "manifest.json"
    manifest = json.loads(manifest_path.read_text())  # re-vouch for the tampered file, as a buggy stage 1 would
    manifest["outputs"] = {k: file_fingerprint(bad_tokenizer / k) for k in manifest["outputs"]}
    manifest_path.write_text(json.dumps(manifest))
    run = _copy_run(tiny_run(), tmp_path / "run")
    state_path = find_checkpoint(run).path / STATE
    state_path.write_text(json.dumps({**json.loads(state_path.read_text()), "tokenizer_dir": str(bad_tokenizer)}))

    out = tmp_path / "out"
    assert convert(workspace, run, out) == 1
    err = capsys.readouterr().err
    assert "FAILED" in err and "did not pass verification" in err and "tokenizer ids differ" in err
    assert counts(out)["verified"] is False
    assert "Verification FAILED" in (out / "README.md").read_text()
    assert convert(workspace, run, out) == 1  # not skipped as "up to date": a failed folder is always redone
    assert "up to date" not in capsys.readouterr().err
