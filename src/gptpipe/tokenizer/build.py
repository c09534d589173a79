"""Stage 1: train the SentencePiece tokenizer on a bounded sample of the corpus, export and verify it.

Steps: scan the corpus (the stage-0 output or the user's own jsonl files); hold out documents and reservoir-sample
training lines (sample.py); train SentencePiece (unigram or BPE, ids unk=0 <unk>, bos=1 <s>, eos=2 </s>, pad=3
<pad>, then the user-defined symbols); round its scores (hf.py explains why); write the HF fast tokenizer; check
that HF and SentencePiece give identical ids on the held-out documents and the tricky strings (and, with identity
normalization, that decoding gives the text back). Everything is built in a temporary folder inside output_dir and
published only after the checks pass; the manifest comes last (Stage.run).

The document separator (eod) is eos "</s>", as in Megatron's SentencePiece tokenizer; "<EOD>" stays an
ordinary user-defined symbol of the original pipeline's vocabulary.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from collections.abc import Iterator

from tqdm import tqdm

from gptpipe.log import get_logger
from gptpipe.stage import StageFailed, StageInputError, StageResult, atomic_dir, atomic_path
from gptpipe.artifacts import PREPARE, TOKENIZER_HF_DIR, TRAIN_TOKENIZER, check_input_files
from gptpipe.tokenizer import charsets, hf
from gptpipe.tokenizer.config import TokenizerConfig
from gptpipe.tokenizer.morpheme import DELIMITER, MorphemeSplitter, crossing_share
from gptpipe.tokenizer.sample import CorpusScan, Sample, sample_corpus, scan_corpus

STAGE = TRAIN_TOKENIZER.name
log = get_logger(STAGE)
SPECIAL_PIECES = {"unk": (0, "<unk>"), "bos": (1, "<s>"), "eos": (2, "</s>"), "pad": (3, "<pad>")}
# the sample's first characters that estimate its script shares (charsets.script_shares)
SHARE_SAMPLE_CHARS = 16 * 2**20
EOD = "eos"  # the document separator: Megatron appends eos ("</s>") after every document
MIB = 1 << 20

# Peak RSS model, fitted with `bench/bench_tokenizer.py --calibrate` (docs/benchmarks.md): 32k unigram, 2 threads.
# The peak is SentencePiece's seed phase (suffix array and seed pieces of the whole sample), which grows with
# both the bytes and the characters of the sampled text: man-page text recombined into a 1.1 GB corpus (~2 bytes
# per character) peaked at 586 MiB for 29.6 MiB sampled, 1,778 for 98 MiB, 5,204 for 295 MiB (3M lines);
# Japanese-only lines (2.6 bytes per character) at 687 MiB and ASCII-only lines at 882 MiB for 38 MiB each.
# Least squares gives 67 MiB + 13.4 per byte + 8.0 per character (within 3 MiB of every point); the constants
# round that up (4-10% above every point) so the estimate is not low. Below ~20 MiB the process's own floor
# dominates (405 MiB for the 10.6 MiB of the man pages, 408 at character_coverage 0.9999; 627 at 0.99999 and
# 1.0). The constants were fitted at 0.9995. The corpus size does not enter.
RSS_FLOOR_MIB = 420
RSS_BASE_MIB = 100
RSS_PER_SAMPLE_BYTE = 14.0
RSS_PER_SAMPLE_CHAR = 8.5


class VerificationError(StageFailed):
    """The exported HF tokenizer does not reproduce SentencePiece: the stage fails and publishes nothing."""


def estimate_peak_mib(sample_bytes: float, sample_chars: float) -> float:
    per_sample = RSS_PER_SAMPLE_BYTE * sample_bytes + RSS_PER_SAMPLE_CHAR * sample_chars
    return max(RSS_FLOOR_MIB, RSS_BASE_MIB + per_sample / MIB)


def expected_sample_share(scan: CorpusScan, size: int, heldout_documents: int) -> float:
    """The share of the corpus's text that sampling ``size`` lines will write, from the scan alone: held-out
    documents are not sampled, and every non-empty line has the same chance to be drawn."""
    kept = 1 - min(heldout_documents, scan.documents) / max(1, scan.documents)
    return min(size, scan.lines_estimate * kept) / max(1, scan.lines_estimate)


def _log_ram_estimate(what: str, sample_bytes: float, sample_chars: float) -> float:
    from gptpipe.runtime.devices import available_host_ram

    estimate = estimate_peak_mib(sample_bytes, sample_chars)
    available = available_host_ram() / MIB
    log.info(f"{what}: {sample_bytes / MIB:,.0f} MiB of text ({sample_chars / 1e6:,.0f} M characters) to "
             f"train on; estimated peak RAM {estimate / 1024:,.1f} GiB ({available / 1024:,.1f} GiB available)")
    if estimate > available:
        log.warning("that is more than the available memory; lower input_sentence_size "
                    "(the RAM is bounded by it, not by the corpus size)")
    return estimate


def _threads(config: TokenizerConfig) -> int:
    return config.num_threads or len(os.sched_getaffinity(0))


@contextlib.contextmanager
def _elapsed_bar(desc: str) -> Iterator[None]:
    """A bar that ticks every second while a step with no progress report of its own runs."""
    done = threading.Event()
    with tqdm(desc=desc, bar_format="{desc}: {elapsed} elapsed") as bar:

        def tick() -> None:
            while not done.wait(1.0):
                bar.refresh()

        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            yield
        finally:
            done.set()
            ticker.join()


def train_sentencepiece(config: TokenizerConfig, text_path: Path, prefix: Path, required: str = "") -> None:
    """SentencePiece on the sampled lines with the original pipeline's Japanese-first settings; every character
    of `required` gets a piece (charsets.choose)."""
    import sentencepiece as spm

    spm.set_random_generator_seed(config.seed)
    ids = {f"{name}_id": i for name, (i, _) in SPECIAL_PIECES.items()}
    pieces = {f"{name}_piece": piece for name, (_, piece) in SPECIAL_PIECES.items()}
    log.info(f"training SentencePiece {config.model_type}, {config.vocab_size:,} pieces, "
             f"{_threads(config)} threads")
    try:
        with _elapsed_bar("stage 1: training SentencePiece"):
            spm.SentencePieceTrainer.train(
                input=str(text_path), model_prefix=str(prefix), model_type=config.model_type,
                vocab_size=config.vocab_size, character_coverage=config.character_coverage, required_chars=required,
                normalization_rule_name=config.normalization, byte_fallback=config.byte_fallback,
                split_digits=config.split_digits, allow_whitespace_only_pieces=config.allow_whitespace_only_pieces,
                remove_extra_whitespaces=False,  # text is kept as it is (the original's setting; exact export)
                max_sentencepiece_length=config.max_sentencepiece_length,
                user_defined_symbols=config.user_defined_symbols, **ids, **pieces,
                # No "▁" before every text: ids of a text do not depend on where it starts (HF export is exact).
                add_dummy_prefix=False,
                input_sentence_size=0, shuffle_input_sentence=False,  # the file already is the sample
                # Lines were cut to max_sentence_length bytes; morpheme marks can make them up to 4x longer.
                max_sentence_length=4 * config.max_sentence_length,
                num_threads=_threads(config),
                pretokenization_delimiter=DELIMITER if config.pretokenize == "morpheme" else "",
                minloglevel=2,  # its INFO log is hundreds of lines; errors still raise
            )
    except RuntimeError as exc:  # e.g. "Vocabulary size too high": the config does not fit this corpus
        raise StageInputError(f"SentencePiece training failed for {config.input}: {exc}") from None


def verify(model_path: Path, hf_dir: Path, heldout: list[str], identity: bool) -> dict[str, Any]:
    """SP == HF ids on held-out documents and tricky strings (and round trips with identity normalization)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_path))
    tokenizer = hf.load_hf(hf_dir)
    problems = hf.check_special_ids(sp, tokenizer)
    for name, texts in (("held-out documents", heldout), ("tricky strings", list(hf.TRICKY_STRINGS))):
        failures, examples = hf.compare(sp, tokenizer, tqdm(texts, desc=f"stage 1: checking {name}", unit=" text",
                                                          mininterval=1.0), round_trip=identity)
        if failures:
            problems.append(f"{failures}/{len(texts)} {name} differ: " + "; ".join(examples))
    if problems:
        raise VerificationError(f"the HF tokenizer in {hf_dir} does not match SentencePiece: " + " | ".join(problems))
    tokens = sum(len(ids) for ids in sp.encode(heldout))
    chars = sum(len(text) for text in heldout)
    return {"heldout_documents_verified": len(heldout), "tricky_strings_verified": len(hf.TRICKY_STRINGS),
            "heldout_characters": chars, "heldout_tokens": tokens,
            "chars_per_token": round(chars / tokens, 4) if tokens else None}


def _sampling(config: TokenizerConfig, files: list[Path], splitter: MorphemeSplitter | None,
              text_path: Path) -> tuple[CorpusScan, Sample, float]:
    scan = scan_corpus(files)
    log.info(f"{', '.join(map(str, files))}: {scan.documents:,} documents, ~{scan.lines_estimate:,} non-empty lines, "
             f"~{scan.text_bytes_estimate / MIB:,.0f} MiB of text")
    share = expected_sample_share(scan, config.input_sentence_size, config.heldout_documents)
    expected = share * scan.text_bytes_estimate
    _log_ram_estimate(f"sampling up to {config.input_sentence_size:,} lines (expected)", expected,
                      share * scan.text_chars_estimate)
    sample = sample_corpus(files, scan, text_path, config.input_sentence_size, config.max_sentence_length,
                           config.heldout_documents, config.seed, splitter.presplit if splitter else None)
    log.info(f"sampled {sample.lines:,} of {sample.lines_seen:,} lines from {sample.training_documents:,} "
             f"documents ({sample.lines_cut:,} long lines cut); held out {len(sample.heldout):,} documents")
    sample.reasons.report(STAGE, scan.documents)
    return scan, sample, expected


def choose_character_sets(config: TokenizerConfig, sample_path: Path) -> charsets.Choice:
    """The sets `character_sets` resolves to on this sample. The reservoir sample is in random order, so its
    first SHARE_SAMPLE_CHARS estimate the script shares of all of it."""
    with open(sample_path, encoding="utf-8") as fh:
        head = fh.read(SHARE_SAMPLE_CHARS).splitlines()
    shares = charsets.script_shares(head)
    chosen = charsets.choose(config.character_sets, shares, config.vocab_size)
    for reason in chosen.reasons:
        log.info(reason)
    return chosen


def train_tokenizer(config: TokenizerConfig, files: list[Path], splitter: MorphemeSplitter | None) -> StageResult:
    """The stage's work: returns its outputs and counts; raises VerificationError on any HF mismatch."""
    out = config.output_dir
    out.mkdir(parents=True, exist_ok=True)
    model_name, vocab_name = f"{config.model_prefix}.model", f"{config.model_prefix}.vocab"
    timings: dict[str, float] = {}
    clock = time.time()

    def lap(name: str) -> None:
        nonlocal clock
        timings[name] = round(time.time() - clock, 3)
        clock = time.time()

    with tempfile.TemporaryDirectory(prefix=".train-", dir=out) as tmp_name:
        tmp = Path(tmp_name)
        scan, sample, expected = _sampling(config, files, splitter, tmp / "sample.txt")
        lap("sample_s")
        estimate = _log_ram_estimate(f"sampled {sample.lines:,} lines", sample.bytes, sample.chars)
        chosen = choose_character_sets(config, tmp / "sample.txt")
        train_sentencepiece(config, tmp / "sample.txt", tmp / config.model_prefix, chosen.characters)
        lap("train_s")
        hf.round_scores(tmp / model_name)
        proto = hf.load_proto(tmp / model_name)
        (tmp / vocab_name).write_text(hf.vocab_text(proto), encoding="utf-8")
        hf.save_hf_folder(proto, tmp / TOKENIZER_HF_DIR)
        lap("export_s")
        report = verify(tmp / model_name, tmp / TOKENIZER_HF_DIR, sample.heldout, config.normalization == "identity")
        if splitter:
            import sentencepiece as spm

            crossing, pieces = crossing_share(spm.SentencePieceProcessor(model_file=str(tmp / model_name)),
                                              splitter, sample.heldout)
            report["pieces_crossing_morphemes"] = round(crossing / max(1, pieces), 5)
        lap("verify_s")
        for name in (model_name, vocab_name):
            with atomic_path(out / name) as dest:
                shutil.copyfile(tmp / name, dest)
        with atomic_dir(out / TOKENIZER_HF_DIR) as dest:
            for name in hf.HF_FILES:
                shutil.copyfile(tmp / TOKENIZER_HF_DIR / name, dest / name)

    ids = {f"{name}_id": i for name, (i, _) in SPECIAL_PIECES.items()}
    counts = {
        "vocab_size": len(proto.pieces), **ids, "eod_id": ids[f"{EOD}_id"], "eod_piece": SPECIAL_PIECES[EOD][1],
        "user_defined_ids": {p.piece: i for i, p in enumerate(proto.pieces) if p.type == hf.Piece.USER_DEFINED},
        **report,
        "character_sets": chosen.names, "required_characters": len(chosen.characters),
        "script_shares": chosen.shares,
        "corpus_documents": scan.documents, **sample.reasons.manifest_counts(),
        "training_documents": sample.training_documents,
        "corpus_lines": sample.lines_seen, "training_lines_sampled": sample.lines, "long_lines_cut": sample.lines_cut,
        "sample_mib": round(sample.bytes / MIB, 2), "expected_sample_mib": round(expected / MIB, 2),
        "estimated_peak_rss_mib": round(estimate), "peak_rss_mib": round(_peak_rss_mib()),
    }
    log.info(f"{counts['vocab_size']:,} pieces; HF ids identical to SentencePiece on "
             f"{report['heldout_documents_verified']:,} held-out documents and {report['tricky_strings_verified']} "
             f"tricky strings; {report['chars_per_token']} characters per token; "
             f"peak RSS {counts['peak_rss_mib']:,} MiB → {out}")
    files = [out / model_name, out / vocab_name] + [out / TOKENIZER_HF_DIR / name for name in hf.HF_FILES]
    return StageResult(outputs=files, counts=counts, timings=timings)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run(config: TokenizerConfig, args: argparse.Namespace) -> int:
    if config.base_tokenizer is not None:
        from gptpipe.tokenizer import extend

        return extend.run(config, args)
    files, fingerprints = check_input_files(config.input if isinstance(config.input, list) else [config.input],
                                            "input", PREPARE)
    splitter = None
    if config.pretokenize == "morpheme":
        try:
            splitter = MorphemeSplitter()
        except ImportError as exc:
            raise StageInputError(str(exc)) from None
    versions = ("sentencepiece", "tokenizers", "transformers") + (("fugashi", "unidic-lite") if splitter else ())
    TRAIN_TOKENIZER.run(config.output_dir, config, {"files": fingerprints},
                        lambda: train_tokenizer(config, files, splitter),
                        force=args.force, versions=versions, input_paths={f"input {f}": f for f in files})
    return 0
