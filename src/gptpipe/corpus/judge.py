"""Stage 0's verdict on one document: its length, its language and the quality rules, in the order they run.

A pure function of the text and the config (no state across documents but the language counts), so that it can
run in any worker; the exact and near-duplicate checks, which compare documents, live in prepare.py and
neardup.py. `checks` is lazy: stage 0 stops at the first check that drops a document, `--explain` reads them all.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gptpipe.corpus import language, quality
from gptpipe.corpus.config import CorpusConfig

if TYPE_CHECKING:  # the index is built by the driver and handed in
    from gptpipe.corpus.decontaminate import Index


@dataclass(frozen=True)
class Check:
    """One rule's look at one document: the drop reason as the manifest counts it, the value it measured."""

    reason: str
    measured: str
    drops: bool
    about: dict[str, str] = field(default_factory=dict)  # what a dropped sample notes beside its text


class Judge:
    """The per-document rules of `config`, built once (the NG-word pattern, HojiChar's masker). `exact`: measure
    the language share over every line (`--explain`) rather than stop the vote once the verdict is certain.
    `index`: the evaluation items' n-grams, when decontamination is on (its `drop` action is a check of its own,
    the last; `remove_span` cuts spans out of a kept document instead, corpus/firstpass.py)."""

    def __init__(self, config: CorpusConfig, exact: bool = False, index: Index | None = None) -> None:
        self.config = config
        self.exact = exact
        self.index = index
        self.wanted = frozenset(config.languages)
        self.rules = quality.rules(config.quality)
        self.mask: Callable[[str], str] | None = quality.pii_masker(config.quality)
        self.languages: Counter[str] = Counter()  # each judged document's main language

    def checks(self, text: str) -> Iterator[Check]:
        config = self.config
        yield Check(f"shorter than min_chars ({config.min_chars})", f"{len(text):,} characters",
                    len(text) < config.min_chars)
        if self.wanted:
            verdict = language.judge(text, self.wanted, config.language_min_score,
                                     None if self.exact else config.language_min_share)
            self.languages[verdict.main] += 1
            yield Check(f"language: under {config.language_min_share:g} {'/'.join(config.languages)} "
                        f"(mainly {verdict.main})", f"{verdict.share:.3f} of the identified text",
                        verdict.share < config.language_min_share)
        for rule in self.rules:
            value = rule.measure(text)
            yield Check(f"quality: {rule.name}", f"{value:,}" if isinstance(value, int) else f"{value:.3g}",
                        rule.past(value))
        if self.index is not None and (self.exact or config.decontamination.action == "drop"):
            overlap = self.index.find(text)
            cuts = config.decontamination.action == "remove_span"
            about = self.index.describe(overlap) if overlap else "no n-gram of an evaluation item"
            if overlap and cuts:
                about += f"; {sum(b - a for a, b in overlap.spans):,} characters to cut"
            yield Check(f"contaminated: {overlap.tasks[0]}" if overlap else "contaminated", about,
                        bool(overlap) and not cuts, {"overlaps": about} if overlap else {})

    def reject(self, text: str) -> Check | None:
        """The first failing check, or None for a document to keep."""
        return next((check for check in self.checks(text) if check.drops), None)
