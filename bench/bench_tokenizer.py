"""Stage-1 benchmark: tokenizer training time and peak RSS on the man-page corpus, and on it repeated 10x.

    python bench/bench_tokenizer.py [--corpus data/corpus/corpus.jsonl] [--workdir DIR] [--unbounded]

Every training runs `gptpipe train-tokenizer` in its own child process; its peak RSS is that child's own
rusage (os.wait4), so runs do not mask each other. Runs:
  1x          the corpus, the shipped 32k settings (input_sentence_size 3M: every line is used);
  10x-bounded the corpus repeated 10 times, input_sentence_size = the 1x run's line count: the same amount
              of text is sampled, so peak RSS must stay at the 1x figure although the input is 10x larger;
  10x-all     (--unbounded) the 10x corpus with input_sentence_size 3M, i.e. all 10x lines: what RAM
              does when the sampling limit is above the corpus size (slow: several minutes on 2 cores).
Without --corpus, stage 0 builds the man-page corpus first (needs manpages-ja). Prints a table; the
figures go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REPEAT = 10


def gptpipe(*args: str, cwd: Path) -> tuple[float, float]:
    """Run a gptpipe subcommand in a child process; (wall seconds, the child's peak RSS in MiB)."""
    started = time.time()
    child = subprocess.Popen([sys.executable, "-m", "gptpipe", *args], cwd=cwd,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stderr = child.stderr.read() if child.stderr else b""
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        sys.exit(f"gptpipe {' '.join(args)} failed ({child.returncode}):\n{stderr.decode(errors='replace')[-3000:]}")
    return time.time() - started, usage.ru_maxrss / 1024


def corpus_stage(workdir: Path, jsonl: Path, name: str) -> None:
    """Stage 0 over an existing jsonl, without dedup (the repeated copies must stay), into data/<name>."""
    gptpipe("prepare", "--config", str(workdir / "config.yaml"), "corpus.sources.0.type=jsonl",
            f"corpus.sources.0.path={jsonl}", "corpus.dedup=false", f"corpus.output_dir=data/{name}", cwd=workdir)


def train(workdir: Path, corpus: str, label: str, *overrides: str) -> dict:
    wall, rss = gptpipe("train-tokenizer", "--config", str(workdir / "sentence_piece_config.yaml"),
                        f"input=data/{corpus}/corpus.jsonl", f"output_dir=tokenizers/{label}", *overrides, cwd=workdir)
    manifest = json.loads((workdir / "tokenizers" / label / "manifest.json").read_text(encoding="utf-8"))
    counts, timings = manifest["counts"], manifest["timings"]
    return {"run": label, "corpus_mib": (workdir / "data" / corpus / "corpus.jsonl").stat().st_size / 2**20,
            "lines": counts["training_lines_sampled"], "sample_mib": counts["sample_mib"],
            "train_s": timings["train_s"], "wall_s": wall, "peak_rss_mib": rss,
            "estimated_mib": counts["estimated_peak_rss_mib"], "chars_per_token": counts["chars_per_token"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, help="an existing corpus.jsonl (default: build it with stage 0)")
    parser.add_argument("--workdir", type=Path, help="keep outputs here (default: a temporary folder)")
    parser.add_argument("--unbounded", action="store_true", help="also train on all lines of the 10x corpus")
    args = parser.parse_args()

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_tokenizer_"))
    workdir.mkdir(parents=True, exist_ok=True)
    for name in ("config.yaml", "sentence_piece_config.yaml"):
        shutil.copy(REPO / name, workdir / name)
    source = args.corpus.resolve() if args.corpus else None
    if source is None:
        print("building the man-page corpus with stage 0 ...", file=sys.stderr)
        gptpipe("prepare", "--config", str(workdir / "config.yaml"), cwd=workdir)
        source = workdir / "data" / "corpus" / "corpus.jsonl"
    else:
        corpus_stage(workdir, source, "corpus")
    repeated = workdir / "repeated.jsonl"
    with open(repeated, "wb") as out:
        for _ in range(REPEAT):
            out.write(source.read_bytes())
    corpus_stage(workdir, repeated, "corpus10x")

    rows = [train(workdir, "corpus", "1x")]
    rows.append(train(workdir, "corpus10x", "10x-bounded", f"input_sentence_size={rows[0]['lines']}"))
    if args.unbounded:
        rows.append(train(workdir, "corpus10x", "10x-all"))

    header = f"{'run':<12} {'corpus MiB':>10} {'lines':>10} {'sample MiB':>10} {'train s':>8} {'wall s':>8} " \
             f"{'peak RSS MiB':>12} {'estimated':>9} {'chars/token':>11}"
    print(header)
    for r in rows:
        print(f"{r['run']:<12} {r['corpus_mib']:>10.1f} {r['lines']:>10,} {r['sample_mib']:>10.1f} "
              f"{r['train_s']:>8.1f} {r['wall_s']:>8.1f} {r['peak_rss_mib']:>12.0f} {r['estimated_mib']:>9} "
              f"{r['chars_per_token']:>11}")
    print(f"(outputs in {workdir}; {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
