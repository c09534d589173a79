"""How closely two computations of the same model must agree, in one place: stage 4's gate (an export against
its checkpoint), stage 7's export gate and stage 3's step-0 gate (the engine against a base model's folder).
How far another runtime's logits may lie from the fp32 model's, per weight type, builds on these steps in
export/agreement.py.

fp32: the same weights through the same code, so only summation order may differ: FP32_TOLERANCE absolute on
logits, the same relative to a loss. bf16: one bf16 rounding step (2^-8 relative) of the largest logit for two
bf16 models built the same way (on CPU they agree exactly); four steps of the mean loss for a bf16/fp16 forward
against the fp32 reference. A wrong or misplaced weight is off by far more than any of these.
"""

from __future__ import annotations

FP32_TOLERANCE = 1e-4
BF16_RELATIVE = 2.0 ** -8
LOSS_HALF_RELATIVE = 4 * BF16_RELATIVE


def logits_tolerance(largest_logit: float, dtype: str) -> float:
    """Largest |Δ| allowed between a folder's logits and the reference's, whose largest magnitude is given."""
    return FP32_TOLERANCE + (BF16_RELATIVE * largest_logit if dtype == "bf16" else 0.0)


def loss_tolerance(reference: float, precision: str) -> float:
    """Largest |Δ| allowed between an engine's loss in `precision` and the fp32 reference loss."""
    return max(1.0, abs(reference)) * (FP32_TOLERANCE if precision == "fp32" else LOSS_HALF_RELATIVE)
