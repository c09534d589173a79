"""Stage-7 speed: fine-tune tokens/s against stage 3's on the same model, and predict rows/s greedy vs beam 4.

    python bench/bench_finetune.py --pipeline-config demo/config.yaml --model demo/models/hf/demo \
        --task demo/data/finetune/manpage_section [--steps 30] [--rounds 2] [--threads 2]

Training runs as a user runs it, one rank each: `gptpipe train` (stage 3: the pipeline config's model, random
init, on its tokenized dataset) and `gptpipe finetune` (the stage-4 folder of that model, on the task's training
rows), alternated round by round so a machine shared with other jobs slows both alike. Each figure is the median
of a run's logged windows after the first (warm-up); no evaluation or checkpoint falls inside a window. Stage 3's
rows are seq_len tokens, all real; a fine-tune step computes its micro-batch padded to its longest row and the
loss covers the label tokens only, so its real tokens/s (prompt + label + EOS) is rows/s × mean row length, and
its computed positions/s is rows/s × the mean longest row of a batch (both from the task's rows as the fine-tune
encodes them). Pick stage 3's seq_len × batch near the fine-tune's computed positions per step: the optimizer
step costs the same whatever the batch, so equal work per step compares like with like.

Predict: the best checkpoint of a fine-tune run (--run, e.g. the demo's runs/finetune-demo; else the short run
trained above) on the task's test rows, greedy and beam 4, in this process (gptpipe.finetune.predict, the code
`gptpipe predict` runs), alternated, model load excluded. --predict-only skips the training comparison.
Prints markdown rows for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

QUIET = ("logging.wandb=false", "logging.tensorboard=false", "train.precision=fp32", "train.eval_interval=1000000",
         "train.save_interval=1000000")


def gptpipe(*argv: object, threads: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "WANDB_MODE": "offline"}
    done = subprocess.run([sys.executable, "-m", "gptpipe", *map(str, argv)], env=env, capture_output=True,
                          text=True, check=False)
    if done.returncode:
        sys.exit(f"gptpipe {argv[0]} failed:\n{done.stderr[-3000:]}")


def window_rates(run: Path, key: str) -> list[float]:
    """The `key` of every logged training window but the first."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    return [r[key] for r in rows if key in r][1:]


def row_lengths(model: Path, train: Path, prompt: str, seq_len: int, batch: int) -> tuple[float, float]:
    """(mean tokens per row, mean longest row per batch of `batch` random rows), encoded as the fine-tune does."""
    from transformers import AutoTokenizer

    from gptpipe.finetune.data import Encoder, Skipped, read_rows

    encoder = Encoder(AutoTokenizer.from_pretrained(model), prompt, seq_len, seq2seq=False)
    rows, _ = read_rows(train, "auto")
    lengths = np.array([len(e.input_ids) for e in (encoder.encode(r, Skipped()) for r in rows) if e is not None])
    rng = np.random.default_rng(0)
    longest = [lengths[rng.permutation(len(lengths))[:batch]].max() for _ in range(2000)]
    return float(lengths.mean()), float(np.mean(longest))


def bench_training(args: argparse.Namespace, tmp: Path) -> tuple[list[str], Path]:
    from gptpipe.config.core import load_config
    from gptpipe.finetune.config import FinetuneConfig

    ft_config = load_config(FinetuneConfig, args.finetune_config, list(args.finetune_overrides))
    mean_len, padded_len = row_lengths(args.model, args.task / "train.tsv", ft_config.task.prompt,
                                       ft_config.train.seq_len, ft_config.train.global_batch_size)
    few = tmp / "validation.tsv"  # the end-of-run evaluation is not measured: keep it short
    few.write_text("".join((args.task / "validation.tsv").read_text(encoding="utf-8").splitlines(True)[:8]),
                   encoding="utf-8")
    stage3, finetune = [], []
    for r in range(args.rounds):
        run = tmp / f"pretrain{r}"
        gptpipe("train", "--config", args.pipeline_config, f"train.output_model_dir={run}",
                f"train.train_iters={args.steps}", f"train.seq_len={args.stage3_seq}",
                f"train.global_batch_size={args.stage3_batch}", "train.log_interval=5", "train.train_tokens=null",
                "train.sample_prompts=[]", "train.eval_iters=1", *QUIET, threads=args.threads)
        stage3 += window_rates(run, "tokens_per_s")
        run = tmp / f"finetune{r}"
        gptpipe("finetune", "--config", args.finetune_config, f"model.path={args.model}",
                f"data.train={args.task / 'train.tsv'}", f"data.validation={few}", f"train.output_model_dir={run}",
                f"train.train_iters={args.steps}", "train.log_interval=5", *QUIET, *args.finetune_overrides,
                threads=args.threads)
        finetune += window_rates(run, "rows_per_s")
    rows_s = statistics.median(finetune)
    s3 = statistics.median(stage3)
    tokens_per_step = args.stage3_seq * args.stage3_batch
    gbs = ft_config.train.global_batch_size
    lines = [
        "| run | rows/step | tokens/step (computed) | tokens/s real | positions/s computed | vs stage 3 |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| stage 3 (`gptpipe train`, seq {args.stage3_seq}) | {args.stage3_batch} | {tokens_per_step} | {s3:,.0f} | "
        f"{s3:,.0f} | 1.00 |",
        f"| stage 7 (`gptpipe finetune`, label-only loss) | {gbs} | {gbs * padded_len:,.0f} | {rows_s * mean_len:,.0f} "
        f"| {rows_s * padded_len:,.0f} | {rows_s * padded_len / s3:.2f} computed, {rows_s * mean_len / s3:.2f} real |",
        "", f"({len(stage3)} + {len(finetune)} windows of 5 steps; fine-tune rows: {mean_len:.1f} tokens on average, "
            f"the longest of a batch {padded_len:.1f}; {rows_s:.1f} rows/s)"]
    return lines, tmp / "finetune0"


def bench_predict(args: argparse.Namespace, run: Path) -> list[str]:
    import torch

    from gptpipe.config.core import load_config
    from gptpipe.finetune.config import FinetuneConfig
    from gptpipe.finetune.data import read_rows
    from gptpipe.finetune.predict import load_predictor, predict_rows
    from gptpipe.train.engine import setup_distributed

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
