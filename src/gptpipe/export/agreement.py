"""Does another runtime agree with the model? One answer for stage 4's gate (the exported folder in transformers,
through its generation_config.json) and every runtime of export/runtimes/ (`runtime_report`: the vLLM check,
vllm_check.py, and the llama.cpp check of `gptpipe gguf`).

- Prompt (`prompt_ids`): text as the folder's tokenizer encodes it, BOS where the tokenizer adds one. That is
  how the exported model is used: transformers' pipeline, `gptpipe generate`, vLLM's completions endpoint and
  llama.cpp (whose GGUF adds BOS as the tokenizer does, gguf.py) all encode a prompt so, and a model continued
  from a base whose tokenizer adds BOS trained on documents that follow it. A conversation: the folder's chat
  template with the generation prompt, as chat servers render it.
- Reference: the fp32 model (`reference_model`, or the checkpoint's in the gate), plainly greedy (`plain`: no
  penalty or suppressed token of a copied generation_config.json), ending at its stop ids (`greedy`).
- Gaps (`compare`): the fp32 model reads the runtime's own continuation and scores each token the runtime chose
  by how far its logit lies below the best at that step; reading the runtime's tokens keeps one near-tie from
  derailing the comparison of the rest.
- Tolerance (`tolerance`): how far a forward pass with weights in a dtype may move a logit from the fp32
  model's, in bf16 rounding steps of the largest logit (tolerance.py's LOGIT_STEPS: fp32 none, f16 four, bf16
  eight, q8_0 thirty-two; measured in docs/benchmarks.md, "logits tolerance").
- Verdict (`Verdict`): exact (the fp32 model's ids), near-tie (other ids, but every token within
  NEAR_TIE_FACTOR tolerances of the best: logits that each lie within t of fp32's can swap their argmax only
  where the best two are within 2t), or departs: a token further below, going on after a stop id, or stopping
  where the model goes on.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptpipe.export.runtimes.base import Prompt, Runtime
from gptpipe.ids import first_difference
from gptpipe.tolerance import logits_tolerance

GREEDY_TOKENS = 20  # new tokens each check generates per prompt
NEAR_TIE_FACTOR = 2.0
EXACT, NEAR_TIE, DEPARTS = "exact", "near-tie", "departs"
BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")  # a SentencePiece byte-fallback piece: one UTF-8 byte
EXAMPLES = 3  # prompts whose ids differ, shown in a report


def tolerance(dtype: str, largest_logit: float) -> float:
    """Largest |Δ| between a logit of a forward pass with weights in `dtype` and the fp32 model's, whose largest
    logit magnitude is given."""
    return logits_tolerance(largest_logit, dtype, other_runtime=True)


def prompt_ids(tokenizer: Any, prompt: Prompt) -> list[int]:
    """`prompt`'s ids as the exported model is used: text with the special tokens the tokenizer adds (BOS where
    it adds one), a conversation through its chat template with the generation prompt."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    return list(tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


def stop_ids(model: Any) -> frozenset[int]:
    """The ids at which `model`'s generation_config ends generation."""
    stops = model.generation_config.eos_token_id
    return frozenset([] if stops is None else [stops] if isinstance(stops, int) else stops)


def plain(model: Any) -> Any:
    """`model` generating with its special ids only: a copied generation_config.json may carry its author's
    sampling settings or a repetition penalty, which would make greedy decoding other than the model's argmax."""
    from transformers import GenerationConfig

    own = model.generation_config
    # A peft model (an adapter folder) generates through its base model, with the base's generation config.
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    target.generation_config = GenerationConfig(bos_token_id=own.bos_token_id, eos_token_id=own.eos_token_id,
                                                pad_token_id=own.pad_token_id,
                                                decoder_start_token_id=own.decoder_start_token_id)
    return model


def reference_model(folder: Path) -> Any:
    """The fp32 model of an exported causal-LM folder (merged, or an adapter folder on its base), plainly greedy:
    what other runtimes are judged against."""
    from gptpipe.export.adapter import load_export

    return plain(load_export(folder, seq2seq=False, dtype="float32"))


def greedy(model: Any, prompt: list[int], max_new_tokens: int = GREEDY_TOKENS) -> list[int]:
    """The ids `model` generates greedily after `prompt` through its generation_config, the stop id included
    where it stops (an encoder-decoder's: its decoder's, after the start token)."""
    import torch

    ids = torch.tensor([prompt], dtype=torch.long)
    pad = model.generation_config.pad_token_id
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                             pad_token_id=pad if pad is not None else min(stop_ids(model), default=None))
    return out[0, 1:].tolist() if model.config.is_encoder_decoder else out[0, len(prompt):].tolist()


@dataclass
class Verdict:
    """A runtime's greedy ids for one prompt against the fp32 model's."""

    expected: list[int]  # the fp32 model's greedy ids
    got: list[int]  # the runtime's
    gaps: list[float]  # per token of `got`: how far below the fp32 model's best logit at its step
    best: list[int]  # per token of `got`: the fp32 model's best token at its step
    tolerance: float  # the largest gap of a near-tie: NEAR_TIE_FACTOR × tolerance(dtype)
    stops: Collection[int]  # the ids at which generation ends

    @property
    def first_difference(self) -> int | None:
        """Index of the first new token where `got` and `expected` differ (or where one ends); None if equal."""
        return first_difference(self.got, self.expected)

    @property
    def max_gap(self) -> float:
        return max(self.gaps, default=0.0)

    def departure(self) -> tuple[int, str] | None:
        """(index of the new token, why) where `got` really disagrees with the model; None at most near-ties."""
        for i, (token, gap) in enumerate(zip(self.got, self.gaps)):
            if gap > self.tolerance:
                return i, "gap"
            if token in self.stops and i + 1 < len(self.got):
                return i + 1, "goes on"
        if len(self.got) < len(self.expected) and (not self.got or self.got[-1] not in self.stops):
            return len(self.got), "stops"
        return None

    @property
    def kind(self) -> str:
        if self.got == self.expected:
            return EXACT
        return DEPARTS if self.departure() else NEAR_TIE

    def describe(self, tokenizer: Any) -> str:
        """What happened, for a report or a failure message: where and how `got` leaves the model's ids."""
        text = lambda i: repr(tokenizer.decode([i]))
        departure = self.departure()
        if departure is None:
            step = self.first_difference
            if step is None:
                return f"the model's {len(self.got)} greedy tokens"
            return (f"leaves the model's ids at new token {step + 1} at a near-tie: every token within "
                    f"{self.max_gap:.3g} of the best logit (a near-tie: within {self.tolerance:.3g})")
        i, why = departure
        if why == "gap":
            return (f"new token {i + 1} ({text(self.got[i])}) is {self.gaps[i]:.3g} below the best logit "
                    f"({text(self.best[i])}; a near-tie is within {self.tolerance:.3g})")
        if why == "goes on":
            return f"goes on after the stop token {text(self.got[i - 1])} (new token {i})"
        return f"stops after {i} new tokens, where the model goes on with {text(self.expected[i])}"

    def as_dict(self) -> dict[str, Any]:
        """The verdict's figures for a manifest or report."""
        return {"verdict": self.kind, "first_difference": self.first_difference, "max_gap": self.max_gap,
                "gap_tolerance": self.tolerance}


def compare(reference: Any, prompts: Sequence[list[int]], got: Sequence[list[int]],
            expected: Sequence[list[int]], dtype: str, stops: Collection[int], *, seq2seq: bool = False,
            choosable: int | None = None) -> list[Verdict]:
    """A runtime's greedy ids (`got`, one list per prompt, computed with weights in `dtype`) against the fp32
    model's (`expected`), each token scored by ``reference`` (the fp32 model) over its first `choosable` ids (the
    ids the runtime chooses from: a checkpoint's padded embedding rows are not among them)."""
    import torch

    from gptpipe.runtime.batching import IGNORE, collate
    from gptpipe.runtime.scoring import as_scored, logits

    batch = collate([as_scored(p, g, seq2seq) for p, g in zip(prompts, got)], 0, seq2seq)
    batch.pop("target_columns", None)  # logits at every position: the prompts are short
    with torch.no_grad():
        scores = logits(reference, batch, seq2seq)[..., :choosable].float()
    targets, scored = batch["targets"], batch["targets"] != IGNORE
    best = scores.max(dim=-1)
    gaps = best.values - scores.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    verdicts = []
    for row, (want, have) in enumerate(zip(expected, got)):
        mine = scored[row]
        largest = scores[row][mine].abs().max().item() if mine.any() else 0.0
        verdicts.append(Verdict(list(want), list(have), gaps[row][mine].tolist(), best.indices[row][mine].tolist(),
                                NEAR_TIE_FACTOR * tolerance(dtype, largest), stops))
    return verdicts


def check(reference: Any, prompts: Sequence[list[int]], got: Sequence[list[int]], dtype: str,
          max_new_tokens: int = GREEDY_TOKENS) -> list[Verdict]:
    """Another runtime's greedy ids after `prompts` (at most `max_new_tokens` each) against the fp32 model's
    (``reference``, from `reference_model`)."""
    expected = [greedy(reference, p, max_new_tokens) for p in prompts]
    return compare(reference, prompts, got, expected, dtype, stop_ids(reference))


def runtime_report(runtime: Runtime, folder: Path, requests: Sequence[Prompt], max_new_tokens: int = GREEDY_TOKENS
                   ) -> dict[str, Any]:
    """How `runtime` runs the exported `folder` on `requests`, against transformers: per request whether the
    runtime's prompt ids are the folder tokenizer's (`prompt_ids`; a conversation: also whether its rendered text
    is the chat template's), and, with max_new_tokens, its greedy tokens judged against the fp32 model's after the
    same ids (`check`). `agrees`: no continuation departs and, where the runtime reads the folder's tokenizer
    (ids_must_match), every request encoded as transformers encodes it. Ids that differ are counted, with how
    many of those requests hold a character the HF tokenizer writes as bytes."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    serving = runtime.serve(requests, max_new_tokens)
    byte_ids = {i for i, t in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))
                if t and BYTE_PIECE.fullmatch(t)}
    entries, differing, byte_fallback, examples = [], 0, 0, []
    for request, served in zip(requests, serving.outputs):
        want = prompt_ids(tokenizer, request)
        text = request if isinstance(request, str) else tokenizer.apply_chat_template(
            list(request), add_generation_prompt=True, tokenize=False)
        entry: dict[str, Any] = {"prompt": text, "prompt_ids_equal": served.prompt_ids == want}
        if served.rendered is not None:
            entry["prompt_text_equal"] = served.rendered == text
        if served.prompt_ids != want:
            differing += 1
            byte_fallback += bool(byte_ids & set(want))
            if len(examples) < EXAMPLES:
                examples.append(f"{text[:40]!r}: transformers {want[:12]} vs {runtime.name} {served.prompt_ids[:12]}")
        entries.append(entry)
    verdicts = check(reference_model(folder), [s.prompt_ids for s in serving.outputs],
                     [s.tokens for s in serving.outputs], serving.dtype, max_new_tokens) if max_new_tokens else []
    decoded = lambda ids: repr(tokenizer.decode(ids, skip_special_tokens=False))
    described = []
    for entry, verdict in zip(entries, verdicts):
        entry.update(tokens_equal=verdict.kind == EXACT, runtime_tokens=verdict.got,
                     transformers_tokens=verdict.expected, **verdict.as_dict())
        described.append(f"{entry['prompt']!r}: {verdict.describe(tokenizer)} ({runtime.name} "
                         f"{decoded(verdict.got)}, the model {decoded(verdict.expected)})")
    departures = [d for d, v in zip(described, verdicts) if v.kind == DEPARTS]
    encoded = all(e["prompt_ids_equal"] and e.get("prompt_text_equal", True) for e in entries)
    how = ", ".join([serving.dtype, *serving.notes])
    return {"runtime": runtime.name, "version": serving.version, "dtype": serving.dtype, **serving.details,
            "max_tokens": max_new_tokens, "requests": entries, "ids_differing": differing,
            "ids_differing_with_byte_fallback": byte_fallback, "examples": examples, "departures": departures,
            "near_ties": [d for d, v in zip(described, verdicts) if v.kind == NEAR_TIE],
            "agrees": not departures and (encoded or not runtime.ids_must_match),
            "summary": f"{runtime.name} {serving.version} ({how}): {len(entries) - differing}/{len(entries)} prompts "
                       "identical ids" + (f", {sum(v.kind == EXACT for v in verdicts)}/{len(verdicts)} the fp32 "
                                          f"model's greedy tokens, {sum(v.kind == NEAR_TIE for v in verdicts)} other "
                                          f"at near-ties ({max_new_tokens} max)" if verdicts else "")}
