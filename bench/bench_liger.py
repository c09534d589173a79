"""Liger on and off: the same weights and batch through transformers' own model and through the model Liger patched,
for every model type gptpipe patches (runtime/devices.py LIGER_ARCHS), compared by loss and gradients.

The patched model is built and run as training runs it (engine.apply_liger, engine.forward_loss with
fused_loss_kwargs, mixtral's per-layer router loss included). Patching changes transformers' classes for the rest of
the process, so each type's unpatched reference is computed first. One markdown row per type, and with --json a
line per type for tests/test_gpu_path.py and bench/gpu_check.sh.

    .venv/bin/python bench/bench_liger.py                        # CUDA, bf16: what gpu_check.sh runs
    TRITON_INTERPRET=1 .venv/bin/python bench/bench_liger.py --device cpu --precision fp32 --seq 32  # CPU, interpreted

Tolerances: fp32 within 1e-4 relative (the same sums in another order); bf16 within 2e-2 for the loss (a bf16
model's rounding, as the two paths round in different places) and the gradients compared by cosine similarity.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

import torch

from gptpipe.train.config import TrainConfig
from gptpipe.runtime.devices import LIGER_ARCHS
from gptpipe.runtime.engine import apply_liger, forward_loss, fused_loss_kwargs
from gptpipe.runtime.model import build_model

VOCAB, BATCH = 1024, 2
SEQ = 64  # tokens per row; the CPU check (tests/test_gpu_path.py) halves it: the interpreter's time is per row


def tiny_config(arch: str, seq: int) -> Any:
    """A 2-layer model of `arch` with grouped-query attention, its own head_dim where the type has one, a sliding
    window of half the sequence where the type has one."""
    from transformers import AutoConfig

    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    extra: dict[str, dict[str, Any]] = {
        "qwen3": dict(head_dim=48),
        "gemma2": dict(head_dim=48, attn_logit_softcapping=50.0, final_logit_softcapping=None, sliding_window=seq // 2),
        "gemma3_text": dict(head_dim=48, sliding_window=seq // 2, final_logit_softcapping=None),
        "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=False,
                        router_aux_loss_coef=0.02),
    }
    return AutoConfig.for_model(arch, **common, **extra.get(arch, {}))


def loss_and_grads(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                   loss_kwargs: dict[str, Any]) -> tuple[float, dict[str, torch.Tensor]]:
    model.train()
    loss, _ = forward_loss(model, batch, **loss_kwargs)
    loss.backward()
    grads = {name: p.grad.detach().float().cpu() for name, p in model.named_parameters() if p.grad is not None}
    return float(loss), grads


def compare(arch: str, device: torch.device, precision: str, seq: int = SEQ) -> dict[str, Any]:
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    config = tiny_config(arch, seq)
    torch.manual_seed(0)
    reference_model = build_model(config, device).to(dtype)
    weights = {k: v.clone() for k, v in reference_model.state_dict().items()}
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, VOCAB, (BATCH, seq + 1), generator=generator).to(device)
    batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
    # dropout off in both (gemma's attention dropout is 0 anyway): the comparison is of the kernels alone
    loss_ref, grads_ref = loss_and_grads(reference_model, batch, {})
    del reference_model
    apply_liger(arch)
    patched = build_model(config, device).to(dtype)
    patched.load_state_dict(weights)
    kwargs = fused_loss_kwargs(TrainConfig(precision=precision, zero_stage=1))
    loss_liger, grads_liger = loss_and_grads(patched, batch, kwargs)
    with torch.no_grad():  # the fused loss ran: no logits came out
        fused = patched(input_ids=batch["input_ids"], shift_labels=batch["labels"], use_cache=False,
                        **kwargs).logits is None
    worst_name, worst_error, lowest_cosine = "", 0.0, 1.0
    for name, ref in grads_ref.items():
        got = grads_liger[name]
        error = float((got - ref).norm() / ref.norm().clamp(min=1e-12))
        cosine = float(torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0))
        if error > worst_error:
            worst_name, worst_error = name, error
        lowest_cosine = min(lowest_cosine, cosine)
    return {"arch": arch, "device": str(device), "precision": precision, "loss_off": loss_ref, "loss_on": loss_liger,
            "loss_rel": abs(loss_liger - loss_ref) / abs(loss_ref), "grad_rel": worst_error, "grad_worst": worst_name,
            "grad_cosine": lowest_cosine, "fused_loss": fused, "gradients": len(grads_ref),
            "gradients_on": len(grads_liger),
            "kernels": sorted({type(m).__name__ for m in patched.modules() if type(m).__module__.startswith("liger")})}


def interpret_float_scalars() -> None:
    """Under TRITON_INTERPRET=1, hand float scalars to kernels as fp32 tensors, as compiled Triton does.

    Triton's interpreter passes them as Python floats (its own "TODO: wrap everything in triton tensors" in
    triton/runtime/interpreter.py), and Liger's RMSNorm calls `eps.to(tl.float32)` on them."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    convert = interpreter._implicit_cvt

    def with_floats(arg: Any) -> Any:
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return convert(arg)

    interpreter._implicit_cvt = with_floats
    # libdevice's functions are declarations only (`...`) that compiled Triton links to CUDA's libdevice; the
    # interpreter runs them as Python and gets None. Liger's kernels that import them get the interpreter's own
    # math functions of the same name.
    import importlib
    import pkgutil

    import liger_kernel.ops

    for info in pkgutil.iter_modules(liger_kernel.ops.__path__, "liger_kernel.ops."):
        module = _imported(importlib, info.name)
        for name, value in list(vars(module).items()) if module else []:
            if "libdevice" in getattr(value, "__module__", ""):
                setattr(module, name, _interpreted_math(name))


def _imported(importlib: Any, name: str) -> Any:
    """The module, or None for backends of other hardware (NPU, CuTe) that do not import here and are not used."""
    try:
        return importlib.import_module(name)
    except Exception:
        return None


def _interpreted_math(name: str) -> Any:
    """The interpreter's twin of libdevice's `name`, looked up at each call: the interpreter swaps tl.math's
    functions in while a kernel runs. tanh, which tl.math lacks, through the sigmoid."""
    import triton.language as tl

    if name == "tanh":
        return lambda x: 2 * tl.sigmoid(2 * x) - 1
    return lambda *args: getattr(tl.math, name)(*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--arch", nargs="*", default=list(LIGER_ARCHS))
    parser.add_argument("--json", action="store_true", help="one JSON line per type instead of markdown")
    parser.add_argument("--seq", type=int, default=SEQ, help="tokens per row (2 rows)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if os.environ.get("TRITON_INTERPRET") == "1":
        interpret_float_scalars()
    loss_tolerance = 1e-4 if args.precision == "fp32" else 2e-2
    failed = []
    for arch in args.arch:
        row = compare(arch, device, args.precision, args.seq)
        ok = (row["fused_loss"] and row["loss_rel"] <= loss_tolerance and row["gradients"] == row["gradients_on"]
              and (row["grad_rel"] <= 1e-4 if args.precision == "fp32" else row["grad_cosine"] >= 0.99)
              and math.isfinite(row["loss_on"]))
        failed += [] if ok else [arch]
        if args.json:
            print(json.dumps({**row, "ok": ok}), flush=True)
        else:
            print(f"| {arch} | {args.precision} {device.type} | loss off {row['loss_off']:.5f} on {row['loss_on']:.5f} "
                  f"(rel {row['loss_rel']:.1e}) | gradients: worst rel {row['grad_rel']:.1e} ({row['grad_worst']}), "
                  f"lowest cosine {row['grad_cosine']:.5f} | {', '.join(row['kernels'])} | "
                  f"{'ok' if ok else 'FAILED'} |", flush=True)
    if failed:
        sys.exit(f"Liger on/off differ beyond tolerance for {', '.join(failed)}")


if __name__ == "__main__":
    main()
