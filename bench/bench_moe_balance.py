"""Mixtral routing balanced by the per-layer load-balancing loss vs DeepSeek-V3's selection bias (issue 45), on CPU.

The run of tests/test_moe_balance.py's routing test (4 layers of 8 experts, top-2, width 64, from scratch; 200 steps
of 8 x 128 tokens at lr 3e-3, validated every 50 steps on 64 held-out samples) with `model.moe_balance` aux_loss
(router_aux_loss_coef 0.01, the default) and bias (each --rate), for each --seed (data order: `data.seed`; the weights'
seed stays the config's). Prints, per validation, each layer's smallest share of the top-2 choices, the experts under a
quarter of a fair share (of 32) and the validation loss, then one line per run at the closing validation.

A workspace is a folder holding a config.yaml whose data is tokenized (stage 2 done), e.g. the tests' shared
`pipeline` folder (pytest's basetemp/.../pipeline after any test that trains):

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_moe_balance.py --workspace /tmp/pt-moe/shared/pipeline \
        --seeds 1 2 3 --rates 1e-3 1e-2

(figures in docs/benchmarks.md, "Mixtral routing")
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from gptpipe.runtime.metrics_rows import ValidationRow, of_kind, read_metrics

MOE = ("model.arch=mixtral", "model.preset=custom", "model.num_layers=4", "model.hidden_size=64",
       "model.num_attn_heads=4", "model.num_kv_heads=4", "model.ffn_hidden_size=128", "model.num_experts=8",
       "model.experts_top_k=2")
RUN = ("train.train_iters=200", "train.seq_len=128", "train.global_batch_size=8", "train.lr=3e-3", "train.min_lr=3e-4",
       "train.warmup_steps=10", "train.eval_interval=50", "train.log_interval=10", "train.eval_iters=8",
       "train.precision=fp32", "train.save_interval=1000", "train.sample_prompts=[]", "train.train_tokens=null",
       "train.train_epochs=1", "logging.wandb=false", "logging.tensorboard=false")


def validations(out: Path) -> list[ValidationRow]:
    return of_kind(read_metrics(out / "metrics.jsonl"), ValidationRow)


def train(workspace: Path, out: Path, balance: str, seed: int, rate: float | None) -> tuple[list[ValidationRow], float]:
    """The validation rows of one run (rerun only when its folder has no closing one) and its wall seconds."""
    if any(row.step == 200 for row in validations(out)):
        return validations(out), float("nan")
    extra = [f"model.moe_balance={balance}", f"data.seed={seed}"] + (
        [f"model.moe_bias_update_rate={rate}"] if rate is not None else [])
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "gptpipe", "train", "--config", str(workspace / "config.yaml"), *MOE,
                           *RUN, *extra, f"train.output_model_dir={out}"], capture_output=True, text=True,
                          env={**os.environ, "WANDB_MODE": "offline"})
    if done.returncode != 0:
        raise SystemExit(f"{out}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return validations(out), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workspace", type=Path, required=True, help="folder with config.yaml and its stage-2 data")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench-moe-balance"), help="where the runs go")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234], help="data.seed of each pair of runs")
    parser.add_argument("--rates", type=float, nargs="+", default=[1e-3], help="moe_bias_update_rate of bias runs")
    args = parser.parse_args()
    closing = []
    for seed in args.seeds:
        for balance, rate in [("aux_loss", None), *(("bias", r) for r in args.rates)]:
            name = f"{balance}{'' if rate is None else f'-{rate:g}'}-seed{seed}"
            rows, seconds = train(args.workspace, args.workdir / name, balance, seed, rate)
            print(f"\n{name} ({seconds:.0f} s)")
            for row in rows:
                shares = " / ".join(f"{100 * s:.2f}" for s in row.expert_share_min)
                print(f"  step {row.step:>3}  smallest share {shares} %  starved {row.experts_starved:>2}  "
                      f"val_loss {row.val_loss:.4f}")
            closing.append((name, rows[-1]))
    print("\n| run | smallest share per layer (0/1/2/3) | experts under ¼ of a fair share | validation loss |")
    print("|---|---|---|---|")
    for name, row in closing:
        shares = " / ".join(f"{100 * s:.2f}" for s in row.expert_share_min)
        print(f"| {name} | {shares} % | {row.experts_starved} | {row.val_loss:.4f} |")


if __name__ == "__main__":
    main()
