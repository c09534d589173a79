"""Stage 3 with the run folder in a bucket: what the mirror costs, and how fast a preempted run stops and resumes.

Needs a finished stage 2 (e.g. after `bash demo.sh`: demo/config.yaml). Starts moto's S3 server on a loopback
port (pip install s3fs "moto[server]"), so the network is as fast as it gets and the figures isolate gptpipe's
own costs: the training loop with uploads in the background, the SIGTERM save and upload, the download.

    .venv/bin/python bench/bench_storage.py --config demo/config.yaml [--preset tiny] [--steps 40] [--save-interval 10]

  tokens/s         over the run's training time (the log windows, saves excluded), local run folder vs s3://
                   (checkpoints every --save-interval); --rounds alternates local and bucket runs so that other load
                   on the machine hits both alike (each kind goes first in turn), and the cost is the median of
                   each round's bucket/local ratio.
                   --control adds a second local run to each round: its ratio to the first is the noise of
                   identical runs. Beside it the CPU seconds of the training process (and its uploader) and of the
                   moto server, and the load average.
  --moto-nice N    the moto server runs in its own process at this niceness (default 0). A real store's CPU is
                   not the training machine's; on loopback moto costs 3x the uploader's CPU (1.6 s against 0.5 s
                   per 141 MiB), so 19 approximates a remote store; 0 charges the whole server to the training.
  SIGTERM → exit   seconds from the signal to exit 75 with the checkpoint committed in the bucket
  resume           seconds from the start of a fresh machine's process (empty staging folder) to its first step
  --direct-gib G   instead: a checkpoint of G GiB (e.g. 2.0, the 125m preset's, `gptpipe plan` "disk") made of
                   filler files, uploaded through the mirror (submit, then finish as after SIGTERM) and restored
                   into an empty staging folder, timed without training (for sizes too slow to train on CPU)
It prints a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gptpipe.ports import free_port
from gptpipe.runtime.metrics_rows import TrainRow, of_kind, read_metrics

QUICK = ("train.seq_len=128", "train.global_batch_size=8", "train.eval_iters=1", "train.eval_interval=100000",
         "train.log_interval=1", "train.sample_prompts=[]", "train.train_tokens=null", "train.train_epochs=1",
         "logging.wandb=false", "logging.tensorboard=false", "train.precision=fp32")


def command(config: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "gptpipe", "train", "--config", str(config), *QUICK, *overrides]


def speed(metrics: Path) -> float:
    """Tokens/s over the run's log windows (their tokens / their seconds), the first 2 steps (warm-up) left out."""
    rows = of_kind(read_metrics(metrics), TrainRow)
    tokens = [b.tokens - a.tokens for a, b in zip(rows[1:], rows[2:])]
    return sum(tokens) / sum(t / r.tokens_per_s for t, r in zip(tokens, rows[2:]))


MOTO = ("from moto.server import ThreadedMotoServer; import time\n"
        "ThreadedMotoServer(ip_address='127.0.0.1', port={port}, verbose=False).start()\n"
        "time.sleep(1e9)")
MOTO_PID = 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed_run(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Run argv to completion; (CPU seconds of the child and its children, of the moto server meanwhile)."""
    child, moto = children_cpu(), cpu_seconds(MOTO_PID)
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return children_cpu() - child, cpu_seconds(MOTO_PID) - moto


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
    parser.add_argument("--rounds", type=int, default=2, help="local/bucket run pairs, alternated")
    parser.add_argument("--control", action="store_true", help="a second local run each round (the noise)")
    parser.add_argument("--moto-nice", type=int, default=0, help="niceness of the moto server's process")
    parser.add_argument("--skip-stop", action="store_true", help="only the tokens/s comparison")
    parser.add_argument("--direct-gib", type=float, help="only the mirror's upload and download of a checkpoint of "
                        "this size")
    parser.add_argument("--before-src", type=Path, help="also a bucket run on these sources (the src/ of an earlier "
                        "commit, e.g. from git archive), for before/after figures in the same rounds")
    args = parser.parse_args()

    port = free_port()
    # `nice` execs the interpreter: the pid is the server's
    server = subprocess.Popen(["nice", "-n", str(args.moto_nice), sys.executable, "-c", MOTO.format(port=port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}",
           "WANDB_MODE": "offline", "PYTHONWARNINGS": "ignore", "TQDM_DISABLE": "1"}
    os.environ.update({k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                           "AWS_ENDPOINT_URL_S3")})
    import fsspec

    for _ in range(200):  # the server's start
        try:
            fsspec.filesystem("s3", skip_instance_cache=True).mkdir("bench")
            break
        except OSError:
            time.sleep(0.1)
    global MOTO_PID
    MOTO_PID = server.pid
    work = Path(tempfile.mkdtemp(prefix="bench-storage-"))
    common = (f"model.preset={args.preset}", f"train.train_iters={args.steps}",
              f"train.save_interval={args.save_interval}", "train.keep_checkpoints=2")
    rows: list[tuple[str, str]] = []
    try:
        if args.direct_gib:
            rows += direct(args.direct_gib, work)
        else:
            if args.rounds:
                rows += speed_rows(args, env, work, common)
            if not args.skip_stop:
                rows += stop_rows(args, env, work, common)
    finally:
        server.kill()
        shutil.rmtree(work, ignore_errors=True)
    print_rows(args, rows)


def speed_rows(args: argparse.Namespace, env: dict[str, str], work: Path, common: tuple[str, ...]) -> list:
    """Tokens/s and CPU seconds of local and bucket runs, alternated --rounds times; costs as paired ratios."""
    rows = []
    load = [os.getloadavg()[0]]
    kinds = ("local", "bucket", *(("control",) if args.control else ()), *(("before",) if args.before_src else ()))
    runs: dict[str, list[tuple[float, float, float]]] = {kind: [] for kind in kinds}
    for round_ in range(args.rounds):
        for kind in kinds[round_ % len(kinds):] + kinds[:round_ % len(kinds)]:  # each kind first in turn
            folder = work / f"{kind}{round_}"
            where = (f"train.output_model_dir={folder}",) if kind in ("local", "control") else (
                f"train.output_model_dir=s3://bench/runs/{kind}{round_}", f"train.local_dir={folder}")
            run_env = {**env, "PYTHONPATH": str(args.before_src)} if kind == "before" else env
            child_cpu, moto_cpu = timed_run(command(args.config, *common, *where), run_env)
            runs[kind].append((speed(folder / "metrics.jsonl"), child_cpu, moto_cpu))
            load.append(os.getloadavg()[0])
    size = sum(p.stat().st_size for p in (work / "local0" / "checkpoints").glob("global_step*/*"))
    size /= len(list((work / "local0" / "checkpoints").glob("global_step*")))
    each = lambda kind: ", ".join(f"{r[0]:,.0f}" for r in runs[kind])

    def against_local(kind: str) -> str:
        """The median of the rounds' kind/local ratios, and their range."""
        ratios = [r[0] / l[0] - 1 for r, l in zip(runs[kind], runs["local"])]
        return (f"{statistics.median(r[0] for r in runs[kind]):,.0f}: {statistics.median(ratios):+.1%} "
                f"(rounds {min(ratios):+.1%} … {max(ratios):+.1%})")

    rows.append(("load average (1 min) before/between runs", " / ".join(f"{x:.1f}" for x in load)))
    rows.append((f"tokens/s, run folder local (runs: {each('local')})",
                 f"{statistics.median(r[0] for r in runs['local']):,.0f}"))
    rows.append((f"tokens/s, run folder in s3://, save every {args.save_interval} (runs: {each('bucket')}); "
                 f"against local", against_local("bucket")))
    if args.control:
        rows.append((f"control: a second local run each round (runs: {each('control')}); against local",
                     against_local("control")))
    if args.before_src:
        rows.append((f"the same on {args.before_src} (runs: {each('before')}); against local", against_local("before")))
    cpu = lambda kind, i: statistics.median(r[i] for r in runs[kind])
    rows.append((f"CPU s of the training process and its uploader, {' / '.join(kinds)} (median)",
                 " / ".join(f"{cpu(kind, 1):.0f}" for kind in kinds)))
    rows.append((f"CPU s of the moto server (nice {args.moto_nice}), {' / '.join(kinds)} (median)",
                 " / ".join(f"{cpu(kind, 2):.1f}" for kind in kinds)))
    rows.append(("checkpoint size", f"{size / 2**20:,.0f} MiB"))
    return rows


def stop_rows(args: argparse.Namespace, env: dict[str, str], work: Path, common: tuple[str, ...]) -> list:
    """SIGTERM → exit 75 with the upload done, then a fresh machine's start to its first step."""
    rows = []
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
    rows.append(("of which the upload (its log line)", stderr.split("[train] uploaded ")[-1].split("\n")[0]))

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
    _, resumed = process.communicate()
    rows.append(("fresh machine: start → first step after the download (process start included)",
                 f"{first:.1f} s"))
    rows.append(("of which the download (its log line)", resumed.split("[train] downloaded ")[-1].split("\n")[0]))
    return rows


def direct(gib: float, work: Path) -> list[tuple[str, str]]:
    """The mirror alone on a checkpoint of `gib` GiB: upload (submit + finish within the grace) and download."""
    from gptpipe.runtime import checkpoint
    from gptpipe.runtime.mirror import RunMirror

    url = "s3://bench/runs/direct"
    load = os.getloadavg()[0]
    mirror = RunMirror(url, work / "direct", None, keep=2, grace_s=3600)
    mirror.restore()  # an empty bucket: starts the uploader
    folder = work / "direct" / "checkpoints" / checkpoint.tag_of(1)
    folder.mkdir(parents=True)
    block = os.urandom(64 * 2**20)
    # The layout of a 1-rank ZeRO-1 fp32 checkpoint: weights (4 bytes a parameter), optimizer states (12 bytes)
    for name, share in (("mp_rank_00_model_states.pt", 0.25), ("zero_pp_rank_0_mp_rank_00_optim_states.pt", 0.75)):
        with open(folder / name, "wb") as fh:
            left = int(gib * 2**30 * share)
            while left > 0:
                fh.write(block[:left])
                left -= len(block)
    for name in (checkpoint.HF_CONFIG, checkpoint.STATE, "rng_state_rank0.pt", checkpoint.COMPLETE_MARKER):
        (folder / name).write_text("{}\n")
    started = time.monotonic()
    mirror.submit(1, folder)
    code = mirror.finish(75, 75)
    upload_s = time.monotonic() - started
    assert code == 75 and mirror.committed_step == 1
    started = time.monotonic()
    fresh = RunMirror(url, work / "fresh", None, keep=2, grace_s=3600)
    fresh.restore()
    download_s = time.monotonic() - started
    fresh.finish(0, 75)
    assert (work / "fresh" / "checkpoints" / checkpoint.tag_of(1) / "complete").is_file()
    size = sum(p.stat().st_size for p in folder.iterdir()) / 2**30
    return [("load average (1 min) at the start", f"{load:.1f}"),
            (f"{size:.2f} GiB checkpoint: submit → uploaded and committed (what SIGTERM waits for after the save)",
             f"{upload_s:.1f} s ({size * 1024 / upload_s:,.0f} MiB/s)"),
            (f"{size:.2f} GiB checkpoint: restore into an empty staging folder",
             f"{download_s:.1f} s ({size * 1024 / download_s:,.0f} MiB/s)")]


def print_rows(args: argparse.Namespace, rows: list[tuple[str, str]]) -> None:
    what = "the mirror alone" if args.direct_gib else f"{args.preset}, {args.steps} steps"
    print(f"| {what}, loopback moto S3 | |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
