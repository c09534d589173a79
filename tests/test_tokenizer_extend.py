"""Stage 1 extending a base model's tokenizer with pieces learned on the corpus (continued pretraining): English
base tokenizers trained here on the English man pages (no hub), a byte-level BPE (GPT-2/Llama 3 style, BOS
added) and a SentencePiece unigram tokenizer.model that transformers converts (Llama 2 style, byte fallback),
extended on the Japanese man-page corpus. Every old id keeps its string, the special tokens stay, text the new
pieces do not cover keeps the base's ids, and every difference is new pieces standing for the base's ids."""

from __future__ import annotations

import gzip
import json
import random
from collections import Counter
from pathlib import Path

import orjson
import pytest
from conftest import byte_level_bpe, corpus_texts, manifest_counts, run_cli
from test_continued_pretraining import sentencepiece_unigram

from gptpipe.artifacts import EXIT_BAD_INPUT, TOKENIZER_HF_DIR
from gptpipe.cli import main
from gptpipe.tokenizer.extend import MIN_COUNT, NEW_PIECES_FILE, expand, learn_steps

ENGLISH = Path("/usr/share/man/man1")
BASE_PAGES = 300  # English pages the bases are trained on; the next HELDOUT_PAGES are held-out English text
HELDOUT_PAGES = 40
NEW_PIECES = 600
# Seconds per extension on 2 cores: a 20,000-line sample.
QUICK = ("input_sentence_size=20000", "heldout_documents=100")


def english_pages(start: int, count: int) -> list[str]:
    pages = sorted(ENGLISH.glob("*.gz"))[start:start + count]
    if len(pages) < count:
        pytest.skip(f"fewer than {start + count} English man pages in {ENGLISH}")
    return [gzip.decompress(page.read_bytes()).decode("utf-8", "replace") for page in pages]


def extend(workspace: Path, base: Path, out: Path, *overrides: str, force: bool = False) -> int:
    argv = ["train-tokenizer", "--config", str(workspace / "sentence_piece_config.yaml"), f"base_tokenizer={base}",
            f"output_dir={out}", *QUICK, *overrides]
    return main(argv + (["--force"] if force else []))


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("extend-bases")
    english = english_pages(0, BASE_PAGES)
    return {"byte-level": byte_level_bpe(english, root / "byte-level", adds_bos=True),
            "sentencepiece": sentencepiece_unigram(english, root / "sentencepiece")}


@pytest.fixture(scope="module")
def extended(bases, corpus_dir: Path, workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each base extended by NEW_PIECES pieces on the Japanese man-page corpus → {base name: output_dir}."""
    root = tmp_path_factory.mktemp("extended")
    for name, base in bases.items():
        assert extend(workspace, base, root / name, f"new_pieces={NEW_PIECES}") == 0
    return {name: root / name for name in bases}


def tokenizers(bases, extended, name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bases[name]), AutoTokenizer.from_pretrained(extended[name] / TOKENIZER_HF_DIR)


def new_pieces(folder: Path) -> dict[int, tuple[int, ...]]:
    rows = [json.loads(line) for line in (folder / NEW_PIECES_FILE).read_text(encoding="utf-8").splitlines()]
    return {row["id"]: tuple(row["base_ids"]) for row in rows}


@pytest.mark.parametrize("name", ["byte-level", "sentencepiece"])
def test_old_ids_keep_their_strings_the_special_tokens_stay_and_the_manifest_lists_the_new(name, bases,
                                                                                           extended) -> None:
    base, ext = tokenizers(bases, extended, name)
    counts = manifest_counts(extended[name])
    size = counts["base_vocab_size"]
    assert size == len(base) and counts["vocab_size"] == len(ext) == size + NEW_PIECES == size + counts["new_pieces"]
    assert ext.convert_ids_to_tokens(list(range(size))) == base.convert_ids_to_tokens(list(range(size)))
    assert ext.special_tokens_map == base.special_tokens_map and ext.all_special_ids == base.all_special_ids
    assert type(ext) is type(base)
    assert counts["new_piece_strings"] == ext.convert_ids_to_tokens(list(range(size, size + NEW_PIECES)))
    assert sorted(new_pieces(extended[name])) == list(range(size, size + NEW_PIECES))
    sample = "東京 Tokyo"
    assert (ext(sample)["input_ids"][0] == base.bos_token_id) == (base(sample)["input_ids"][0] == base.bos_token_id)
    # the sentencepiece base lacks most kanji and kana: characters come first where they save most
    assert (counts["new_characters"] > 0) == (name == "sentencepiece")
    assert counts["chars_per_token_after"] >= 1.5 * counts["chars_per_token_before"], counts
    assert counts["heldout_documents_changed"] > 0


@pytest.mark.parametrize("name", ["byte-level", "sentencepiece"])
def test_text_the_new_pieces_do_not_cover_keeps_the_base_ids(name, bases, extended) -> None:
    """English lines held out of the base's training: where no new piece's text occurs, the ids are the base's,
    and everywhere each new id stands for the base's ids of its text."""
    base, ext = tokenizers(bases, extended, name)
    new = new_pieces(extended[name])
    # A piece's text as decoded, part of it at least (SentencePiece's decoder drops a leading space); none for the
    # byte-level pieces of part of a character
    texts = [t for t in (ext.decode([i]) for i in new) if t and "\ufffd" not in t]
    lines = [line for page in english_pages(BASE_PAGES, HELDOUT_PAGES) for line in page.split("\n") if line]
    before = base(lines, add_special_tokens=False)["input_ids"]
    after = ext(lines, add_special_tokens=False)["input_ids"]
    uncovered = [i for i, line in enumerate(lines) if not any(t in line for t in texts)]
    # The Japanese man pages hold English too, so short English pieces cover many lines (SentencePiece's decode
    # drops a piece's leading space, so its texts cover more still).
    assert len(uncovered) > len(lines) // 10, (len(uncovered), len(lines))
    assert all(after[i] == before[i] for i in uncovered)
    assert all(expand(a, new) == b for a, b in zip(after, before))
    for text in ("The quick brown fox jumps over the lazy dog.", "ls -la /usr/share/man"):
        assert ext(text)["input_ids"] == base(text)["input_ids"] or any(i in new for i in ext(text)["input_ids"])


@pytest.mark.parametrize("name", ["byte-level", "sentencepiece"])
def test_every_difference_on_japanese_lines_is_new_pieces_for_the_base_ids(name, bases, extended,
                                                                            corpus_dir: Path) -> None:
    base, ext = tokenizers(bases, extended, name)
    new = new_pieces(extended[name])
    lines = [line for text in corpus_texts(corpus_dir)[::7] for line in text.split("\n") if line]
    before = base(lines, add_special_tokens=False)["input_ids"]
    after = ext(lines, add_special_tokens=False)["input_ids"]
    changed = [i for i in range(len(lines)) if after[i] != before[i]]
    assert len(changed) > len(lines) // 2, (len(changed), len(lines))
    assert [i for i in changed if expand(after[i], new) != before[i]] == []
    assert all(any(t in new for t in after[i]) for i in changed)


def test_stage_2_encodes_with_the_extended_folder(bases, extended, corpus_dir: Path, workspace: Path,
                                                 tmp_path: Path, capfd) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    base, ext = tokenizers(bases, extended, "byte-level")
    texts = corpus_texts(corpus_dir)[:40]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(b"".join(orjson.dumps({"text": t}) + b"\n" for t in texts))
    folder = extended["byte-level"] / TOKENIZER_HF_DIR
    run_cli("tokenize", "--config", workspace / "config.yaml", f"tokenize.input=[{corpus}]",
            f"tokenize.tokenizer_dir={folder}", f"tokenize.output_prefix={tmp_path / 'ext'}", "tokenize.workers=1")
    dataset = IndexedDataset(str(tmp_path / "ext_text_document"), mmap=True)
    assert [dataset[i].tolist() for i in range(len(texts))] == [ids + [ext.eos_token_id]
                                                               for ids in ext(texts)["input_ids"]]
    assert ext(texts[0])["input_ids"][0] == base.bos_token_id
    # the stage's output_dir itself is routed to its hf/ folder: the same ids
    code = main(["tokenize", "--config", str(workspace / "config.yaml"), f"tokenize.input=[{corpus}]",
                 f"tokenize.tokenizer_dir={extended['byte-level']}", f"tokenize.output_prefix={tmp_path / 'x'}",
                 "tokenize.workers=1"])
    assert code == 0
    assert (tmp_path / "x_text_document.bin").read_bytes() == (tmp_path / "ext_text_document.bin").read_bytes()


def test_a_current_extension_is_skipped_and_a_changed_input_reruns(bases, corpus_dir: Path, workspace: Path,
                                                                  tmp_path: Path, capfd) -> None:
    import shutil

    base = shutil.copytree(bases["byte-level"], tmp_path / "base")
    out = tmp_path / "ext"
    small = ("input_sentence_size=2000", "new_pieces=50")
    assert extend(workspace, base, out, *small) == 0
    stamp = (out / "manifest.json").stat().st_mtime_ns
    capfd.readouterr()
    assert extend(workspace, base, out, *small, "vocab_size=8000") == 0  # a SentencePiece key: not used here
    assert "up to date" in capfd.readouterr().err and (out / "manifest.json").stat().st_mtime_ns == stamp
    config = json.loads((base / "tokenizer_config.json").read_text())
    (base / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 64}))
    assert extend(workspace, base, out, *small) == 0
    assert "up to date" not in capfd.readouterr().err
    assert extend(workspace, base, out, "input_sentence_size=2000", "new_pieces=60") == 0
    assert manifest_counts(out)["new_pieces"] == 60
    assert extend(workspace, base, out, "input_sentence_size=2000", "new_pieces=60", force=True) == 0
    assert "up to date" not in capfd.readouterr().err


def test_a_unigram_or_missing_base_is_refused_naming_the_key(corpus_dir: Path, workspace: Path, tmp_path: Path,
                                                             capfd) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    unigram = Tokenizer(models.Unigram([("<unk>", 0.0), ("</s>", 0.0), *((c, -2.0) for c in "abcdefgh ")], 0))
    unigram.pre_tokenizer = pre_tokenizers.Metaspace()
    PreTrainedTokenizerFast(tokenizer_object=unigram, unk_token="<unk>", eos_token="</s>").save_pretrained(
        tmp_path / "unigram")
    assert extend(workspace, tmp_path / "unigram", tmp_path / "out") == EXIT_BAD_INPUT
    assert "base_tokenizer: transformers builds a Unigram tokenizer of it" in capfd.readouterr().err
    assert extend(workspace, tmp_path / "nowhere", tmp_path / "out") == EXIT_BAD_INPUT
    assert f"base_tokenizer: {tmp_path / 'nowhere'} is not a folder" in capfd.readouterr().err
    assert not (tmp_path / "out").exists()


def plain_bpe(words: list[list[str]], counts: list[int], taken: set[str], limit: int, barrier: set[str],
              characters: dict[str, int]) -> list:
    """BPE training as the textbook has it, every pair counted again at each step: the reference."""
    words, taken, blocked, steps = [list(w) for w in words], set(taken), set(barrier) | set(characters), []
    while len(steps) < limit:
        pairs: Counter = Counter()
        for word, count in zip(words, counts):
            for pair in zip(word, word[1:]):
                if not blocked & set(pair) and pair[0] + pair[1] not in taken:
                    pairs[pair] += count
        best = min([(-n, 0, p) for p, n in pairs.items()] +
                   [(-n, 1, c) for c, n in characters.items() if c in blocked], default=None)
        if best is None or -best[0] < MIN_COUNT:
            break
        steps.append(best[2])
        if best[1] == 1:
            blocked.discard(best[2])
            continue
        first, second = best[2]
        taken.add(first + second)
        for k, word in enumerate(words):
            out, j = [], 0
            while j < len(word):
                if word[j:j + 2] == [first, second]:
                    out.append(first + second)
                    j += 2
                else:
                    out.append(word[j])
                    j += 1
            words[k] = out
    return steps


@pytest.mark.parametrize("seed", range(6))
def test_learning_is_plain_bpe_training_continued(seed: int) -> None:
    """The incremental learner makes the steps that counting every pair again at each step makes: merges over
    repeated and overlapping pairs, characters the base lacked (X, Y: no merge with them before they are pieces),
    byte pieces never merged, pairs whose string the base has never merged."""
    rng = random.Random(seed)
    words = [[rng.choice("aaabbcdXY#") for _ in range(rng.randint(1, 12))] for _ in range(300)]
    counts = [rng.randint(1, 9) for _ in words]
    args = ({"ab", "ca"}, 40, {"#"}, {"X": 30, "Y": 400})
    expected = plain_bpe(words, counts, *args)
    assert learn_steps([list(w) for w in words], counts, set(args[0]), *args[1:]) == expected
    assert "X" in expected or "Y" in expected
