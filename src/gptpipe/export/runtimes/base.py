"""What every runtime besides transformers gives (runtimes/__init__.py lists them): the shape of a run over
requests, and the interface a runtime implements."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

Prompt = str | Sequence[dict[str, str]]  # text, or a conversation (role/content messages)


@dataclass
class Served:
    """What a runtime made of one request."""

    prompt_ids: list[int]  # the request as the runtime encoded it (a conversation: through its chat template)
    tokens: list[int]  # its greedy continuation from those ids, the stop token included where it stopped
    rendered: str | None = None  # a conversation: the text the runtime's chat template made of it


@dataclass
class Serving:
    """One run of a runtime over a list of requests."""

    version: str
    dtype: str  # the weights' type as the runtime ran them: a tolerance.LOGIT_STEPS name
    outputs: list[Served]
    details: dict[str, Any] = field(default_factory=dict)  # what else the runtime states (vLLM: lora)
    notes: tuple[str, ...] = ()  # how it ran, in words, beyond the dtype (a report's summary)


class Runtime:
    """One runtime: how to run it on one exported folder (or the file made from it), and how users do."""

    name: str  # as reports and the card name it
    setup: str  # what installs or builds it
    # Whether its prompt ids must be transformers' own: true where it reads the folder's tokenizer files; false
    # where it has a tokenizer of its own whose known differences are reported (llama.cpp's UGM has no byte
    # fallback), so only its greedy tokens decide.
    ids_must_match: bool = True
    renders_conversations: bool = False  # it applies the folder's chat template itself

    def missing(self) -> str | None:
        """Why it cannot run here and how to fix that; None when it can."""
        raise NotImplementedError

    def serve(self, requests: Sequence[Prompt], max_new_tokens: int) -> Serving:
        """Each request's prompt ids and greedy continuation (max_new_tokens 0: the ids only)."""
        raise NotImplementedError

    def complete(self, prompt_ids: Sequence[Sequence[int]], max_new_tokens: Sequence[int]) -> Serving:
        """Each prompt's greedy continuation from the ids given (no special tokens added), up to its own count of
        new tokens, in one run: what an evaluation's generation tasks ask (gptpipe.eval_generation). A runtime
        that cannot take ids says so here."""
        raise NotImplementedError(f"{self.name} does not generate from prompt ids")

    @classmethod
    def serving_line(cls, architectures: Collection[str], adapter_rank: int | None) -> str | None:
        """The card's line on running a folder of these architectures (`adapter_rank`: a LoRA adapter folder
        of that rank) in this runtime; None where it cannot."""
        raise NotImplementedError
