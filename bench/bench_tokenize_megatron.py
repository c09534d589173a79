"""Stage 2 with an HF tokenizer: `gptpipe tokenize` vs Megatron-LM's tools/preprocess_data.py, whole process.

Both tools get the same jsonl corpus and the same HF tokenizer folder (a 32k byte-level BPE trained here with
the `tokenizers` library) and are timed as whole programs (start to finish, wall clock), side by side in one
run: for every repeat, each worker count, both tools one after the other (the order flips every repeat).
It prints a markdown table (MB/s of jsonl input, tokens/s, per worker, and CPU seconds of each whole process
tree: gptpipe's single in-process worker encodes with the `tokenizers` thread pool, so it can use more than
one core), each tool's own timing of its work after start-up, and checks that the two outputs hold the same
documents and token ids.

    PYTHONPATH=src .venv/bin/python bench/bench_tokenize_megatron.py [--workers 1 2] [--repeat 5] [--target-mb 50]

Set-up is idempotent and cached under --cache (default .bench-cache/, git-ignored):
  megatron-lm-<commit>/  tools/ and megatron/ of the Megatron-LM mirror at --megatron-rev (git archive; never
                         part of gptpipe); default core_v0.16.1 = the installed megatron-core
  megatron-venv/         a venv whose site-packages includes .venv's (a .pth file) plus what Megatron's tools
                         import and gptpipe does not need (triton, via megatron.training → megatron.core)
  work/                  stage 0 (`gptpipe prepare`) on the demo's man pages, when --corpus is not given
  corpus_<N>mb.jsonl     the corpus repeated to at least --target-mb
  bpe32k/                the HF tokenizer folder (tokenizer.json + tokenizer_config.json), EOS only, no BOS
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MIRROR = Path("/work/.mirror/NVIDIA+Megatron-LM/repo")
EOS = "<|endoftext|>"


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, check=True, text=True, **kwargs)


def megatron_checkout(cache: Path, mirror: Path, rev: str) -> Path:
    commit = run(["git", "--git-dir", str(mirror), "rev-parse", f"{rev}^{{commit}}"], capture_output=True).stdout
    folder = cache / f"megatron-lm-{commit.strip()[:12]}"
    if not (folder / "tools" / "preprocess_data.py").is_file():
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        archive = subprocess.Popen(["git", "--git-dir", str(mirror), "archive", commit.strip(), "tools", "megatron"],
                                   stdout=subprocess.PIPE)
        run(["tar", "-x", "-C", str(tmp)], stdin=archive.stdout)
        assert archive.wait() == 0
        tmp.rename(folder)
    return folder


def megatron_venv(cache: Path) -> Path:
    """A venv on top of gptpipe's .venv (nothing is installed into .venv) with triton added."""
    venv = cache / "megatron-venv"
    python = venv / "bin" / "python"
    if not python.exists():
        run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
               capture_output=True).stdout.strip()
    base = run([sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
               capture_output=True).stdout.strip()
    Path(site, "gptpipe-venv.pth").write_text(base + "\n")
    if subprocess.run([str(python), "-c", "import triton"], capture_output=True).returncode != 0:
        run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "triton"])
    return python


def demo_corpus(cache: Path) -> Path:
    """Stage 0 on the man pages, as demo.sh runs it, in cache/work/."""
    work = cache / "work"
    corpus = work / "data" / "corpus" / "corpus.jsonl"
    if not corpus.is_file():
        work.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "config.yaml", work / "config.yaml")
        run([sys.executable, "-m", "gptpipe", "prepare", "--config", str(work / "config.yaml"), "corpus.join=true"],
            env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "TQDM_DISABLE": "1"})
    return corpus


def repeated(corpus: Path, cache: Path, target_mb: float) -> Path:
    data = corpus.read_bytes()
    copies = max(1, int(-(-target_mb * 1e6 // len(data))))
    out = cache / f"corpus_{corpus.stat().st_size * copies / 1e6:.0f}mb.jsonl"
    if not out.is_file() or out.stat().st_size != len(data) * copies:
        out.write_bytes(data * copies)
    return out


def hf_tokenizer(corpus: Path, folder: Path, vocab_size: int) -> Path:
    """A byte-level BPE (GPT-2 style: EOS between documents, no BOS) trained on ``corpus``, as an HF folder."""
    if (folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file():
        return folder
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [json.loads(line)["text"] for line in corpus.open(encoding="utf-8")]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tmp = folder.with_name(folder.name + ".tmp")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, bos_token=EOS).save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def gptpipe_config(cache: Path, corpus: Path, tokenizer: Path) -> Path:
    config = cache / "gptpipe-tokenize.yaml"
    text = (f"tokenize:\n  input: [{corpus}]\n  tokenizer_dir: {tokenizer}\n"
            f"  output_prefix: {cache / 'out' / 'gptpipe'}\n  workers: 0\n")
    if not config.is_file() or config.read_text() != text:
        config.write_text(text)
    return config


def timed(command: list[str], env: dict) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the process and its waited-for children, output)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, result.stdout + result.stderr


def documents(prefix: Path) -> list[np.ndarray]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix), mmap=True)
    return [np.array(dataset[i]) for i in range(len(dataset))]


def agreement(ours: Path, theirs: Path) -> str:
    a, b = documents(ours), documents(theirs)
    differ = sum(1 for x, y in zip(a, b) if x.shape != y.shape or not np.array_equal(x, y))
    same_bytes = all(Path(f"{ours}{s}").read_bytes() == Path(f"{theirs}{s}").read_bytes() for s in (".bin", ".idx"))
    tokens = sum(len(x) for x in a), sum(len(y) for y in b)
    return (f"documents {len(a):,} vs {len(b):,}; tokens {tokens[0]:,} vs {tokens[1]:,}; "
            f"documents whose ids differ: {differ}; .bin/.idx byte-identical: {'yes' if same_bytes else 'no'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=ROOT / ".bench-cache")
    parser.add_argument("--mirror", type=Path, default=MIRROR)
    parser.add_argument("--megatron-rev", default="core_v0.16.1",
                        help="the release of the installed megatron-core; the mirror's HEAD needs Python ≥ 3.12")
    parser.add_argument("--corpus", type=Path, help="a jsonl corpus (default: stage 0 on the demo's man pages)")
    parser.add_argument("--target-mb", type=float, default=50, help="repeat the corpus to at least this size")
    parser.add_argument("--vocab-size", type=int, default=32_000)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeat", type=int, default=5, help="median of this many runs per figure")
    parser.add_argument("--setup-only", action="store_true")
    args = parser.parse_args()

    cache = args.cache.resolve()
    cache.mkdir(parents=True, exist_ok=True)
    megatron = megatron_checkout(cache, args.mirror, args.megatron_rev)
    mpython = megatron_venv(cache)
    base = args.corpus.resolve() if args.corpus else demo_corpus(cache)
    tokenizer = hf_tokenizer(base, cache / f"bpe{args.vocab_size // 1000}k", args.vocab_size)
    corpus = repeated(base, cache, args.target_mb)
    config = gptpipe_config(cache, corpus, tokenizer)
    out = cache / "out"
    out.mkdir(exist_ok=True)
    input_mb = corpus.stat().st_size / 1e6
    lines = sum(1 for _ in corpus.open("rb"))
    commit = megatron.name.rsplit("-", 1)[-1]
    print(f"corpus {corpus} ({input_mb:.1f} MB jsonl, {lines:,} documents); tokenizer {tokenizer}; "
          f"Megatron-LM {commit}; {os.cpu_count()} cores; load {os.getloadavg()}", flush=True)
    if args.setup_only:
        return

    env = {**os.environ, "TQDM_DISABLE": "1"}
    commands = {
        "gptpipe": lambda w: ([sys.executable, "-m", "gptpipe", "tokenize", "--config", str(config), "--force",
                               f"tokenize.workers={w}", f"tokenize.output_prefix={out / f'gptpipe_w{w}'}"],
                              {**env, "PYTHONPATH": str(ROOT / "src")}),
        "megatron": lambda w: ([str(mpython), str(megatron / "tools" / "preprocess_data.py"), "--input", str(corpus),
                                "--output-prefix", str(out / f"megatron_w{w}"), "--tokenizer-type",
                                "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer), "--workers", str(w),
                                "--append-eod", "--log-interval", str(lines)],  # one progress line, at the end
                               {**env, "PYTHONPATH": str(megatron)}),
    }
    walls: dict[tuple[str, int], list[float]] = {}
    cpus: dict[tuple[str, int], list[float]] = {}
    loops: dict[tuple[str, int], list[float]] = {}  # each tool's own timing of its work, after start-up
    for rep in range(args.repeat):
        for workers in args.workers:
            order = ["gptpipe", "megatron"] if rep % 2 == 0 else ["megatron", "gptpipe"]
            for tool in order:
                wall, cpu, log = timed(*commands[tool](workers))
                walls.setdefault((tool, workers), []).append(wall)
                cpus.setdefault((tool, workers), []).append(cpu)
                if tool == "megatron":  # its own figure for the encoding loop alone (after start-up)
                    rate = re.findall(r"Processed (\d+) documents \(([\d.]+) docs/s", log)
                    loops.setdefault((tool, workers), []).append(int(rate[-1][0]) / float(rate[-1][1]))
                else:  # stage 2's own log line: read, encode, write, .idx (after imports and the manifest checks)
                    seconds = re.findall(r"tokens \(\w+\) in ([\d.]+) s", log)[-1]
                    loops.setdefault((tool, workers), []).append(float(seconds))
                print(f"  rep {rep + 1} {tool} w{workers}: {wall:.2f} s, CPU {cpu:.2f} s "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)

    prefix = {(t, w): out / f"{t}_w{w}_text_document" for t, w in walls}
    tokens = len(np.memmap(f"{prefix['gptpipe', args.workers[0]]}.bin", dtype=np.uint16 if args.vocab_size < 65_500
                           else np.int32, mode="r"))
    print(f"\n{tokens:,} tokens; load at the end {os.getloadavg()}\n")
    print("| tool | workers | wall s (median) | min–max s | MB/s | MB/s per worker | Mtokens/s | gptpipe ÷ Megatron "
          "| CPU s (median) | MB per CPU-s | gptpipe ÷ Megatron per CPU-s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for workers in args.workers:
        for tool in ("gptpipe", "megatron"):
            times = walls[tool, workers]
            median, cpu = statistics.median(times), statistics.median(cpus[tool, workers])
            ratio = statistics.median(walls["megatron", workers]) / statistics.median(walls["gptpipe", workers])
            cpu_ratio = statistics.median(cpus["megatron", workers]) / statistics.median(cpus["gptpipe", workers])
            print(f"| {tool} | {workers} | {median:.2f} | {min(times):.2f}–{max(times):.2f} | "
                  f"{input_mb / median:.2f} "
                  f"| {input_mb / median / workers:.2f} | {tokens / median / 1e6:.2f} "
                  f"| {f'**{ratio:.2f}×**' if tool == 'gptpipe' else ''} | {cpu:.2f} | {input_mb / cpu:.2f} "
                  f"| {f'**{cpu_ratio:.2f}×**' if tool == 'gptpipe' else ''} |")
    print("\n| tool | workers | work s (own log) | work MB/s | start-up and the rest s |")
    print("| --- | --- | --- | --- | --- |")
    for workers in args.workers:
        for tool in ("gptpipe", "megatron"):
            loop = statistics.median(loops[tool, workers])
            print(f"| {tool} | {workers} | {loop:.2f} | {input_mb / loop:.2f} "
                  f"| {statistics.median(walls[tool, workers]) - loop:.2f} |")
    for workers in args.workers:
        print(f"agreement w{workers}: {agreement(prefix['gptpipe', workers], prefix['megatron', workers])}")


if __name__ == "__main__":
    main()
