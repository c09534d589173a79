"""Stage 2 on several machines: ``--shard I/N`` names, and the checks before ``gptpipe merge`` joins them.

Shard I of N tokenizes the I-th of N equal byte ranges of the input into <prefix>.shard-I-of-N.bin/.idx
with its own manifest; merging the N shards gives byte-for-byte what a single run writes.
"""

from __future__ import annotations

from pathlib import Path

from gptpipe.config.core import ConfigError
from gptpipe.data.config import TokenizeConfig
from gptpipe.stage import Manifest, StageInputError
from gptpipe.artifacts import TOKENIZE


def parse_shard(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        index, count = (int(x) for x in text.split("/"))
        if not 0 <= index < count:
            raise ValueError
    except ValueError:
        raise ConfigError("command line", [f"--shard {text!r}: expected I/N with 0 <= I < N, e.g. 0/4"]) from None
    return index, count


def shard_prefix(prefix: Path, index: int, count: int) -> Path:
    return prefix.with_name(f"{prefix.name}.shard-{index}-of-{count}")


def read_shards(cfg: TokenizeConfig, count: int) -> tuple[list[Path], list[Manifest]]:
    """The N shard prefixes of the configured dataset and their manifests, once they are all there and fit."""
    if count < 1:
        raise ConfigError("command line", [f"--shards {count}: must be >= 1"])
    prefix = cfg.dataset_prefix
    shards = [shard_prefix(prefix, i, count) for i in range(count)]
    try:
        manifests = [TOKENIZE.require(p) for p in shards]
    except StageInputError as exc:
        raise StageInputError(f"{exc}\n(shards made on other machines: copy each shard's .bin, .idx and "
                              f".manifest.json into {prefix.parent} keeping their mtimes: rsync -t, scp -p, cp -p; "
                              f"a shard is made with: bash 2_tokenize.sh --shard I/{count})") from None
    # What decides the bytes of a shard; paths may differ between machines.
    identity = [{"shard": m.config.get("shard"), "text_key": m.config["text_key"],
                 "max_document_chars": m.config["max_document_chars"], "tokenizer": m.inputs["tokenizer"],
                 "input_sizes": [f["size"] for f in m.inputs["files"].values()]} for m in manifests]
    for i, made in enumerate(identity):
        expected = {**identity[0], "shard": f"{i}/{count}", "text_key": cfg.text_key,
                    "max_document_chars": cfg.max_document_chars}
        if made != expected:
            different = ", ".join(k for k in made if made[k] != expected[k])
            raise StageInputError(f"{TOKENIZE.manifest_path(shards[i])} does not fit the other shards or this config "
                                  f"({different} differ); remake it: bash 2_tokenize.sh --shard {i}/{count}")
    return shards, manifests
