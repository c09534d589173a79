"""The SentencePiece model as a HuggingFace fast tokenizer with identical ids, and the check that proves it.

Built from the model's pieces with the `tokenizers` primitives, not transformers' converters (some ignore the
model file or turn a unigram model into BPE): the same pieces and scores (or BPE merges from the piece order),
byte fallback, user-defined pieces matched first, control/unknown/byte pieces never matched by text, " " → "▁"
with no dummy prefix, and no BOS/EOS added (``tokenizer(text).input_ids == sp.encode(text)``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sentencepiece import sentencepiece_model_pb2 as sp_pb2

from gptpipe.ids import first_difference
from gptpipe.stage import write_text_atomic

SCORE_QUANTUM = 1 / 16
Piece = sp_pb2.ModelProto.SentencePiece
HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SENTENCEPIECE_FILE = "tokenizer.model"  # the model itself, by the name transformers and llama.cpp look for
# An exported tokenizer_config.json's statement that no "▁" goes before a text (the stage trains with
# add_dummy_prefix=false). The generic class the folder names reads tokenizer.json and ignores both keys;
# transformers' LlamaTokenizer reads add_prefix_space (its default adds the prefix) and converters that build
# a tokenizer from tokenizer.model (llama.cpp's) read these keys.
NO_SPACE_PREFIX = {"add_prefix_space": False, "legacy": False}

# Strings the stage always checks besides the held-out documents: the cases where exports go wrong.
TRICKY_STRINGS = (
    "吾輩は猫である。名前はまだ無い。",
    "ls -la /usr/share/man/ja を実行すると、ファイルの一覧が表示されます。",
    "2024年1月23日 12,345.67円 0x1F 007 3.14159",
    "a  b   c    d     e",
    "    indented line",
    "trailing spaces   ",
    " ",
    "  ",
    "\tcol1\t\tcol2\t",
    "line1\nline2\n\n\nline5\n",
    "\n",
    "\r\nwindows line\r\n",
    "😀👍🏽 🇯🇵 👨‍👩‍👧 ☕",
    "𠮷野家の𩸽と龘靐齉𪚥",
    "ＡＢＣ１２３　全角　ｶﾀｶﾅ",
    "が\u3099 e\u0301 ﬁ ①",
    "<s>text</s> <pad> <unk> <EOD> <CLS> <SEP> <MASK>",
    "<0x41><0xE3> <|endoftext|>",
    "안녕하세요 你好 مرحبا Привет",
    "def f(x):\n    return x ** 2  # comment\n",
    "ああああああああああああああああああああああああああああ",
    "=" * 80,
    " " * 50 + "x",
    "\x00\x01\x7f control",
    "",
)


def round_scores(model_path: Path) -> None:
    """Round the piece scores of a trained model to multiples of :data:`SCORE_QUANTUM`, in place.

    SentencePiece sums piece scores in float32, `tokenizers` in float64, so an exact tie between two
    segmentations (e.g. "▁▁▁▁"+"▁" vs "▁"+"▁▁▁▁") was broken by rounding noise, differently on each side
    (9 of 1,785 man-page documents differed with a 32k unigram model). Both keep the first best path on an
    exact tie; multiples of 1/16 sum exactly in float32 up to 2^20, so ties stay ties (0 of 1,785 differ) and
    characters per token stay the same to 4 digits. The stage's own check remains the proof."""
    proto = load_proto(model_path)
    for piece in proto.pieces:
        if piece.type == Piece.NORMAL:
            piece.score = round(piece.score / SCORE_QUANTUM) * SCORE_QUANTUM
    model_path.write_bytes(proto.SerializeToString())


def load_proto(model_path: Path) -> Any:
    proto = sp_pb2.ModelProto()
    proto.ParseFromString(model_path.read_bytes())
    return proto


def vocab_text(proto: Any) -> str:
    """The .vocab file for people to read: piece TAB score per line, in id order, with the final scores.
    Newlines, tabs and carriage returns inside pieces are written as \\n, \\t, \\r to keep one piece a line."""
    escape = str.maketrans({"\n": "\\n", "\t": "\\t", "\r": "\\r"})
    return "".join(f"{p.piece.translate(escape)}\t{p.score:g}\n" for p in proto.pieces)


def build_tokenizer(proto: Any) -> Any:
    """A `tokenizers.Tokenizer` that encodes exactly like the SentencePiece model in ``proto``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    if norm.add_dummy_prefix or norm.remove_extra_whitespaces or trainer.treat_whitespace_as_suffix:
        raise ValueError("export supports models trained with add_dummy_prefix, remove_extra_whitespaces and "
                         "treat_whitespace_as_suffix all false (how this stage trains)")
    normal_scores = [p.score for p in proto.pieces if p.type == Piece.NORMAL]
    reserved = [p for p in proto.pieces if p.type not in (Piece.NORMAL, Piece.USER_DEFINED)]
    # Lower than any sequence of normal pieces covering the same characters: never the best path.
    never = (max(len(p.piece) for p in reserved) + 1) * min(normal_scores) - 1.0
    if trainer.model_type == sp_pb2.TrainerSpec.UNIGRAM:
        vocab = [(p.piece, p.score if p.type in (Piece.NORMAL, Piece.USER_DEFINED) else never)
                 for p in proto.pieces]
        model = models.Unigram(vocab, unk_id=trainer.unk_id, byte_fallback=trainer.byte_fallback)
    elif trainer.model_type == sp_pb2.TrainerSpec.BPE:
        ids = {p.piece: i for i, p in enumerate(proto.pieces)}
        model = models.BPE(ids, bpe_merges(proto), unk_token=trainer.unk_piece, fuse_unk=True,
                           byte_fallback=trainer.byte_fallback)
    else:
        raise ValueError(f"model type {trainer.model_type} cannot be exported")
    tokenizer = Tokenizer(model)
    steps = [normalizers.Replace(" ", "▁")]
    if norm.precompiled_charsmap:
        steps.insert(0, normalizers.Precompiled(norm.precompiled_charsmap))
    tokenizer.normalizer = normalizers.Sequence(steps)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_tokens([AddedToken(p.piece, normalized=False, special=False)
                          for p in proto.pieces if p.type == Piece.USER_DEFINED])
    return tokenizer


def bpe_merges(proto: Any) -> list[tuple[str, str]]:
    """SentencePiece BPE merges two symbols whenever their concatenation is a piece, best-scored piece
    first; as ranked merges: every split of every normal piece into two pieces, in piece order."""
    normal = [p.piece for p in proto.pieces if p.type == Piece.NORMAL]
    rank = {piece: i for i, piece in enumerate(normal)}
    merges = []
    for piece in normal:
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
        merges += sorted(((a, b) for a, b in splits if a in rank and b in rank),
                         key=lambda pair: (rank[pair[0]], rank[pair[1]]))
    return merges


def save_hf_folder(proto: Any, folder: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json for ``proto`` into ``folder``."""
    trainer = proto.trainer_spec
    folder.mkdir(parents=True, exist_ok=True)
    write_text_atomic(folder / "tokenizer.json", build_tokenizer(proto).to_str(pretty=True))
    special = {"bos_token": trainer.bos_piece, "eos_token": trainer.eos_piece,
               "unk_token": trainer.unk_piece, "pad_token": trainer.pad_piece}
    config = {
        # The generic class: any transformers version loads tokenizer.json as it is.
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": False,
        "add_eos_token": False,
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,
    }
    write_text_atomic(folder / "tokenizer_config.json", json.dumps(config, ensure_ascii=False, indent=2) + "\n")
    write_text_atomic(folder / "special_tokens_map.json", json.dumps(special, ensure_ascii=False, indent=2) + "\n")


def exported_config(hf_dir: Path) -> str:
    """tokenizer_config.json for a folder that ships the SentencePiece model beside tokenizer.json: the stage's
    own, stating that there is no space prefix."""
    config = json.loads((hf_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    return json.dumps({**config, **NO_SPACE_PREFIX}, ensure_ascii=False, indent=2) + "\n"


def load_hf(folder: Path) -> Any:
    """The folder as users load it: AutoTokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def compare(sp: Any, hf: Any, texts: list[str], round_trip: bool) -> tuple[int, list[str]]:
    """(texts where HF differs from SentencePiece, up to three described): ids, and with ``round_trip``
    also decode(encode(x)) == x on both sides. SentencePiece writes a literal "▁" back as a space, so texts
    holding one are exempt from the round trip."""
    failures, examples = 0, []
    for text in texts:
        expected = sp.encode(text)
        got = hf(text).input_ids
        problem = ""
        if got != expected:
            first = first_difference(expected, got)
            problem = f"token {first}: HF {got[first:first + 3]} vs SentencePiece {expected[first:first + 3]}"
        elif round_trip and "▁" not in text:
            if sp.decode(expected) != text:
                problem = f"SentencePiece decodes to {sp.decode(expected)[:60]!r}"
            elif hf.decode(got) != text:
                problem = f"HF decodes to {hf.decode(got)[:60]!r}"
        if problem:
            failures += 1
            if len(examples) < 3:
                examples.append(f"{text[:40]!r}: {problem}")
    return failures, examples


def check_special_ids(sp: Any, hf: Any) -> list[str]:
    """Problems with the HF tokenizer's size and special ids, compared with SentencePiece's."""
    problems = []
    if len(hf) != sp.vocab_size():
        problems.append(f"HF has {len(hf)} tokens, SentencePiece {sp.vocab_size()}")
    for name, want in (("unk", sp.unk_id()), ("bos", sp.bos_id()), ("eos", sp.eos_id()), ("pad", sp.pad_id())):
        got = getattr(hf, f"{name}_token_id")
        if got != want:
            problems.append(f"HF {name}_token_id is {got}, SentencePiece's {name} id is {want}")
    return problems
