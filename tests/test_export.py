"""Stage 4: DeepSpeed checkpoint → verified HuggingFace folder, for every architecture, and its failure paths."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import SHIPPED, TINY_STEPS, TRAINED, finetune_args, gptpipe_command
from conftest import manifest_counts as counts
from safetensors import safe_open

from gptpipe.cli import main
from gptpipe.runtime.checkpoint import (consolidate, find_checkpoint, COMPLETE_MARKER, HF_CONFIG, STATE,
                                        complete_checkpoints)
from gptpipe.export.config import ConvertConfig
from gptpipe.export.convert import reference_models
from gptpipe.export.source import HELDOUT_DOCUMENTS, heldout_documents, pretrain_source
from gptpipe.export.verify import verify_export
from gptpipe.tokenizer.hf import NO_SPACE_PREFIX
from gptpipe.tolerance import FP32_TOLERANCE
from gptpipe.stage import StageInputError, file_fingerprint
from gptpipe.artifacts import read_tokenizer


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
        tensors = [weights.get_tensor(k) for k in weights.keys()]  # noqa: SIM118 - safe_open is no dict
    assert {t.dtype for t in tensors} == {torch.float32 if dtype == "fp32" else torch.bfloat16}
    # The SentencePiece model ships beside tokenizer.json (converters such as llama.cpp's read it), with no space
    # prefix stated; AutoTokenizer still reads tokenizer.json, the gate compared its ids with SentencePiece's.
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer.model").read_bytes() == info.model_path.read_bytes()
    assert report["sentencepiece_file"] is True
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert {k: tokenizer_config.get(k) for k in NO_SPACE_PREFIX} == NO_SPACE_PREFIX

    card = (out / "README.md").read_text()
    assert f"{report['parameters']:,}" in card and "Final validation loss" in card
    assert "![loss curve](loss_curve.png)" in card and (out / "loss_curve.png").stat().st_size > 1000
    assert "Verified." in card and "pipeline(\"text-generation\"" in card
    assert "`vllm serve PATH" in card  # every causal LM; a GGUF for the architectures `gptpipe gguf` maps
    assert ("`gptpipe gguf --model PATH" in card) == (arch in ("llama", "gpt2"))

    generator = pipeline("text-generation", model=str(out))
    text = generator("日本語の", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    assert text.startswith("日本語の") and len(text) > len("日本語の")


def bf16_optimizer_master_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The fp32 master weights of DeepSpeed's BF16_Optimizer (bf16 at ZeRO-1 with fp32 gradients), read
    through its own per-parameter map (param_slice_mappings: where each rank's fragment of each parameter lies
    in that rank's flat partition), not through the flat layout that consolidate reassembles."""
    files = sorted(folder.glob("bf16_zero_pp_rank_*_optim_states.pt"), key=lambda f: int(f.name.split("_")[4]))
    fragments: dict[str, list[torch.Tensor]] = {}
    for file in files:
        state = torch.load(file, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        for partition, mapping in zip(state["single_partition_of_fp32_groups"], state["param_slice_mappings"]):
            for name, address in mapping.items():
                fragments.setdefault(name, []).append(partition[address.start:address.start + address.numel])
    return {name: torch.cat(parts) for name, parts in fragments.items()}


def assert_exports_bf16_master_weights(run: Path, out: Path, ranks: int) -> float:
    """consolidate and the fp32 export of a bf16 ZeRO-1 run hold the optimizer's fp32 master weights, not the
    bf16 module's; returns max |export - master|."""
    checkpoint = find_checkpoint(run)
    assert len(list(checkpoint.path.glob("bf16_zero_pp_rank_*_optim_states.pt"))) == ranks
    master = bf16_optimizer_master_weights(checkpoint.path)
    module = torch.load(checkpoint.path / "mp_rank_00_model_states.pt", map_location="cpu",
                        weights_only=False)["module"]
    state_dict = consolidate(checkpoint)
    assert set(master) <= set(state_dict) and len(master) > 10
    for name, weights in master.items():
        assert torch.equal(state_dict[name].flatten(), weights), name
        assert torch.equal(state_dict[name].bfloat16(), module[name]), name  # the module is the master rounded
    # fp32 precision survived: the master is not the bf16 module upcast
    assert any(not torch.equal(state_dict[name], module[name].float()) for name in master)

    from safetensors.torch import load_file

    exported = load_file(out / "model.safetensors")
    compared = [name for name in master if name in exported]
    assert len(compared) >= len(master) - 2  # at most tied copies left out of the file
    # The padded vocabulary's extra embedding rows are dropped from the export: compare its rows.
    return max((exported[name].flatten() - master[name][:exported[name].numel()]).abs().max().item()
               for name in compared)


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.ranks)])
def test_bf16_zero1_run_exports_its_fp32_master_weights(tiny_run, workspace, tmp_path, ranks):
    """The default GPU setting (bf16, ZeRO-1, fp32 gradients) saves DeepSpeed's BF16_Optimizer files, which
    zero_to_fp32 refuses: stage 4 must still export the exact fp32 master weights and pass the gate."""
    run = tiny_run("llama", 1, True, ranks)
    out = tmp_path / "export"
    assert convert(workspace, run, out, "dtype=fp32") == 0
    report = counts(out)
    assert report["verified"] is True and report["failures"] == [] and report["logits_max_abs_diff"] == 0
    assert assert_exports_bf16_master_weights(run, out, ranks) == 0


def test_exported_mixtral_generates_padded_batches_and_beams(tiny_run, workspace, tmp_path):
    """output_router_logits is a training switch: on in a config, transformers computes the load-balancing
    loss in every forward, and generation from a left-padded batch fails there."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gptpipe.export.generate import load

    out = tmp_path / "mixtral"
    assert convert(workspace, tiny_run("mixtral", 3, False, 2), out) == 0
    assert json.loads((out / "config.json").read_text())["output_router_logits"] is False

    def generate_batches(model, tokenizer) -> None:
        tokenizer.padding_side = "left"
        prompts = ["日本語の", "このコマンドは指定したファイルを削除します。"]  # 2 and 4 tokens
        batch = tokenizer(prompts, padding=True, return_tensors="pt")
        assert not batch["attention_mask"].all()  # the shorter prompt is padded
        for beams in (1, 2):
            ids = model.generate(**batch, max_new_tokens=4, do_sample=False, num_beams=beams)
            assert ids.shape[0] == 2 and ids.shape[1] > batch["input_ids"].shape[1]

    generate_batches(AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out))
    # A folder exported with the switch on (older gptpipe): `gptpipe generate` turns it off on loading.
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "output_router_logits": True}))
    generate_batches(*load(out))


def test_export_is_skipped_when_current_and_sharded_on_request(exported_model, trained_run, workspace, capsys):
    report = counts(exported_model)  # the main path: shipped convert_config.yaml on the stage-3 run
    steps = [step for step, _ in complete_checkpoints(trained_run / "checkpoints")]
    assert report["verified"] is True and report["dtype"] == "bf16" and report["step"] == steps[-1]
    state = json.loads((find_checkpoint(trained_run).path / STATE).read_text())
    assert report["final_val_loss"] == state["final_val_loss"]
    # the rate of the checkpoint's last step, the run's last (min_lr): a run continued from the export re-warms from it
    assert report["final_lr"] == state["lr"] == pytest.approx(TRAINED.min_lr, rel=1e-9)
    before = file_fingerprint(exported_model / "model.safetensors")
    assert main(["convert", "--config", str(workspace / "convert_config.yaml")]) == 0
    assert "up to date" in capsys.readouterr().err
    assert file_fingerprint(exported_model / "model.safetensors") == before

    sharded = workspace / "models" / "hf" / "sharded"
    assert convert(workspace, trained_run, sharded, "max_shard_size=1MB", f"checkpoint_step={steps[0]}") == 0
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


def run_gate(folder: Path, run: Path) -> dict:
    """The verification gate on ``folder`` against the checkpoint it was exported from."""
    checkpoint = find_checkpoint(run)
    dtype = counts(folder)["dtype"]
    reference, reference_fp32 = reference_models(checkpoint, consolidate(checkpoint), dtype, adapter=False)
    source = pretrain_source(ConvertConfig(test_prompt_text="こんにちは。"), checkpoint)
    return verify_export(folder, reference, reference_fp32, source.gate(), dtype)


def test_gate_compares_on_documents_training_never_saw(dataset_prefix, tokenizer_dir):
    from gptpipe.data.split import document_order, split_bounds
    from gptpipe.data.indexed import IndexedDataset

    eod = read_tokenizer(tokenizer_dir).eod_id
    split, seed = SHIPPED.data.split, SHIPPED.data.seed
    heldout = heldout_documents(dataset_prefix, HELDOUT_DOCUMENTS, eod, split, seed, "こんにちは。")
    reader = IndexedDataset(dataset_prefix)
    begin, end = split_bounds(split, len(reader))[0]
    order = document_order(len(reader), seed)
    train = {tuple(t for t in reader[int(i)].tolist() if t != eod) for i in order[begin:end]}
    assert len(heldout.documents) == HELDOUT_DOCUMENTS
    assert not any(tuple(doc) in train for doc in heldout.documents)  # stage 0 removed duplicate documents


def test_gate_fails_on_a_tokenizer_that_differs_from_sentencepiece(exported_model, trained_run, tokenizer_dir,
                                                                   dataset_prefix, tmp_path):
    folder = tmp_path / "tampered"
    shutil.copytree(exported_model, folder)
    _tamper_tokenizer_json(folder)
    report = run_gate(folder, trained_run)
    assert report["verified"] is False
    assert report["tokenizer_mismatches"] > 0
    assert any("tokenizer ids differ from SentencePiece" in f for f in report["failures"])
    assert report["logits_max_abs_diff"] <= report["logits_tolerance"]  # the weights themselves are still right


def test_gate_fails_without_the_sentencepiece_model_or_its_no_prefix_statement(exported_model, trained_run,
                                                                              tmp_path):
    """tokenizer.model must ship, byte-identical to stage 1's, and tokenizer_config.json say: no space prefix."""
    from transformers import AutoTokenizer

    assert run_gate(exported_model, trained_run)["sentencepiece_file"] is True
    assert AutoTokenizer.from_pretrained(exported_model).vocab_file.endswith("tokenizer.model")  # read, ids unchanged
    missing, prefixed = tmp_path / "missing", tmp_path / "prefixed"
    shutil.copytree(exported_model, missing)
    (missing / "tokenizer.model").unlink()
    report = run_gate(missing, trained_run)
    assert report["verified"] is False and report["failures"] == ["no tokenizer.model beside tokenizer.json"]
    shutil.copytree(exported_model, prefixed)
    config = prefixed / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "add_prefix_space": True}))
    report = run_gate(prefixed, trained_run)
    assert report["verified"] is False and report["tokenizer_mismatches"] == 0
    assert [f for f in report["failures"] if "no space prefix" in f] == report["failures"] != []


def test_gate_fails_on_weights_mapped_to_the_wrong_layer(exported_model, trained_run, tokenizer_dir, dataset_prefix,
                                                         tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "tampered"
    shutil.copytree(exported_model, folder)
    weights = load_file(folder / "model.safetensors")
    first, second = "model.layers.0.self_attn.o_proj.weight", "model.layers.1.self_attn.o_proj.weight"
    weights[first], weights[second] = weights[second], weights[first]  # a classic conversion-script bug
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    report = run_gate(folder, trained_run)
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
    report = run_gate(folder, trained_run)
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
    state = json.loads(state_path.read_text())
    state["config"]["tokenize"]["tokenizer_dir"] = str(bad_tokenizer)  # the run record names the tokenizer
    state_path.write_text(json.dumps(state))

    out = tmp_path / "out"
    assert convert(workspace, run, out) == 1
    err = capsys.readouterr().err
    assert "FAILED" in err and "did not pass verification" in err and "tokenizer ids differ" in err
    assert counts(out)["verified"] is False
    assert "Verification FAILED" in (out / "README.md").read_text()
    assert convert(workspace, run, out) == 1  # not skipped as "up to date": a failed folder is always redone
    assert "up to date" not in capsys.readouterr().err


# --- a fine-tune run (stage 7) through the same command ---------------------------------------------------------
def gptpipe(*argv: object) -> None:
    """A gptpipe subcommand in a subprocess (a fine-tune's process group must not leak into this process)."""
    done = gptpipe_command(*argv)
    assert done.returncode == 0, done.stderr[-3000:]


def test_finetune_export_passes_the_gate_and_predicts_like_the_run(classifier_run, tiny_lm, task_files, workspace,
                                                                   tmp_path):
    """The best checkpoint of a fine-tune exported: gate on its validation rows, task.json, a card with the
    metrics beside the majority baseline, the same predictions as the run, ready for stage 6."""
    from gptpipe.runtime.checkpoint import model_from_checkpoint
    from gptpipe.export.source import finetune_source
    from gptpipe.runtime.checkpoint import BEST

    run, args, _ = classifier_run  # conftest's CLASSIFIER_RUN: the best of 5 evaluated steps, by accuracy
    best = (run / "checkpoints" / BEST).read_text().split()[0]
    out = tmp_path / "export"
    assert convert(workspace, run, out, "dtype=fp32", "huggingface_name=ft-test") == 0
    report = counts(out)
    assert report["verified"] is True and report["failures"] == [] and f"global_step{report['step']}" == best
    assert report["logits_max_abs_diff"] <= FP32_TOLERANCE and report["tokenizer_mismatches"] == 0
    assert report["heldout_source"].endswith("validation.tsv") and report["task"] == "classification"
    labels = json.loads((run / "task.json").read_text())["labels"]
    assert all(s["prediction"] in labels for s in report["greedy_samples"])
    task = json.loads((out / "task.json").read_text())
    run_task = json.loads((run / "task.json").read_text())
    assert task == {**run_task, "pretrained_model": tiny_lm.name, "train_file": "train.tsv"}  # no local paths
    card = (out / "README.md").read_text()
    summary = json.loads((run / "finetune_summary.json").read_text())
    metrics = summary["best"]["metrics"]
    assert f"| accuracy | {metrics['accuracy']:.4f} | {metrics['majority_accuracy']:.4f} |" in card
    assert f"| macro-F1 | {metrics['macro_f1']:.4f} | {metrics['majority_macro_f1']:.4f} |" in card
    assert ", ".join(f"`{label}`" for label in labels) in card and "Verified." in card
    assert "![validation metrics](metric_curve.png)" in card
    # baseline.classical is on by default: the card shows the model beside it on the same rows
    classical = summary["comparison"]["classical"]
    assert (f"| classical: character 1-4-gram TF-IDF + logistic regression | {classical['accuracy']:.4f} | "
            f"{classical['macro_f1']:.4f} | - |") in card
    assert (out / "metric_curve.png").stat().st_size > 1000 and (out / "loss_curve.png").stat().st_size > 1000

    # The exported folder predicts exactly what the run's best checkpoint predicts.
    rows = task_files[1]  # 12 labelled rows
    predictions = {}
    for name, model in (("run", run), ("export", out)):
        predicted = tmp_path / f"{name}.jsonl"
        gptpipe("predict", "--input", rows, "--output", predicted, *args, f"predict.model={model}",
                "predict.num_beams=2")
        predictions[name] = [json.loads(line) for line in predicted.read_text().splitlines()]
    assert predictions["export"] == predictions["run"] and len(predictions["run"]) == 12

    # Stage 6 takes it unchanged: every file the gate checked, task.json included.
    assert main(["upload", "--config", str(workspace / "convert_config.yaml"), f"output_tokenizer_and_model_dir={out}",
                 "huggingface_name=ft-test", "--dry-run"]) == 0

    # The gate is the real one: an output head moved to the wrong rows fails it.
    checkpoint = find_checkpoint(run)
    reference = model_from_checkpoint(checkpoint, consolidate(checkpoint))
    tampered = tmp_path / "tampered"
    shutil.copytree(out, tampered)
    from safetensors.torch import load_file, save_file

    weights = load_file(tampered / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"].roll(1, dims=0)
    save_file(weights, tampered / "model.safetensors", metadata={"format": "pt"})
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = finetune_source(checkpoint)
    data = source.rows
    failed = verify_export(tampered, reference, reference, source.gate(), "fp32")
    assert failed["verified"] is False and any("logits differ" in f for f in failed["failures"])

    # So is its generation check: right weights, a generation_config.json that bans the answers' first tokens.
    from gptpipe.runtime.scoring import generate

    assert report["greedy_max_gap"] <= report["greedy_gap_tolerance"]
    tokenizer = AutoTokenizer.from_pretrained(out)
    encoder = data.encoder(tokenizer)
    answers = generate(AutoModelForCausalLM.from_pretrained(out), encoder,
                       [encoder.prompt_ids(row.input) for row in data.rows[:4]], torch.device("cpu"))
    tampered = tmp_path / "tampered-generation"
    shutil.copytree(out, tampered)
    path = tampered / "generation_config.json"
    first_tokens = sorted({answer[0] for answer in answers})
    path.write_text(json.dumps({**json.loads(path.read_text()), "begin_suppress_tokens": first_tokens}))
    failed = verify_export(tampered, reference, reference, source.gate(), "fp32")
    assert failed["verified"] is False and failed["greedy_max_gap"] > failed["greedy_gap_tolerance"]
    assert [f for f in failed["failures"] if "not greedy under the checkpoint's model" in f] == failed["failures"]


def instruction_rows(task_files: tuple[Path, Path], folder: Path) -> tuple[Path, Path]:
    """task_files as chat rows (jsonl, instruction → output): a man page's description → its section."""
    files = []
    for path in task_files:
        rows = [line.split("\t") for line in path.read_text(encoding="utf-8").splitlines()]
        files.append(folder / f"{path.stem}.jsonl")
        files[-1].write_text("".join(json.dumps({"instruction": f"{text} は何章?", "output": f"{section}章"},
                                                ensure_ascii=False) + "\n" for text, section in rows),
                             encoding="utf-8")
    return files[0], files[1]


@pytest.mark.parametrize("kind", ["classification", "chat"])
def test_finetune_of_an_export_ships_its_sentencepiece_model(kind, exported_model, task_files, workspace, tmp_path):
    """A fine-tune of a stage-4 export (a classifier, an instruction-tuned chat model) ships that export's
    tokenizer.model (transformers does not save it into the run's tokenizer folder), with no space prefix stated;
    the gate checks its ids against the folder's."""
    import sentencepiece
    from transformers import AutoTokenizer

    run = tmp_path / "run"
    files = instruction_rows(task_files, tmp_path) if kind == "chat" else task_files
    gptpipe("finetune", *finetune_args(exported_model, files, run, "train.train_iters=2", "train.eval_interval=1000",
                                       f"task.kind={kind}", "train.seq_len=96", "task.chat_eval_rows=2"))
    out = tmp_path / "export"
    assert convert(workspace, run, out, "dtype=fp32") == 0
    report = counts(out)
    assert report["verified"] is True and report["sentencepiece_file"] is True and report["task"] == kind
    assert report["tokenizer_mismatches"] == 0 and report["tokenizer_reference"].endswith("and SentencePiece")
    assert (out / "tokenizer.model").read_bytes() == (exported_model / "tokenizer.model").read_bytes()
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert {k: tokenizer_config.get(k) for k in NO_SPACE_PREFIX} == NO_SPACE_PREFIX
    sp, exported = sentencepiece.SentencePieceProcessor(model_file=str(out / "tokenizer.model")), \
        AutoTokenizer.from_pretrained(out)
    texts = [line.split("\t")[0] for line in task_files[1].read_text(encoding="utf-8").splitlines()]
    assert [exported(t, add_special_tokens=False).input_ids for t in texts] == [sp.encode(t) for t in texts]
    if kind == "chat":  # the template travels with the SentencePiece model
        assert exported.chat_template and (out / "chat_template.jinja").is_file()


def test_seq2seq_finetune_exports_as_an_encoder_decoder(t5_run, workspace, tmp_path):
    """The small random T5 with the ByT5 tokenizer (conftest's T5_RUN, 3 steps), exported in bf16."""
    from transformers import AutoModelForSeq2SeqLM

    run = t5_run[0]
    assert find_checkpoint(run).step == 3
    out = tmp_path / "export"
    assert convert(workspace, run, out, "checkpoint_step=2") == 0  # bf16, a chosen step, not the newest
    report = counts(out)
    assert report["verified"] is True and report["step"] == 2 and report["dtype"] == "bf16"
    assert json.loads((out / "config.json").read_text())["is_encoder_decoder"] is True
    assert "pipeline_tag: text2text-generation" in (out / "README.md").read_text()
    model = AutoModelForSeq2SeqLM.from_pretrained(out)
    assert model.generation_config.decoder_start_token_id == model.config.decoder_start_token_id

    # Stage 6's check of the hub copy loads it as an encoder-decoder and shows the decoder's output alone.
    from gptpipe.export.upload import check_hub_copy, repository_contents
    from gptpipe.artifacts import read_export

    problems, sample = check_hub_copy(repository_contents(out, list(read_export(out).files)), out, "入力: ls")
    output = sample.split(" → ", 1)[1]
    assert problems == [] and sample.startswith("入力: ls → ") and "入力" not in output


@pytest.mark.slow  # a fine-tune, two exports' worth of reading and two predicts: minutes on 2 cores
def test_bf16_zero1_finetune_exports_and_predicts_from_its_fp32_master_weights(tiny_t5, task_files, workspace,
                                                                                 tmp_path):
    """Stage 7 at the default GPU setting (bf16, ZeRO-1): `gptpipe predict` on the run and stage 4 both read
    its checkpoint (BF16_Optimizer's files) through consolidate; T5's tied embeddings included."""
    run = tmp_path / "run"
    args = finetune_args(tiny_t5, task_files, run, "train.train_iters=2", "train.eval_interval=1000",
                         "train.seq_len=96", "task.prompt='入力: {input}'", "train.precision=bf16",
                         "train.zero_stage=1")
    done = gptpipe_command("finetune", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "export"
    assert convert(workspace, run, out, "dtype=fp32") == 0
    report = counts(out)
    assert report["verified"] is True and report["failures"] == [] and report["logits_max_abs_diff"] == 0
    assert assert_exports_bf16_master_weights(run, out, 1) == 0

    rows = tmp_path / "rows.tsv"
    rows.write_text("".join(task_files[1].read_text().splitlines(keepends=True)[:4]))
    predictions = {}
    for name, model in (("run", run), ("export", out)):
        predicted = tmp_path / f"{name}.jsonl"
        done = gptpipe_command("predict", "--input", rows, "--output", predicted, *args, f"predict.model={model}",
                               "predict.max_new_tokens=4")
        assert done.returncode == 0, done.stderr[-3000:]
        predictions[name] = [json.loads(line) for line in predicted.read_text().splitlines()]
    assert predictions["export"] == predictions["run"] and len(predictions["run"]) == 4
