"""Stage 0's decontamination on the acceptance corpus (issue 46): documents quoting an evaluation item caught,
the others left.

    PYTHONPATH=src:tests python bench/bench_corpus_decontaminate.py --out /tmp/decontaminate [--seed 0]

The documents: bench/bench_corpus_acceptance.py's corpus (the Japanese Debian manuals' sections, their near
copies, the man pages of 24 other languages, generated junk: the same packages needed). The items, written as
one .jsonl file, as exam questions and passages are: runs of 1-4 sentences of the Japanese man pages (20-300
letters) and of the English ones (8-80 words), text the acceptance corpus does not hold. The quoting
documents: for each item, a copy of a random corpus document with the item put in at a random line break,
exactly, with one character (Japanese) or word (English) substituted at a random place, re-wrapped at 20-40
columns, re-spaced (Japanese: a space every 2-4 characters; English: doubled spaces and capitals), or edited
and re-wrapped. Measured with corpus/decontaminate.py's index directly (every document, whatever the other
rules would say): the share of quoting documents caught (by the item put in) and of the corpus's own documents
overlapping an item, each of those read (does it hold a run of the item's words or letters, or is it a hash
collision?). Then stage 0 itself on the corpus plus the quoting documents, `languages: [ja]`, with and without
decontamination: its time and drops.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import yaml

from bench_corpus_acceptance import build
from gptpipe.corpus.config import DecontaminationConfig
from gptpipe.corpus.decontaminate import Index
from gptpipe.corpus.neardup import spaceless_share
from test_corpus_neardup import MAN, manpage_texts

VARIANTS = ("exact", "edited", "re-wrapped", "re-spaced", "edited + re-wrapped")
JA_SENTENCE = re.compile(r"[^。！？\n]+[。！？]")
EN_SENTENCE = re.compile(r"[^.!?\n]+[.!?](?=\s|$)")
LETTERS = re.compile(r"[\W_]+")
WORD = re.compile(r"\w+")


def candidate_items(pages: list[str], japanese: bool, rng: random.Random, count: int) -> list[str]:
    """Runs of 1-4 consecutive sentences of the pages' paragraphs, 20-300 letters (Japanese) or 8-80 words
    (English), each text once."""
    found: list[str] = []
    seen: set[str] = set()
    for page in pages:
        for paragraph in page.split("\n\n"):
            paragraph = " ".join(paragraph.split())
            sentences = (JA_SENTENCE if japanese else EN_SENTENCE).findall(paragraph)
            if not sentences:
                continue
            start = rng.randrange(len(sentences))
            item = " ".join(s.strip() for s in sentences[start:start + rng.randint(1, 4)])
            size = len(LETTERS.sub("", item)) if japanese else len(WORD.findall(item))
            if japanese and not re.search(r"[ぁ-ん]", item):
                continue
            if ((20 <= size <= 300) if japanese else (8 <= size <= 80)) and item not in seen:
                seen.add(item)
                found.append(item)
    rng.shuffle(found)
    return found[:count]


def quoted(item: str, variant: str, rng: random.Random) -> str:
    japanese = spaceless_share(item) >= 0.1
    if "edited" in variant:
        if japanese:  # a letter (not punctuation) substituted
            letters = [i for i, c in enumerate(item) if c.isalnum()]
            at = rng.choice(letters)
            item = item[:at] + rng.choice("あいうえおかきくけこ日本語文書") + item[at + 1:]
        else:
            words = item.split(" ")
            words[rng.randrange(len(words))] = rng.choice(("zebra", "banana", "quantum", "purple"))
            item = " ".join(words)
    if "re-wrapped" in variant:
        item = "\n".join(textwrap.wrap(item, rng.randint(20, 40)))
    if variant == "re-spaced":
        if japanese:  # a space after every 2-4 Japanese characters, as a PDF's text comes out
            item = re.sub(r"[^\x00-\x7f]{2,4}(?=[^\x00-\x7f])", lambda m: m.group() + " ", item)
        else:
            item = "  ".join(w.upper() if rng.random() < 0.3 else w for w in item.split())
    return item


def inserted(text: str, quote: str, rng: random.Random) -> str:
    """`quote` put into `text` at a random line break (or at an end)."""
    breaks = [0, len(text)] + [m.end() for m in re.finditer("\n", text)]
    at = rng.choice(breaks)
    return text[:at] + ("\n" if at and text[at - 1] != "\n" else "") + quote + "\n" + text[at:]


def shared_run(item: str, text: str, words: int, letters: int) -> bool:
    """Whether `text` holds a run of `words` of the item's words or `letters` of its letters (normalised), by a
    plain substring search: the check of an overlap the index found, independent of its hashing."""
    if spaceless_share(item) >= 0.1:
        units, doc = LETTERS.sub("", item.casefold()), LETTERS.sub("", text.casefold())
        return any(units[i:i + letters] in doc for i in range(len(units) - letters + 1))
    units, doc = WORD.findall(item.casefold()), " " + " ".join(WORD.findall(text.casefold())) + " "
    return any(" " + " ".join(units[i:i + words]) + " " in doc for i in range(len(units) - words + 1))


def band(item: str) -> str:
    if spaceless_share(item) >= 0.1:
        size = len(LETTERS.sub("", item))
        return "ja 20-39 letters" if size < 40 else "ja 40-79 letters" if size < 80 else "ja 80-300 letters"
    size = len(WORD.findall(item))
    return "en 8-15 words" if size < 16 else "en 16-25 words" if size < 26 else "en 26-80 words"


def stage0(out: Path, documents: Path, items: Path | None, name: str) -> tuple[float, dict]:
    corpus: dict = {"sources": [{"type": "jsonl", "path": str(documents)}], "languages": ["ja"],
                    "output_dir": str(out / name), "workers": 1}
    if items:
        corpus["decontamination"] = {"files": [str(items)]}
    (out / f"{name}.yaml").write_text(yaml.safe_dump({"corpus": corpus}, allow_unicode=True), encoding="utf-8")
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "gptpipe", "prepare", "--config", str(out / f"{name}.yaml"), "--force",
                    "corpus.join=true"],
                   check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    return wall, json.loads((out / name / "manifest.json").read_text(encoding="utf-8"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ja", type=int, default=600, help="Japanese items")
    parser.add_argument("--en", type=int, default=400, help="English items")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    docs = build(args.seed, 100)
    items = (candidate_items(manpage_texts(MAN / "ja", 2, 500, 500), True, rng, args.ja)
             + candidate_items(manpage_texts(MAN, 25, 400, 500), False, rng, args.en))
    items_file = args.out / "items.jsonl"
    items_file.write_text("".join(json.dumps({"text": item}, ensure_ascii=False) + "\n" for item in items),
                          encoding="utf-8")
    started = time.perf_counter()
    index = Index.build(DecontaminationConfig(files=[items_file]))
    built_s = time.perf_counter() - started
    # The index numbers the items in the file's order (each text is there once).
    assert index.counts["items"]["items"] == len(items)
    looked_for = set(np.concatenate([owners for _, owners, *_ in index.grams.values()]).tolist())
    quoting = []
    for i, item in enumerate(items):
        if i not in looked_for:  # under min_char_ngram letters / min_word_ngram words of its script
            continue
        variant = VARIANTS[i % len(VARIANTS)]
        host = rng.choice(docs)["text"]
        quoting.append({"item": i, "variant": variant, "band": band(item),
                        "text": inserted(host, quoted(item, variant, rng), rng)})
    counts = index.counts["items"]
    print(f"items: {len(items):,} ({sum(spaceless_share(t) >= 0.1 for t in items):,} Japanese), "
          f"{counts['too short']} too short to look for (no n-gram of its script; not quoted below), "
          f"{counts['ngrams']:,} n-grams; index built in {built_s:.2f} s")

    started = time.perf_counter()
    caught = collections.Counter()
    total = collections.Counter()
    missed = []
    for doc in quoting:
        overlap = index.find(doc["text"])
        hit = doc["item"] in overlap.items.get("items", set())
        for key in (doc["variant"], doc["band"], "all"):
            total[key] += 1
            caught[key] += hit
        if not hit:
            missed.append({**doc, "item_text": items[doc["item"]]})
    flagged = []
    for i, doc in enumerate(docs):
        overlap = index.find(doc["text"])
        if overlap:
            which = sorted(overlap.items["items"])
            genuine = any(shared_run(items[j], doc["text"], 8, 20) for j in which)
            flagged.append({"document": i, "kind": doc["kind"], "origin": doc["origin"], "items": which,
                            "shares a run of the item": genuine, "item_text": items[which[0]][:200]})
    checked_s = time.perf_counter() - started
    mb = sum(len(d["text"].encode()) for d in quoting + docs) / 1e6
    print(f"checked {len(quoting) + len(docs):,} documents ({mb:.1f} MB) in {checked_s:.1f} s")
    print("\n| quoting documents | documents | caught | share |\n| --- | --- | --- | --- |")
    for key in (*VARIANTS, *sorted(k for k in total if k[:2] in ("ja", "en")), "all"):
        print(f"| {key} | {total[key]:,} | {caught[key]:,} | {caught[key] / total[key]:.1%} |")
    genuine = sum(f["shares a run of the item"] for f in flagged)
    print(f"\ncorpus documents overlapping an item: {len(flagged)} of {len(docs):,} "
          f"({len(flagged) / len(docs):.2%}); {genuine} of them hold a run of the item's words or letters")
    for f in flagged:
        print(f"  {f['kind']}: {f['origin']}: items {f['items'][:5]}: {f['item_text'][:80]!r}")
    with open(args.out / "missed.jsonl", "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(m, ensure_ascii=False) + "\n" for m in missed)
    with open(args.out / "flagged.jsonl", "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(f, ensure_ascii=False) + "\n" for f in flagged)

    documents = args.out / "docs.jsonl"
    documents.write_text("".join(json.dumps({"text": d["text"]}, ensure_ascii=False) + "\n"
                                 for d in docs + quoting), encoding="utf-8")
    plain_s, plain = stage0(args.out, documents, None, "plain")
    decon_s, decon = stage0(args.out, documents, items_file, "decontaminated")
    contaminated = decon["counts"]["dropped"].get("contaminated: items", 0)
    kept = {name: {json.loads(line)["text"] for line in open(args.out / name / "corpus.jsonl", encoding="utf-8")}
            for name in ("plain", "decontaminated")}
    originals = [d["text"] for d in docs]
    lost = [t for t in originals if t in kept["plain"] and t not in kept["decontaminated"]]
    quotes_left = sum(d["text"] in kept["decontaminated"] for d in quoting)
    print(f"\nstage 0 on the corpus and the quoting documents ({len(docs) + len(quoting):,}): without "
          f"decontamination {plain_s:.1f} s, {plain['counts']['documents']:,} kept; with it {decon_s:.1f} s, "
          f"{decon['counts']['documents']:,} kept, {contaminated:,} dropped as contaminated (the other quoting "
          f"documents went to an earlier rule: junk, other languages, near copies of their host); quoting documents "
          f"kept {quotes_left}; corpus documents kept without it and lost with it: {len(lost)}")


if __name__ == "__main__":
    main()
