"""Stage-3 speed: tokens/s, MFU and peak memory of gptpipe's training step, against the planner's estimate.

The default is the target setting: the 125m llama preset, seq 2048, bf16, one GPU (target >= 45% MFU on an
H100). It runs the real path: `build_engine` (DeepSpeed, SDPA, Liger kernels when installed, fused AdamW)
and `train_step`, on random token ids (speed does not depend on the text), and prints a markdown row for
docs/benchmarks.md.

    .venv/bin/python bench/bench_train.py                          # 125m, seq 2048, bf16, 1 GPU
    .venv/bin/python bench/bench_train.py --micro 8 --checkpointing --compile
    .venv/bin/python bench/bench_train.py --smoke                  # tiny preset on CPU: checks it runs
    .venv/bin/python bench/bench_train.py --continued              # the same, the weights from a saved folder

MFU = FLOPs per token (6·N + 12·L·h·s, N without the embedding lookup) × tokens/s ÷ the GPU's dense peak
(H100/H200 989 TFLOP/s bf16; override with --peak-tflops). The memory column compares torch's peak
allocation with the planner's weights + gradients + optimizer + activations + logits (the headroom it leaves
for the CUDA context, NCCL and fragmentation is not part of it): the target is within ±10%.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from gptpipe.config.core import load_config
from gptpipe.pipeline import PipelineConfig
from gptpipe.train.devices import peak_flops
from gptpipe.train.engine import build_engine, deepspeed_config, setup_distributed, train_step
from gptpipe.train.memory import EngineSettings, estimate_memory
from gptpipe.train.model import build_model, build_model_config, count_parameters, flops_per_token, resolve_shape
from gptpipe.train.schedule import Schedule

VOCAB = 32000  # the shipped tokenizer's size (padded to 32,000 already)


class _NeverStop:
    def agreed(self) -> bool:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="125m")
    parser.add_argument("--arch", default="llama", choices=["llama", "gpt2", "mixtral"])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=16, help="micro-batch (no accumulation: one step each)")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--no-liger", action="store_true")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (allocator, kernels, compile)")
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny preset, seq 128, fp32, 3 steps: runs on CPU")
    parser.add_argument("--continued", action="store_true",
                        help="load the weights from a HF folder as model.init_from does (the model built here, "
                             "saved to a temporary folder first): continued pretraining's step against scratch's")
    args = parser.parse_args()
    if args.smoke:
        args.preset, args.seq, args.micro, args.precision, args.steps, args.warmup = "tiny", 128, 4, "fp32", 3, 1

    dist = setup_distributed()
    on_gpu = dist.device.type == "cuda"
    overrides = [f"model.arch={args.arch}", f"model.preset={args.preset}", f"train.seq_len={args.seq}",
                 f"train.precision={args.precision}", f"train.zero_stage={args.zero}",
                 f"train.micro_batch_size={args.micro}", f"train.global_batch_size={args.micro * dist.world_size}",
                 f"train.activation_checkpointing={str(args.checkpointing).lower()}",
                 f"train.compile={str(args.compile).lower()}", f"train.liger_kernels={str(not args.no_liger).lower()}",
                 "train.warmup_fraction=0.1"]
    config = load_config(PipelineConfig, None, overrides)
    train = config.train
    tokenizer = SimpleNamespace(vocab_size=VOCAB, bos_id=1, eos_id=2, pad_id=3)
    hf_config = build_model_config(config.model, tokenizer, args.seq)
    shape = resolve_shape(config.model, VOCAB)
    steps = args.warmup + args.steps
    ds_config, _ = deepspeed_config(train, args.micro, 1, dist.world_size, on_gpu)
    torch.manual_seed(0)
    make_model = None
    if args.continued:
        base = Path(tempfile.mkdtemp(prefix="bench-base-"))
        build_model(hf_config).save_pretrained(base)
        make_model = lambda: build_model(hf_config, dist.device, init_from=base)
    engine, fused = build_engine(train, args.arch, hf_config, ds_config, Schedule.for_run(train, steps),
                                 dist.device, make_model)

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (args.micro, args.seq + 1), generator=generator).to(dist.device)
    batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
    stop = _NeverStop()
    for _ in range(args.warmup):
        train_step(engine, [batch], stop)
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        result = train_step(engine, [batch], stop)
    loss = float(result.loss)  # syncs
    seconds = time.perf_counter() - start

    tokens_per_s = args.steps * args.micro * args.seq * dist.world_size / seconds
    flops = flops_per_token(shape, args.seq)
    name = torch.cuda.get_device_name(0) if on_gpu else "CPU"
    peak = peak_flops(name, args.precision, args.peak_tflops) if on_gpu else None
    predicted = estimate_memory(shape, count_parameters(shape, args.seq), args.seq, args.precision, dist.world_size,
                                EngineSettings(args.micro, args.zero, args.checkpointing, False), fused,
                                train.fp32_gradients)
    if dist.is_main:
        mfu = f"{flops * tokens_per_s / (peak * dist.world_size):.1%}" if peak else "n/a (CPU)"
        measured = torch.cuda.max_memory_allocated() / 2**30 if on_gpu else float("nan")
        planned = predicted.total / 2**30  # what the allocator hands out, as planned
        print(f"| {args.arch} {args.preset} | seq {args.seq} | micro {args.micro} | {args.precision} ZeRO-{args.zero}"
              f"{' ckpt' if args.checkpointing else ''}{' compile' if args.compile else ''}"
              f"{' liger' if fused else ''}{' init_from' if args.continued else ''} | {name} ×{dist.world_size} | "
              f"{tokens_per_s:,.0f} tok/s | MFU {mfu} | "
              f"peak {measured:.1f} GiB (planned {planned:.1f}) | loss {loss:.3f} |")
        print(f"command: {os.path.basename(sys.executable)} {' '.join(sys.argv)}", file=sys.stderr)
    if not math.isfinite(loss):  # CI runs --smoke: a diverged step is a broken training path, not a slow one
        sys.exit(f"loss is {loss}: the training step is broken")


if __name__ == "__main__":
    main()
