"""Stage-3 speed: tokens/s, MFU and peak memory of gptpipe's training step, against the planner's estimate and a
plain PyTorch loop on the same model.

The default is the target setting: the 125m llama preset, seq 2048, bf16, one GPU, at the planner's micro-batch
(target >= 45% MFU on an H100). It runs the real path: `build_engine` (DeepSpeed, SDPA, Liger kernels when
installed, fused AdamW) and `train_step`, on random token ids (speed does not depend on the text), and prints a
markdown row for docs/benchmarks.md (--json also appends the figures to a file, for bench/gpu_check.sh).

    .venv/bin/python bench/bench_train.py                          # 125m, seq 2048, bf16, the planner's micro-batch
    .venv/bin/python bench/bench_train.py --micro 8 --checkpointing --compile --plain
    .venv/bin/python bench/bench_train.py --base qwen3             # Qwen3-0.6B's shape, 151,936 vocabulary
    .venv/bin/python bench/bench_train.py --smoke                  # tiny preset on CPU: checks it runs
    .venv/bin/python bench/bench_train.py --continued              # the weights from a saved folder (init_from)

MFU = FLOPs per token × tokens/s ÷ the GPU's dense peak (H100/H200 989 TFLOP/s bf16, not the 1,979 "with
sparsity"; override with --peak-tflops). FLOPs per token are printed two ways: 6·N + 12·L·h·s counts attention's
scores over the full s×s square (the convention of the planner, Megatron-LM and llm-foundry; N without the
embedding lookup), and 6·N + 6·L·h·s counts the causal half that flash attention computes. The memory column
compares torch's peak allocation with the planner's weights + gradients + optimizer + activations + logits (the
headroom it leaves for the CUDA context, NCCL and fragmentation is not part of it): the target is within ±10%.
--plain times the same model, batch and kernels in a plain loop first (fp32 weights under bf16 autocast, torch's
fused AdamW, gradient clipping, no DeepSpeed), so the engine's cost is a ratio. On CUDA the row also counts the
host-device syncs of one step (torch.cuda.set_sync_debug_mode) and DeepSpeed's device synchronizes.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import sys
import sysconfig
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from gptpipe.config.core import load_config
from gptpipe.pipeline import PipelineConfig
from gptpipe.runtime.devices import loss_path, peak_flops
from gptpipe.runtime.engine import (apply_liger, build_engine, deepspeed_config, forward_loss, fused_loss_kwargs,
                                    setup_distributed, train_step)
from gptpipe.runtime.memory import EngineSettings, estimate_memory, memory_budget
from gptpipe.runtime.model import (base_shape, build_model, build_model_config, count_parameters, flops_per_token,
                                   meta_parameters, parameter_groups, resolve_shape)
from gptpipe.train.plan import largest_micro_batch
from gptpipe.runtime.schedule import Schedule

VOCAB = 32000  # the shipped tokenizer's size (padded to 32,000 already)
# Base-model shapes (model.init_from), random weights: what continued pretraining trains.
BASES = {
    "qwen3": dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936,
                  tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=40960),  # Qwen3-0.6B
}
PLANNED_SAMPLES = 512  # samples per rank and step the planner divides when --micro is auto


class _NeverStop:
    def agreed(self) -> bool:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="125m")
    parser.add_argument("--arch", default="llama", choices=["llama", "gpt2", "mixtral"])
    parser.add_argument("--base", choices=list(BASES), help="a base model's shape instead of a preset")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro", default="auto",
                        help="micro-batch (no accumulation: one per step); auto: the planner's largest that fits")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--no-liger", action="store_true")
    parser.add_argument("--plain", action="store_true", help="also time a plain PyTorch loop on the same model")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (allocator, kernels, compile)")
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--json", type=Path, help="append the row's figures to this file as one JSON line")
    parser.add_argument("--label", default="", help="the row's name in --json output")
    parser.add_argument("--smoke", action="store_true", help="tiny preset, seq 128, fp32, 3 steps: runs on CPU")
    parser.add_argument("--continued", action="store_true",
                        help="load the weights from a HF folder as model.init_from does (the model built here, "
                             "saved to a temporary folder first): continued pretraining's step against scratch's")
    args = parser.parse_args()
    if args.smoke:
        args.preset, args.seq, args.micro, args.precision, args.steps, args.warmup = "tiny", 128, "4", "fp32", 3, 1

    dist = setup_distributed()
    on_gpu = dist.device.type == "cuda"
    overrides = [f"model.arch={args.arch}", f"model.preset={args.preset}", f"train.seq_len={args.seq}",
                 f"train.precision={args.precision}", f"train.zero_stage={args.zero}",
                 f"train.activation_checkpointing={str(args.checkpointing).lower()}",
                 f"train.compile={str(args.compile).lower()}", f"train.liger_kernels={str(not args.no_liger).lower()}",
                 "train.warmup_fraction=0.1"]
    config = load_config(PipelineConfig, None, overrides)
    train = config.train
    if args.base:
        base = dict(BASES[args.base])
        from transformers import AutoConfig

        hf_config = AutoConfig.for_model(base.pop("model_type"), bos_token_id=1, eos_token_id=2, **base)
        shape, parameters, arch = base_shape(hf_config), meta_parameters(hf_config), hf_config.model_type
    else:
        tokenizer = SimpleNamespace(vocab_size=VOCAB, bos_id=1, eos_id=2, pad_id=3)
        hf_config = build_model_config(config.model, tokenizer, args.seq)
        shape, arch = resolve_shape(config.model, VOCAB), args.arch
        parameters = count_parameters(shape, args.seq)
    vocab = shape.vocab_size

    # The planner's figures: its loss path, its budget for this device and its micro-batch
    loss = loss_path(arch, on_gpu, train.liger_kernels)
    device_bytes = torch.cuda.get_device_properties(0).total_memory if on_gpu else 0
    budget = memory_budget(device_bytes, on_gpu) if on_gpu else None

    def memory_of(settings: EngineSettings) -> Any:
        return estimate_memory(shape, parameters, args.seq, args.precision, dist.world_size, settings, loss.fused,
                               train.fp32_gradients)

    settings = EngineSettings(1 if args.micro == "auto" else int(args.micro), args.zero, args.checkpointing, False)
    if args.micro == "auto":
        if budget is None:
            sys.exit("--micro auto plans for a GPU's memory: give --micro on CPU")
        settings = largest_micro_batch(settings, PLANNED_SAMPLES, lambda s: memory_of(s).total <= budget.usable)
    micro = settings.micro_batch
    train.micro_batch_size, train.global_batch_size = micro, micro * dist.world_size
    loss_kwargs = fused_loss_kwargs(train) if loss.fused else {}

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (micro, args.seq + 1), generator=generator).to(dist.device)
    batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
    steps = args.warmup + args.steps

    plain = None
    if args.plain:
        if loss.fused:
            apply_liger(arch)  # the same kernels as the engine's (build_engine applies them again: no change)
        try:
            plain = plain_loop(hf_config, train, batch, loss_kwargs, args.warmup, args.steps, dist.device)
        except torch.OutOfMemoryError:  # its fp32 weights and autocast copies need more than the engine's plan
            print(f"plain loop: out of memory at micro-batch {micro}; the engine row still runs", file=sys.stderr)
        gc.collect()  # outside the handler: its traceback held the loop's model and optimizer
        if on_gpu:
            torch.cuda.empty_cache()

    ds_config, _ = deepspeed_config(train, micro, 1, dist.world_size, on_gpu)
    torch.manual_seed(0)
    make_model = None
    if args.continued:
        folder = Path(tempfile.mkdtemp(prefix="bench-base-"))
        build_model(hf_config).save_pretrained(folder)
        make_model = lambda: build_model(hf_config, dist.device, init_from=folder)
    engine, _ = build_engine(train, arch, hf_config, ds_config, Schedule.for_run(train, steps + 2), dist.device,
                             make_model)

    stop = _NeverStop()
    first = train_step(engine, [batch], stop)
    first_loss = float(first.loss)  # the untrained model's loss (one sync, before timing)
    for _ in range(args.warmup - 1):
        train_step(engine, [batch], stop)
    synchronize(dist.device)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    with counted_synchronizes() as device_syncs:
        start = time.perf_counter()
        for _ in range(args.steps):
            result = train_step(engine, [batch], stop)
        synchronize(dist.device)
        seconds = time.perf_counter() - start
    loss_value = float(result.loss)
    syncs = host_syncs(lambda: train_step(engine, [batch], stop)) if on_gpu else None

    tokens_per_s = args.steps * micro * args.seq * dist.world_size / seconds
    flops_full = flops_per_token(shape, args.seq, parameters if args.base else None)
    flops_causal = flops_full - 6 * shape.num_layers * shape.num_attn_heads * shape.head_dim * args.seq
    name = torch.cuda.get_device_name(0) if on_gpu else "CPU"
    peak = peak_flops(name, args.precision, args.peak_tflops) if on_gpu else None
    planned = memory_of(settings).total / 2**30
    measured = torch.cuda.max_memory_allocated() / 2**30 if on_gpu else float("nan")
    if not dist.is_main:
        return
    row = {"label": args.label or (args.base or f"{args.arch} {args.preset}"), "device": name,
           "ranks": dist.world_size, "seq": args.seq, "micro": micro, "micro_planned": args.micro == "auto",
           "precision": args.precision, "zero": args.zero, "checkpointing": args.checkpointing,
           "compile": args.compile, "liger": loss.fused, "parameters": parameters, "tokens_per_s": tokens_per_s,
           "mfu_full": flops_full * tokens_per_s / (peak * dist.world_size) if peak else None,
           "mfu_causal": flops_causal * tokens_per_s / (peak * dist.world_size) if peak else None,
           "peak_gib": measured, "planned_gib": planned,
           "budget_gib": budget.usable / 2**30 if budget else None, "first_loss": first_loss, "loss": loss_value,
           "plain_tokens_per_s": plain, "engine_vs_plain": tokens_per_s / plain if plain else None,
           "host_syncs_per_step": None if syncs is None else len(syncs), "host_sync_sites": syncs,
           "device_synchronizes": device_syncs[0],
           "command": f"python {' '.join(sys.argv)}"}
    mfu = (f"MFU {row['mfu_full']:.1%} (causal {row['mfu_causal']:.1%})" if peak else "MFU n/a (CPU)")
    ratio = f" | plain {plain:,.0f} tok/s, engine {row['engine_vs_plain']:.2f}×" if plain else ""
    print(f"| {row['label']} | seq {args.seq} | micro {micro}{' (plan)' if args.micro == 'auto' else ''} | "
          f"{args.precision} ZeRO-{args.zero}{' ckpt' if args.checkpointing else ''}"
          f"{' compile' if args.compile else ''}{' liger' if loss.fused else ''}"
          f"{' init_from' if args.continued else ''} | {name} ×{dist.world_size} | {tokens_per_s:,.0f} tok/s | {mfu} | "
          f"peak {measured:.1f} GiB (planned {planned:.1f}) | loss {first_loss:.3f} → {loss_value:.3f}{ratio} | "
          f"syncs/step: host {row['host_syncs_per_step']}, DeepSpeed {device_syncs[0]} in {args.steps} steps |")
    if syncs:
        print(f"host syncs of one step: {', '.join(syncs)}")
    print(f"command: {os.path.basename(sys.executable)} {' '.join(sys.argv)}", file=sys.stderr)
    if args.json:
        with args.json.open("a", encoding="utf-8") as out:
            out.write(json.dumps(row) + "\n")
    if not math.isfinite(loss_value):  # CI runs --smoke: a diverged step is a broken training path, not a slow one
        sys.exit(f"loss is {loss_value}: the training step is broken")
    if device_syncs[0]:  # DeepSpeed's throughput timer (engine.deepspeed_config turns it off) and the like
        sys.exit(f"DeepSpeed synchronized the device {device_syncs[0]} times in {args.steps} steps")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def counted_synchronizes():
    """Counts DeepSpeed's full device synchronizes (its accelerator's synchronize(), which its timers call)."""
    from deepspeed.accelerator import get_accelerator

    accelerator, count = get_accelerator(), [0]
    original = accelerator.synchronize

    def counting(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(*args, **kwargs)

    accelerator.synchronize = counting
    try:
        yield count
    finally:
        accelerator.synchronize = original


def host_syncs(step: Any) -> list[str]:
    """Where one call of `step` synchronizes host and device: the Python line of each sync that torch.cuda's sync
    debug mode warns of (the innermost frame outside torch)."""
    sites = []
    stdlib = sysconfig.get_paths()["stdlib"]

    def short(frame: traceback.FrameSummary) -> str:
        """package/file.py:line, the path below site-packages (or the repository)."""
        parts = Path(frame.filename).parts
        return f"{'/'.join(parts[-2:])}:{frame.lineno}"

    def record(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if "synchroniz" in str(message):
            # the innermost frame outside torch and the standard library (warnings.py), and its caller
            frames = [f for f in traceback.extract_stack()[:-1]
                      if "/torch/" not in f.filename and not f.filename.startswith(stdlib)]
            sites.append(" < ".join(short(f) for f in reversed(frames[-2:])) if frames else f"{filename}:{lineno}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")  # reports a sync of its own: recorded only from the next line on
        warnings.showwarning = record
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites


def plain_loop(hf_config: Any, train: Any, batch: dict[str, torch.Tensor], loss_kwargs: dict[str, Any],
               warmup: int, steps: int, device: torch.device) -> float:
    """Tokens/s of the same model in a plain PyTorch loop: fp32 weights under bf16/fp16 autocast (fp32: none),
    torch's fused AdamW with the engine's groups, gradient clipping; the memory is freed before returning."""
    torch.manual_seed(0)
    model = build_model(hf_config, device)
    if train.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(parameter_groups(model, train.weight_decay), lr=train.lr,
                                  betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps, fused=True)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(train.precision)
    model.train()
    start = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            synchronize(device)
            start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss, _ = forward_loss(model, batch, **loss_kwargs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    synchronize(device)
    seconds = time.perf_counter() - start
    del model, optimizer, loss
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return steps * batch["input_ids"].numel() / seconds


if __name__ == "__main__":
    main()
