"""Stages 0 and 2 at 1x and 10x of a corpus, on one worker, two worker processes and a two-node Ray cluster on
this machine (one CPU each), in one run: wall seconds, MB/s per core, the driver's peak RSS, and stage 0's
seconds per step (judging, the duplicate steps, the join), from which docs/benchmarks.md projects 1 TB and 10 TB.

    python 0_prepare_corpus.py corpus.join=true     # the man pages' stage-0 corpus as one file
    PYTHONPATH=src:tests python bench/bench_scale.py --pages data/corpus/corpus.jsonl [--scales 1 10]

The corpus is bench/bench_corpus_peer.py's: the documents of a stage-0 corpus.jsonl (`--pages`, the first
`--count`) and English man pages, then 2k-1 near copies of each page of 1,500+ characters for scale k, as one
jsonl. Stage 0 runs with `shard_mb` 2 (so that scale 1 has shards for two workers) and keeps Japanese; stage 1
trains an 8,000-piece tokenizer on scale 1's output once; stage 2 tokenizes each scale's whole input (stage
0's output is ~5 MB at any scale: the copies are dropped) with `task_bytes` 1 MB. Every run is a fresh process
(`gptpipe` through its CLI) that reports its own peak RSS (VmHWM); with local workers their largest peak is
reported too (RUSAGE_CHILDREN), Ray's workers are not the driver's children.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from test_corpus_neardup import MAN, MIN_CHARS, manpage_texts, near_copy

REPORT = ("import resource, sys\nfrom gptpipe.cli import main\ncode = main(sys.argv[1:])\n"
          "hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]\n"
          "print('RSS', hwm, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\nsys.exit(code)")


def run(argv: list[str]) -> tuple[float, float, float]:
    """Wall seconds, the process's peak RSS and its largest worker's, in MiB."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", REPORT, *argv], capture_output=True, text=True,
                          env=env)
    if done.returncode:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    wall = time.perf_counter() - started
    _, own, worker = next(line for line in done.stdout.splitlines() if line.startswith("RSS ")).split()
    return wall, int(own) / 1024, int(worker) / 1024


def write_yaml(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=Path, required=True, help="a stage-0 corpus.jsonl (Japanese man pages)")
    parser.add_argument("--count", type=int, default=600, help="documents to take from it (the first N)")
    parser.add_argument("--en", type=int, default=150, help="English man pages to add (every 37th of man1-8)")
    parser.add_argument("--scales", type=int, nargs="+", default=[1, 10])
    args = parser.parse_args()
    from ray.cluster_utils import Cluster

    with open(args.pages, encoding="utf-8") as fh:
        ja = [json.loads(line)["text"] for line in fh][:args.count]
    en = manpage_texts(MAN, 37, args.en, min_chars=200)
    originals = [("ja", t) for t in ja] + [("en", t) for t in en]
    print(f"originals: {len(ja)} from {args.pages}, {len(en)} English; load average {os.getloadavg()[0]:.1f}")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    engines = {"1 worker": ["workers=1"], "2 workers": ["workers=2"],
               "Ray, 2 nodes x 1 CPU": ["executor=ray", f"ray_address={cluster.address}"]}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            tokenizer = folder / "tokenizer"
            for scale in args.scales:
                rng = random.Random(scale)
                made = [near_copy(t, lang, rng) for lang, t in originals if len(t) >= MIN_CHARS
                        for _ in range(2 * scale - 1)]
                documents = folder / f"docs-{scale}.jsonl"
                with open(documents, "w", encoding="utf-8") as fh:
                    fh.writelines(json.dumps({"text": t}, ensure_ascii=False) + "\n"
                                  for t in [t for _, t in originals] + made)
                mb = documents.stat().st_size / 1e6
                print(f"\nscale {scale}: {len(originals) + len(made):,} documents, {mb:.1f} MB; load average "
                      f"{os.getloadavg()[0]:.1f}")
                config = write_yaml(folder / "config.yaml", {
                    "corpus": {"sources": [{"type": "jsonl", "path": str(documents)}], "languages": ["ja"],
                               "dropped_samples": 0, "shard_mb": 2},
                    "tokenize": {"tokenizer_dir": str(tokenizer), "task_bytes": 1 << 20}})
                outputs = {}
                for name, keys in engines.items():
                    out = folder / f"out-{scale}-{len(outputs)}"
                    wall, own, worker = run(["prepare", "--config", str(config), f"corpus.output_dir={out}",
                                             "corpus.join=true", *(f"corpus.{key}" for key in keys)])
                    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
                    cores = 1 if name == "1 worker" else 2
                    steps = ", ".join(f"{k[:-2]} {v:.1f}" for k, v in manifest["timings"].items() if k != "total_s")
                    print(f"  stage 0, {name:21}: {wall:6.1f} s, {mb / wall / cores:5.2f} MB/s per core, driver "
                          f"{own:,.0f} MiB, largest worker {worker:,.0f} MiB, kept "
                          f"{manifest['counts']['documents']:,}; s per step: {steps}")
                    outputs[name] = out / "corpus.jsonl"
                first = outputs["1 worker"].read_bytes()
                print(f"  stage 0 outputs identical: {all(p.read_bytes() == first for p in outputs.values())}")
                if not tokenizer.exists():
                    run(["train-tokenizer", "--config", str(write_yaml(folder / "sp.yaml", {
                        "input": str(outputs["1 worker"]), "output_dir": str(tokenizer), "vocab_size": 8000}))])
                datasets = []
                for name, keys in engines.items():
                    prefix = folder / f"tok-{scale}-{len(datasets)}"
                    wall, own, worker = run(["tokenize", "--config", str(config),
                                             f"tokenize.input=[{documents}]",
                                             f"tokenize.output_prefix={prefix}", *(f"tokenize.{key}" for key in keys)])
                    cores = 1 if name == "1 worker" else 2
                    print(f"  stage 2, {name:21}: {wall:6.1f} s, {mb / wall / cores:5.2f} MB/s per core, driver "
                          f"{own:,.0f} MiB, largest worker {worker:,.0f} MiB")
                    datasets.append(Path(f"{prefix}_text_document.bin"))
                first = datasets[0].read_bytes()
                print(f"  stage 2 outputs identical: {all(p.read_bytes() == first for p in datasets)}")
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
