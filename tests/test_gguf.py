"""`gptpipe gguf` on tiny Llamas and a tiny GPT-2 with small tokenizers trained here on the man-page corpus
(stage 1's SentencePiece unigram and BPE, the shipped 32k unigram, a byte-level BPE): each model is a real stage-4
export (conftest's tiny_export / tokenizer_export: stage 2 with that tokenizer, a one-step run, `gptpipe convert`).

The quick tier reads the written file back with the `gguf` package's reader (vocabulary, special ids, tensors
against the safetensors); the ``llamacpp`` tier runs llama.cpp itself (scripts/build_llamacpp.sh) and is
skipped, with the reason, where that build is absent.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import (HEAD_DIM, HEADS, KV_HEADS, MOE_BIAS_EXPORT, MOE_BIAS_HEAD_DIM, SHIPPED_STAGE1, SMALLER,
                      byte_level_bpe, chat_args, corpus_texts, gptpipe_command, random_model, train_small_tokenizer)
from gptpipe.artifacts import EXIT_FAILED, read_corpus
from gptpipe.cli import main
from gptpipe.export import agreement, gguf as export_gguf
from gptpipe.export.agreement import DEPARTS, runtime_report
from gptpipe.export.runtimes import llamacpp as llama_cpp
from gptpipe.stage import Manifest
from gptpipe.tokenizer.hf import TRICKY_STRINGS

ANSWER_TOKENS = 64  # room for a chat answer to end
PROMPTS = ("ディレクトリの内容を", "ls -la を実行すると", "NAME\n    cp - ファイルをコピーする\n\n")


@pytest.fixture(scope="module")
def bpe_tokenizer(corpus_dir: Path, workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stage 1's output folder of a 2,000-piece SentencePiece BPE tokenizer."""
    tokenizer = tmp_path_factory.mktemp("tok") / "bpe"
    assert train_small_tokenizer(workspace, tokenizer, *SMALLER, "model_type=bpe") == 0
    return tokenizer


@pytest.fixture(scope="module")
def bpe_llama(bpe_tokenizer: Path, tokenizer_export) -> Path:
    return tokenizer_export("gguf-bpe", bpe_tokenizer)


@pytest.fixture(scope="module")
def bpe_gpt2(bpe_tokenizer: Path, tokenizer_export) -> Path:
    """A GPT-2 (tied head) on the same stage-2 data."""
    return tokenizer_export("gguf-bpe-gpt2", bpe_tokenizer, "model.arch=gpt2", "model.tie_word_embeddings=true",
                            data="gguf-bpe")


@pytest.fixture(scope="module")
def byte_level_llama(corpus_dir: Path, tokenizer_export, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama 3-shaped base (a user's own: byte-level BPE, llama.cpp's "gpt2" vocabulary, that adds BOS),
    continued for one step on the corpus stage 2 encoded with its tokenizer, and exported."""
    from transformers import AutoTokenizer, LlamaConfig

    folder = byte_level_bpe(corpus_texts(corpus_dir), tmp_path_factory.mktemp("base") / "byte-level", adds_bos=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=HEADS * HEAD_DIM, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=256, initializer_range=0.3, tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    random_model(config, folder, tokenizer=tokenizer)
    return tokenizer_export("gguf-byte-level", folder, base=folder)


@pytest.fixture(scope="module")
def moe_bias(tiny_export) -> Path:
    """A mixture of experts balanced by a selection bias (model.moe_balance bias: Ernie 4.5's class), on the
    workspace's unigram tokenizer."""
    name, overrides = MOE_BIAS_EXPORT
    return tiny_export(name, *overrides, head_dim=MOE_BIAS_HEAD_DIM)


def write(workspace: Path, model: Path, outtype: str) -> Path:
    """`gptpipe gguf` on ``model``; the .gguf path."""
    assert main(["gguf", "--config", str(workspace / "convert_config.yaml"), "--model", str(model),
                 "--outtype", outtype]) == 0
    return model.with_name(f"{model.name}-gguf-{outtype}") / f"{model.name}-{outtype}.gguf"


def field(reader: object, key: str) -> object:
    value = reader.fields[key]
    if len(value.types) > 1:  # an array
        return [value.contents(i) for i in range(len(value.data))]
    return value.contents()


def test_unigram_vocabulary_and_f16_tensors(unigram_llama: Path, workspace: Path) -> None:
    from gguf import GGUFReader, TokenType, dequantize

    path = write(workspace, unigram_llama, "f16")
    reader = GGUFReader(path)
    state = json.loads((unigram_llama / "tokenizer.json").read_text(encoding="utf-8"))
    pieces = [piece for piece, _ in state["model"]["vocab"]]
    config = json.loads((unigram_llama / "config.json").read_text())
    tokenizer_config = json.loads((unigram_llama / "tokenizer_config.json").read_text())

    assert field(reader, "general.architecture") == "llama"
    assert field(reader, "tokenizer.ggml.model") == "t5"  # llama.cpp's UGM vocabulary
    assert field(reader, "tokenizer.ggml.add_space_prefix") is False
    assert field(reader, "tokenizer.ggml.add_bos_token") is False
    assert field(reader, "tokenizer.ggml.tokens") == pieces
    for key, name in (("bos", "bos"), ("eos", "eos"), ("padding", "pad")):
        assert field(reader, f"tokenizer.ggml.{key}_token_id") == config[f"{name}_token_id"]
    assert "tokenizer.ggml.eot_token_id" not in reader.fields  # generation_config.json stops at EOS alone
    assert pieces[field(reader, "tokenizer.ggml.unknown_token_id")] == tokenizer_config["unk_token"]
    types = field(reader, "tokenizer.ggml.token_type")
    scores = field(reader, "tokenizer.ggml.scores")
    by_piece = dict(zip(pieces, types))
    assert by_piece["<unk>"] == TokenType.UNKNOWN
    assert by_piece["<s>"] == by_piece["</s>"] == by_piece["<pad>"] == TokenType.CONTROL
    assert by_piece["<0xE3>"] == TokenType.BYTE
    assert by_piece["\n"] == TokenType.USER_DEFINED
    normal = [i for i, t in enumerate(types) if t == TokenType.NORMAL]
    assert len(normal) > 1500
    assert [scores[i] for i in normal] == pytest.approx([state["model"]["vocab"][i][1] for i in normal])
    # llama.cpp's penalty for an unknown character follows the lowest normal score: the trained pieces' range.
    assert min(scores[i] for i in normal) > -100

    weights = load_file(unigram_llama / "model.safetensors")
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == len(weights)
    embedding = tensors["token_embd.weight"]
    assert embedding.tensor_type.name == "F16" and tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"
    np.testing.assert_allclose(embedding.data.astype(np.float32), weights["model.embed_tokens.weight"], rtol=1e-3,
                               atol=1e-6)
    np.testing.assert_array_equal(tensors["output_norm.weight"].data, weights["model.norm.weight"])
    # llama.cpp rotates adjacent rows (2j, 2j+1) of a head; HF rotates row j with row j + head_dim/2.
    for name, heads in (("q_proj", HEADS), ("k_proj", KV_HEADS)):
        hf = weights[f"model.layers.1.self_attn.{name}.weight"].reshape(heads, HEAD_DIM, -1)
        got = dequantize(tensors[f"blk.1.attn_{name[0]}.weight"].data, embedding.tensor_type).reshape(
            heads, HEAD_DIM, -1)
        half = HEAD_DIM // 2
        np.testing.assert_allclose(got[:, 0::2], hf[:, :half], rtol=1e-3, atol=1e-4)
        np.testing.assert_allclose(got[:, 1::2], hf[:, half:], rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(tensors["blk.1.attn_v.weight"].data.astype(np.float32),
                               weights["model.layers.1.self_attn.v_proj.weight"], rtol=1e-3, atol=1e-6)

    manifest = Manifest.read(path.parent / "manifest.json")
    assert manifest.complete and manifest.counts["vocabulary"] == "t5"
    assert set(manifest.outputs) == {path.name, "Modelfile"}
    assert (path.parent / "Modelfile").read_text().startswith(f"FROM ./{path.name}\n")


def test_rerun_is_up_to_date_and_q8_0_is_close(unigram_llama: Path, workspace: Path,
                                                 capfd: pytest.CaptureFixture) -> None:
    from gguf import GGUFReader, dequantize

    path = write(workspace, unigram_llama, "f16")
    mtime = path.stat().st_mtime_ns
    assert write(workspace, unigram_llama, "f16").stat().st_mtime_ns == mtime
    err = capfd.readouterr().err
    assert "up to date" in err
    # Said on every run, llama.cpp built or not: what a unigram GGUF does with characters no piece covers.
    assert "no byte fallback" in err and "model_type: bpe" in err

    weights = load_file(unigram_llama / "model.safetensors")
    tensor = next(t for t in GGUFReader(write(workspace, unigram_llama, "q8_0")).tensors
                  if t.name == "blk.0.ffn_down.weight")
    assert tensor.tensor_type.name == "Q8_0"
    want = weights["model.layers.0.mlp.down_proj.weight"]
    got = dequantize(tensor.data, tensor.tensor_type).reshape(want.shape)
    assert np.abs(got - want).max() < np.abs(want).max() / 100


def test_a_relative_model_path_writes_beside_it(unigram_llama: Path, workspace: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """`--model models/hf/x` as the README and demo.sh write it: the outputs are found relative to the GGUF
    folder (they were looked for under it twice over)."""
    from gguf import GGUFReader

    monkeypatch.chdir(unigram_llama.parent.parent)
    model = Path(unigram_llama.parent.name) / unigram_llama.name
    assert main(["gguf", "--config", str(workspace / "convert_config.yaml"), "--model", str(model),
                 "--outtype", "bf16"]) == 0
    out = model.with_name(f"{model.name}-gguf-bf16")
    assert json.loads((out / "manifest.json").read_text())["complete"] is True
    assert len(GGUFReader(out / f"{model.name}-bf16.gguf").tensors) > 0 and (out / "Modelfile").is_file()


def test_sentencepiece_bpe_is_the_spm_vocabulary(bpe_llama: Path, workspace: Path,
                                                 capfd: pytest.CaptureFixture) -> None:
    from gguf import GGUFReader, TokenType

    reader = GGUFReader(write(workspace, bpe_llama, "bf16"))
    assert "no byte fallback" not in capfd.readouterr().err  # llama.cpp's SPM vocabulary has it
    assert field(reader, "tokenizer.ggml.model") == "llama"
    assert field(reader, "tokenizer.ggml.add_space_prefix") is False
    types, scores = field(reader, "tokenizer.ggml.token_type"), field(reader, "tokenizer.ggml.scores")
    normal = [scores[i] for i, t in enumerate(types) if t == TokenType.NORMAL]
    assert normal == sorted(normal, reverse=True)  # merged best first, in piece order as HF's merges rank them
    assert next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight").tensor_type.name == "BF16"


# A ChatML template as Qwen's: every turn ends in <|im_end|>, a special token that is not the tokenizer's EOS.
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def chatml_export(corpus_dir: Path, chat_files: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's base whose chat template ends turns in <|im_end|> (byte-level BPE, as Qwen's), chat-tuned by stage 7
    and exported by stage 4: the run found <|im_end|> ending the answers, so the export's generation_config.json
    stops at EOS and at it."""
    from transformers import AutoTokenizer, LlamaConfig

    base = tmp_path_factory.mktemp("chatml") / "base"
    byte_level_bpe(corpus_texts(corpus_dir), base, adds_bos=False)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.add_special_tokens({"pad_token": "<|pad|>", "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=HEADS * HEAD_DIM, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    random_model(config, base, tokenizer=tokenizer)
    run, out = base.with_name("run"), base.with_name("export")
    done = gptpipe_command("finetune", *chat_args(base, chat_files, run, "train.seq_len=384", "train.train_iters=12",
                                                  "train.eval_interval=1000", "train.save_interval=1000"))
    assert done.returncode == 0, done.stderr[-3000:]
    done = gptpipe_command("convert", f"input_model_dir={run}", f"output_tokenizer_and_model_dir={out}", "dtype=fp32")
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.slow  # a chat fine-tune and its export
def test_an_end_of_turn_stop_besides_eos_is_the_ggufs_eot_token(chatml_export: Path, workspace: Path) -> None:
    from gguf import GGUFReader
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(chatml_export)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert GenerationConfig.from_pretrained(chatml_export).eos_token_id == [tokenizer.eos_token_id, end_of_turn]
    reader = GGUFReader(write(workspace, chatml_export, "f16"))
    assert field(reader, "tokenizer.ggml.eot_token_id") == end_of_turn
    assert field(reader, "tokenizer.ggml.eos_token_id") == tokenizer.eos_token_id
    assert field(reader, "tokenizer.chat_template") == CHATML


def test_unsupported_architecture_is_refused(tmp_path: Path, workspace: Path, capfd: pytest.CaptureFixture) -> None:
    from transformers import GPTNeoXConfig

    GPTNeoXConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                  intermediate_size=64).save_pretrained(tmp_path / "neox")
    assert main(["gguf", "--config", str(workspace / "convert_config.yaml"), "--model", str(tmp_path / "neox")]) == 2
    err = capfd.readouterr().err
    assert "gpt_neox" in err and "LlamaForCausalLM, GPT2LMHeadModel" in err
    assert not (tmp_path / "neox-gguf-f16").exists()


# --- llama.cpp itself ------------------------------------------------------------------------------------------
needs_llamacpp = pytest.mark.skipif(llama_cpp.LlamaCpp(Path()).missing() is not None,
                                    reason=f"{llama_cpp.LlamaCpp(Path()).missing()} (~10 min)")


def llamacpp_report(gguf_path: Path, folder: Path, texts: list[str], max_new_tokens: int = 0) -> dict:
    """agreement.py's report on llama.cpp running the GGUF of `folder`, as `gptpipe gguf` makes it."""
    return runtime_report(export_gguf.llamacpp(gguf_path, folder), folder, texts, max_new_tokens)


def heldout_texts(corpus_dir: Path) -> list[str]:
    """Man-page text as it is (spaces, newlines, digits, rare characters) in pieces of a few lines."""
    texts = []
    for document in corpus_texts(corpus_dir)[-40:]:
        lines = document.split("\n")
        texts += ["\n".join(lines[i:i + 6]) for i in range(0, min(len(lines), 60), 6)]
    return [*texts, *TRICKY_STRINGS]


@pytest.mark.llamacpp
@needs_llamacpp
@pytest.mark.parametrize("parse_special", [False, True])
def test_the_one_process_tokenizer_gives_llama_tokenizes_ids(bpe_llama: Path, corpus_dir: Path, workspace: Path,
                                                             parse_special: bool) -> None:
    """gptpipe-llama-tokenize (many texts in one process, what the checks call) gives the ids llama.cpp's own
    llama-tokenize gives for each text alone: man-page text, the tricky strings, special-token text, an empty
    text and one of newlines only."""
    gguf = write(workspace, bpe_llama, "f16")
    texts = [*heldout_texts(corpus_dir)[:20], *TRICKY_STRINGS, "</s>はEOS<s>", "", "\n\n"]
    command = [str(llama_cpp.llamacpp_tool("llama-tokenize")), "-m", str(gguf), "--stdin", "--ids", "--no-escape",
               "--log-disable", *([] if parse_special else ["--no-parse-special"])]
    alone = [json.loads(subprocess.run(command, input=text.encode(), capture_output=True, check=True)
                        .stdout.decode().strip().splitlines()[-1]) for text in texts]
    assert llama_cpp.llamacpp_ids(gguf, texts, parse_special) == alone
    assert alone[-3] != llama_cpp.llamacpp_ids(gguf, texts[-3:-2], not parse_special)[0]  # the switch matters


@pytest.mark.llamacpp
@needs_llamacpp
def test_llamacpp_reads_special_token_text_as_a_chat_tokenizer_does(bpe_llama: Path, workspace: Path,
                                                                     tmp_path: Path) -> None:
    """A chat run's tokenizer does not split special tokens ("</s>" in text is EOS, as its template writes it);
    llama.cpp then parses them too, as its chat path does, and the ids agree on the tricky strings."""
    chat_like = tmp_path / "chat-like"  # an edited export: no longer the one stage 4 verified (no manifest)
    shutil.copytree(bpe_llama, chat_like, ignore=shutil.ignore_patterns("manifest.json"))
    config_path = chat_like / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config_path.write_text(json.dumps({**config, "split_special_tokens": False}), encoding="utf-8")
    report = llamacpp_report(write(workspace, chat_like, "f16"), chat_like, list(TRICKY_STRINGS))
    assert report["ids_differing"] == 0, report["examples"]


@pytest.mark.llamacpp
@needs_llamacpp
@pytest.mark.parametrize("model", ["unigram_llama", "bpe_llama", "bpe_gpt2", "byte_level_llama"])
def test_llamacpp_tokenizes_and_generates_as_transformers(model: str, request: pytest.FixtureRequest,
                                                          corpus_dir: Path, workspace: Path) -> None:
    """The stage-1 SentencePiece tokenizers (UGM, SPM) on a Llama and (SPM) on a GPT-2, and a byte-level BPE one
    (llama.cpp's BPE vocabulary, with BOS) on a Llama. llama.cpp's greedy ids agree with the fp32 model's up to
    near-ties at every weight type's tolerance (agreement.py; these random models have many: their logits are
    large, so a rounding step moves them far)."""
    folder = request.getfixturevalue(model)
    texts = heldout_texts(corpus_dir)
    for outtype in export_gguf.OUTTYPES:
        gguf_path = write(workspace, folder, outtype)
        report = llamacpp_report(gguf_path, folder, list(PROMPTS), agreement.GREEDY_TOKENS)
        print(outtype, json.dumps(report, ensure_ascii=False))
        assert report["dtype"] == outtype and report["agrees"], report["departures"]
        assert [g["verdict"] for g in report["requests"]].count(DEPARTS) == 0
        if outtype == "q8_0":
            continue  # the tokenizer is the same in every file
        report = llamacpp_report(gguf_path, folder, texts)
        if model != "unigram_llama":  # llama.cpp's SPM vocabulary has byte fallback, its BPE one bytes
            assert report["ids_differing"] == 0, report["examples"]
        else:  # its UGM one has none: only texts with characters no piece covers may differ
            assert report["ids_differing"] == report["ids_differing_with_byte_fallback"], report["examples"]


def routing_gap(model, ids: list[int]) -> float:
    """The smallest margin, over the layers and positions of `ids`, between the last expert a token is routed to
    and the next one (Ernie 4.5's scores: softmax plus selection bias): below rounding, the choice is a coin toss."""
    import torch

    scores = []

    def record(router, _inputs, out) -> None:  # out: the router's logits, gating weights and choices
        scores.append(torch.softmax(out[0], -1) + router.moe_statics.e_score_correction_bias)

    hooks = [layer.mlp.gate.register_forward_hook(record) for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    k = model.config.moe_k
    ranked = [s.sort(-1, descending=True).values for s in scores]
    return min(float((r[:, k - 1] - r[:, k]).min()) for r in ranked)


@pytest.mark.llamacpp
@needs_llamacpp
def test_llamacpp_routes_a_bias_balanced_mixture_of_experts_as_transformers(moe_bias: Path, workspace: Path) -> None:
    """An Ernie 4.5 mixture of experts (model.moe_balance bias) in every weight type: llama.cpp departs from
    transformers' greedy tokens only at a near-tie, of the logits (agreement.py) or of transformers' own choice of
    experts for the context (the k-th and next scores within 1e-3: rounded weights pick either, and the experts'
    outputs then differ by far more than a logit near-tie; this random model, init std 0.3, has such ties in its
    third prompt). And it adds the selection bias (exp_probs_b) as transformers does: in f16 it gives the biased
    model's tokens on a prompt where the same model without the bias gives others."""
    import copy

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(moe_bias).eval()
    tokenizer = AutoTokenizer.from_pretrained(moe_bias)
    reports = {}
    for outtype in export_gguf.OUTTYPES:
        report = reports[outtype] = llamacpp_report(write(workspace, moe_bias, outtype), moe_bias, list(PROMPTS),
                                                    agreement.GREEDY_TOKENS)
        print(outtype, json.dumps(report, ensure_ascii=False))
        for entry in report["requests"]:
            assert entry["prompt_ids_equal"], entry
            if entry["verdict"] == DEPARTS:
                context = tokenizer(entry["prompt"])["input_ids"] + entry["transformers_tokens"][
                    :entry["first_difference"]]
                assert routing_gap(model, context) < 1e-3, entry
    unbiased = copy.deepcopy(model)
    for layer in unbiased.model.layers:
        layer.mlp.gate.moe_statics.e_score_correction_bias.data.zero_()
    followed = [entry["prompt"] for entry in reports["f16"]["requests"] if entry["tokens_equal"] and agreement.greedy(
        unbiased, tokenizer(entry["prompt"])["input_ids"]) != entry["transformers_tokens"]]
    assert followed, reports["f16"]["summary"]


@pytest.mark.llamacpp
@needs_llamacpp
def test_llamacpp_stops_at_the_end_of_turn_token(chatml_export: Path, chat_files: tuple[Path, Path],
                                                 workspace: Path) -> None:
    """llama.cpp ends a chat answer at the GGUF's end-of-turn token, where transformers stops at the export's
    generation_config.json; and the agreement check says when a GGUF goes on where the model stops."""
    from transformers import AutoTokenizer

    from gptpipe.data.jsonl import Reasons
    from gptpipe.finetune.chat_data import read_conversations

    tokenizer = AutoTokenizer.from_pretrained(chatml_export)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    gguf_path, reference = write(workspace, chatml_export, "f16"), agreement.reference_model(chatml_export)
    ended = []
    for row in read_conversations(chat_files[1], Reasons()):
        prompt = agreement.prompt_ids(tokenizer, row.prompt)
        answer = llama_cpp.llamacpp_greedy(gguf_path, prompt, ANSWER_TOKENS)
        [verdict] = agreement.check(reference, [prompt], [answer], "f16", ANSWER_TOKENS)
        assert verdict.kind != DEPARTS, verdict.describe(tokenizer)
        if answer[-1] == end_of_turn:
            ended.append((prompt, answer))
    print(f"{len(ended)} answers ended at <|im_end|>")
    assert ended
    prompt, answer = ended[0]
    [verdict] = agreement.check(reference, [prompt], [[*answer, answer[0]]], "f16", ANSWER_TOKENS)
    assert verdict.kind == DEPARTS and "goes on after the stop token" in verdict.describe(tokenizer)


@pytest.mark.llamacpp
@needs_llamacpp
def test_a_gguf_whose_greedy_tokens_depart_fails(unigram_llama: Path, workspace: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture) -> None:
    """The file `gptpipe gguf` writes, its output matrix then negated in place (llama.cpp now picks the model's
    worst token first; the writer itself is the real one): the command fails, naming the prompt and the token,
    and its manifest says so rather than vouching for the file; a rerun redoes it."""
    from gguf import GGUFReader

    folder = tmp_path / "model"
    shutil.copytree(unigram_llama, folder)
    written = export_gguf.write_gguf

    def write_then_negate(*args: object) -> dict:
        counts = written(*args)
        reader = GGUFReader(args[1], "r+")
        output = next(t for t in reader.tensors if t.name == "output.weight")
        output.data[...] = -output.data
        reader.data.flush()
        return counts

    monkeypatch.setattr(export_gguf, "write_gguf", write_then_negate)
    argv = ["gguf", "--config", str(workspace / "convert_config.yaml"), "--model", str(folder)]
    assert main(argv) == EXIT_FAILED
    manifest = Manifest.read(folder.with_name("model-gguf-f16") / "manifest.json")
    check = manifest.counts["llamacpp_check"]
    assert manifest.counts["verified"] is False and check["agrees"] is False
    assert check["requests"][0]["verdict"] == DEPARTS and check["requests"][0]["first_difference"] == 0
    prompt = manifest.config["test_prompt_text"]
    assert len(manifest.counts["failures"]) == 1 and repr(prompt) in manifest.counts["failures"][0]
    err = capfd.readouterr().err
    assert "verified: false" in err and f"on {prompt!r}: new token 1 (" in err and "below the best logit" in err

    monkeypatch.undo()  # the writer alone: the file is redone although nothing changed, and agrees
    assert main(argv) == 0
    assert Manifest.read(folder.with_name("model-gguf-f16") / "manifest.json").counts["verified"] is True
    assert "up to date" not in capfd.readouterr().err


@pytest.mark.llamacpp
@needs_llamacpp
def test_the_default_tokenizers_gguf_reads_held_out_man_pages_as_transformers(
        shipped_tokenizer: Path, corpus_dir: Path, workspace: Path, tokenizer_export) -> None:
    """Issue 29's target: with stage 1's defaults (32k unigram, character_coverage 0.9999, character_sets auto:
    ja) llama.cpp reads >= 99% of 300-character passages of stage 1's held-out documents as transformers does
    (800 of 800 in docs/benchmarks.md; 98.4% before the character sets)."""
    import tempfile

    from gptpipe.config.core import load_config
    from gptpipe.tokenizer.config import TokenizerConfig
    from gptpipe.tokenizer.sample import sample_corpus, scan_corpus

    config = load_config(TokenizerConfig, workspace / SHIPPED_STAGE1)
    corpus = list(read_corpus(corpus_dir).files)  # stage 1's input: the files stage 0's manifest lists
    with tempfile.TemporaryDirectory() as tmp:  # the documents stage 1 held out (they depend on the seed only)
        held_out = sample_corpus(corpus, scan_corpus(corpus), Path(tmp) / "sample.txt", 1000,
                                 config.max_sentence_length, config.heldout_documents, config.seed).heldout
    folder = tokenizer_export("gguf-shipped", shipped_tokenizer)
    texts = export_gguf.passages(held_out)
    report = llamacpp_report(write(workspace, folder, "f16"), folder, texts)
    total = len(report["requests"])
    print(f"{total - report['ids_differing']} of {total} held-out passages exact")
    assert total == export_gguf.HELDOUT_PASSAGES
    assert report["ids_differing"] <= 0.01 * total, report["examples"]


@pytest.mark.llamacpp
@needs_llamacpp
def test_the_gguf_check_reads_held_out_text_of_the_run(unigram_llama: Path, workspace: Path,
                                                      capfd: pytest.CaptureFixture) -> None:
    """`gptpipe gguf` checks llama.cpp on 300-character passages of the run's own validation/test documents, not
    only on fixed strings, and prints the share it reads as transformers does. With the default stage-1 tokenizer
    (a unigram model: llama.cpp's UGM tokenizer has no byte fallback) only passages holding a character written as
    UTF-8 bytes may differ, and they are few (the tests' 4k vocabulary is too small for the ja character set:
    1-2% on held-out man pages, 0% with the default 32k, above)."""
    folder = workspace / "default-tokenizer-export"  # a stage-3 run's export on the workspace's data
    shutil.copytree(unigram_llama, folder, dirs_exist_ok=True)
    gguf_path = write(workspace, folder, "f16")
    held_out = Manifest.read(gguf_path.parent / "manifest.json").counts["llamacpp_heldout"]
    total = len(held_out["requests"])
    assert "validation/test documents" in held_out["source"] and total >= 100, held_out
    assert held_out["ids_differing"] == held_out["ids_differing_with_byte_fallback"], held_out["examples"]
    assert held_out["ids_differing"] <= 0.05 * total, held_out["examples"]
    assert "passages of 300 characters" in capfd.readouterr().out
