"""gptpipe.export.agreement: the one judgement of another runtime's greedy ids against the fp32 model, which stage
4's gate (test_export.py), the vLLM check (test_vllm.py) and the llama.cpp check (test_gguf.py) share."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from conftest import byte_level_bpe, corpus_texts
from gptpipe.export import agreement
from gptpipe.export.agreement import DEPARTS, EXACT, NEAR_TIE, Verdict
from gptpipe.tolerance import FP32_TOLERANCE

PROMPT = "ディレクトリの内容を"
STOP = 9


def verdict(got: list[int], gaps: list[float], tolerance: float = 0.2, expected: tuple[int, ...] = (1, 2, 3)
            ) -> Verdict:
    return Verdict(list(expected), got, gaps, list(expected[:len(got)]), tolerance, {STOP})


def test_tolerance_grows_with_the_rounding_of_the_dtype() -> None:
    by_name = {name: agreement.tolerance(name, 10.0) for name in ("fp32", "float32", "f16", "bf16", "bfloat16",
                                                                   "q8_0")}
    assert by_name["fp32"] == by_name["float32"] == FP32_TOLERANCE
    assert by_name["bf16"] == by_name["bfloat16"] > by_name["f16"] > by_name["fp32"]
    assert by_name["q8_0"] > by_name["bf16"]
    assert agreement.tolerance("bf16", 20.0) > agreement.tolerance("bf16", 10.0)  # relative to the largest logit
    with pytest.raises(ValueError, match="q4_0"):
        agreement.tolerance("q4_0", 10.0)


def test_the_verdict_is_exact_near_tie_or_departs() -> None:
    assert verdict([1, 2, 3], [0.0, 0.0, 0.0]).kind == EXACT
    near = verdict([1, 4, 5], [0.0, 0.15, 0.0])
    assert near.kind == NEAR_TIE and near.first_difference == 1 and near.max_gap == 0.15
    assert "new token 2 at a near-tie" in near.describe(_Decoder())
    # Every token counts, not only the first difference: a later token too far below the best departs.
    late = verdict([1, 4, 5], [0.0, 0.15, 0.3])
    assert late.kind == DEPARTS and late.departure() == (2, "gap")
    assert "new token 3 ('5') is 0.3 below the best logit ('3'; a near-tie is within 0.2)" in late.describe(_Decoder())
    assert verdict([1, 4, 5], [0.0, 0.15, 0.0], tolerance=0.1).kind == DEPARTS


def test_stopping_is_judged_too() -> None:
    # Stopping at a near-tie is a near-tie; going on after a stop id, or stopping without one, departs.
    assert verdict([1, STOP], [0.0, 0.1]).kind == NEAR_TIE
    goes_on = verdict([1, STOP, 3], [0.0, 0.0, 0.0], expected=(1, STOP))
    assert goes_on.kind == DEPARTS and "goes on after the stop token '9'" in goes_on.describe(_Decoder())
    stops = verdict([1, 2], [0.0, 0.0])
    assert stops.kind == DEPARTS and "stops after 2 new tokens, where the model goes on with '3'" in stops.describe(
        _Decoder())


class _Decoder:
    """A tokenizer's decode for made-up ids: the id as text."""

    def decode(self, ids: list[int]) -> str:
        return "".join(map(str, ids))


def test_a_runtime_is_judged_by_the_fp32_models_logits(unigram_llama: Path) -> None:
    """The model's own greedy ids are exact; its worst token first departs there, and the message says where; the
    second best token first is judged by its gap alone."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(unigram_llama)
    reference = agreement.reference_model(unigram_llama)
    prompt = agreement.prompt_ids(tokenizer, PROMPT)
    assert prompt == tokenizer(PROMPT, add_special_tokens=False)["input_ids"]  # stage 1's tokenizer adds no BOS
    expected = agreement.greedy(reference, prompt)
    assert len(expected) == agreement.GREEDY_TOKENS
    [exact] = agreement.check(reference, [prompt], [expected], "fp32")
    assert exact.kind == EXACT and exact.max_gap == 0.0 and exact.tolerance == pytest.approx(
        2 * FP32_TOLERANCE)

    with torch.no_grad():
        first = reference(torch.tensor([prompt])).logits[0, -1]
    worst, second = int(first.argmin()), int(first.topk(2).indices[1])
    [departs] = agreement.check(reference, [prompt], [[worst]], "fp32")
    assert departs.kind == DEPARTS and departs.departure() == (0, "gap")
    assert departs.max_gap == pytest.approx(float(first.max() - first.min()), rel=1e-5)
    assert "new token 1" in departs.describe(tokenizer)

    # The second best token, then the model's own continuation from there: the model reads the runtime's ids, so
    # only the first has a gap, and whether that is a near-tie depends on the allowance alone.
    got = [second, *agreement.greedy(reference, [*prompt, second], agreement.GREEDY_TOKENS - 1)]
    [swapped] = agreement.check(reference, [prompt], [got], "fp32")
    gap = float(first.max() - first[second])
    # the same logit difference from the prompt batched with the continuation: fp32 rounding apart
    assert swapped.gaps[0] == pytest.approx(gap, abs=FP32_TOLERANCE) and max(swapped.gaps[1:]) == 0.0
    assert swapped.kind == DEPARTS and replace(swapped, tolerance=1.01 * gap).kind == NEAR_TIE


def test_a_prompt_gets_bos_where_the_tokenizer_adds_it(corpus_dir: Path, tmp_path: Path) -> None:
    """As transformers, vLLM and llama.cpp (the GGUF's add_bos) encode a prompt for a Llama 3-style tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(byte_level_bpe(corpus_texts(corpus_dir), tmp_path / "bpe",
                                                             adds_bos=True))
    ids = agreement.prompt_ids(tokenizer, PROMPT)
    assert ids[0] == tokenizer.bos_token_id and ids[1:] == tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
