"""Stage-2 speed: gptpipe tokenize vs sentencepiece's own batch encode vs Megatron-LM's preprocess_data.py.

Needs a finished stage 0 and stage 1 (e.g. after `bash demo.sh`: demo/config.yaml, the man-page corpus and the
32k tokenizer). Run it on a quiet machine; it prints a markdown table for docs/benchmarks.md.

    .venv/bin/python bench/bench_tokenize.py --config demo/config.yaml [--workers 1 2] [--repeat 3]

All MB/s figures are UTF-8 bytes of the documents' text per second (per core: divided by the workers), so
they compare like with like; Megatron's own log line counts MiB of JSON characters instead.
  sp encode      sentencepiece's batch encode of the texts already in memory (lists of ints, its default
                 output, is the reference; gptpipe asks it for numpy arrays)
  gptpipe        stage 2 end to end (read, split, parse, encode, write parts, concatenate, .idx), in-process
  whole process  `python -m gptpipe tokenize --force` wall time, imports and start-up included

Megatron-LM side by side (its code is never part of this project): check out the release matching the installed
megatron-core outside the project and give its tools the two packages they import but gptpipe does not need:

    git clone https://github.com/NVIDIA/Megatron-LM /tmp/Megatron-LM
    git -C /tmp/Megatron-LM checkout core_v0.16.1          # = `pip show megatron-core`
    .venv/bin/pip install --no-deps --target /tmp/megatron-deps six triton
    .venv/bin/python bench/bench_tokenize.py --config demo/config.yaml \\
        --megatron-lm /tmp/Megatron-LM --megatron-pythonpath /tmp/megatron-deps

It runs tools/preprocess_data.py (SentencePieceTokenizer, --append-eod, same workers), reports its encoding
loop per core and its whole-process time, and checks that its .bin/.idx are byte-identical to gptpipe's.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import sentencepiece as spm

from gptpipe.config.core import load_config
from gptpipe.pipeline import PipelineConfig
from gptpipe.data.indexed import bin_path, idx_path, token_dtype
from gptpipe.data.tokenize import log, tokenize_files
from gptpipe.taskpool import TaskPool, local_cores as default_workers
from gptpipe.data.worker import WorkerSettings
from gptpipe.artifacts import read_tokenizer

os.environ.setdefault("TQDM_DISABLE", "1")  # no progress bars in the timings


def best_time(function, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - started)
    return best


def same_files(a: Path, b: Path) -> bool:
    return all(p(a).read_bytes() == p(b).read_bytes() for p in (bin_path, idx_path))


def megatron_run(args: argparse.Namespace, corpus: Path, model: Path, out: Path, workers: int,
                 documents: int) -> tuple[float, float]:
    """(whole-process seconds, encoding-loop seconds) of Megatron-LM's preprocess_data.py."""
    env = dict(os.environ)
    if args.megatron_pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(args.megatron_pythonpath), env.get("PYTHONPATH")]))
    command = [sys.executable, str(args.megatron_lm / "tools" / "preprocess_data.py"), "--input", str(corpus),
               "--output-prefix", str(out), "--tokenizer-type", "SentencePieceTokenizer",
               "--tokenizer-model", str(model), "--workers", str(workers), "--append-eod",
               "--log-interval", str(documents)]  # one progress line, at the last document
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"preprocess_data.py failed:\n{result.stderr[-3000:]}")
    rate = re.findall(r"Processed (\d+) documents \(([\d.]+) docs/s", result.stdout + result.stderr)
    done, docs_per_s = int(rate[-1][0]), float(rate[-1][1])
    return wall, done / docs_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("demo/config.yaml"))
    parser.add_argument("--workers", type=int, nargs="+", default=sorted({1, 2, default_workers()}))
    parser.add_argument("--repeat", type=int, default=3, help="best of this many runs per figure")
    parser.add_argument("--megatron-lm", type=Path, help="a Megatron-LM checkout outside the project")
    parser.add_argument("--megatron-pythonpath", type=Path, help="folder with six and triton for Megatron's tools")
    args = parser.parse_args()

    config = load_config(PipelineConfig, args.config)
    cfg = config.tokenize
    info = read_tokenizer(cfg.tokenizer_dir)
    files = cfg.input
    texts = [orjson.loads(line)[cfg.text_key] for path in files for line in open(path, "rb") if line.strip()]
    text_mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    file_mb = sum(p.stat().st_size for p in files) / 1e6
    print(f"corpus: {', '.join(map(str, files))}: {len(texts):,} documents, {text_mb:.1f} MB of text "
          f"({file_mb:.1f} MB of jsonl); tokenizer {info.model_path} (vocab {info.vocab_size:,}); "
          f"{default_workers()} cores", flush=True)

    load = best_time(lambda: spm.SentencePieceProcessor(model_file=str(info.model_path)), args.repeat)
    sp = spm.SentencePieceProcessor(model_file=str(info.model_path))
    sp_one = best_time(lambda: sp.encode(texts, num_threads=1), args.repeat)
    rows = [("sp encode → lists, 1 thread", 1, sp_one, None, None),
            ("sp encode → numpy, 1 thread", 1,
             best_time(lambda: sp.encode(texts, num_threads=1, return_type="numpy"), args.repeat), None, None),
            (f"sp encode → lists, {default_workers()} threads", default_workers(),
             best_time(lambda: sp.encode(texts, num_threads=default_workers()), args.repeat), None, None)]
    print(f"loading the tokenizer takes {load:.3f} s (once per worker, inside the gptpipe figures)")

    settings = WorkerSettings(model_path=str(info.model_path), eod_id=info.eod_id,
                              dtype=token_dtype(info.vocab_size).name, text_key=cfg.text_key,
                              max_chars=cfg.max_document_chars, max_line_bytes=cfg.max_line_bytes,
                              block_bytes=4 << 20, parts_dir="")
    cfg.dataset_prefix.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench_tokenize_", dir=cfg.dataset_prefix.parent) as tmp:
        tmp_dir = Path(tmp)
        reference = tmp_dir / "gptpipe_w1"
        for workers in args.workers:
            prefix = tmp_dir / f"gptpipe_w{workers}"
            seconds = best_time(lambda prefix=prefix, workers=workers: tokenize_files(
                files, prefix, settings, TaskPool("local", workers, None, log, ""), 0, None), args.repeat)
            assert same_files(prefix, reference), "the output depends on the number of workers"
            whole = best_time(lambda workers=workers: subprocess.run(
                [sys.executable, "-m", "gptpipe", "tokenize", "--config", str(args.config), "--force",
                 f"tokenize.output_prefix={tmp_dir / 'whole'}", f"tokenize.workers={workers}"],
                check=True, capture_output=True), args.repeat)
            rows.append((f"gptpipe, {workers} worker(s)", workers, seconds, whole, None))

        if args.megatron_lm:
            if len(files) != 1:
                raise SystemExit("the Megatron comparison takes a single input file")
            for workers in args.workers:
                out = tmp_dir / f"megatron_w{workers}"
                whole, loop = megatron_run(args, files[0], info.model_path, out, workers, len(texts))
                identical = same_files(Path(f"{out}_text_document"), reference)
                rows.append((f"Megatron preprocess_data.py, {workers} worker(s)", workers, loop, whole, identical))

    sp_per_core = text_mb / sp_one
    print("\n| what | workers | seconds | MB/s | MB/s per core | vs sp encode per core | whole process s "
          "| output = gptpipe's |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, workers, seconds, whole, identical in rows:
        rate = text_mb / seconds
        print(f"| {name} | {workers} | {seconds:.2f} | {rate:.1f} | {rate / workers:.1f} "
              f"| {rate / workers / sp_per_core:.0%} | {'' if whole is None else f'{whole:.2f}'} "
              f"| {'' if identical is None else ('yes' if identical else 'NO')} |")
    ours = {w: (s, whole) for name, w, s, whole, _ in rows if name.startswith("gptpipe")}
    if 1 in ours and 2 in ours:
        print(f"\nscaling 1 → 2 workers: {ours[1][0] / ours[2][0]:.2f}x (2.00x is linear)")
    for name, workers, seconds, whole, _ in rows:
        if name.startswith("Megatron") and workers in ours:
            print(f"{workers} worker(s): per core {seconds / ours[workers][0]:.2f}x Megatron's encoding loop, "
                  f"whole process {whole / ours[workers][1]:.2f}x faster ({ours[workers][1]:.2f} s vs {whole:.2f} s)")


if __name__ == "__main__":
    main()
