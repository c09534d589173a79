"""Continued pretraining with the base's tokenizer extended by stage 1 (model.init_from + tokenize.tokenizer_dir at
the extension): an English byte-level BPE trained here on English man pages, a tiny random Llama on it with 64
spare embedding rows past the tokenizer (as Qwen has), the tokenizer extended with NEW_PIECES pieces on the
Japanese man pages. The base's matrices grown (spare rows taken first, padded to a multiple of 128) with each new
row the mean of its base ids' rows, the step-0 gate's checks (and their failures on a wrong init), stage 3 with
an embedding warm-up (what it trains, an exact resume across its end), the export (the true vocabulary, the
extension's tokenizer files), llama.cpp's ids and vLLM's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import orjson
import pytest
from conftest import corpus_texts, manifest_counts, run_cli, run_train, train_losses
from test_continued_pretraining import convert, make_base, train_args
from test_tokenizer_extend import english_pages, extend

from gptpipe.artifacts import EXIT_BAD_INPUT, TOKENIZE, TOKENIZER_HF_DIR
from gptpipe.data.base_tokenizer import expand
from gptpipe.export.agreement import runtime_report
from gptpipe.export.runtimes.llamacpp import LlamaCpp, llamacpp_ids
from gptpipe.export.runtimes.vllm import PROMPTS, Vllm
from gptpipe.stage import StageInputError
from gptpipe.tolerance import loss_tolerance
from gptpipe.train.continued import new_row_problems, old_rows_loss, reference_loss
from gptpipe.runtime.base_model import open_base
from gptpipe.runtime.model import VOCAB_MULTIPLE, build_model

CORPUS_DOCS = 300
NEW_PIECES = 300
SPARE_ROWS = 64


def byte_level_base_tokenizer(folder: Path) -> Path:
    from conftest import byte_level_bpe

    return byte_level_bpe(english_pages(0, 300), folder, adds_bos=True)


@pytest.fixture(scope="module")
def corpus(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    texts = corpus_texts(corpus_dir)[:CORPUS_DOCS]
    path = tmp_path_factory.mktemp("vocab-corpus") / "corpus.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"text": t}) + b"\n" for t in texts))
    return path, texts


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An untied Llama with SPARE_ROWS spare rows (one 32-wide head: vLLM's CPU attention runs head sizes 32, 64,
    ...) and a tied GPT-2, on one English byte-level BPE."""
    root = tmp_path_factory.mktemp("vocab-bases")
    tokenizer = byte_level_base_tokenizer(root / "tokenizer")
    return {"llama": make_base("llama", tokenizer, root / "llama", extra_vocab=SPARE_ROWS, num_attention_heads=1,
                               num_key_value_heads=1),
            "gpt2": make_base("gpt2", tokenizer, root / "gpt2")}


@pytest.fixture(scope="module")
def extension(bases, corpus_dir: Path, workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stage 1: the bases' tokenizer extended on the Japanese man pages (the workspace's stage-0 corpus, which
    corpus_dir makes; its output_dir)."""
    out = tmp_path_factory.mktemp("vocab-extension") / "ext"
    assert extend(workspace, bases["llama"], out, f"new_pieces={NEW_PIECES}") == 0
    return out


@pytest.fixture(scope="module")
def dataset(corpus, extension, workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stage 2 with tokenize.tokenizer_dir at the extension's output_dir (routed to its hf/)."""
    root = tmp_path_factory.mktemp("vocab-data")
    run_cli("tokenize", "--config", workspace / "config.yaml", f"tokenize.input=[{corpus[0]}]",
            f"tokenize.tokenizer_dir={extension}", f"tokenize.output_prefix={root / 'ja'}", "tokenize.workers=1")
    return root / "ja_text_document"


def new_rows(extension: Path) -> dict[int, tuple[int, ...]]:
    rows = [json.loads(line) for line in (extension / "new_pieces.jsonl").read_text(encoding="utf-8").splitlines()]
    return {row["id"]: tuple(row["base_ids"]) for row in rows}


def grown(bases, extension, name: str):
    """(the BaseModel, the base's own model, the model stage 3 initialises) of base `name` with the extension."""
    from transformers import AutoModelForCausalLM

    base = open_base(bases[name], extension / TOKENIZER_HF_DIR)
    original = AutoModelForCausalLM.from_pretrained(bases[name])
    return base, original, build_model(base.config, "cpu", base.folder, base.extension.new_rows)


def test_stage_2_encodes_with_the_extension_routed_from_its_output_dir(corpus, extension, dataset) -> None:
    from transformers import AutoTokenizer

    from gptpipe.data.tokenizer_check import first_documents

    tokenizer = AutoTokenizer.from_pretrained(extension / TOKENIZER_HF_DIR)
    texts = corpus[1][:20]
    want = [ids + [tokenizer.eos_token_id] for ids in tokenizer(texts)["input_ids"]]
    assert first_documents(dataset, len(texts)) == want
    boundaries = TOKENIZE.require(dataset).counts["boundaries"]
    assert boundaries["vocab_size"] == len(tokenizer) == manifest_counts(extension)["vocab_size"]
    assert any(i >= manifest_counts(extension)["base_vocab_size"] for doc in want for i in doc)


def test_the_grown_matrices_keep_the_base_rows_and_start_new_ones_at_their_means(bases, extension) -> None:
    """Llama (untied): the new ids take the 64 spare rows first, then rows past them; the size is padded to a
    multiple of 128; every other row of both matrices is the base's; each new row in both is the mean of its base
    ids' rows; the padding rows the mean of all the base's rows."""
    import torch

    base, original, model = grown(bases, extension, "llama")
    pieces = new_rows(extension)
    base_tokens, rows = manifest_counts(extension)["base_vocab_size"], original.config.vocab_size
    assert rows == base_tokens + SPARE_ROWS and base.base_rows == rows
    size = model.config.vocab_size
    assert size % VOCAB_MULTIPLE == 0 and base_tokens + NEW_PIECES <= size < base_tokens + NEW_PIECES + VOCAB_MULTIPLE
    assert base.export_rows == base_tokens + NEW_PIECES
    assert sorted(pieces) == list(range(base_tokens, base_tokens + NEW_PIECES))
    for get in ("get_input_embeddings", "get_output_embeddings"):
        old, new = getattr(original, get)().weight.detach(), getattr(model, get)().weight.detach()
        assert new.shape == (size, old.shape[1])
        assert torch.equal(new[:base_tokens], old[:base_tokens])
        for i, ids in pieces.items():
            assert torch.equal(new[i], old[list(ids)].mean(dim=0)), (get, i)
        assert torch.equal(new[base_tokens + NEW_PIECES:], old.mean(dim=0).expand(size - base_tokens - NEW_PIECES, -1))
    assert not model.config.tie_word_embeddings
    # the body is the base's
    mine, theirs = model.state_dict(), original.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs if "embed_tokens" not in k and "lm_head" not in k)


def test_a_tied_model_grows_its_one_matrix(bases, extension) -> None:
    import torch

    _, original, model = grown(bases, extension, "gpt2")
    assert model.config.tie_word_embeddings
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    old, new = original.get_input_embeddings().weight.detach(), model.get_input_embeddings().weight.detach()
    assert torch.equal(new[:len(old)], old)
    pieces = new_rows(extension)
    assert all(torch.equal(new[i], old[list(ids)].mean(dim=0)) for i, ids in pieces.items())


def gate_sample(corpus, extension) -> dict:
    """The gate's kind of sample: Japanese text in the extension's ids, each new id spelled in its base ids."""
    import torch
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(extension / TOKENIZER_HF_DIR)(corpus[1][0])["input_ids"]
    tokens = torch.tensor([expand(ids, new_rows(extension))[:61]])  # GPT-2's 64 positions
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_the_gate_passes_a_right_init_and_refuses_a_wrong_one(name, bases, extension, corpus) -> None:
    """On text in base ids the grown model's loss over the base's own rows is the base's, the new rows pass the
    mean check in fp32 and in bf16; a new row off its mean (input or output side), or an old row changed, fails."""
    import torch

    from gptpipe.export.verify import cast_parameters

    base, _, model = grown(bases, extension, name)
    batch = gate_sample(corpus, extension)
    old = base.old_rows()
    want = reference_loss(base.folder, batch, old)
    assert old.sum() == manifest_counts(extension)["base_vocab_size"]  # the spare rows new ids took left out

    def got() -> float:
        with torch.no_grad():
            return old_rows_loss(model(input_ids=batch["input_ids"]).logits, batch["labels"], old)

    assert abs(got() - want) <= loss_tolerance(want, "fp32")
    assert new_row_problems(model, base.extension, "fp32")[0] == []
    # the full vocabulary's loss is higher: the new rows take part of the probability
    with torch.no_grad():
        full = torch.nn.functional.cross_entropy(model(input_ids=batch["input_ids"]).logits[0], batch["labels"][0])
    assert float(full) > want
    bf16 = cast_parameters(grown(bases, extension, name)[2], torch.bfloat16)
    assert new_row_problems(bf16, base.extension, "bf16")[0] == []

    new_id = sorted(base.extension.new_rows)[5]
    with torch.no_grad():
        model.get_input_embeddings().weight[new_id] += 0.01
    problems, _ = new_row_problems(model, base.extension, "fp32")
    assert "input embedding rows" in problems[0], problems
    assert len(problems) == (2 if name == "gpt2" else 1)  # tied: the one matrix is the output's too
    if name == "llama":  # untied: the output row is a matrix of its own
        with torch.no_grad():
            model.get_input_embeddings().weight[new_id] -= 0.01
            model.get_output_embeddings().weight[new_id] *= 1.5
        problems, _ = new_row_problems(model, base.extension, "fp32")
        assert len(problems) == 1 and "output rows" in problems[0], problems
    with torch.no_grad():  # an old row the sample uses (not by a constant: GPT-2's LayerNorms would remove it)
        weight = model.get_input_embeddings().weight
        weight[int(batch["input_ids"][0, 3])] += torch.linspace(-0.5, 0.5, weight.shape[1])
    assert abs(got() - want) > loss_tolerance(want, "fp32")


def test_an_extension_of_another_tokenizer_is_refused(extension, tmp_path: Path) -> None:
    other = byte_level_base_tokenizer(tmp_path / "tok")
    # the same training texts, another vocabulary: an id more at the start
    state = json.loads((other / "tokenizer.json").read_text())
    state["model"]["vocab"] = {p: i + 1 for p, i in state["model"]["vocab"].items()} | {"<extra>": 0}
    for token in state["added_tokens"]:
        token["id"] += 1
    (other / "tokenizer.json").write_text(json.dumps(state))
    base = make_base("llama", other, tmp_path / "other")
    with pytest.raises(StageInputError, match="extends another tokenizer than model.init_from"):
        open_base(base, extension)


# --- stage 3 and 4 -----------------------------------------------------------------------------------------------
def run_args(workspace: Path, bases, extension: Path, dataset: Path, run: Path, *extra: str) -> list:
    return train_args(workspace, bases["llama"], dataset, run, f"tokenize.tokenizer_dir={extension / TOKENIZER_HF_DIR}",
                      "train.lr=1e-3", "train.log_interval=1", *extra)


def weights(run: Path, step: int) -> dict:
    from gptpipe.runtime.checkpoint import consolidate, find_checkpoint

    return consolidate(find_checkpoint(run / "checkpoints", step))


VOCAB_KEYS = ("model.embed_tokens.weight", "lm_head.weight")


@pytest.mark.slow
def test_stage_3_grows_trains_with_an_embedding_warmup_resumes_exactly_and_exports(
        bases, extension, dataset, workspace: Path, tmp_path: Path) -> None:
    """4 steps, the first 2 an embedding warm-up: the gate passes, the warm-up's steps change the embedding and
    output matrices only (bit for bit the rest), the steps after change everything; the run resumed from step 1
    repeats every loss and ends on the same weights; the export ships the extension's tokenizer with the true
    vocabulary and passes its gate."""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    run = tmp_path / "run"
    extra = ("train.train_iters=4", "train.embedding_warmup_steps=2", "train.save_interval=1",
             "train.keep_checkpoints=10")
    done = run_train(*run_args(workspace, bases, extension, dataset, run, *extra))
    assert done.returncode == 0, done.stderr[-3000:]
    err = done.stderr
    assert "step-0 gate passed" in err and "with its new pieces spelled in base ids" in err, err[-3000:]
    assert f"its {NEW_PIECES} new rows: max |Δ|" in err
    assert f"vocabulary extended by {NEW_PIECES} pieces" in err
    assert "embedding warm-up: steps 1–2 train only" in err and "embedding warm-up over after step 2" in err

    base = open_base(bases["llama"], extension / TOKENIZER_HF_DIR)
    start = build_model(base.config, "cpu", base.folder, base.extension.new_rows).state_dict()
    warm, after = weights(run, 2), weights(run, 4)
    body = [k for k in start if k not in VOCAB_KEYS]
    assert all(torch.equal(warm[k], start[k]) for k in body)
    assert all(not torch.equal(warm[k], start[k]) for k in VOCAB_KEYS)
    assert all(not torch.equal(after[k], warm[k]) for k in body if k.endswith("proj.weight"))

    # resumed from step 1 (inside the warm-up) in a copy: the same losses (conftest's train_losses asserts that a
    # repeated step repeats its loss) and the same weights after step 4
    resumed = shutil.copytree(run, tmp_path / "resumed")
    for folder in (resumed / "checkpoints").iterdir():
        if folder.is_dir() and folder.name != "global_step1":
            shutil.rmtree(folder)
    (resumed / "checkpoints" / "latest").unlink(missing_ok=True)
    done = run_train(*run_args(workspace, bases, extension, dataset, resumed, *extra))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stderr and "embedding warm-up: steps 2–2 train only" in done.stderr
    assert train_losses(resumed) == train_losses(run)
    again = weights(resumed, 4)
    assert all(torch.equal(again[k], after[k]) for k in after)

    out = tmp_path / "export"
    assert convert(workspace, run, out) == 0
    counts = manifest_counts(out)
    assert counts["verified"], counts["failures"]
    tokenizer = AutoTokenizer.from_pretrained(out)
    hf = extension / TOKENIZER_HF_DIR
    assert AutoConfig.from_pretrained(out).vocab_size == len(tokenizer) == base.export_rows
    assert len(tokenizer) == manifest_counts(extension)["vocab_size"]
    assert all((out / p.name).read_bytes() == p.read_bytes() for p in hf.iterdir())
    assert (out / "generation_config.json").read_bytes() == (bases["llama"] / "generation_config.json").read_bytes()
    assert not (out / "tokenizer.model").exists()


@pytest.fixture(scope="module")
def exported(bases, extension, dataset, workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-step run from the Llama with the extension, exported in fp32."""
    root = tmp_path_factory.mktemp("vocab-export")
    done = run_train(*run_args(workspace, bases, extension, dataset, root / "run"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert convert(workspace, root / "run", root / "export") == 0
    return root / "export"


@pytest.mark.llamacpp
@pytest.mark.skipif(LlamaCpp(Path()).missing() is not None, reason=str(LlamaCpp(Path()).missing()))
def test_llamacpp_gives_the_extended_tokenizers_ids(exported: Path, corpus, workspace: Path) -> None:
    """`gptpipe gguf` of the export: llama.cpp's ids equal transformers' on Japanese text (new pieces in it) and
    English, and its greedy tokens agree with the model's."""
    from transformers import AutoTokenizer

    from gptpipe.cli import main

    assert main(["gguf", "--config", str(workspace / "convert_config.yaml"), "--model", str(exported),
                 "--outtype", "f16"]) == 0
    gguf = next((exported.parent / f"{exported.name}-gguf-f16").glob("*.gguf"))
    tokenizer = AutoTokenizer.from_pretrained(exported)
    base_size = len(tokenizer) - NEW_PIECES
    texts = [t[:400] for t in corpus[1][-20:]] + ["The quick brown fox jumps over the lazy dog."]
    new_seen = 0
    for text, got in zip(texts, llamacpp_ids(gguf, texts)):
        ids = tokenizer(text)["input_ids"]
        assert got == ids, text[:60]
        new_seen += sum(i >= base_size for i in ids)
    assert new_seen > 0
    counts = manifest_counts(gguf.parent)
    assert counts["verified"], counts.get("failures")
    assert counts["llamacpp_heldout"]["ids_differing"] == 0, counts["llamacpp_heldout"]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(Vllm(Path()).missing() is not None, reason=str(Vllm(Path()).missing()))
def test_vllm_gives_the_extended_tokenizers_ids_and_greedy_tokens(exported: Path) -> None:
    report = runtime_report(Vllm(exported), exported, PROMPTS)
    print(report["summary"])
    for entry in report["requests"]:
        assert entry["prompt_ids_equal"], entry
        assert entry["verdict"] != "departs", entry
    assert report["agrees"], report["departures"]


@pytest.mark.slow
def test_data_of_the_base_tokenizer_is_refused_with_the_extension(bases, extension, dataset, corpus,
                                                                 workspace: Path, tmp_path: Path) -> None:
    """The extension's data with the base's own tokenizer named (or the reverse): refused before any work."""
    done = run_train(*train_args(workspace, bases["llama"], dataset, tmp_path / "run",
                                 f"tokenize.tokenizer_dir={bases['llama']}"))
    assert done.returncode == EXIT_BAD_INPUT
    assert f"the data was not tokenized with model.init_from {bases['llama']}'s tokenizer" in done.stderr
