"""Stages 0 and 2 at 1x and 10x of a corpus, on one worker, two worker processes and a two-node Ray cluster on
this machine (one CPU each), in one run: wall seconds, MB/s per core, the driver's peak RSS, and stage 0's
seconds per step (judging, the duplicate steps, the join), from which docs/benchmarks.md projects 1 TB and 10 TB.

    python 0_prepare_corpus.py corpus.join=true     # the man pages' stage-0 corpus as one file
    PYTHONPATH=src:tests python bench/bench_scale.py --pages data/corpus/corpus.jsonl [--scales 1 10]
    PYTHONPATH=src:tests python bench/bench_scale.py --pages ... --scales 120 --stages 2 --task-mb 16

The corpus is bench/bench_corpus_peer.py's: the documents of a stage-0 corpus.jsonl (`--pages`, the first
`--count`) and English man pages, then 2k-1 near copies of each page of 1,500+ characters for scale k, as one
jsonl. Stage 0 runs with `shard_mb` 2 (`--shard-mb`: so that scale 1 has shards for two workers) and keeps
Japanese; stage 1 trains an 8,000-piece tokenizer on scale 1's output once; stage 2 tokenizes each scale's whole
input (stage 0's output is ~5 MB at any scale: the copies are dropped) with `task_bytes` 1 MB. Every run is a
fresh process (`gptpipe` through its CLI) that reports its own peak RSS (VmHWM); with local workers their largest
peak is reported too (RUSAGE_CHILDREN), Ray's workers are not the driver's children.

CPU seconds per run, which unlike wall seconds do not grow with the machine's load: the driver's and its local
workers' (RUSAGE_CHILDREN of this process), the Ray workers' and the Ray daemons' (raylets, GCS, agents: the
processes of the cluster this bench started, sampled through the run), and the tasks' own (the sum the stage
logs per step, gptpipe/taskpool.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import yaml

from test_corpus_neardup import MAN, MIN_CHARS, manpage_texts, near_copy

REPORT = ("import resource, sys\nfrom gptpipe.cli import main\ncode = main(sys.argv[1:])\n"
          "hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]\n"
          "own = resource.getrusage(resource.RUSAGE_SELF)\n"
          "print('RSS', hwm, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, own.ru_utime + own.ru_stime)\n"
          "sys.exit(code)")
STEP = re.compile(r"([\d,.]+) CPU s in the tasks, in \d+ process\(es\), the busiest ([\d,.]+) CPU s; the longest "
                  r"task ([\d,.]+) CPU s")


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class RayCPU:
    """CPU seconds of the Ray cluster's processes (this process's descendants) during a run, sampled every 0.2 s
    (a raylet does not add its exited workers to its children's times): its workers' (a raylet's children but
    its agents), its daemons' (GCS, raylets, agents, monitors); not the run's own processes."""

    def __init__(self) -> None:
        self.start = self._sample()
        self.last = dict(self.start)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    @staticmethod
    def _sample() -> dict[tuple[int, bool], float]:
        seen = {}
        for process in psutil.Process().children(recursive=True):
            try:
                times, command = process.cpu_times(), " ".join(process.cmdline())
                if "gptpipe.cli" in command:  # the run itself, its local workers (forked: the same command)
                    continue
                worker = "raylet" in " ".join(process.parent().cmdline()) and "Agent" not in command
            except (psutil.Error, AttributeError):  # exited meanwhile
                continue
            seen[process.pid, worker] = times.user + times.system
        return seen

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            self.last.update(self._sample())

    def stop(self) -> tuple[float, float]:
        """The workers' and the daemons' CPU seconds since the start."""
        self._stop.set()
        self._thread.join()
        self.last.update(self._sample())
        spent = {key: cpu - self.start.get(key, 0.0) for key, cpu in self.last.items()}
        return (sum(cpu for (_, worker), cpu in spent.items() if worker),
                sum(cpu for (_, worker), cpu in spent.items() if not worker))


def run(argv: list[str], log: Path | None = None) -> dict[str, float]:
    """Wall seconds, the process's peak RSS and its largest worker's in MiB, and CPU seconds: `driver` (with its
    local workers), `ray` (Ray's workers), `daemons` (Ray's own processes), `tasks` (inside the tasks). `log`:
    where to save the run's log (GPTPIPE_LOG_LEVEL=DEBUG: a line per task)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    cpu, ray = children_cpu(), RayCPU()
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", REPORT, *argv], capture_output=True, text=True,
                          env=env)
    if done.returncode:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    wall = time.perf_counter() - started
    if log:
        log.write_text(done.stderr, encoding="utf-8")
    cpu, (workers, daemons) = children_cpu() - cpu, ray.stop()
    _, own, worker, driver = next(line for line in done.stdout.splitlines() if line.startswith("RSS ")).split()
    steps = [[float(n.replace(",", "")) for n in step] for step in STEP.findall(done.stderr)]
    return {"wall": wall, "rss": int(own) / 1024, "worker_rss": int(worker) / 1024, "driver": float(driver),
            "local": cpu - float(driver), "ray": workers, "daemons": daemons, "tasks": sum(s[0] for s in steps),
            "busiest": sum(s[1] for s in steps), "longest": sum(s[2] for s in steps)}


def idle_wall(measured: dict[str, float], workers: int, ray: bool) -> float:
    """The run's wall seconds on `workers` idle cores, from its CPU seconds: the driver's own work outside the
    tasks; each step's tasks spread over the workers, at most a longest task more (each goes to whichever worker
    is free: how the load split them now does not count); each worker's own start (its CPU outside the tasks,
    side by side); Ray's daemons taking their share of the cores all along (their CPU per second of this run:
    timers and bookkeeping, not the load). It leaves out waits (disk, Ray's scheduling)."""
    if workers == 1:  # the tasks ran in the driver
        return measured["driver"]
    outside = measured["ray" if ray else "local"] - measured["tasks"]
    busy = measured["driver"] + (measured["tasks"] + outside) / workers + measured["longest"] * (1 - 1 / workers)
    return busy / (1 - measured["daemons"] / measured["wall"] / workers) if ray else busy


def speedups(rows: dict[str, dict[str, float]], mb: float) -> str:
    """Each engine's speed-up on two idle cores over one worker at the same CPU seconds in the tasks (the
    one-worker run's: CPU seconds too grow a little with the machine's load): its estimate less half its tasks'
    CPU is its fixed part (driver, worker start, daemons, the longest tasks), which does not grow with the input;
    and the input from which it reaches 1.8x."""
    one = rows.get(ENGINES["1"])
    if not one:
        return ""
    work, serial = one["tasks"], one["driver"] - one["tasks"]
    said = []
    for name, measured in rows.items():
        if name == ENGINES["1"] or not measured["tasks"]:
            continue
        fixed = idle_wall(measured, 2, name == ENGINES["ray"]) - measured["tasks"] / 2
        needed = (1.8 * fixed - serial) / (1 - 1.8 / 2)  # (serial + W) / (fixed + W / 2) = 1.8
        said.append(f"{name} {(serial + work) / (fixed + work / 2):.2f}x (fixed {fixed:.1f} s; 1.8x from "
                    f"{needed:.0f} CPU s in the tasks, ~{needed / work * mb:,.0f} MB)")
    return "; ".join(said)


def cpu_line(measured: dict[str, float], engine: str) -> str:
    workers, ray = 1 if engine == ENGINES["1"] else 2, engine == ENGINES["ray"]
    return (f"CPU s: driver {measured['driver']:.1f}, local workers {measured['local']:.1f}, Ray workers "
            f"{measured['ray']:.1f}, Ray daemons {measured['daemons']:.1f}, in the tasks {measured['tasks']:.1f} "
            f"(per step, summed: the busiest process {measured['busiest']:.1f}, the longest task "
            f"{measured['longest']:.1f}); on {workers} idle core(s) "
            f"~{idle_wall(measured, workers, ray):.1f} s")


ENGINES = {"1": "1 worker", "2": "2 workers", "ray": "Ray, 2 nodes x 1 CPU"}


def write_yaml(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def write_originals(path: Path, originals: list[tuple[str, str]]) -> Path:
    """The pages the copies are made from, as jsonl: stage 1's input when stage 0 does not run."""
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps({"text": t}, ensure_ascii=False) + "\n" for _, t in originals)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument("--pages", type=Path, help="a stage-0 corpus.jsonl (Japanese man pages)")
    given.add_argument("--originals", type=Path,
                       help="the documents a --save-originals run wrote: no man pages or groff needed (a machine "
                            "lent for bench/gpu_check.sh)")
    parser.add_argument("--save-originals", type=Path,
                        help="write the documents taken (--pages' and the English man pages) to this jsonl, stop")
    parser.add_argument("--count", type=int, default=600, help="documents to take from it (the first N)")
    parser.add_argument("--en", type=int, default=150, help="English man pages to add (every 37th of man1-8)")
    parser.add_argument("--scales", type=int, nargs="+", default=[1, 10])
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES),
                        help="1 and 2: local worker processes; ray: the two-node cluster")
    parser.add_argument("--logs", type=Path, help="a folder to save each run's log in")
    parser.add_argument("--stages", nargs="+", default=["0", "2"], choices=["0", "2"],
                        help="2 alone: stage 2 on each scale's input, its tokenizer trained on the originals")
    parser.add_argument("--task-mb", type=int, default=1, help="stage 2's tokenize.task_bytes, in MiB")
    parser.add_argument("--shard-mb", type=int, default=2,
                        help="stage 0's corpus.shard_mb (2: scale 1 has shards for two workers; larger scales can "
                             "take tasks nearer the default 64's)")
    args = parser.parse_args()

    if args.originals:
        with open(args.originals, encoding="utf-8") as fh:
            originals = [(row["lang"], row["text"]) for row in map(json.loads, fh)]
    else:
        with open(args.pages, encoding="utf-8") as fh:
            ja = [json.loads(line)["text"] for line in fh][:args.count]
        originals = [("ja", t) for t in ja] + [("en", t) for t in manpage_texts(MAN, 37, args.en, min_chars=200)]
    counts = {lang: sum(1 for code, _ in originals if code == lang) for lang in ("ja", "en")}
    print(f"originals: {counts['ja']} Japanese, {counts['en']} English from {args.originals or args.pages}; "
          f"load average {os.getloadavg()[0]:.1f}")
    if args.save_originals:
        with open(args.save_originals, "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps({"lang": lang, "text": t}, ensure_ascii=False) + "\n" for lang, t in originals)
        return
    keys = {"1": ["workers=1"], "2": ["workers=2"]}
    cluster = None
    if "ray" in args.engines:
        from ray.cluster_utils import Cluster

        # Ray runs its workers at nice 15 (below its own daemons): on this shared machine they would lose the
        # cores to everyone else's processes, which the local workers (nice 0) compete with as equals.
        os.environ["RAY_worker_niceness"] = "0"
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        keys["ray"] = ["executor=ray", f"ray_address={cluster.address}"]
    engines = {ENGINES[e]: keys[e] for e in args.engines}
    codes = {ENGINES[e]: e for e in args.engines}
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
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
                               "dropped_samples": 0, "shard_mb": args.shard_mb},
                    "tokenize": {"tokenizer_dir": str(tokenizer), "task_bytes": args.task_mb << 20}})
                outputs, rows = {}, {}
                for name, keys in engines.items() if "0" in args.stages else ():
                    out = folder / f"out-{scale}-{len(outputs)}"
                    measured = run(["prepare", "--config", str(config), f"corpus.output_dir={out}",
                                    "corpus.join=true", *(f"corpus.{key}" for key in keys)],
                                   args.logs and args.logs / f"stage0-{scale}x-{codes[name]}.log")
                    wall, own, worker = measured["wall"], measured["rss"], measured["worker_rss"]
                    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
                    cores = 1 if name == "1 worker" else 2
                    steps = ", ".join(f"{k[:-2]} {v:.1f}" for k, v in manifest["timings"].items() if k != "total_s")
                    print(f"  stage 0, {name:21}: {wall:6.1f} s, {mb / wall / cores:5.2f} MB/s per core, driver "
                          f"{own:,.0f} MiB, largest worker {worker:,.0f} MiB, kept "
                          f"{manifest['counts']['documents']:,}; s per step: {steps}; {cpu_line(measured, name)}")
                    outputs[name], rows[name] = out / "corpus.jsonl", measured
                if outputs:
                    print(f"  stage 0 on two idle cores: {speedups(rows, mb)}")
                    first = next(iter(outputs.values())).read_bytes()
                    print(f"  stage 0 outputs identical: {all(p.read_bytes() == first for p in outputs.values())}")
                if "2" not in args.stages:
                    continue
                if not tokenizer.exists():
                    text = next(iter(outputs.values()), None) or write_originals(folder / "originals.jsonl", originals)
                    sp = {"input": str(text), "output_dir": str(tokenizer), "vocab_size": 8000}
                    run(["train-tokenizer", "--config", str(write_yaml(folder / "sp.yaml", sp))])
                datasets, rows = [], {}
                for name, keys in engines.items():
                    prefix = folder / f"tok-{scale}-{len(datasets)}"
                    measured = run(["tokenize", "--config", str(config), f"tokenize.input=[{documents}]",
                                    f"tokenize.output_prefix={prefix}", *(f"tokenize.{key}" for key in keys)],
                                   args.logs and args.logs / f"stage2-{scale}x-{codes[name]}.log")
                    wall, own, worker = measured["wall"], measured["rss"], measured["worker_rss"]
                    cores = 1 if name == "1 worker" else 2
                    print(f"  stage 2, {name:21}: {wall:6.1f} s, {mb / wall / cores:5.2f} MB/s per core, driver "
                          f"{own:,.0f} MiB, largest worker {worker:,.0f} MiB; {cpu_line(measured, name)}")
                    datasets.append(Path(f"{prefix}_text_document.bin"))
                    rows[name] = measured
                print(f"  stage 2 on two idle cores: {speedups(rows, mb)}")
                first = datasets[0].read_bytes()
                print(f"  stage 2 outputs identical: {all(p.read_bytes() == first for p in datasets)}")
    finally:
        if cluster:
            cluster.shutdown()


if __name__ == "__main__":
    main()
