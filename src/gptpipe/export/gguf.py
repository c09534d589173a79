"""An exported HuggingFace folder → one GGUF file for llama.cpp, Ollama and LM Studio (`gptpipe gguf`).

Written with llama.cpp's own `gguf` package, reading the folder's tokenizer.json (no tokenizer.model needed):

- vocabulary type: UGM ("t5") for a unigram SentencePiece model, SPM ("llama") for a SentencePiece BPE model
  (byte fallback, " " → "▁"), BPE ("gpt2") with the matching pre-tokenizer for a byte-level BPE model; always
  without llama.cpp's space prefix, since the HF tokenizer adds none (llama.cpp's own converter adds one and
  merges a unigram model's pieces by score: other ids, a silently different model);
- token types as SentencePiece has them: control, unknown and byte pieces, which text never matches, are
  not normal pieces (llama.cpp's UGM search uses only normal and user-defined pieces, and its penalty for an
  unknown character follows the lowest normal score); the special ids (with the end-of-turn token at which
  generation_config.json stops, when it is not EOS), whether BOS/EOS are added, and the chat template when the
  tokenizer has one;
- tensors under llama.cpp's names (the `gguf` package's own map), as each architecture's Layout writes them: a
  Llama's Q and K rows are permuted from HF's rotate-half RoPE layout to llama.cpp's interleaved pairs; an Ernie 4.5
  mixture of experts (model.moe_balance bias) has its experts stacked per layer and its router's selection bias as
  llama.cpp's exp_probs_b; 1-D tensors and a router stay float32.

llama.cpp's UGM tokenizer has no byte fallback: a character no piece covers becomes one <unk> (a run of
them, one) where the HF tokenizer writes its UTF-8 bytes. The llama.cpp check (export/runtimes/llamacpp.py,
judged by agreement.py's runtime_report) measures it; the rest of the text keeps its ids. The folder written
holds the .gguf, an Ollama Modelfile and manifest.json (stage.py).
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import numpy as np

from gptpipe.export.agreement import BYTE_PIECE, GREEDY_TOKENS, runtime_report
from gptpipe.export.runtimes.llamacpp import ARCHITECTURES, LlamaCpp
from gptpipe.export.config import ConvertConfig
from gptpipe.log import get_logger
from gptpipe.stage import (Manifest, StageFailed, StageInputError, StageResult, atomic_path, tree_fingerprint,
                           write_text_atomic)
from gptpipe.artifacts import CONVERT, EXIT_OK, GGUF

log = get_logger("gguf")

OUTTYPES = ("f16", "bf16", "q8_0")
# tokenizer.json pre-tokenizer regexes llama.cpp knows by name (its tokenizer.ggml.pre values).
GPT2_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"""
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {GPT2_REGEX: "gpt-2", LLAMA3_REGEX: "llama-bpe"}
# The llama.cpp check's held-out text: passages of this many characters (what a prompt or a served request
# looks like) from documents the model never trained on, at most this many of them.
PASSAGE_CHARS, HELDOUT_PASSAGES, HELDOUT_DOCUMENTS = 300, 200, 400


def gguf_arguments(parser: argparse.ArgumentParser) -> None:
    """`gptpipe gguf`: which folder, which weight type, where to."""
    parser.add_argument("--model", type=Path,
                        help="exported HuggingFace folder (default: output_tokenizer_and_model_dir)")
    parser.add_argument("--outtype", choices=OUTTYPES, default="f16",
                        help="weight type of the 2-D tensors (norms stay float32); q8_0 is ~half of f16")
    parser.add_argument("--output", type=Path, help="folder to write (default: <model>-gguf-<outtype>)")


@dataclass
class Vocabulary:
    """The GGUF tokenizer.ggml.* values that reproduce a folder's HF tokenizer."""

    model: str  # "t5" (UGM), "llama" (SPM) or "gpt2" (BPE)
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    pre: str | None = None
    precompiled_charsmap: bytes | None = None
    special_ids: dict[str, int] = field(default_factory=dict)  # bos, eos, unk, pad, eot
    add_bos: bool = False
    add_eos: bool = False
    chat_template: str | None = None


def read_vocabulary(folder: Path, vocab_size: int) -> Vocabulary:
    """The vocabulary of ``folder``'s tokenizer.json, padded with control tokens to the model's ``vocab_size``
    embedding rows (llama.cpp requires one token per row)."""
    import base64

    from gguf import TokenType
    from transformers import AutoTokenizer

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise StageInputError(f"{path} not found: `gptpipe gguf` reads the fast tokenizer of an exported folder")
    state = json.loads(path.read_text(encoding="utf-8"))
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = state["model"]
    pieces: dict[int, str] = {}
    scores: dict[int, float] = {}
    if model["type"] == "Unigram":
        for i, (piece, score) in enumerate(model["vocab"]):
            pieces[i], scores[i] = piece, score
    elif model["type"] == "BPE":
        pieces = {i: piece for piece, i in model["vocab"].items()}
    else:
        raise StageInputError(f"{path}: a {model['type']} tokenizer model has no GGUF vocabulary type here "
                              "(supported: Unigram, BPE)")
    added = {t["id"]: t for t in state.get("added_tokens", [])}
    pieces.update({i: t["content"] for i, t in added.items()})
    if max(pieces) >= vocab_size:
        raise StageInputError(f"{path} has token id {max(pieces)}, the model only {vocab_size} embedding rows")

    special = {name: getattr(tokenizer, f"{name}_token_id") for name in ("bos", "eos", "unk", "pad")}
    control = set(tokenizer.all_special_ids) | {i for i, t in added.items() if t["special"]}
    if model["type"] == "Unigram" and model.get("unk_id") is not None:
        # gptpipe's export gives control, unknown and byte pieces one score below any normal path: the unknown's.
        reserved = scores[model["unk_id"]]
        control |= {i for i, s in scores.items() if s == reserved}
    byte_fallback = bool(model.get("byte_fallback"))
    types, tokens, token_scores = [], [], []
    for i in range(vocab_size):
        piece = pieces.get(i)
        if piece is None:  # embedding rows past the tokenizer (a hub model's padding)
            tokens.append(f"<gptpipe_unused_{i}>")
            types.append(TokenType.CONTROL)
        else:
            tokens.append(piece)
            if i == special["unk"]:
                types.append(TokenType.UNKNOWN)
            elif byte_fallback and BYTE_PIECE.fullmatch(piece):
                types.append(TokenType.BYTE)
            elif i in control:
                types.append(TokenType.CONTROL)
            elif i in added:
                types.append(TokenType.USER_DEFINED)
            else:
                types.append(TokenType.NORMAL)
        normal = types[-1] == TokenType.NORMAL
        if model["type"] == "Unigram":
            token_scores.append(scores[i] if normal or types[-1] == TokenType.USER_DEFINED else 0.0)
        else:  # SentencePiece BPE merges the best-scored piece first: the piece order, which HF's merges follow
            token_scores.append(-float(i) if normal else 0.0)

    normalizers = _flatten(state.get("normalizer"), "normalizers")
    charsmap = next((n["precompiled_charsmap"] for n in normalizers if n["type"] == "Precompiled"), None)
    metaspace = any(n["type"] == "Replace" and n["content"] == "▁" for n in normalizers)
    prepends = any(n["type"] == "Prepend" for n in normalizers)
    pre_tokenizers = _flatten(state.get("pre_tokenizer"), "pretokenizers")
    probe = tokenizer("a").input_ids
    vocabulary = Vocabulary(
        model="", tokens=tokens, types=[int(t) for t in types], special_ids={k: v for k, v in special.items()
                                                                             if v is not None},
        add_bos=bool(probe) and probe[0] == special["bos"], add_eos=bool(probe) and probe[-1] == special["eos"],
        chat_template=tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None)
    end_of_turn = end_of_turn_id(folder, special["eos"])
    if end_of_turn is not None:
        vocabulary.special_ids["eot"] = end_of_turn
    if prepends or any(p.get("add_prefix_space") or p.get("prepend_scheme") not in (None, "never")
                       for p in pre_tokenizers):
        raise StageInputError(f"{path}: the tokenizer adds a space prefix; gptpipe's GGUF export writes tokenizers "
                              "without one (add_space_prefix false)")
    if model["type"] == "Unigram":
        if not metaspace:
            raise StageInputError(f"{path}: a Unigram model without the \" \" → \"▁\" normalizer is not a "
                                  "SentencePiece tokenizer llama.cpp's UGM vocabulary reproduces")
        vocabulary.model, vocabulary.scores = "t5", token_scores
        vocabulary.precompiled_charsmap = base64.b64decode(charsmap) if charsmap else None
    elif metaspace and byte_fallback:
        if charsmap:
            raise StageInputError(f"{path}: llama.cpp's SPM vocabulary applies no normalization rules; this "
                                  "tokenizer has some (train it with normalization: identity)")
        vocabulary.model, vocabulary.scores = "llama", token_scores
    elif [p["type"] for p in pre_tokenizers][-1:] == ["ByteLevel"]:
        vocabulary.model, vocabulary.pre = "gpt2", _byte_level_pre(pre_tokenizers, path)
        if state.get("normalizer"):
            raise StageInputError(f"{path}: a byte-level tokenizer with a normalizer has no llama.cpp "
                                  "pre-tokenizer here")
        vocabulary.merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    else:
        raise StageInputError(f"{path}: a BPE model that is neither SentencePiece-style (\"▁\" with byte fallback) "
                              "nor byte-level has no GGUF vocabulary type here")
    return vocabulary


def end_of_turn_id(folder: Path, eos: int | None) -> int | None:
    """The token besides EOS at which the folder's generation_config.json stops generating (a chat template's
    end-of-turn token), for llama.cpp to stop at too; None when EOS alone stops it."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return None
    stops = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    others = [i for i in ([stops] if isinstance(stops, int) else stops or []) if i != eos]
    if len(others) > 1:  # llama.cpp still knows the usual ones (<|eom_id|>, <|im_end|>...) by their text
        log.warning(f"{path}: generation stops at {others} besides EOS; the GGUF names {others[0]} as its "
                    f"end-of-turn token")
    return others[0] if others else None


def _flatten(node: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    if node is None:
        return []
    if node["type"] == "Sequence":
        return [leaf for child in node[key] for leaf in _flatten(child, key)]
    return [node]


def _byte_level_pre(pre_tokenizers: list[dict[str, Any]], path: Path) -> str:
    """llama.cpp's name for the regex that splits text before byte-level BPE."""
    *splits, byte_level = pre_tokenizers
    if not splits and byte_level.get("use_regex", True):
        return "gpt-2"
    if len(splits) == 1 and splits[0]["type"] == "Split" and not byte_level.get("use_regex", True):
        name = PRE_TOKENIZERS.get(splits[0]["pattern"].get("Regex", ""))
        if name:
            return name
    raise StageInputError(f"{path}: its pre-tokenizer is not one llama.cpp knows by name here "
                          f"(supported: {', '.join(PRE_TOKENIZERS.values())})")


def permute_rope_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """HF Llama's Q/K rows (per head: the first half of the dimensions pairs with the second half) in
    llama.cpp's order (per head: pairs are adjacent rows)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def hf_tensors(folder: Path) -> Iterator[tuple[str, np.ndarray]]:
    """(name, float32 array) of every tensor in the folder's safetensors files."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise StageInputError(f"no *.safetensors in {folder}")
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                yield name, handle.get_tensor(name).float().numpy()


class Layout:
    """How one HF architecture is written for llama.cpp: its hyperparameters and its tensors under llama.cpp's
    names and layout (the `gguf` package's map for `model_arch`). This base writes GPT-2's."""

    model_arch = "GPT2"  # gguf.MODEL_ARCH's member
    kept_f32: tuple[str, ...] = ()  # GGUF names of matrices written in float32 whatever the outtype

    def check(self, folder: Path, config: Any) -> None:
        """Refuse what this writer does not map (StageInputError)."""

    def layers(self, config: Any) -> int:
        return config.n_layer

    def hyperparameters(self, writer: Any, config: Any) -> None:
        writer.add_context_length(config.n_positions)
        writer.add_embedding_length(config.n_embd)
        writer.add_feed_forward_length(config.n_inner or 4 * config.n_embd)
        writer.add_block_count(config.n_layer)
        writer.add_head_count(config.n_head)
        writer.add_layer_norm_eps(config.layer_norm_epsilon)

    def arrays(self, config: Any, tensors: Iterator[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
        """(HF name, array in llama.cpp's layout) for every weight: buffers dropped."""
        for name, data in tensors:
            if name.endswith((".attn.bias", ".attn.masked_bias")):  # buffers, not weights
                continue
            if data.ndim == 2 and not name.endswith(("wte.weight", "wpe.weight", "lm_head.weight")):
                data = data.T  # GPT-2's Conv1D stores (in, out)
            yield name, data


class LlamaLayout(Layout):
    """Llama: Q and K rows permuted from HF's rotate-half RoPE to llama.cpp's interleaved pairs."""

    model_arch = "LLAMA"
    rotate_half = True  # HF's Q/K rows pair each head's first half with its second (llama.cpp pairs neighbours)

    def check(self, folder: Path, config: Any) -> None:
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise StageInputError(f"{folder / 'config.json'}: RoPE scaling {rope} is not written to GGUF here")
        if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False) or \
                getattr(config, "use_bias", False):
            raise StageInputError(f"{folder / 'config.json'}: projection biases are not written to GGUF here")

    def layers(self, config: Any) -> int:
        return config.num_hidden_layers

    def hyperparameters(self, writer: Any, config: Any) -> None:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rope = getattr(config, "rope_parameters", None) or {}
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_block_count(config.num_hidden_layers)
        writer.add_head_count(config.num_attention_heads)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
        writer.add_rope_dimension_count(head_dim)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)

    def arrays(self, config: Any, tensors: Iterator[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
        for name, data in tensors:
            if name.endswith("rotary_emb.inv_freq"):  # a buffer, not a weight
                continue
            if self.rotate_half and name.endswith("q_proj.weight"):
                data = permute_rope_rows(data, config.num_attention_heads)
            elif self.rotate_half and name.endswith("k_proj.weight"):
                data = permute_rope_rows(data, config.num_key_value_heads)
            yield name, data


class Ernie45MoeLayout(LlamaLayout):
    """Ernie 4.5's mixture of experts (what model.moe_balance bias trains): Llama's block, RoPE already on
    interleaved pairs (llama.cpp's own order), each layer's experts stacked into one tensor per projection, and the
    router's selection bias (e_score_correction_bias) as llama.cpp's exp_probs_b, which it adds for the choice of
    experts only, as transformers does."""

    model_arch = "ERNIE4_5_MOE"
    rotate_half = False
    kept_f32 = ("ffn_gate_inp.weight",)  # the router, fp32 in transformers' class too (as llama.cpp's converter)

    def check(self, folder: Path, config: Any) -> None:
        super().check(folder, config)
        if config.moe_num_shared_experts or config.moe_layer_interval != 1 or \
                config.moe_layer_end_index != config.num_hidden_layers - 1:
            raise StageInputError(f"{folder / 'config.json'}: only an Ernie 4.5 MoE without shared experts whose "
                                  "mixtures run from moe_layer_start_index to the last layer is written to GGUF here")

    def hyperparameters(self, writer: Any, config: Any) -> None:
        super().hyperparameters(writer, config)
        writer.add_expert_count(config.moe_num_experts)
        writer.add_expert_used_count(config.moe_k)
        writer.add_interleave_moe_layer_step(config.moe_layer_interval)
        writer.add_leading_dense_block_count(config.moe_layer_start_index)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_count(0)

    def arrays(self, config: Any, tensors: Iterator[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
        experts: dict[str, dict[int, np.ndarray]] = {}
        for name, data in super().arrays(config, tensors):
            match = EXPERT.match(name)
            if match:  # model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight, as save_pretrained writes them
                stack = experts.setdefault(f"{match['layer']}.mlp.experts.{match['proj']}.weight", {})
                stack[int(match["expert"])] = data
                if len(stack) == config.moe_num_experts:
                    yield match["layer"] + f".mlp.experts.{match['proj']}.weight", np.stack(
                        [stack[e] for e in range(config.moe_num_experts)])
                    del experts[f"{match['layer']}.mlp.experts.{match['proj']}.weight"]
            elif name.endswith(".e_score_correction_bias"):
                yield name.replace("e_score_correction_bias", "e_score_correction.bias"), data.reshape(-1)
            else:
                yield name, data
        if experts:
            raise StageInputError(f"experts missing from the folder's tensors: {sorted(experts)[:3]}")


EXPERT = re.compile(r"^(?P<layer>.+)\.mlp\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
# llama.cpp's architecture name (ARCHITECTURES' values) → how it is written
LAYOUTS: dict[str, Layout] = {"llama": LlamaLayout(), "gpt2": Layout(), "ernie4_5-moe": Ernie45MoeLayout()}


def model_config(folder: Path) -> tuple[str, Any]:
    """(llama.cpp architecture, transformers config) of the folder; refuses what this writer does not map."""
    from transformers import AutoConfig

    if not (folder / "config.json").is_file():
        raise StageInputError(f"{folder / 'config.json'} not found: --model must be an exported HuggingFace folder")
    config = AutoConfig.from_pretrained(str(folder))
    names = config.architectures or [config.model_type]
    arch = next((ARCHITECTURES[n] for n in names if n in ARCHITECTURES), None)
    if arch is None:
        raise StageInputError(f"{folder / 'config.json'}: architecture {names} is not supported by `gptpipe gguf` "
                              f"(supported: {', '.join(ARCHITECTURES)})")
    LAYOUTS[arch].check(folder, config)
    return arch, config


def _add_hyperparameters(writer: Any, arch: str, config: Any) -> None:
    LAYOUTS[arch].hyperparameters(writer, config)
    writer.add_vocab_size(config.vocab_size)


def _add_vocabulary(writer: Any, vocab: Vocabulary) -> None:
    writer.add_tokenizer_model(vocab.model)
    if vocab.pre:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    if vocab.merges is not None:
        writer.add_token_merges(vocab.merges)
    if vocab.precompiled_charsmap:
        writer.add_precompiled_charsmap(vocab.precompiled_charsmap)
    for name, token_id in vocab.special_ids.items():
        getattr(writer, f"add_{name}_token_id")(token_id)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(vocab.add_eos)
    writer.add_add_space_prefix(False)
    writer.add_remove_extra_whitespaces(False)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)


def gguf_tensors(arch: str, config: Any, tensors: Iterator[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array in llama.cpp's layout) for every HF tensor."""
    import gguf

    layout = LAYOUTS[arch]
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, layout.model_arch), layout.layers(config))
    for name, data in layout.arrays(config, tensors):
        new_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new_name is None:
            raise StageInputError(f"tensor {name} has no llama.cpp {arch} name")
        yield new_name, np.ascontiguousarray(data)


def write_gguf(folder: Path, path: Path, outtype: str, name: str) -> dict[str, Any]:
    """Write ``folder`` as a GGUF file at ``path`` (atomically); returns counts for the manifest."""
    import gguf

    arch, config = model_config(folder)
    vocab = read_vocabulary(folder, config.vocab_size)
    qtype = {"f16": gguf.GGMLQuantizationType.F16, "bf16": gguf.GGMLQuantizationType.BF16,
             "q8_0": gguf.GGMLQuantizationType.Q8_0}[outtype]
    file_type = {"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype]
    with atomic_path(path) as tmp:
        writer = gguf.GGUFWriter(tmp, arch=arch)
        writer.add_name(name)
        _add_hyperparameters(writer, arch, config)
        writer.add_file_type(file_type)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _add_vocabulary(writer, vocab)
        kept_f16 = 0
        tensors = 0
        for new_name, data in gguf_tensors(arch, config, hf_tensors(folder)):
            matrix = data.ndim >= 2 and not new_name.endswith(LAYOUTS[arch].kept_f32)  # experts: one 3-D tensor
            tensor_type = qtype if matrix else gguf.GGMLQuantizationType.F32
            if tensor_type == gguf.GGMLQuantizationType.Q8_0 and data.shape[-1] % 32:
                tensor_type, kept_f16 = gguf.GGMLQuantizationType.F16, kept_f16 + 1  # Q8_0 blocks are 32 wide
            writer.add_tensor(new_name, gguf.quants.quantize(data, tensor_type), raw_dtype=tensor_type)
            tensors += 1
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return {"arch": arch, "outtype": outtype, "vocabulary": vocab.model, "pre_tokenizer": vocab.pre,
            "tokens": len(vocab.tokens), "byte_pieces": vocab.types.count(gguf.TokenType.BYTE),
            "tensors": tensors, "tensors_kept_f16": kept_f16,
            "chat_template": vocab.chat_template is not None, "bytes": path.stat().st_size}


def modelfile(gguf_name: str, chat_template: bool) -> str:
    """An Ollama Modelfile for the GGUF beside it: greedy-friendly defaults, no template of Ollama's own
    (a model without a chat template continues raw text)."""
    lines = [f"FROM ./{gguf_name}"]
    if not chat_template:
        lines.append('TEMPLATE """{{ .Prompt }}"""')
    return "\n".join(lines) + "\n"


def llamacpp(gguf_path: Path, folder: Path) -> LlamaCpp:
    """llama.cpp on the GGUF written from `folder`, reading special-token text as the folder's tokenizer does."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return LlamaCpp(gguf_path, parse_special=not getattr(tokenizer, "split_special_tokens", True))


def passages(documents: list[str], count: int = HELDOUT_PASSAGES, seed: int = 0) -> list[str]:
    """`count` passages of PASSAGE_CHARS consecutive characters drawn (seeded) from the documents' cuts."""
    import random

    cut = [doc[i:i + PASSAGE_CHARS] for doc in documents for i in range(0, len(doc), PASSAGE_CHARS)]
    cut = [text for text in cut if text.strip()]
    return random.Random(seed).sample(cut, min(count, len(cut)))


def heldout_texts(model_dir: Path) -> tuple[list[str], str]:
    """(documents of the run's own data that the model never trained on, where they come from), decoded by the
    folder's tokenizer: the validation/test split of the first dataset of the stage-3 run the folder was exported
    from, as stage 4's gate takes them. ([], why not) for another folder, or where that run's files are gone."""
    from transformers import AutoTokenizer

    from gptpipe.data.split import unseen_document_ids
    from gptpipe.export.checkpoint import training_config
    from gptpipe.runtime.checkpoint import find_checkpoint

    if not CONVERT.has_manifest(model_dir):
        return [], "not a gptpipe export (no manifest.json): no held-out text of its training data"
    inputs = Manifest.read(model_dir / "manifest.json").inputs
    path = Path((inputs.get("checkpoint") or {}).get("path", ""))
    if not inputs.get("datasets"):
        return [], "it was not exported from a stage-3 run (held-out text comes from a pretraining run's data)"
    if not path.is_dir():
        return [], f"the checkpoint it was exported from ({path}) is not on this machine"
    try:
        training = training_config(find_checkpoint(path))
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        prefix = Path(training.data.prefixes[0])
        documents = unseen_document_ids(prefix, HELDOUT_DOCUMENTS, training.data.split, training.data.seed,
                                        frozenset(tokenizer.all_special_ids))
    except (StageInputError, OSError) as exc:
        return [], f"its training data cannot be read here ({exc})"
    return ([tokenizer.decode(doc) for doc in documents],
            f"{len(documents)} validation/test documents of {prefix.name}")


def run(config: ConvertConfig, args: argparse.Namespace) -> int:
    """`gptpipe gguf`: write the GGUF folder (skipped when current), check it with llama.cpp when built."""
    from gptpipe.tokenizer.hf import TRICKY_STRINGS

    model_dir = Path(args.model or config.output_tokenizer_and_model_dir)
    if not model_dir.is_dir():
        raise StageInputError(f"{model_dir} not found: export a model first (gptpipe convert) or pass --model")
    if CONVERT.has_manifest(model_dir):  # a gptpipe export: only a verified one
        CONVERT.require(model_dir)
        model_input = CONVERT.fingerprint(model_dir)
    else:
        model_input = tree_fingerprint([p for p in model_dir.iterdir() if p.is_file()])
    out = Path(args.output or model_dir.with_name(f"{model_dir.name}-gguf-{args.outtype}"))
    name = f"{model_dir.name}-{args.outtype}.gguf"
    settings = {"outtype": args.outtype, "model": str(model_dir), "test_prompt_text": config.test_prompt_text}

    def work() -> StageResult:
        counts = write_gguf(model_dir, out / name, args.outtype, model_dir.name)
        write_text_atomic(out / "Modelfile", modelfile(name, counts["chat_template"]))
        runtime = llamacpp(out / name, model_dir)
        if runtime.missing() is None:
            check = runtime_report(runtime, model_dir, [config.test_prompt_text], GREEDY_TOKENS)
            tricky = runtime_report(runtime, model_dir, list(TRICKY_STRINGS), 0)
            documents, source = heldout_texts(model_dir)
            held_out = runtime_report(runtime, model_dir, passages(documents), 0) if documents else {}
            # As stage 4's gate: the file stays for inspection, its manifest says it failed.
            counts.update(llamacpp_check=check, llamacpp_tokens=tricky, llamacpp_heldout={"source": source, **held_out},
                          verified=check["agrees"], failures=[f"llama.cpp's greedy tokens depart from the model's "
                                                              f"on {where}" for where in check["departures"]])
        return StageResult([Path(name), Path("Modelfile")], counts)  # outputs are named relative to `out`

    manifest = GGUF.run(out, settings, {"model": model_input}, work, force=args.force or failed_before(out),
                        versions=("gguf", "transformers", "tokenizers"), input_paths={"the model": model_dir})
    counts = manifest.counts
    if counts["vocabulary"] == "t5" and counts.get("byte_pieces"):
        log.warning("llama.cpp's unigram (UGM) tokenizer has no byte fallback: a character none of the pieces "
                    "covers becomes <unk> in llama.cpp, where transformers writes its UTF-8 bytes (the held-out "
                    "line below says how often). Stage 1's character_sets give a script's common characters a "
                    "piece each (auto: from 14k pieces up); for a GGUF that tokenizes every text as "
                    "transformers does, train stage 1 with model_type: bpe.")
    check, tricky = counts.get("llamacpp_check"), counts.get("llamacpp_tokens")
    if check and tricky:
        print(f"{check['summary']}; tricky strings: {tricky['ids_differing']}/{len(tricky['requests'])} tokenized "
              f"differently ({tricky['ids_differing_with_byte_fallback']} of them hold byte-fallback characters)")
        held_out = counts.get("llamacpp_heldout", {})
        if held_out.get("requests"):
            total = len(held_out["requests"])
            exact = total - held_out["ids_differing"]
            print(f"llama.cpp on held-out text of the run's data: {exact}/{total} passages of {PASSAGE_CHARS} "
                  f"characters ({exact / total:.1%}) tokenized as transformers does ({held_out['source']}; "
                  f"{held_out['ids_differing_with_byte_fallback']} of the others hold byte-fallback characters)")
        else:
            print(f"llama.cpp on held-out text: not checked: {held_out.get('source', 'rerun with --force')}")
    else:
        print("not checked with llama.cpp (build it once with scripts/build_llamacpp.sh, then rerun with --force)")
    if counts.get("failures"):
        raise StageFailed(f"{out / name} does not run as the model does in llama.cpp (its manifest says verified: "
                          f"false; rerunning redoes it):\n  - " + "\n  - ".join(counts["failures"]))
    print(f"wrote {out / name}\n"
          f"  llama.cpp: llama-cli -m {out / name} -p {config.test_prompt_text!r} -n 64 --temp 0\n"
          f"  Ollama:    cd {out} && ollama create {model_dir.name} -f Modelfile && ollama run {model_dir.name}")
    return EXIT_OK


def failed_before(out: Path) -> bool:
    """Whether the GGUF folder at ``out`` failed its llama.cpp check: it is redone even when nothing changed,
    as a stage-4 folder that failed verification is, since the fix may be in the software."""
    try:
        return bool(Manifest.read(GGUF.manifest_path(out)).counts.get("failures"))
    except (OSError, ValueError, TypeError):  # none yet, or unreadable: GGUF.run decides
        return False
