"""Stage 3's checkpoints of a model preset: the training stall per save, then the checkpoint's upload and download
through gptpipe's committed folders, one stream (gptpipe before issue 44) against now, on moto's S3 server behind the
per-connection throttle of bench/throttle_proxy.py (bench_transfers.store).

    PYTHONPATH=src OMP_NUM_THREADS=1 .venv/bin/python bench/bench_saves.py --preset 125m [--zero 2] \
        [--precision fp32] [--saves 3] [--mib-per-s 32 --rtt-ms 20]

The engine is `gptpipe train`'s (build_engine, synthetic weights from the preset's init, one rank on this machine's
device), stepped once so that Adam's moments exist; each save is runtime/checkpoint.save, the call the training
loop makes and waits for (its wall time is the stall the loop now logs, "saved ... in X s"); the bucket's upload
then runs beside training in the uploader process, which moves the folder with committed.put as timed here.
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

import bench_transfers
from gptpipe.config.core import load_config
from gptpipe.pipeline import PipelineConfig
from gptpipe.runtime import checkpoint
from gptpipe.runtime.engine import (StopFlag, build_engine, deepspeed_config, forward_loss, setup_distributed,
                                    train_step)
from gptpipe.runtime.model import build_model_config, count_parameters, resolve_shape
from gptpipe.runtime.schedule import Schedule

VOCAB = 32000  # the shipped tokenizer's size


def tensors_copied(state: object) -> list[torch.Tensor]:
    """A copy of every tensor in the nested dicts/lists `state` (a checkpoint's content)."""
    if isinstance(state, torch.Tensor):
        return [state.detach().clone()]
    if isinstance(state, dict):
        state = list(state.values())
    if isinstance(state, (list, tuple)):
        return [copy for item in state for copy in tensors_copied(item)]
    return []


def allocate_moments(optimizer: torch.optim.Optimizer) -> None:
    """Adam's state as its first step makes it (both moments, the step count) without a backward pass's memory:
    one step on gradients of zeros that are stride-0 views of one number, so no gradient buffer is allocated."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.zeros((), dtype=p.dtype, device=p.device).expand_as(p)
    # the fused and foreach kernels want dense gradients (fused crashes on these): one step of the plain loop
    kernels = [{k: group.get(k) for k in ("fused", "foreach")} for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group.update(fused=False, foreach=False)
    optimizer.step()
    for group, kept in zip(optimizer.param_groups, kernels):
        group.update(kept)
    for p in params:
        p.grad = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="125m")
    parser.add_argument("--zero", type=int, default=2)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--saves", type=int, default=3, help="saves timed, one step apart")
    parser.add_argument("--mib-per-s", type=float, default=32.0, help="the proxy's cap per connection; 0: none")
    parser.add_argument("--rtt-ms", type=float, default=20.0)
    parser.add_argument("--work", type=Path, default=None, help="where the checkpoints go (default: a temp folder)")
    parser.add_argument("--no-transfers", action="store_true", help="time the saves (and the snapshot) only")
    parser.add_argument("--no-step", action="store_true",
                        help="no training step: Adam's moments made by one optimizer step on zero gradients that "
                             "take no memory, and nothing copied into RAM; for a preset whose step or second copy "
                             "does not fit this machine's memory (1b)")
    args = parser.parse_args()

    dist = setup_distributed()
    seq = 64
    overrides = [f"model.preset={args.preset}", f"train.seq_len={seq}", f"train.precision={args.precision}",
                 f"train.zero_stage={args.zero}", "train.liger_kernels=false", "train.warmup_fraction=0.1",
                 "train.micro_batch_size=1", f"train.global_batch_size={dist.world_size}"]
    config = load_config(PipelineConfig, None, overrides)
    train = config.train
    tokenizer = SimpleNamespace(vocab_size=VOCAB, bos_id=1, eos_id=2, pad_id=3)
    hf_config = build_model_config(config.model, tokenizer, seq)
    parameters = count_parameters(resolve_shape(config.model, VOCAB), seq)
    ds_config, _ = deepspeed_config(train, 1, 1, dist.world_size, dist.device.type == "cuda")
    torch.manual_seed(0)
    engine, loss_kwargs = build_engine(train, config.model.arch, hf_config, ds_config,
                                       Schedule.for_run(train, args.saves + 2), dist.device)
    tokens = torch.randint(0, VOCAB, (1, seq + 1), generator=torch.Generator().manual_seed(0)).to(dist.device)
    batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
    stop = StopFlag(dist.world_size)

    if args.no_step:
        allocate_moments(engine.optimizer.optimizer)
    work = Path(tempfile.mkdtemp(prefix="bench-saves-", dir=args.work))
    root = work / "checkpoints"
    stalls, loads = [], [os.getloadavg()[0]]
    try:
        for n in range(1, args.saves + 1):
            if not args.no_step:
                train_step(engine, [batch], stop, lambda e, b: forward_loss(e, b, **loss_kwargs))
            state = {"step": n, "world_size": dist.world_size}
            started = time.perf_counter()
            folder = checkpoint.save(engine, root, n, state, hf_config.to_json_string(), dist, keep=1)
            stalls.append(time.perf_counter() - started)
            loads.append(os.getloadavg()[0])
            print(f"save {n}: {stalls[-1]:.2f} s, load {loads[-1]:.1f}", file=sys.stderr, flush=True)
        # The transfer's committed folder writes its own record (a bucket checkpoint's is `complete` too).
        sizes = {p.name: p.stat().st_size for p in folder.iterdir()
                 if p.is_file() and p.name != checkpoint.COMPLETE_MARKER}
        gib = sum(sizes.values()) / 2**30
        # What a save that writes in the background would still stall for: a copy of every tensor it saves.
        snapshots = []
        for _ in range(0 if args.no_step else 3):
            started = time.perf_counter()
            copy = tensors_copied([engine.module.state_dict(), engine.optimizer.state_dict()])
            snapshots.append(time.perf_counter() - started)
            copied = sum(t.numel() * t.element_size() for t in copy) / 2**30
            del copy
        moved: dict[bool, tuple[float, float]] = {}
        with bench_transfers.store(args.mib_per_s, args.rtt_ms):
            for one_stream in () if args.no_transfers else (True, False):
                moved[one_stream] = bench_transfers.transfer(f"s3://bench-transfers/{args.preset}-{one_stream}",
                                                             folder, sizes, one_stream, read_timeout=900)
                loads.append(os.getloadavg()[0])
                print(("one stream" if one_stream else "now"), moved[one_stream], file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mib = gib * 1024
    stall = statistics.median(stalls)
    print(f"| {args.preset} ({parameters / 1e6:,.0f} M parameters), ZeRO-{args.zero} {args.precision}, "
          f"{dist.world_size} rank(s), {dist.device.type}; loopback moto S3, "
          f"{bench_transfers.link(args.mib_per_s, args.rtt_ms)}; load {min(loads):.1f}-{max(loads):.1f} | |\n|---|---|")
    print(f"| checkpoint (one rank's folder: {len(sizes)} files) | {gib:.2f} GiB |")
    print(f"| stall per save (checkpoint.save; median of {len(stalls)}: "
          f"{', '.join(f'{s:.1f}' for s in stalls)} s) | {stall:.1f} s ({gib / stall:.2f} GiB/s) |")
    if snapshots:
        snapshot = statistics.median(snapshots)
        print(f"| a copy in RAM of every saved tensor ({copied:.2f} GiB; median of 3: "
              f"{', '.join(f'{s:.1f}' for s in snapshots)} s) | {snapshot:.1f} s ({copied / snapshot:.2f} GiB/s) |")
    for i, what in enumerate(("upload (put + commit)", "download (fetch)") if moved else ()):
        one, now = mib / moved[True][i], mib / moved[False][i]
        print(f"| {what}: one stream / now | {one:.0f} s / {now:.0f} s ({moved[False][i] / moved[True][i]:.2f}x) |")


if __name__ == "__main__":
    main()
