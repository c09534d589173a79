"""Stage 1 for continued pretraining: a base model's tokenizer extended with pieces learned on the corpus.

The tokenizer extended is the one ``AutoTokenizer.from_pretrained(base)`` builds, the one stage 2 encodes
with (data/base_tokenizer.py): a BPE, byte-level as in GPT-2, Llama 3, Qwen and SmolLM, or SentencePiece-style
("▁" for spaces, UTF-8 byte pieces for unknown characters) as transformers builds Llama 2's and Gemma's, also
from a lone tokenizer.model. Its BPE is continued on the corpus: every sampled word is segmented exactly as the
base segments it (its normalizer, pre-tokenizer and model), then the most frequent pair of adjacent tokens is
merged, again and again, as BPE training does; each merge is appended after the base's with a new id after the
base's last. A BPE applies its merges in rank order, so the appended ones act only where no merge of the base
applies any more: a text keeps the base's ids wherever no new merge fits, and each new piece stands for the
base's own ids of its text (``base_ids``: what stage 3 can initialise its embedding row from). Characters the
base lacks (a SentencePiece-style base spells them in byte pieces) become pieces first, most frequent first,
so that merges can build on them; pairs with a byte piece are never merged (a byte-fallback decoder would not
decode them).

The pieces go into the model, not into ``added_tokens``: added tokens are cut out of the text before the model
sees it, longest first, whatever the merges would do around them, and llama.cpp matches them anywhere as
user-defined tokens. A Unigram model (T5-style, gptpipe's own stage-1 unigram) is refused for now: a new piece
there needs a score that competes with the base's in every segmentation.

The output: <output_dir>/hf, a folder as transformers saves the base's tokenizer class (chat template and
special tokens included) with the extended tokenizer.json; new_pieces.jsonl (each new piece's id, string, the
merge that makes it and its base ids); the manifest. Before publishing, the stage loads the folder back and
checks that AutoTokenizer builds exactly the extended pipeline, that every old id keeps its string, that the
special tokens and document boundaries are the base's, and that on every held-out document each new id stands
for the base's ids of its text; it reports characters per token there before and after.
"""

from __future__ import annotations

import argparse
import heapq
import json
import shutil
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from gptpipe.artifacts import EXTEND_TOKENIZER, PREPARE, TOKENIZER_HF_DIR, check_input_files
from gptpipe.data.base_tokenizer import (ID_PARTS, NEW_PIECES_FILE, TOKENIZER_JSON, PretrainedTokenizer, expand,
                                         read_pretrained_tokenizer)
from gptpipe.log import get_logger
from gptpipe.stage import StageFailed, StageInputError, StageResult, atomic_dir, atomic_path
from gptpipe.tokenizer.config import TokenizerConfig
from gptpipe.tokenizer.sample import sample_corpus, scan_corpus

STAGE = EXTEND_TOKENIZER.name
log = get_logger(STAGE)
# A pair or character seen once in the sample is noise, not a piece worth a row of the embedding matrix.
MIN_COUNT = 2
# The stage-1 keys an extension reads; the others (SentencePiece's) do not change its output.
USED_KEYS = ("input", "output_dir", "base_tokenizer", "new_pieces", "input_sentence_size", "max_sentence_length",
             "heldout_documents", "seed")


@dataclass(frozen=True)
class NewPiece:
    """A piece the extension added."""

    id: int
    piece: str  # its string in the vocabulary (byte-level: the bytes as GPT-2's alphabet spells them)
    parts: tuple[str, str] | None  # the merge that makes it; None for a character the base lacked
    base_ids: tuple[int, ...]  # the base's ids of its text: what it replaces wherever it occurs


@dataclass
class Learned:
    """What learning on the sample found."""

    pieces: list[NewPiece]
    words: int  # distinct words (units of the base's pre-tokenizer) in the sample
    characters: int  # of the new pieces, characters the base lacked


def _model(encoder: dict[str, Any], config_key: str) -> dict[str, Any]:
    """The BPE model of a tokenizer.json, after refusing the kinds an extension cannot keep exact."""
    model = encoder["model"]
    if model.get("type") != "BPE":
        raise StageInputError(f"{config_key}: transformers builds a {model.get('type')} tokenizer of it; only BPE "
                              f"tokenizers (byte-level or SentencePiece-style) can be extended so far")
    odd = [key for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix") if model.get(key)]
    if odd:
        raise StageInputError(f"{config_key}: its BPE sets {', '.join(odd)}; the extension keeps a tokenizer's ids "
                              f"only for BPEs without them (GPT-2, Llama, Qwen, Gemma style)")
    return model


def _tokenizer(encoder: dict[str, Any]) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(json.dumps(encoder))


def count_words(lines: Iterable[str], encoder: dict[str, Any]) -> Counter[str]:
    """The sample's words as the base's normalizer and pre-tokenizer cut them (a BPE never merges across
    them), with their counts."""
    tokenizer = _tokenizer(encoder)
    normalizer, pre_tokenizer = tokenizer.normalizer, tokenizer.pre_tokenizer
    words: Counter[str] = Counter()
    for line in lines:
        text = normalizer.normalize_str(line) if normalizer else line
        if pre_tokenizer:
            words.update(word for word, _ in pre_tokenizer.pre_tokenize_str(text))
        else:  # Gemma's: the normalizer puts in the "▁"s and the model takes the whole text
            words[text] += 1
    return words


def _segment(words: Counter[str], encoder: dict[str, Any]) -> list[list[str]]:
    model = _tokenizer(encoder).model
    return [[token.value for token in model.tokenize(word)] for word in tqdm(
        words, desc="stage 1: segmenting words as the base does", unit=" word", mininterval=1.0)]


def missing_characters(words: Counter[str], vocab: dict[str, int]) -> Counter[str]:
    """The characters of the sample the base has no piece for, with their counts."""
    counts: Counter[str] = Counter()
    for word, count in words.items():
        for char in set(word):
            if char not in vocab:
                counts[char] += count * word.count(char)
    return counts


Step = str | tuple[str, str]  # a character made a piece, or a merge


def learn_steps(words: list[list[str]], counts: list[int], taken: set[str], limit: int, barrier: set[str],
                characters: dict[str, int]) -> list[Step]:
    """BPE training continued from the base's segmentations ``words`` (modified in place): up to ``limit``
    steps, each the one that saves the most tokens of the sample. A merge saves its pair's count; it makes a
    string not in ``taken`` (a pair that would make an existing piece is never merged) of two tokens not in
    ``barrier``. A character of ``characters`` (the base lacks it; each is one symbol of ``words``) saves what
    it is given (its count times the byte pieces it replaces less one); until it is a piece, pairs with it are
    never merged, as in the extended tokenizer, which spells it in byte pieces. Ties go to the smallest pair,
    characters after pairs; a step must save at least MIN_COUNT tokens."""
    blocked = set(barrier) | set(characters)  # shrinks as characters become pieces
    pairs: Counter[tuple[str, str]] = Counter()
    where: dict[tuple[str, str], set[int]] = defaultdict(set)
    holding: dict[str, set[int]] = defaultdict(set)  # the words that hold each character not yet a piece
    fresh: set[tuple[str, str]] = set()  # pairs whose count rose: pushed after each step

    def count_word(i: int, sign: int) -> None:
        word, count = words[i], sign * counts[i]
        for pair in zip(word, word[1:]):
            if pair[0] not in blocked and pair[1] not in blocked:
                pairs[pair] += count
                if sign > 0:
                    where[pair].add(i)
                    fresh.add(pair)

    def merge(pair: tuple[str, str], merged: str) -> None:
        """Every occurrence of ``pair`` merged (left to right, as BPE does), the counts of the pairs around
        each updated (the pair itself is dropped after)."""
        first, second = pair
        for i in where.pop(pair):
            word, count = words[i], counts[i]
            out: list[str] = []
            start = j = 0
            while True:
                try:
                    j = word.index(first, j)
                except ValueError:
                    break
                if j + 1 == len(word) or word[j + 1] != second:
                    j += 1
                    continue
                out += word[start:j]
                if out and out[-1] not in blocked:  # the left neighbour as it is now (maybe merged just before)
                    left = out[-1]
                    pairs[left, first] -= count
                    pairs[left, merged] += count
                    where[left, merged].add(i)
                    fresh.add((left, merged))
                if j + 2 < len(word) and word[j + 2] not in blocked:
                    right = word[j + 2]
                    pairs[second, right] -= count
                    pairs[merged, right] += count
                    where[merged, right].add(i)
                    fresh.add((merged, right))
                out.append(merged)
                start = j = j + 2
            if start:  # else an earlier merge took every occurrence in this word
                words[i] = out + word[start:]

    for i, word in enumerate(words):
        count_word(i, 1)
        for token in blocked.intersection(word) & characters.keys():
            holding[token].add(i)
    # A max-heap of (-tokens saved, kind, key) with lazy updates: a pair's count only falls, except for pairs
    # with the newest piece, pushed when they appear; a popped entry above its pair's count is pushed again.
    heap: list[tuple[int, int, Any]] = [(-n, 0, pair) for pair, n in pairs.items()]
    heap += [(-saves, 1, char) for char, saves in characters.items()]
    heapq.heapify(heap)
    fresh.clear()
    steps: list[Step] = []
    with tqdm(total=limit, desc="stage 1: learning pieces", unit=" piece", mininterval=1.0) as bar:
        while heap and len(steps) < limit:
            negative, kind, key = heapq.heappop(heap)
            if -negative < MIN_COUNT:
                break  # the best step left saves too little: nothing worth a piece remains
            if kind == 1:
                steps.append(key)
                holders = holding.pop(key, set())
                for i in holders:  # recounted with the character's pairs, which count from now on
                    count_word(i, -1)
                blocked.discard(key)
                for i in holders:
                    count_word(i, 1)
            else:
                count = pairs.get(key, 0)
                if count < -negative:
                    if count >= MIN_COUNT:
                        heapq.heappush(heap, (-count, 0, key))
                    continue
                merged = key[0] + key[1]
                if merged in taken:
                    continue  # its string is already a piece (of the base, or new); nothing pushes it again
                taken.add(merged)
                steps.append(key)
                merge(key, merged)
                del pairs[key]
            bar.update()
            for pair in fresh:
                heapq.heappush(heap, (-pairs[pair], 0, pair))
            fresh.clear()
    return steps


def learn(encoder: dict[str, Any], lines: Iterable[str], limit: int, config_key: str) -> Learned:
    """Up to ``limit`` new pieces for the base tokenizer.json ``encoder``, learned on ``lines``."""
    model = _model(encoder, config_key)
    vocab: dict[str, int] = model["vocab"]
    taken = set(vocab) | {token["content"] for token in encoder.get("added_tokens", [])}
    next_id = max([*vocab.values(), *(token["id"] for token in encoder.get("added_tokens", []))]) + 1
    words = count_words(lines, encoder)
    base_model = _tokenizer(encoder).model
    counts = missing_characters(words, vocab)
    spelled = {c: tuple(t.id for t in base_model.tokenize(c)) for c in counts if c not in taken}
    # A character spelled in n byte pieces saves n - 1 tokens where it occurs; one the base makes <unk> saves
    # no token but gains its meaning: counted as one.
    saves = {c: counts[c] * max(1, len(ids) - 1) for c, ids in spelled.items()}
    # Segmented with every missing character as a piece: the base's own segmentation, each character's byte
    # pieces as one symbol (no merge of the base involves either).
    with_characters = {**encoder, "model": {**model, "vocab": {**vocab, **{c: next_id for c in spelled}}}}
    # Never merged: <unk>, and byte pieces where the model falls back to them (its decoder reads them alone).
    barrier = {model["unk_token"]} if model.get("unk_token") else set()
    if model.get("byte_fallback"):
        barrier |= {f"<0x{b:02X}>" for b in range(256)}
    segmented = _segment(words, with_characters)
    steps = learn_steps(segmented, list(words.values()), taken | set(spelled), limit, barrier, saves)
    base_ids: dict[str, tuple[int, ...]] = dict(spelled)
    pieces = []
    for step in steps:
        if isinstance(step, str):
            pieces.append(NewPiece(next_id + len(pieces), step, None, spelled[step]))
            continue
        merged = step[0] + step[1]
        base_ids[merged] = tuple(i for part in step for i in (base_ids[part] if part in base_ids else (vocab[part],)))
        pieces.append(NewPiece(next_id + len(pieces), merged, step, base_ids[merged]))
    return Learned(pieces, len(words), sum(p.parts is None for p in pieces))


def extended_encoder(encoder: dict[str, Any], pieces: list[NewPiece]) -> dict[str, Any]:
    """The base's tokenizer.json with the new pieces in its vocabulary and their merges after its own."""
    model = encoder["model"]
    return {**encoder, "model": {**model, "vocab": {**model["vocab"], **{p.piece: p.id for p in pieces}},
                                 "merges": [*model["merges"], *([*p.parts] for p in pieces if p.parts)]}}


def _changed_without_new_id(before: list[int], after: list[int], new: dict[int, tuple[int, ...]]) -> bool:
    """Whether ``after`` differs from ``before`` in a span holding no new id. A base that emits a whole word
    found in its vocabulary (Llama 3's ignore_merges) may spell a new piece's text in other base ids than the
    merges it was learned from, so a failed expansion is checked span by span."""
    import difflib

    if expand(after, new) == before:
        return False
    matcher = difflib.SequenceMatcher(a=before, b=after, autojunk=False)
    return any(op != "equal" and not any(i in new for i in after[j1:j2])
               for op, _, _, j1, j2 in matcher.get_opcodes())


def compare(base: Any, extended: Any, texts: list[str], new: dict[int, tuple[int, ...]]) -> dict[str, Any]:
    """Characters per token of ``texts`` before and after, which of them tokenize differently, and those that
    differ other than through new pieces (none, or the stage fails)."""
    before = base(texts, add_special_tokens=False)["input_ids"]
    after = extended(texts, add_special_tokens=False)["input_ids"]
    changed = [i for i, (b, a) in enumerate(zip(before, after)) if a != b]
    wrong = [i for i in changed if _changed_without_new_id(before[i], after[i], new)]
    characters = sum(map(len, texts))
    tokens_before, tokens_after = sum(map(len, before)), sum(map(len, after))
    return {"heldout_documents": len(texts), "heldout_characters": characters,
            "heldout_tokens_before": tokens_before, "heldout_tokens_after": tokens_after,
            "chars_per_token_before": round(characters / max(1, tokens_before), 4),
            "chars_per_token_after": round(characters / max(1, tokens_after), 4),
            "heldout_documents_changed": len(changed), "changed_other_than_by_new_pieces": wrong}


def _check_folder(base: PretrainedTokenizer, folder: Path, encoder: dict[str, Any], pieces: list[NewPiece]) -> None:
    """The written folder loads as the base's class, builds exactly ``encoder``, keeps every old id's string,
    the special tokens and the document boundaries; StageFailed naming what differs otherwise."""
    from transformers import AutoTokenizer

    loaded = read_pretrained_tokenizer(folder)
    built = json.loads(loaded.encoder)
    problems = []
    if loaded.tokenizer_class != base.tokenizer_class:
        problems.append(f"it loads as {loaded.tokenizer_class}, the base as {base.tokenizer_class}")
    changed = [part for part in ID_PARTS if built.get(part) != encoder.get(part)]
    if changed:
        problems.append(f"transformers' {loaded.tokenizer_class} builds another {', '.join(changed)} of it")
    if (loaded.bos_id, loaded.eod_id) != (base.bos_id, base.eod_id):
        problems.append(f"BOS/EOS ids {loaded.bos_id}/{loaded.eod_id}, the base's {base.bos_id}/{base.eod_id}")
    if loaded.vocab_size != base.vocab_size + len(pieces):
        problems.append(f"{loaded.vocab_size:,} ids, not {base.vocab_size:,} + {len(pieces):,}")
    old, new = AutoTokenizer.from_pretrained(str(base.folder)), AutoTokenizer.from_pretrained(str(folder))
    ids = list(range(base.vocab_size))
    moved = [i for i, a, b in zip(ids, old.convert_ids_to_tokens(ids), new.convert_ids_to_tokens(ids)) if a != b]
    if moved:
        problems.append(f"{len(moved)} old ids have another string (first: {moved[:5]})")
    if old.special_tokens_map != new.special_tokens_map or old.all_special_ids != new.all_special_ids:
        problems.append(f"special tokens {new.special_tokens_map} with ids {new.all_special_ids}, the base's "
                        f"{old.special_tokens_map} with {old.all_special_ids} (a class that adds a special token "
                        f"the base's files lack gives it the next free id, now a new piece's)")
    if [new.convert_tokens_to_ids(p.piece) for p in pieces] != [p.id for p in pieces]:
        problems.append("the new pieces do not have the ids the extension gave them")
    if problems:
        raise StageFailed(f"the extended tokenizer in {folder} is not the base's plus new pieces: "
                          + "; ".join(problems))


def _save_folder(base: PretrainedTokenizer, encoder: dict[str, Any], folder: Path) -> list[str]:
    """The base's tokenizer saved by its own class (tokenizer_config.json, chat template, special tokens) with
    the extended tokenizer.json; the files written."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(base.folder)).save_pretrained(str(folder))
    # A SentencePiece tokenizer.model lacks the new pieces: a converter reading it (llama.cpp's) would get the
    # base's ids back. tokenizer.json holds the whole tokenizer; transformers reads that.
    (folder / "tokenizer.model").unlink(missing_ok=True)
    (folder / TOKENIZER_JSON).write_text(_tokenizer(encoder).to_str(), encoding="utf-8")
    return sorted(p.name for p in folder.iterdir() if p.is_file())


def _piece_row(piece: NewPiece) -> str:
    return json.dumps({"id": piece.id, "piece": piece.piece, "parts": piece.parts, "base_ids": piece.base_ids},
                      ensure_ascii=False) + "\n"


def extend_tokenizer(config: TokenizerConfig, base: PretrainedTokenizer, files: list[Path]) -> StageResult:
    """The stage's work: learn, write, check, publish."""
    from transformers import AutoTokenizer

    out = config.output_dir
    out.mkdir(parents=True, exist_ok=True)
    encoder = json.loads(base.encoder)
    timings: dict[str, float] = {}
    clock = time.time()
    with tempfile.TemporaryDirectory(prefix=".extend-", dir=out) as tmp_name:
        tmp = Path(tmp_name)
        scan = scan_corpus(files)
        sample = sample_corpus(files, scan, tmp / "sample.txt", config.input_sentence_size,
                               config.max_sentence_length, config.heldout_documents, config.seed)
        sample.reasons.report(STAGE, scan.documents)
        log.info(f"sampled {sample.lines:,} lines of {sample.training_documents:,} documents; held out "
                 f"{len(sample.heldout):,} documents")
        timings["sample_s"] = round(time.time() - clock, 3)
        clock = time.time()
        with open(tmp / "sample.txt", encoding="utf-8") as lines:
            learned = learn(encoder, (line.rstrip("\n") for line in lines), config.new_pieces, "base_tokenizer")
        if not learned.pieces:
            raise StageInputError(f"input {', '.join(map(str, files))}: no pair of the base's tokens occurs "
                                  f"{MIN_COUNT} times in the sample, so there is nothing to add")
        timings["learn_s"] = round(time.time() - clock, 3)
        clock = time.time()
        # as the `tokenizers` library writes it: what the folder, loaded back, must build
        extended = json.loads(_tokenizer(extended_encoder(encoder, learned.pieces)).to_str())
        written = _save_folder(base, extended, tmp / TOKENIZER_HF_DIR)
        _check_folder(base, tmp / TOKENIZER_HF_DIR, extended, learned.pieces)
        new = {p.id: p.base_ids for p in learned.pieces}
        report = compare(AutoTokenizer.from_pretrained(str(base.folder)),
                         AutoTokenizer.from_pretrained(str(tmp / TOKENIZER_HF_DIR)), sample.heldout, new)
        if report["changed_other_than_by_new_pieces"]:
            raise StageFailed(f"held-out documents {report['changed_other_than_by_new_pieces'][:10]} tokenize "
                              f"differently from the base where no new piece is: the extension is not exact")
        timings["check_s"] = round(time.time() - clock, 3)
        (tmp / NEW_PIECES_FILE).write_text("".join(map(_piece_row, learned.pieces)), encoding="utf-8")
        with atomic_path(out / NEW_PIECES_FILE) as dest:
            shutil.copyfile(tmp / NEW_PIECES_FILE, dest)
        with atomic_dir(out / TOKENIZER_HF_DIR) as dest:
            for name in written:
                shutil.copyfile(tmp / TOKENIZER_HF_DIR / name, dest / name)

    if len(learned.pieces) < config.new_pieces:
        log.warning(f"only {len(learned.pieces):,} of new_pieces {config.new_pieces:,} pieces: no other pair of "
                    f"tokens occurs {MIN_COUNT} times in the sample (a larger corpus or input_sentence_size gives "
                    f"more)")
    report.pop("changed_other_than_by_new_pieces")
    counts = {
        "base_tokenizer": str(base.folder), "tokenizer_class": base.tokenizer_class,
        "base_vocab_size": base.vocab_size, "vocab_size": base.vocab_size + len(learned.pieces),
        "new_pieces": len(learned.pieces), "new_characters": learned.characters,
        "new_merges": len(learned.pieces) - learned.characters, "bos_id": base.bos_id, "eod_id": base.eod_id,
        **report, "new_piece_strings": [p.piece for p in learned.pieces],
        "corpus_documents": scan.documents, "training_documents": sample.training_documents,
        "training_lines_sampled": sample.lines, "sample_words": learned.words, **sample.reasons.manifest_counts(),
    }
    log.info(f"{base.vocab_size:,} + {len(learned.pieces):,} pieces ({learned.characters:,} characters, "
             f"{counts['new_merges']:,} merges) → {out / TOKENIZER_HF_DIR}; held-out documents: "
             f"{report['chars_per_token_before']} → {report['chars_per_token_after']} characters per token; "
             f"{report['heldout_documents_changed']:,} of {report['heldout_documents']:,} tokenize differently, "
             f"all through new pieces, the other {report['heldout_documents'] - report['heldout_documents_changed']:,}"
             f" exactly as before")
    outputs = [out / NEW_PIECES_FILE] + [out / TOKENIZER_HF_DIR / name for name in written]
    return StageResult(outputs=outputs, counts=counts, timings=timings)


def run(config: TokenizerConfig, args: argparse.Namespace) -> int:
    """`gptpipe train-tokenizer` with base_tokenizer set."""
    assert config.base_tokenizer is not None  # build.run dispatches here only then
    files, fingerprints = check_input_files(config.input if isinstance(config.input, list) else [config.input],
                                            "input", PREPARE)
    if not config.base_tokenizer.is_dir():
        raise StageInputError(f"base_tokenizer: {config.base_tokenizer} is not a folder")
    base = read_pretrained_tokenizer(config.base_tokenizer, key="base_tokenizer")
    _model(json.loads(base.encoder), "base_tokenizer")  # refused before any work
    used = {key: getattr(config, key) for key in USED_KEYS}
    EXTEND_TOKENIZER.run(config.output_dir, used, {"files": fingerprints, "base_tokenizer": base.fingerprint()},
                         lambda: extend_tokenizer(config, base, files), force=args.force,
                         versions=("tokenizers", "transformers"),
                         input_paths={"base_tokenizer": config.base_tokenizer, **{f"input {f}": f for f in files}})
    return 0
