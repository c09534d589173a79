"""Stage 3 with the run folder in a bucket: what the mirror costs, and how fast a preempted run stops and resumes.

Needs a finished stage 2 (e.g. after `bash demo.sh`: demo/config.yaml). Starts moto's S3 server on a loopback
port (pip install s3fs "moto[server]"), so the network is as fast as it gets and the figures isolate gptpipe's
own costs: the training loop with uploads in the background, the SIGTERM save and upload, the download.

    .venv/bin/python bench/bench_storage.py --config demo/config.yaml [--preset tiny] [--steps 40] [--save-interval 10]

  tokens/s         median over the log steps of the run, local run folder vs s3:// (checkpoints every --save-interval)
  SIGTERM → exit   seconds from the signal to exit 75 with the checkpoint committed in the bucket
  resume           seconds from the start of a fresh machine's process (empty staging folder) to its first step
It prints a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUICK = ("train.seq_len=128", "train.global_batch_size=8", "train.eval_iters=1", "train.eval_interval=100000",
         "train.log_interval=1", "train.sample_prompts=[]", "train.train_tokens=null", "train.train_epochs=1",
         "logging.wandb=false", "logging.tensorboard=false", "train.precision=fp32")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(config: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "gptpipe", "train", "--config", str(config), *QUICK, *overrides]


def speeds(metrics: Path) -> list[float]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r["tokens_per_s"] for r in rows if "tokens_per_s" in r][2:]  # the first steps warm up


def wait_for_step(metrics: Path, step: int, process: subprocess.Popen) -> None:
    while not (metrics.is_file() and f'"step": {step},' in metrics.read_text()):
        if process.poll() is not None:
            raise SystemExit(f"training stopped early:\n{process.stderr.read()[-3000:]}")
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-interval", type=int, default=10)
    args = parser.parse_args()

    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}",
           "WANDB_MODE": "offline", "PYTHONWARNINGS": "ignore", "TQDM_DISABLE": "1"}
    os.environ.update({k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                           "AWS_ENDPOINT_URL_S3")})
    import fsspec

    fsspec.filesystem("s3").mkdir("bench")
    work = Path(tempfile.mkdtemp(prefix="bench-storage-"))
    common = (f"model.preset={args.preset}", f"train.train_iters={args.steps}",
              f"train.save_interval={args.save_interval}", "train.keep_checkpoints=2")
    rows = []
    try:
        local = subprocess.run(command(args.config, *common, f"train.output_model_dir={work / 'local'}"), env=env,
                               capture_output=True, text=True)
        assert local.returncode == 0, local.stderr[-3000:]
        bucket = subprocess.run(command(args.config, *common, "train.output_model_dir=s3://bench/runs/a",
                                        f"train.local_dir={work / 'a'}"), env=env, capture_output=True, text=True)
        assert bucket.returncode == 0, bucket.stderr[-3000:]
        local_speed = statistics.median(speeds(work / "local" / "metrics.jsonl"))
        bucket_speed = statistics.median(speeds(work / "a" / "metrics.jsonl"))
        size = sum(p.stat().st_size for p in (work / "local" / "checkpoints").glob("global_step*/*"))
        size /= len(list((work / "local" / "checkpoints").glob("global_step*")))
        rows.append(("tokens/s, run folder local", f"{local_speed:,.0f}"))
        rows.append((f"tokens/s, run folder in s3:// (save every {args.save_interval})",
                     f"{bucket_speed:,.0f} ({bucket_speed / local_speed - 1:+.1%})"))
        rows.append(("checkpoint size", f"{size / 2**20:,.0f} MiB"))

        process = subprocess.Popen(command(args.config, *common, "train.train_iters=100000",
                                           "train.save_interval=100000", "train.output_model_dir=s3://bench/runs/b",
                                           f"train.local_dir={work / 'b'}"),
                                   env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wait_for_step(work / "b" / "metrics.jsonl", 3, process)
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate()
        stop_s = time.monotonic() - started
        assert process.returncode == 75 and "the run is mirrored" in stderr, stderr[-3000:]
        rows.append(("SIGTERM → exit 75, checkpoint committed in the bucket", f"{stop_s:.1f} s"))

        shutil.rmtree(work / "b")
        started = time.monotonic()
        process = subprocess.Popen(command(args.config, *common, "train.train_iters=100000",
                                           "train.save_interval=100000", "train.output_model_dir=s3://bench/runs/b",
                                           f"train.local_dir={work / 'b'}"),
                                   env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        saved = int(stderr.split("checkpoint at step ")[1].split(";")[0])
        wait_for_step(work / "b" / "metrics.jsonl", saved + 1, process)
        first = time.monotonic() - started
        process.send_signal(signal.SIGKILL)
        process.wait()
        rows.append(("fresh machine: start → first step after the download (process start included)",
                     f"{first:.1f} s"))
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"| {args.preset}, {args.steps} steps, loopback moto S3 | |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
