"""Stage 1 on the real Japanese man-page corpus: SentencePiece training, the HF export and its verification.

The shipped 32k unigram tokenizer comes from the session fixture ``shipped_tokenizer``; extra trainings use a
small sample (input_sentence_size) and mostly BPE, which trains in seconds, to keep this file quick.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import sentencepiece as spm
from transformers import AutoTokenizer

from conftest import SHIPPED_STAGE1, SHIPPED_TOKENIZER
from conftest import train_small_tokenizer as train
from conftest import corpus_texts as documents
from gptpipe.artifacts import read_corpus
from conftest import manifest_counts as counts
from gptpipe.cli import main
from gptpipe.config.core import ConfigError, load_config
from gptpipe.stage import Manifest, StageInputError, file_fingerprint, manifest_fingerprint
from gptpipe.tokenizer import charsets, hf
from gptpipe.tokenizer.config import TokenizerConfig
from gptpipe.artifacts import TOKENIZE, read_tokenizer
from gptpipe.tokenizer.morpheme import DELIMITER
from gptpipe.tokenizer.sample import cut_utf8, sample_corpus, scan_corpus
from gptpipe.tokenizer.build import expected_sample_share

def assert_identical_ids(folder: Path, texts: list[str]) -> None:
    """HF (as users load it) gives SentencePiece's ids on every text, and both decode back to the text."""
    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    tok = AutoTokenizer.from_pretrained(folder / "hf")
    expected = sp.encode(texts)
    got = tok(texts).input_ids
    differing = [i for i, (a, b) in enumerate(zip(expected, got)) if a != b]
    assert not differing, f"{len(differing)}/{len(texts)} texts differ, first: {texts[differing[0]][:80]!r}"
    for text, ids in zip(texts, expected):
        if "▁" not in text:  # SentencePiece writes a literal "▁" back as a space
            assert sp.decode(ids) == text and tok.decode(ids) == text, text[:80]


@pytest.fixture(scope="module")
def small_bpe(corpus_dir: Path, workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "bpe"
    assert train(workspace, out, "model_type=bpe") == 0
    return out


# --- the shipped 32k unigram tokenizer ---------------------------------------------------------------

def test_hf_ids_equal_sentencepiece_on_every_document(shipped_tokenizer: Path, corpus_dir: Path) -> None:
    """Every document of the corpus (the held-out ones and all the others), not just the stage's own check."""
    assert counts(shipped_tokenizer)["heldout_documents_verified"] == SHIPPED_TOKENIZER.heldout_documents
    assert_identical_ids(shipped_tokenizer, documents(corpus_dir))


def test_tricky_strings(shipped_tokenizer: Path) -> None:
    sp = spm.SentencePieceProcessor(model_file=str(shipped_tokenizer / "tokenizer.model"))
    tok = AutoTokenizer.from_pretrained(shipped_tokenizer / "hf")
    texts = list(hf.TRICKY_STRINGS) + ["x▁y", "末尾の改行\n", "\n\n先頭の改行"]
    for text in texts:
        assert tok(text).input_ids == sp.encode(text), repr(text)
    assert_identical_ids(shipped_tokenizer, texts)
    # Characters outside the vocabulary go through byte fallback: 4 UTF-8 bytes, no <unk>.
    for rare in ("𪚥", "😀"):
        ids = sp.encode(rare)
        assert len(ids) == 4 and all(sp.is_byte(i) for i in ids), rare
    newline = counts(shipped_tokenizer)["user_defined_ids"]["\n"]
    assert sp.encode("\n\n") == [newline, newline]
    assert len(sp.encode("2024")) == 4  # split_digits
    assert sp.eos_id() not in sp.encode("</s>") and sp.bos_id() not in tok("<s>").input_ids  # text stays text
    assert sp.decode(sp.encode("a   b\t\tc")) == "a   b\t\tc"  # whitespace runs kept


def test_manifest_ids_and_info(shipped_tokenizer: Path) -> None:
    c = counts(shipped_tokenizer)
    vocab = SHIPPED_TOKENIZER.vocab_size
    assert (c["vocab_size"], c["unk_id"], c["bos_id"], c["eos_id"], c["pad_id"]) == (vocab, 0, 1, 2, 3)
    assert c["eod_id"] == c["eos_id"] and c["eod_piece"] == "</s>"
    assert list(c["user_defined_ids"]) == ["<CLS>", "<SEP>", "<EOD>", "<MASK>", "\n"]
    assert c["chars_per_token"] > 2.0 and c["heldout_tokens"] > 0
    assert c["training_lines_sampled"] == c["corpus_lines"]  # the man pages are below input_sentence_size
    info = read_tokenizer(shipped_tokenizer)
    assert (info.vocab_size, info.eod_id, info.pad_id) == (vocab, 2, 3) and info.model_path.is_file()
    sp = spm.SentencePieceProcessor(model_file=str(info.model_path))
    assert [sp.id_to_piece(i) for i in range(4)] == ["<unk>", "<s>", "</s>", "<pad>"]
    tok = AutoTokenizer.from_pretrained(info.hf_dir)
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2, 3)
    assert len(tok) == vocab
    special_map = json.loads((info.hf_dir / "special_tokens_map.json").read_text(encoding="utf-8"))
    assert special_map["eos_token"] == "</s>"


def test_every_common_japanese_character_has_a_piece(shipped_tokenizer: Path, corpus_dir: Path) -> None:
    """character_sets: auto gives the Japanese sample JIS X 0208's kana, symbols and level-1 kanji (and the basic
    Latin set) a piece each, those the man pages never write too; a unigram GGUF then reads them in llama.cpp,
    which has no byte fallback for unigram models (test_gguf.py reads held-out passages with it)."""
    c = counts(shipped_tokenizer)
    assert (c["character_sets"], c["required_characters"]) == (["basic", "ja"], 3689)
    assert c["script_shares"]["kana"] > 0.3 and c["script_shares"]["hangul"] == 0
    sp = spm.SentencePieceProcessor(model_file=str(shipped_tokenizer / "tokenizer.model"))
    written = set("".join(documents(corpus_dir)))
    unseen = [ch for ch in charsets.characters("ja") if ch not in written]
    assert len(unseen) > 1000  # 材, 誌, 君 ...: the man pages lack half of the level-1 kanji
    assert all(sp.piece_to_id(ch) != sp.unk_id() for ch in charsets.characters("ja") + charsets.characters("basic"))
    assert sp.encode("材料の雑誌と君", out_type=str) == list("材料の雑誌と君")


def test_auto_leaves_out_a_set_the_vocabulary_cannot_spare(tokenizer_dir: Path) -> None:
    """The tests' 4,000-piece tokenizer: the ja set's 3,489 characters exceed a quarter of it; basic's 225 fit."""
    c = counts(tokenizer_dir)
    assert (c["character_sets"], c["required_characters"]) == (["basic"], 225) and c["script_shares"]["kana"] > 0.3


def manpage_lines(language: str, count: int = 400) -> list[str]:
    """Lines of the roff sources of a language's man pages, as Debian installs them."""
    import gzip

    lines: list[str] = []
    for page in sorted(Path(f"/usr/share/man/{language}/man1").glob("*.gz"))[:20]:
        with gzip.open(page, "rt", encoding="utf-8", errors="replace") as fh:
            lines += [line for line in fh.read().splitlines() if line and not line.startswith(".")]
    if not lines:
        pytest.skip(f"no man pages in /usr/share/man/{language}")
    return lines[:count]


def test_character_sets_follow_the_scripts_of_the_sample(corpus_dir: Path) -> None:
    """auto: basic always, kana → ja (its kanji included), Hangul → ko, Han without kana → zh-hans and zh-hant,
    each only when it fits a quarter of the vocabulary; named sets are kept whatever the sample; sets come from
    Python's codecs."""
    assert [len(charsets.characters(n)) for n in charsets.SETS] == [225, 3489, 3390, 2350, 3755, 5401]
    assert "?" in charsets.characters("basic") and "“" in charsets.characters("basic")
    japanese = charsets.script_shares(documents(corpus_dir)[:50])
    assert charsets.choose(["auto"], japanese, 32000).names == ["basic", "ja"]
    left_out = charsets.choose(["auto"], japanese, 8000)
    assert left_out.names == ["basic"]
    assert "auto left out ja (3,489 characters > 25% of vocab_size 8,000" in left_out.reasons[1]
    assert charsets.choose(["auto"], charsets.script_shares(manpage_lines("ko")), 32000).names == ["basic", "ko"]
    chinese = charsets.script_shares(manpage_lines("zh_CN"))
    assert chinese["kana"] == 0 and chinese["han"] > 0.1
    assert charsets.choose(["auto"], chinese, 32000).names == ["basic", "zh-hans", "zh-hant"]
    assert charsets.choose(["auto"], chinese, 16000).names == ["basic", "zh-hans"]  # Big5's 5,401 > 4,000
    german = charsets.script_shares(manpage_lines("de"))
    assert charsets.choose(["auto"], german, 32000).names == ["basic"]
    named = charsets.choose(["ja-level2", "ja"], german, 32000)
    assert named.names == ["ja-level2", "ja"] and len(named.characters) == 3390 + 3489


def test_rerun_is_up_to_date(shipped_tokenizer: Path, workspace: Path, capfd: pytest.CaptureFixture) -> None:
    def state() -> tuple[int, str]:
        model, manifest = shipped_tokenizer / "tokenizer.model", shipped_tokenizer / "manifest.json"
        return model.stat().st_mtime_ns, manifest.read_text()

    before = state()
    assert main(["train-tokenizer", "--config", str(workspace / SHIPPED_STAGE1)]) == 0
    assert "up to date" in capfd.readouterr().err
    assert state() == before


# --- extra trainings (small sample) -----------------------------------------------------------------

def test_bpe_ids_equal_sentencepiece(small_bpe: Path, corpus_dir: Path) -> None:
    proto = hf.load_proto(small_bpe / "tokenizer.model")
    assert proto.trainer_spec.model_type == proto.trainer_spec.BPE
    assert_identical_ids(small_bpe, documents(corpus_dir)[:400] + list(hf.TRICKY_STRINGS))


def test_sample_size_force_and_changed_key(small_bpe: Path, workspace: Path, capfd: pytest.CaptureFixture) -> None:
    c = counts(small_bpe)
    assert c["training_lines_sampled"] == 20000 < c["corpus_lines"]
    assert c["training_documents"] + c["heldout_documents_verified"] == c["corpus_documents"]
    model = small_bpe / "tokenizer.model"
    stamp = model.stat().st_mtime_ns
    capfd.readouterr()
    assert train(workspace, small_bpe, "model_type=bpe") == 0
    assert "up to date" in capfd.readouterr().err and model.stat().st_mtime_ns == stamp
    assert train(workspace, small_bpe, "model_type=bpe", force=True) == 0
    assert model.stat().st_mtime_ns != stamp
    assert train(workspace, small_bpe, "model_type=bpe", "vocab_size=2500") == 0
    assert counts(small_bpe)["vocab_size"] == 2500
    assert "up to date" not in capfd.readouterr().err


def test_mismatching_export_fails_and_vouches_for_nothing(small_bpe: Path, workspace: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capfd: pytest.CaptureFixture) -> None:
    """A broken HF export (spaces not mapped to "▁") must fail the stage: no complete manifest, nothing
    published."""
    real = hf.build_tokenizer

    def without_normalizer(proto):
        tokenizer = real(proto)
        tokenizer.normalizer = None
        return tokenizer

    monkeypatch.setattr(hf, "build_tokenizer", without_normalizer)
    model = small_bpe / "tokenizer.model"
    old_model = model.read_bytes()
    capfd.readouterr()
    assert train(workspace, small_bpe, "model_type=bpe", "vocab_size=2500", force=True) == 1
    assert "does not match SentencePiece" in capfd.readouterr().err
    assert not Manifest.read(small_bpe / "manifest.json").complete
    assert model.read_bytes() == old_model  # the candidate was never published
    assert not list(small_bpe.glob(".train-*"))  # no temporary folder left behind
    with pytest.raises(StageInputError, match="not marked complete"):
        read_tokenizer(small_bpe)


def test_morpheme_mode(corpus_dir: Path, workspace: Path, tokenizer_dir: Path,
                       tmp_path_factory: pytest.TempPathFactory) -> None:
    """Trained on morpheme-split text, used on raw text: ids still identical in HF, no "▁" invented between
    Japanese morphemes, and pieces almost never span a morpheme boundary (unlike plain training)."""
    import fugashi

    out = tmp_path_factory.mktemp("tok") / "morpheme"
    assert train(workspace, out, "pretokenize=morpheme") == 0
    c = counts(out)
    assert c["pieces_crossing_morphemes"] < 0.005
    texts = documents(corpus_dir)[:200]
    assert_identical_ids(out, texts)
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    assert not any(DELIMITER in sp.id_to_piece(i) for i in range(sp.vocab_size()))
    assert not any("▁" in p for p in sp.encode("形態素解析で分割された文章を学習しました。", out_type=str))

    tagger = fugashi.Tagger()

    def crossing_share(model: Path) -> float:
        """Share of pieces that start inside one morpheme (fugashi, used directly) and end in another."""
        processor = spm.SentencePieceProcessor(model_file=str(model))
        crossing = total = 0
        for text in texts:
            for line in text.split("\n")[:50]:
                ends, pos = set(), 0
                for word in tagger(line):
                    pos = line.find(word.surface, pos) + len(word.surface)
                    ends.add(pos)
                start = 0
                for piece in processor.encode(line, out_type=str):
                    if piece.startswith("<0x"):  # byte fallback: a character starts at each non-continuation byte
                        length = 0 if 0x80 <= int(piece[3:5], 16) < 0xC0 else 1
                    else:
                        length = len(piece)
                    crossing += any(start < e < start + length for e in ends)
                    total += 1
                    start += length
        return crossing / total

    morpheme_share = crossing_share(out / "tokenizer.model")
    plain_share = crossing_share(tokenizer_dir / "tokenizer.model")
    assert morpheme_share < 0.005 and plain_share > 20 * morpheme_share, (morpheme_share, plain_share)


# --- inputs and config ------------------------------------------------------------------------------

def test_missing_input_is_a_clear_error(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    config = tmp_path / "sentence_piece_config.yaml"
    config.write_text("input: nowhere/corpus.jsonl\noutput_dir: tok\n", encoding="utf-8")
    assert main(["train-tokenizer", "--config", str(config)]) == 2
    err = capfd.readouterr().err
    assert f"input: {tmp_path / 'nowhere' / 'corpus.jsonl'} not found" in err and "0_prepare_corpus.py" in err
    assert not (tmp_path / "tok").exists()


def test_config_rejects_reserved_symbols_and_tiny_vocab() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(TokenizerConfig, None, ["user_defined_symbols=[<s>, <EOD>]", "vocab_size=200"])
    message = str(err.value)
    assert "<s> already have fixed ids" in message and "vocab_size" in message and "byte-fallback" in message


def test_config_rejects_unknown_and_oversized_character_sets() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(TokenizerConfig, None, ["character_sets=[ja, kanji]"])
    assert "character_sets: unknown kanji; known: auto, basic, ja, ja-level2, ko, zh-hans, zh-hant" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(TokenizerConfig, None, ["character_sets=[ja, ja-level2]", "vocab_size=8000"])
    assert "6,879 characters need more than half of vocab_size 8,000" in str(err.value)


def test_sample_holds_out_documents_and_cuts_long_lines(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    docs = ["\n".join(f"doc{d} line{j}" for j in range(10)) for d in range(30)]
    docs[7] += "\n" + "長" * 1000  # 3,000 bytes on one line
    corpus.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in docs), encoding="utf-8")
    out = tmp_path / "sample.txt"
    sample = sample_corpus([corpus], scan_corpus([corpus]), out, size=50, max_bytes=256, heldout_documents=5, seed=3)
    lines = out.read_text(encoding="utf-8").splitlines()
    assert sample.lines == len(lines) == 50 and len(sample.heldout) == 5 and sample.training_documents == 25
    heldout_ids = {t.split(" ")[0] for t in sample.heldout}
    assert not any(line.split(" ")[0] in heldout_ids for line in lines)
    assert all(len(line.encode("utf-8")) <= 256 for line in lines)
    # Everything fits when the sample size exceeds the corpus: every line of every training document.
    everything = sample_corpus([corpus], scan_corpus([corpus]), out, size=10_000, max_bytes=256, heldout_documents=5,
                               seed=3)
    cut = 0 if any(t.startswith("doc7 ") for t in everything.heldout) else 12  # 3,000 bytes → 12 pieces
    assert everything.lines == 25 * 10 + cut and everything.lines_cut == (cut > 0)
    pieces = cut_utf8("長" * 1000, 256)
    assert "".join(pieces) == "長" * 1000 and max(len(p.encode()) for p in pieces) == 255


def test_scan_predicts_the_sample_size(corpus_dir: Path, tmp_path: Path) -> None:
    """The RAM estimate logged before sampling rests on the scan's prediction of the sampled text: on the man
    pages (a third of their lines blank) it must match what sampling then writes, partial or whole."""
    corpus = list(read_corpus(corpus_dir).files)
    scan = scan_corpus(corpus)
    lines = [line for text in documents(corpus_dir) for line in text.split("\n") if line]
    assert scan.lines_estimate == pytest.approx(len(lines), rel=0.01)
    assert scan.text_chars_estimate == pytest.approx(sum(map(len, lines)), rel=0.01)
    for size in (20_000, 3_000_000):
        sample = sample_corpus(corpus, scan, tmp_path / "sample.txt", size=size, max_bytes=16384,
                               heldout_documents=200, seed=1)
        share = expected_sample_share(scan, size, heldout_documents=200)
        assert share * scan.text_bytes_estimate == pytest.approx(sample.bytes, rel=0.05)
        assert share * scan.text_chars_estimate == pytest.approx(sample.chars, rel=0.05)


# --- the user's own jsonl files ----------------------------------------------------------------------

def write_jsonl(path: Path, texts: list[str], extra_lines: list[bytes] = ()) -> Path:
    lines = [json.dumps({"text": t}, ensure_ascii=False).encode() for t in texts]
    path.write_bytes(b"\n".join([*lines[:10], *extra_lines, *lines[10:]]) + b"\n")
    return path


def test_trains_on_the_users_own_jsonl_counting_bad_lines_like_stages_0_and_2(
        corpus_dir: Path, workspace: Path, tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """A jsonl outside any stage-0 folder, with bad lines: skipped and counted with stage 0's and 2's names. It
    is named corpus.jsonl, like stage 0's output: the name alone does not make it one."""
    bad = [b"", b'{"text": broken', b'{"text": "\xff\xfe"}', b'{"text": "a\\ud800b"}', b'["text"]',
           b'{"body": "x"}', b'{"text": 42}', b'{"text": ""}', b'{"text": "nul\\u0000ok"}']
    (tmp_path / "own").mkdir()
    mine = write_jsonl(tmp_path / "own" / "corpus.jsonl", documents(corpus_dir)[:600], bad)
    out = tmp_path / "tok"
    assert train(workspace, out, f"input={mine}", "model_type=bpe") == 0
    c = counts(out)
    skipped = {"blank line": 1, "invalid json": 1, "undecodable utf-8": 1, "lone surrogate": 1, "not an object": 1,
               "missing key": 1, "not a string": 1, "empty": 1}
    assert c["skipped"] == skipped and c["repaired"] == {"nul stripped": 1}
    assert c["examples"]["invalid json"] == [f"{mine}:12"]
    assert c["corpus_documents"] == 609 and c["training_documents"] + c["heldout_documents_verified"] == 601
    assert "invalid json: 1 line(s) skipped" in capfd.readouterr().err
    assert Manifest.read(out / "manifest.json").inputs == {"files": {str(mine): file_fingerprint(mine)}}

    # Stages 0 and 2 on the same file count the same reasons.
    config = str(workspace / "config.yaml")
    assert main(["prepare", "--config", config, "corpus.sources.0.type=jsonl", f"corpus.sources.0.path={mine}",
                 "corpus.dedup=false", "corpus.min_chars=0", "corpus.languages=[]",  # "nulok" has no language
                 f"corpus.output_dir={tmp_path / 'c0'}"]) == 0
    prepared = Manifest.read(tmp_path / "c0" / "manifest.json").counts
    assert prepared["dropped"] == skipped and prepared["notes"] == {"nul stripped": 1}
    assert main(["tokenize", "--config", config, f"tokenize.input=[{mine}]", f"tokenize.tokenizer_dir={out}",
                 f"tokenize.output_prefix={tmp_path / 'ids'}"]) == 0
    tokenized = TOKENIZE.require(tmp_path / "ids_text_document").counts
    assert tokenized["skipped"] == skipped and tokenized["repaired"] == {"nul stripped": 1}

    # A changed file makes the tokenizer stale.
    capfd.readouterr()
    assert train(workspace, out, f"input={mine}", "model_type=bpe") == 0
    assert "up to date" in capfd.readouterr().err
    with open(mine, "ab") as fh:
        fh.write(json.dumps({"text": "追加の文書です。"}, ensure_ascii=False).encode() + b"\n")
    assert train(workspace, out, f"input={mine}", "model_type=bpe") == 0
    assert "up to date" not in capfd.readouterr().err and counts(out)["corpus_documents"] == 610


def test_trains_on_several_files_and_glob_patterns(corpus_dir: Path, workspace: Path, tmp_path: Path,
                                                   capfd: pytest.CaptureFixture) -> None:
    texts = documents(corpus_dir)[:600]
    own = tmp_path / "own"
    own.mkdir()
    a, b = write_jsonl(own / "a.jsonl", texts[:300]), write_jsonl(own / "b.jsonl", texts[300:])
    for i, given in enumerate((f"[{b}, {a}]", str(own / "*.jsonl"))):
        out = tmp_path / f"tok{i}"
        assert train(workspace, out, f"input={given}", "model_type=bpe") == 0
        assert counts(out)["corpus_documents"] == 600
        files = list(Manifest.read(out / "manifest.json").inputs["files"])
        assert files == ([str(b), str(a)] if i == 0 else [str(a), str(b)])  # patterns expand sorted

    assert train(workspace, tmp_path / "none", f"input=[{a}, {own / 'c*.jsonl'}]") == 2
    assert f"input: {own / 'c*.jsonl'} matches no file" in capfd.readouterr().err
    assert not (tmp_path / "none").exists()


def test_stage0_output_needs_its_complete_manifest(corpus_dir: Path, tokenizer_dir: Path, workspace: Path,
                                                   tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    # The shipped run trained on stage 0's output folder: its input is fingerprinted with stage 0's manifest.
    assert Manifest.read(tokenizer_dir / "manifest.json").inputs == {"files": {str(corpus_dir): {
        "size": sum(p.stat().st_size for p in read_corpus(corpus_dir).files),
        **manifest_fingerprint(corpus_dir / "manifest.json")}}}
    corpus = read_corpus(corpus_dir).files[0]  # one of its files, named on its own

    # A stage-0 rerun that failed (or was killed) leaves the folder's manifest marked incomplete: the file beside
    # it, an earlier run's output, is refused.
    copy = tmp_path / "corpus"
    copy.mkdir()
    shutil.copy2(corpus, copy / corpus.name)
    shutil.copy2(corpus_dir / "manifest.json", copy / "manifest.json")
    mine = write_jsonl(tmp_path / "mine.jsonl", documents(corpus_dir)[:20])
    assert main(["prepare", "--config", str(workspace / "config.yaml"), "corpus.sources.0.type=jsonl",
                 f"corpus.sources.0.path={mine}", "corpus.min_chars=1000000000", f"corpus.output_dir={copy}"]) == 1
    assert (copy / corpus.name).is_file() and not Manifest.read(copy / "manifest.json").complete
    assert train(workspace, tmp_path / "tok", f"input=[{mine}, {copy / corpus.name}]") == 2
    err = capfd.readouterr().err
    assert "the manifest is not marked complete" in err and "0_prepare_corpus.py" in err
    assert train(workspace, tmp_path / "tok", f"input={copy}") == 2  # the folder itself, likewise
    err = capfd.readouterr().err
    assert "the manifest is not marked complete" in err and "0_prepare_corpus.py" in err
    # An own file put into a stage-0 folder is not mistaken for its output.
    shutil.rmtree(copy)
    shutil.copytree(corpus_dir, copy)  # a complete stage-0 folder: its corpus and dropped samples, its manifest
    shutil.copy2(mine, copy / "mine.jsonl")
    assert train(workspace, tmp_path / "tok", f"input={copy / 'mine.jsonl'}") == 2
    assert "is not an output of the prepare (stage 0) run" in capfd.readouterr().err
    assert not (tmp_path / "tok").exists()
