"""Stage-3 speed: tokens/s, MFU and peak memory of gptpipe's training step, against the planner's estimate and a
plain PyTorch loop on the same model.

The default is the target setting: the 125m llama preset, seq 2048, bf16, one GPU, at the planner's micro-batch
(target >= 45% MFU on an H100). It runs the real path: `build_engine` (DeepSpeed, SDPA, Liger kernels when
installed, fused AdamW) and `train_step`, each step on a fresh batch of synthetic text (`bigram_batches`: speed
does not depend on the text, but a loss after many steps only compares on text that can be learned and not
memorized), and prints a markdown row for docs/benchmarks.md (--json also appends the figures to a file, for
bench/gpu_check.sh).

    .venv/bin/python bench/bench_train.py                          # 125m, seq 2048, bf16, the planner's micro-batch
    .venv/bin/python bench/bench_train.py --micro 8 --checkpointing --compile --plain
    .venv/bin/python bench/bench_train.py --base qwen3             # Qwen3-0.6B's shape, 151,936 vocabulary
    .venv/bin/python bench/bench_train.py --smoke                  # tiny preset on CPU, bf16, both loops: runs
    .venv/bin/python bench/bench_train.py --continued              # the weights from a saved folder (init_from)
    .venv/bin/python bench/bench_train.py --preset 1b --micro 8 --precision fp8   # torchao float8 (H100-class)

MFU = FLOPs per token × tokens/s ÷ the GPU's dense peak (H100/H200 989 TFLOP/s bf16, not the 1,979 "with
sparsity"; override with --peak-tflops, which also gives a CPU one). Every row prints MFU in two conventions
(model.flops_per_token): the headline "full" counts 6·N + 12·L·h·s, attention's scores over the full s×s square
(the convention of the planner, Megatron-LM and llm-foundry; N without the embedding lookup), and "causal" counts
6·N + 6·L·h·s, the lower triangle that causal flash attention computes. The memory column compares torch's peak
allocation with the planner's weights + gradients + optimizer + activations + logits (the headroom it leaves for
the CUDA context, NCCL and fragmentation is not part of it): the target is within ±10%.

The engine row is `gptpipe train`'s step: train_step with forward_loss and the loss arguments build_engine returns
(Liger's fp32 sum of lm_head's gradient under train.fp32_gradients). --plain first times the same model, batch,
kernels and loss arguments in a plain PyTorch loop with the engine's numerics and no DeepSpeed: bf16 weights, their
gradients copied to an fp32 master copy, clipped there, stepped by torch's fused AdamW with the engine's groups and
copied back (DeepSpeed's bf16 optimizer; fp32: the weights themselves), so the engine's cost is a ratio and the two
rows' losses agree. On CUDA the engine row also counts the host-device syncs of one step
(torch.cuda.set_sync_debug_mode) and DeepSpeed's device synchronizes.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import itertools
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
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from gptpipe.config.core import load_config
from gptpipe.pipeline import PipelineConfig
from gptpipe.runtime.devices import loss_path, peak_flops
from gptpipe.runtime.engine import (apply_liger, build_engine, deepspeed_config, forward_kwargs, forward_loss,
                                    setup_distributed, train_step)
from gptpipe.runtime.memory import EngineSettings, estimate_memory, memory_budget
from gptpipe.runtime.model import (ExpertBias, base_shape, build_model, build_model_config, count_parameters,
                                   expert_biases, flops_per_token, meta_parameters, parameter_groups, resolve_shape)
from gptpipe.train.plan import largest_micro_batch
from gptpipe.runtime.schedule import Schedule

VOCAB = 32000  # the shipped tokenizer's size (padded to 32,000 already)
EOD = 2  # the end-of-document id of the bench's tokenizer (eos_id below)
SUCCESSORS = 8  # the next tokens each token of the bench's synthetic text can have (bigram_batches)
# Base-model shapes (model.init_from), random weights: what continued pretraining trains.
BASES = {
    "qwen3": dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936,
                  tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=40960),  # Qwen3-0.6B
}
PLANNED_SAMPLES = 512  # samples per rank and step the planner divides when --micro is auto
HEADLINE = "full"  # the MFU convention of the targets (issue 30) and the bold figures: attention over s×s
PLAIN_LOOP = "plain PyTorch: bf16 weights, fp32 master, fused AdamW, clipping"
# --smoke: the two loops' losses after the same 4 steps from the same weights, relative. Same numerics: bf16
# rounding apart (2e-5); the plain loop at a constant learning rate instead of the schedule was 1.5e-3 apart.
PLAIN_AGREES = 5e-4


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
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32", "fp8"],
                        help="fp8: train.precision fp8, the bf16 engine with torchao's float8 linears (MFU still "
                             "against the dense bf16 peak)")
    parser.add_argument("--fp8-recipe", default="tensorwise", choices=["tensorwise", "rowwise"])
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--no-liger", action="store_true")
    parser.add_argument("--document-mask", type=int, default=0, metavar="MEAN_TOKENS",
                        help="train.document_mask on a batch of documents of this mean length (geometric; an "
                             "end-of-document token ends each, positions restart after it); 0: one causal mask")
    parser.add_argument("--moe-balance", default="aux_loss", choices=["aux_loss", "bias"],
                        help="--arch mixtral: model.moe_balance (bias: the selection bias moved after every step, "
                             "as the train loop does; no --plain, whose loop has no bias)")
    parser.add_argument("--plain", action="store_true", help="also time a plain PyTorch loop on the same model")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (allocator, kernels, compile)")
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--json", type=Path, help="append the row's figures to this file as one JSON line")
    parser.add_argument("--label", default="", help="the row's name in --json output")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny preset, seq 128, bf16, 3 steps, --plain: both loops run on CPU")
    parser.add_argument("--continued", action="store_true",
                        help="load the weights from a HF folder as model.init_from does (the model built here, "
                             "saved to a temporary folder first): continued pretraining's step against scratch's")
    args = parser.parse_args()
    if args.smoke:
        args.preset, args.seq, args.micro, args.precision, args.steps, args.warmup = "tiny", 128, "4", "bf16", 3, 1
        args.plain = True
    if args.plain and args.moe_balance == "bias":
        sys.exit("--plain has no selection bias to move: time --moe-balance bias without it")
    if args.plain and args.precision in ("fp16", "fp8"):
        sys.exit("--plain runs bf16 or fp32: an fp16 plain loop would need the engine's loss scaling too, an fp8 "
                 "one the float8 conversion")

    dist = setup_distributed()
    on_gpu = dist.device.type == "cuda"
    overrides = [f"model.arch={args.arch}", f"model.preset={args.preset}", f"train.seq_len={args.seq}",
                 f"train.precision={args.precision}", f"train.zero_stage={args.zero}",
                 f"train.activation_checkpointing={str(args.checkpointing).lower()}",
                 f"train.compile={str(args.compile).lower()}", f"train.liger_kernels={str(not args.no_liger).lower()}",
                 f"train.fp8_recipe={args.fp8_recipe}", "train.warmup_fraction=0.1",
                 f"train.document_mask={str(args.document_mask > 0).lower()}",
                 f"model.moe_balance={args.moe_balance}"]
    config = load_config(PipelineConfig, None, overrides)
    train = config.train
    if args.base:
        base = dict(BASES[args.base])
        from transformers import AutoConfig

        hf_config = AutoConfig.for_model(base.pop("model_type"), bos_token_id=1, eos_token_id=2, **base)
        shape, parameters, arch = base_shape(hf_config), meta_parameters(hf_config), hf_config.model_type
    else:
        tokenizer = SimpleNamespace(vocab_size=VOCAB, bos_id=1, eos_id=EOD, pad_id=3)
        hf_config = build_model_config(config.model, tokenizer, args.seq)
        shape = resolve_shape(config.model, VOCAB)
        arch = shape.arch  # mixtral with moe_balance bias trains Ernie 4.5's MoE class (its selection bias)
        parameters = count_parameters(shape, args.seq)
    vocab = shape.vocab_size
    if args.precision == "fp8":
        from gptpipe.runtime import fp8

        why = fp8.unavailable()
        if why:
            sys.exit(f"--precision fp8: {why}")
        fp8_layer = fp8.largest_converted(fp8.model_choice(hf_config, args.fp8_recipe))
    else:
        fp8_layer = None

    # The planner's figures: its loss path, its budget for this device and its micro-batch
    loss = loss_path(arch, on_gpu, train.liger_kernels)
    device_bytes = torch.cuda.get_device_properties(0).total_memory if on_gpu else 0
    budget = memory_budget(device_bytes, on_gpu) if on_gpu else None

    def memory_of(settings: EngineSettings) -> Any:
        return estimate_memory(shape, parameters, args.seq, train.engine_precision, dist.world_size, settings,
                               loss.fused, train.fp32_gradients, train.document_mask, fp8_layer=fp8_layer)

    settings = EngineSettings(1 if args.micro == "auto" else int(args.micro), args.zero, args.checkpointing, False)
    if args.micro == "auto":
        if budget is None:
            sys.exit("--micro auto plans for a GPU's memory: give --micro on CPU")
        settings = largest_micro_batch(settings, PLANNED_SAMPLES, lambda s: memory_of(s).total <= budget.usable)
    micro = settings.micro_batch
    train.micro_batch_size, train.global_batch_size = micro, micro * dist.world_size
    loss_kwargs = forward_kwargs(train, loss)  # what build_engine returns: the plain loop's loss is the engine's

    generator = torch.Generator().manual_seed(0)
    steps = args.warmup + args.steps
    tokens = bigram_batches(steps, micro, args.seq, vocab, generator)
    if args.document_mask:
        tokens[torch.rand(tokens.shape, generator=generator) < 1 / args.document_mask] = EOD
    tokens = tokens.to(dist.device)
    batches = [{"input_ids": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()} for t in tokens]
    for batch in batches if args.document_mask else ():
        # what megatron's reset_position_ids/eod_mask_loss give stage 3 (train/data.py)
        batch["position_ids"] = document_positions(batch["input_ids"])
        batch["labels"][batch["input_ids"] == EOD] = -100
    schedule = Schedule.for_run(train, steps + 2)  # both loops' learning rates

    plain = None
    if args.plain:
        if loss.fused:
            apply_liger(arch)  # the same kernels as the engine's (build_engine applies them again: no change)
        try:
            plain = plain_loop(hf_config, train, schedule, batches, loss_kwargs, args.warmup, dist.device)
        except torch.OutOfMemoryError:  # no ZeRO partitioning of its own; one rank holds what the plan splits
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
    engine, engine_kwargs = build_engine(train, arch, hf_config, ds_config, schedule, dist.device,
                                         make_model)
    assert engine_kwargs == loss_kwargs, (engine_kwargs, loss_kwargs)  # one decision: devices.loss_path
    loss_of = functools.partial(forward_loss, **engine_kwargs)  # TrainLoop.forward's call
    next_batch = itertools.cycle(batches).__next__  # host_syncs' extra step takes the first again

    biases = expert_biases(engine)
    balance = ExpertBias(biases, config.model.moe_bias_update_rate) if biases else None

    def step() -> Any:
        result = train_step(engine, [next_batch()], _NeverStop(), loss_of)
        if balance is not None and result.applied:  # TrainLoop._loop's update, after the optimizer step
            balance.update(result.aux_loss.counts)
        return result

    first = step()
    first_loss = float(first.loss)  # the untrained model's loss (one sync, before timing)
    for _ in range(args.warmup - 1):
        step()
    synchronize(dist.device)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    with counted_synchronizes() as device_syncs:
        start = time.perf_counter()
        for _ in range(args.steps):
            result = step()
        synchronize(dist.device)
        seconds = time.perf_counter() - start
    loss_value = float(result.loss)
    syncs = host_syncs(step) if on_gpu else None

    tokens_per_s = args.steps * micro * args.seq * dist.world_size / seconds
    total = parameters if args.base else None
    flops = {convention: flops_per_token(shape, args.seq, total, causal=convention == "causal")
             for convention in ("full", "causal")}
    name = torch.cuda.get_device_name(0) if on_gpu else "CPU"
    peak = (peak_flops(name, train.engine_precision, args.peak_tflops) if on_gpu
            else args.peak_tflops * 1e12 if args.peak_tflops else None)

    def mfu(speed: float | None) -> dict[str, float | None]:
        """MFU in both conventions (None without a peak or a speed)."""
        return {c: f * speed / (peak * dist.world_size) if peak and speed else None for c, f in flops.items()}

    planned = memory_of(settings).total / 2**30
    measured = torch.cuda.max_memory_allocated() / 2**30 if on_gpu else float("nan")
    if not dist.is_main:
        return
    engine_mfu, plain_mfu = mfu(tokens_per_s), mfu(plain.tokens_per_s if plain else None)
    row = {"label": args.label or (args.base or f"{args.arch} {args.preset}"), "device": name,
           "ranks": dist.world_size, "seq": args.seq, "micro": micro, "micro_planned": args.micro == "auto",
           "precision": args.precision, "fp8_recipe": args.fp8_recipe if args.precision == "fp8" else None,
           "zero": args.zero, "document_mask": args.document_mask, "steps": args.steps,
           "moe_balance": args.moe_balance if args.arch == "mixtral" else None,
           "checkpointing": args.checkpointing,
           "compile": args.compile, "liger": loss.fused, "loss_kwargs": sorted(engine_kwargs),
           "parameters": parameters, "tokens_per_s": tokens_per_s, "mfu_headline": HEADLINE,
           "flops_per_token_full": flops["full"], "flops_per_token_causal": flops["causal"],
           "mfu_full": engine_mfu["full"], "mfu_causal": engine_mfu["causal"],
           "peak_gib": measured, "planned_gib": planned,
           "budget_gib": budget.usable / 2**30 if budget else None, "first_loss": first_loss, "loss": loss_value,
           "plain_loop": PLAIN_LOOP if args.plain else None,
           "plain_tokens_per_s": plain.tokens_per_s if plain else None,
           "plain_mfu_full": plain_mfu["full"], "plain_mfu_causal": plain_mfu["causal"],
           "plain_peak_gib": plain.peak_gib if plain else None,
           "plain_first_loss": plain.first_loss if plain else None, "plain_loss": plain.loss if plain else None,
           "engine_vs_plain": tokens_per_s / plain.tokens_per_s if plain else None,
           "host_syncs_per_step": None if syncs is None else len(syncs), "host_sync_sites": syncs,
           "device_synchronizes": device_syncs[0],
           "command": f"python {' '.join(sys.argv)}"}
    recipe = f" {args.fp8_recipe}" if args.precision == "fp8" else ""
    settings_text = (f"{args.precision}{recipe} ZeRO-{args.zero}{' ckpt' if args.checkpointing else ''}"
                     f"{' compile' if args.compile else ''}{' liger' if loss.fused else ''}"
                     f"{' init_from' if args.continued else ''}"
                     f"{f' document_mask ({args.document_mask} tokens/doc)' if args.document_mask else ''}")
    micro_text = f"{micro}{' (plan)' if args.micro == 'auto' else ''}"

    def percent(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.1%}"

    print(f"| row | loop | seq | micro | settings | device | tokens/s | MFU {HEADLINE} 12·L·h·s (headline) | "
          "MFU causal 6·L·h·s | peak GiB (planned) | loss 1 → n | syncs/step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {row['label']} | engine: `gptpipe train`'s step | {args.seq} | {micro_text} | {settings_text} | "
          f"{name} ×{dist.world_size} | {tokens_per_s:,.0f} | {percent(engine_mfu['full'])} | "
          f"{percent(engine_mfu['causal'])} | {measured:.2f} ({planned:.2f}) | {first_loss:.4f} → {loss_value:.4f} | "
          f"host {row['host_syncs_per_step']}, DeepSpeed {device_syncs[0]} in {args.steps} steps |")
    if plain:
        plain_settings = (f"{args.precision}{' ckpt' if args.checkpointing else ''}"  # uncompiled, no ZeRO
                          f"{' liger' if loss.fused else ''}")
        print(f"| {row['label']} | {PLAIN_LOOP} | {args.seq} | {micro_text} | {plain_settings} | "
              f"{name} ×1 | {plain.tokens_per_s:,.0f} (engine {row['engine_vs_plain']:.2f}×) | "
              f"{percent(plain_mfu['full'])} | {percent(plain_mfu['causal'])} | {plain.peak_gib:.2f} | "
              f"{plain.first_loss:.4f} → {plain.loss:.4f} | |")
    elif args.plain:
        print(f"| {row['label']} | {PLAIN_LOOP} | out of memory at micro-batch {micro} | | | | | | | | | |")
    if syncs:
        print(f"host syncs of one step: {', '.join(syncs)}")
    print(f"command: {os.path.basename(sys.executable)} {' '.join(sys.argv)}", file=sys.stderr)
    if args.json:
        with args.json.open("a", encoding="utf-8") as out:
            out.write(json.dumps(row) + "\n")
    if not math.isfinite(loss_value):  # CI runs --smoke: a diverged step is a broken training path, not a slow one
        sys.exit(f"loss is {loss_value}: the training step is broken")
    if args.smoke and plain and abs(plain.loss - loss_value) > PLAIN_AGREES * loss_value:
        sys.exit(f"the plain loop's loss {plain.loss:.5f} is not the engine's {loss_value:.5f}: not the same numerics")
    if device_syncs[0]:  # DeepSpeed's throughput timer (engine.deepspeed_config turns it off) and the like
        sys.exit(f"DeepSpeed synchronized the device {device_syncs[0]} times in {args.steps} steps")


def bigram_batches(count: int, micro: int, seq: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """`count` batches of `micro` sequences of seq + 1 token ids from a sparse random bigram chain: each token is
    followed by one of SUCCESSORS tokens, chosen uniformly. A model learns it (its loss falls from ln(vocab)
    towards ln(SUCCESSORS)) but cannot memorize a fresh batch, so two runs' losses after many steps compare."""
    successors = torch.randint(0, vocab, (vocab, SUCCESSORS), generator=generator)
    tokens = torch.empty(count * micro, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (count * micro,), generator=generator)
    choices = torch.randint(0, SUCCESSORS, (count * micro, seq), generator=generator)
    for i in range(seq):
        tokens[:, i + 1] = successors[tokens[:, i], choices[:, i]]
    return tokens.view(count, micro, seq + 1)


def document_positions(input_ids: torch.Tensor) -> torch.Tensor:
    """Positions that restart after every end-of-document token (the token itself ends its document)."""
    index = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    starts = torch.zeros_like(index)
    starts[:, 1:] = torch.where(input_ids[:, :-1] == EOD, index[:, 1:], 0)
    return index - torch.cummax(starts, dim=1).values


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


@dataclass
class PlainRun:
    tokens_per_s: float
    first_loss: float  # the untrained model's: the engine row's, when the numerics are the same
    loss: float  # after the last timed step
    peak_gib: float  # torch's peak allocation over the timed steps (nan on CPU)


def plain_loop(hf_config: Any, train: Any, schedule: Schedule, batches: list[dict[str, torch.Tensor]],
               loss_kwargs: dict[str, Any], warmup: int, device: torch.device) -> PlainRun:
    """The same model in a plain PyTorch loop with the engine's numerics (DeepSpeed's bf16 optimizer): bf16
    weights (fp32: fp32), and in bf16 an fp32 master copy that receives the gradients, is clipped to
    train.grad_clip and stepped by torch's fused AdamW with the engine's groups and learning rates (`schedule`),
    then copied back into the bf16 weights. The same initial weights as the engine's (the same seed, rounded to
    bf16 as DeepSpeed rounds them); the memory is freed before returning."""
    torch.manual_seed(0)
    model = build_model(hf_config, device)
    if train.precision == "bf16":
        model.to(torch.bfloat16)
    if train.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    weights = [p for p in model.parameters() if p.requires_grad]
    master = weights
    if train.precision == "bf16":
        master = [torch.nn.Parameter(p.detach().float()) for p in weights]
        for m in master:
            m.grad = torch.zeros_like(m)
    master_of = {id(p): m for p, m in zip(weights, master)}
    groups = [{**group, "params": [master_of[id(p)] for p in group["params"]]}
              for group in parameter_groups(model, train.weight_decay)]
    optimizer = torch.optim.AdamW(groups, lr=train.lr, betas=(train.adam_beta1, train.adam_beta2),
                                  eps=train.adam_eps, fused=True)
    scheduler = schedule.scheduler_factory()(optimizer)
    model.train()
    start, first_loss = 0.0, float("nan")
    for i, batch in enumerate(batches):
        if i == warmup:
            synchronize(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
        loss, _ = forward_loss(model, batch, **loss_kwargs)
        loss.backward()
        if i == 0:
            first_loss = float(loss)  # one sync, before timing
        with torch.no_grad():
            if master is not weights:
                torch._foreach_copy_([m.grad for m in master], [p.grad for p in weights])
            torch.nn.utils.clip_grad_norm_(master, train.grad_clip, foreach=True)
            optimizer.step()
            scheduler.step()
            if master is not weights:
                torch._foreach_copy_(weights, master)  # rounds to bf16
        model.zero_grad(set_to_none=True)  # the master's fp32 gradients stay: the next copy overwrites them
    synchronize(device)
    seconds = time.perf_counter() - start
    run = PlainRun((len(batches) - warmup) * batch["input_ids"].numel() / seconds, first_loss, float(loss),
                   torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan"))
    del model, optimizer, scheduler, loss, weights, master, master_of, groups
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return run


if __name__ == "__main__":
    main()
