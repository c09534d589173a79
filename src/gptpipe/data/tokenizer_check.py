"""Whether a tokenizer is the one a stage-2 dataset was encoded with: the documents' source texts re-encoded
to the data's ids, or, where the source jsonl cannot be read back as it was encoded, held-out documents decoded and
re-encoded. Stage 3's step-0 gate and stage 4's export check call it with a base model's tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gptpipe.data.base_tokenizer import PretrainedTokenizer
from gptpipe.ids import first_difference

# Documents the gate's tokenizer check encodes (source texts, or held-out documents decoded), and the longest
# held-out one used (whole documents only: a cut inside a word may merge differently).
ROUND_TRIP_DOCUMENTS = 8
ROUND_TRIP_MAX_TOKENS = 4096


def source_texts(manifest: Any, count: int = ROUND_TRIP_DOCUMENTS) -> list[str] | None:
    """The texts of a stage-2 dataset's first `count` documents, read back from the jsonl it was encoded from the
    way stage 2 read it (data/jsonl.py's record_text, NULs stripped); None when that cannot be done exactly: a
    merged or sharded dataset, lines that became no document (skipped), or an input that is gone or changed."""
    from gptpipe.data.jsonl import record_text
    from gptpipe.stage import file_fingerprint

    counts, files = manifest.counts, (manifest.inputs.get("files") or {})
    if counts.get("documents") != counts.get("lines") or "shard" in counts or not files:
        return None
    texts: list[str] = []
    for name, recorded in files.items():
        path = Path(name)
        if not path.is_file() or any(file_fingerprint(path)[k] != recorded.get(k) for k in ("size", "mtime_ns")):
            return None
        with open(path, "rb") as fh:
            for line in fh:
                text, _ = record_text(line, manifest.config.get("text_key", "text"))
                texts.append(text)
                if len(texts) == count:
                    return texts
    return texts


def reencode_problems(tokenizer: Any, texts: list[str], documents: list[list[int]], bos_id: int | None,
                      eod_id: int) -> list[str]:
    """Documents of the data whose source text `tokenizer` encodes to other ids than the data holds (between the
    base's BOS, where its tokenizer adds one, and EOS): the data was encoded with another tokenizer."""
    problems = []
    for n, (text, doc) in enumerate(zip(texts, documents)):
        ids = ([bos_id] if bos_id is not None else []) + tokenizer(text, add_special_tokens=False)["input_ids"]
        ids.append(eod_id)
        if ids != doc:
            at = first_difference(ids, doc)
            problems.append(f"document {n}: the data has ids {doc[at:at + 5]} at token {at}, the tokenizer "
                            f"gives {ids[at:at + 5]} for its text")
    return problems


def first_documents(prefix: Path, count: int) -> list[list[int]]:
    """The first `count` documents of a dataset prefix, as ids."""
    from gptpipe.data.indexed import IndexedDataset

    reader = IndexedDataset(prefix)
    return [reader[i].tolist() for i in range(min(count, len(reader)))]


def tokenizer_problems(tokenizer: Any, facts: PretrainedTokenizer, prefix: Path, split: str,
                       seed: int) -> tuple[list[str], str]:
    """(the problems, what was checked) of a base's tokenizer (`facts`: its conventions) against the data in
    `prefix`: the first documents' source texts re-encoded (`source_texts`), else held-out documents decoded and
    re-encoded (a weaker check: a tokenizer with some pieces' ids swapped decodes and re-encodes consistently)."""
    from gptpipe.artifacts import read_dataset
    from gptpipe.data.split import unseen_document_ids

    bos, eod = facts.bos_id, facts.eod_id
    dataset = read_dataset(prefix)  # a URL prefix: its verified local copy
    texts = source_texts(dataset.manifest)
    if texts:
        problems = reencode_problems(tokenizer, texts, first_documents(dataset.prefix, len(texts)), bos, eod)
        checked = f"re-encodes the source text of {len(texts)} documents to the data's ids"
    else:
        documents = unseen_document_ids(dataset.prefix, ROUND_TRIP_DOCUMENTS, split, seed,
                                        max_tokens=ROUND_TRIP_MAX_TOKENS)
        problems = round_trip_problems(tokenizer, documents, bos, eod)
        checked = (f"decodes and re-encodes {len(documents)} held-out documents to the data's ids (their source "
                   "jsonl is not readable as it was encoded)")
    if problems:
        problems.append(mismatch_cause(facts, dataset.manifest.counts.get("boundaries") or {}))
    return problems, checked


def mismatch_cause(tokenizer: PretrainedTokenizer, recorded: dict[str, Any]) -> str:
    """The likely cause of data ids that the base's tokenizer does not give, from what stage 2 `recorded` of the
    tokenizer it encoded with (check_data has refused a recorded one that differs from the base's)."""
    built = tokenizer.tokenizer_class + (f" ({tokenizer.rebuilt})" if tokenizer.rebuilt else "")
    if "encoder_sha256" not in recorded:
        return (f"likely cause: the data's manifest records no tokenizer class, so an older gptpipe wrote it, encoding "
                f"with tokenizer.json as the file has it (or an older transformers' conversion of tokenizer.model); "
                f"AutoTokenizer now loads {tokenizer.folder} as {built}. Rerun stage 2 with --force (gptpipe "
                "tokenize --force) to write the ids AutoTokenizer gives")
    return (f"stage 2 recorded the tokenizer AutoTokenizer builds now ({built}, encoder sha256 "
            f"{recorded['encoder_sha256'][:12]}), so the data's ids were changed after it wrote them, or its manifest "
            "is not theirs; rerun stage 2 with --force (gptpipe tokenize --force)")


def round_trip_problems(tokenizer: Any, documents: list[list[int]], bos_id: int | None, eod_id: int) -> list[str]:
    """Documents of the data (ids, with their BOS/EOS) that `tokenizer` does not re-encode to the same ids after
    decoding them: the data was encoded with another tokenizer."""
    problems = []
    for n, doc in enumerate(documents):
        body = doc[1:] if bos_id is not None and doc[:1] == [bos_id] else doc
        body = body[:-1] if body[-1:] == [eod_id] else body
        text = tokenizer.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        again = tokenizer(text, add_special_tokens=False)["input_ids"]
        if again != body:
            at = first_difference(again, body)
            problems.append(f"held-out document {n}: the data has ids {body[at:at + 5]} at token {at}, the "
                            f"tokenizer gives {again[at:at + 5]} for the same text")
    return problems
