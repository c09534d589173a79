"""Stage-7 speed: fine-tune tokens/s against stage 3's on the same model, and predict rows/s greedy vs beam 4.

    python bench/bench_finetune.py --pipeline-config demo/config.yaml --model demo/models/hf/demo \
        --task demo/data/finetune/manpage_section [--steps 30] [--rounds 2] [--threads 2]

Training runs as a user runs it, one rank each: `gptpipe train` (stage 3: the pipeline config's model, random
init, on its tokenized dataset) and `gptpipe finetune` (the stage-4 folder of that model, on the task's training
rows) three ways: micro-batches drawn at random and padded to their longest row (train.group_by_length=false),
grouped by length (the default) and packed (train.packing=true, not grouped). The runs alternate round by round,
so a machine shared with other jobs slows all of them alike; the load average is printed before and after.
Each figure is the median of a run's logged windows after the first (warm-up); no evaluation or checkpoint falls
inside a window. Stage 3's rows are seq_len tokens, all real; the fine-tune logs its real tokens/s (prompt +
label + EOS, no padding) and the padding share of the positions it computed, so its computed positions/s is
real / (1 - padding). Pick stage 3's seq_len x batch near the fine-tune's computed positions per step: the
optimizer step costs the same whatever the batch, so equal work per step compares like with like.

Predict: the best checkpoint of a fine-tune run (--run, e.g. the demo's runs/finetune-demo; else the short run
trained above) on the task's test rows, greedy and beam 4, in this process (gptpipe.finetune.predict, the code
`gptpipe predict` runs), alternated, model load excluded. --predict-only skips the training comparison.
Prints markdown rows for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gptpipe.runtime.metrics_rows import TrainRow, of_kind, read_metrics

QUIET = ("logging.wandb=false", "logging.tensorboard=false", "train.precision=fp32", "train.eval_interval=1000000",
         "train.save_interval=1000000")


def gptpipe(*argv: object, threads: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "WANDB_MODE": "offline"}
    done = subprocess.run([sys.executable, "-m", "gptpipe", *map(str, argv)], env=env, capture_output=True,
                          text=True, check=False)
    if done.returncode:
        sys.exit(f"gptpipe {argv[0]} failed:\n{done.stderr[-3000:]}")


def windows(run: Path) -> list[TrainRow]:
    """Every logged training window but the first."""
    return of_kind(read_metrics(run / "metrics.jsonl"), TrainRow)[1:]


# The fine-tune's batch layouts: (name in the table, overrides).
LAYOUTS = (("padded to the longest row, random draw", ("train.group_by_length=false",)),
           ("grouped by length (default)", ("train.group_by_length=true",)),
           ("packed (train.packing=true)", ("train.packing=true", "train.group_by_length=false")))


def bench_training(args: argparse.Namespace, tmp: Path) -> tuple[list[str], Path]:
    from gptpipe.config.core import load_config
    from gptpipe.finetune.config import FinetuneConfig

    gbs = load_config(FinetuneConfig, args.finetune_config, list(args.finetune_overrides)).train.global_batch_size
    few = tmp / "validation.tsv"  # the end-of-run evaluation is not measured: keep it short
    few.write_text("".join((args.task / "validation.tsv").read_text(encoding="utf-8").splitlines(True)[:8]),
                   encoding="utf-8")
    load = [os.getloadavg()]
    stage3: list[float] = []
    finetune: dict[str, list[TrainRow]] = {name: [] for name, _ in LAYOUTS}
    for r in range(args.rounds):
        run = tmp / f"pretrain{r}"
        gptpipe("train", "--config", args.pipeline_config, f"train.output_model_dir={run}",
                f"train.train_iters={args.steps}", f"train.seq_len={args.stage3_seq}",
                f"train.global_batch_size={args.stage3_batch}", "train.log_interval=5", "train.train_tokens=null",
                "train.sample_prompts=[]", "train.eval_iters=1", *QUIET, threads=args.threads)
        stage3 += [w.tokens_per_s for w in windows(run)]
        for k, (name, layout) in enumerate(LAYOUTS):
            run = tmp / f"finetune{r}-{k}"
            gptpipe("finetune", "--config", args.finetune_config, f"model.path={args.model}",
                    f"data.train={args.task / 'train.tsv'}", f"data.validation={few}",
                    f"train.output_model_dir={run}", f"train.train_iters={args.steps}", "train.log_interval=5",
                    *QUIET, *layout, *args.finetune_overrides, threads=args.threads)
            finetune[name] += windows(run)
        load.append(os.getloadavg())
    s3 = statistics.median(stage3)
    lines = [
        "| run | rows/step | real tokens/step | padding | tokens/s real | positions/s computed | real vs stage 3 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| stage 3 (`gptpipe train`, seq {args.stage3_seq}) | {args.stage3_batch} | "
        f"{args.stage3_seq * args.stage3_batch} | 0% | {s3:,.0f} | {s3:,.0f} | 1.00 |"]
    for name, rows in finetune.items():
        real = statistics.median(w.tokens_per_s for w in rows)
        padding = statistics.median(w.padding for w in rows)
        per_step = statistics.median(w.tokens_per_s / w.rows_per_s * gbs for w in rows)
        lines.append(f"| stage 7 (`gptpipe finetune`), {name} | {gbs} | {per_step:.0f} | {padding:.0%} | "
                     f"{real:,.0f} | {real / (1 - padding):,.0f} | {real / s3:.2f} |")
    lines += ["", f"({len(stage3)} windows of 5 steps for stage 3, {len(rows)} per fine-tune layout; load average "
                  f"(1/5/15 min) {' -> '.join('/'.join(f'{x:.1f}' for x in avg) for avg in load)}, "
                  f"round by round)"]
    return lines, tmp / "finetune0-1"


def bench_predict(args: argparse.Namespace, run: Path) -> list[str]:
    import torch

    from gptpipe.config.core import load_config
    from gptpipe.finetune.config import FinetuneConfig
    from gptpipe.finetune.data import read_rows
    from gptpipe.finetune.predict import load_predictor, predict_rows
    from gptpipe.runtime.engine import setup_distributed

    torch.set_num_threads(args.threads)
    dist = setup_distributed()
    config = load_config(FinetuneConfig, args.finetune_config, [*args.finetune_overrides,
                                                                f"predict.max_new_tokens={args.max_new_tokens}"])
    predictor = load_predictor(config, run, dist.device)
    rows, _ = read_rows(args.task / "test.tsv", "auto")
    times: dict[int, list[float]] = {1: [], 4: []}
    accuracy: dict[int, float] = {}
    for _ in range(args.rounds):
        for beams, spent in times.items():
            config.predict.num_beams = beams
            started = time.perf_counter()
            results = predict_rows(predictor.model, predictor, rows, config, dist, synced=False)
            spent.append(time.perf_counter() - started)
            accuracy[beams] = sum(r["prediction"] == r.get("label") for r in results) / len(results)
    lines = [f"| search | rows | batch | wall (median of {args.rounds}) | rows/s | test accuracy |",
             "| --- | --- | --- | --- | --- | --- |"]
    for beams, spent in times.items():
        wall = statistics.median(spent)
        lines.append(f"| {'greedy' if beams == 1 else f'beam {beams}'} | {len(rows)} | {config.predict.batch_size} | "
                     f"{wall:.1f} s | {len(rows) / wall:.1f} | {accuracy[beams]:.3f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline-config", type=Path, default=Path("demo/config.yaml"))
    parser.add_argument("--finetune-config", type=Path, default=Path("finetune_config.yaml"))
    parser.add_argument("--model", type=Path, default=Path("demo/models/hf/demo"), help="the stage-4 folder")
    parser.add_argument("--task", type=Path, default=Path("demo/data/finetune/manpage_section"))
    parser.add_argument("--steps", type=int, default=30, help="training steps per run (windows of 5)")
    parser.add_argument("--stage3-seq", type=int, default=32)
    parser.add_argument("--stage3-batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--run", type=Path, default=None, help="fine-tune run to predict with (default: the bench's)")
    parser.add_argument("--predict-only", action="store_true", help="only the predict comparison (needs --run)")
    parser.add_argument("finetune_overrides", nargs="*", help="finetune_config keys, e.g. train.global_batch_size=32")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-finetune-") as tmp:
        run = args.run
        if not args.predict_only:
            training, run = bench_training(args, Path(tmp))
            print("\n".join(training) + "\n")
        print("\n".join(bench_predict(args, args.run or run)))


if __name__ == "__main__":
    main()
