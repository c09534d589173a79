"""How closely two computations of the same model must agree, in one place: stage 4's gate (an export against
its checkpoint), stage 7's export gate, stage 3's step-0 gate (the engine against a base model's folder), and
another runtime's forward (vLLM, llama.cpp) against the fp32 model (export/agreement.py).

fp32: the same weights through the same code, so only summation order may differ: FP32_TOLERANCE absolute on
logits, the same relative to a loss. Otherwise a number of bf16 rounding steps (2^-8 relative) of the largest
logit, by the weights' dtype and what is compared (LOGIT_STEPS); four steps of the mean loss for a bf16/fp16
forward against the fp32 reference. A wrong or misplaced weight is off by far more than any of these. The
runtime allowances are at least twice the largest gap measured (docs/benchmarks.md, "logits tolerance").
"""

from __future__ import annotations

FP32_TOLERANCE = 1e-4
BF16_RELATIVE = 2.0 ** -8
LOSS_HALF_RELATIVE = 4 * BF16_RELATIVE
# A dtype's names (the gate's, torch's, GGUF outtypes) → the bf16 steps of the largest logit a forward pass with
# weights in it may move a logit: (built the same way as the reference, whose fp16 is exact on CPU too; another
# runtime against the fp32 model: f16 rounds finer than bf16, whose one step is eight of f16's and whose engines
# round activations too; q8_0 rounds each weight to 1/127 of its block's largest, and on CPU the activations).
LOGIT_STEPS = {"fp32": (0, 0), "float32": (0, 0), "f32": (0, 0), "f16": (0, 4), "fp16": (0, 4), "float16": (0, 4),
               "bf16": (1, 8), "bfloat16": (1, 8), "q8_0": (0, 32)}


def logits_tolerance(largest_logit: float, dtype: str, other_runtime: bool = False) -> float:
    """Largest |Δ| allowed between logits of a forward pass with weights in `dtype` and the reference's, whose
    largest magnitude is given; `other_runtime`: another engine's forward against the fp32 model."""
    if dtype not in LOGIT_STEPS:
        raise ValueError(f"no logits tolerance for dtype {dtype!r} (known: {', '.join(LOGIT_STEPS)})")
    return FP32_TOLERANCE + LOGIT_STEPS[dtype][other_runtime] * BF16_RELATIVE * largest_logit


def loss_tolerance(reference: float, precision: str) -> float:
    """Largest |Δ| allowed between an engine's loss in `precision` and the fp32 reference loss."""
    return max(1.0, abs(reference)) * (FP32_TOLERANCE if precision == "fp32" else LOSS_HALF_RELATIVE)
