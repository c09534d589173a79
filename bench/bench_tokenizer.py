"""Stage-1 benchmark: tokenizer training time and peak RSS on the man-page corpus, and on it repeated 10x.

    python bench/bench_tokenizer.py [--corpus data/corpus/corpus.jsonl] [--workdir DIR] [--unbounded]

(--corpus: one jsonl file, e.g. stage 0's with corpus.join=true; without it stage 0 runs here.)

Every training runs `gptpipe train-tokenizer` in its own child process; its peak RSS is that child's own
rusage (os.wait4), so runs do not mask each other. Runs:
  1x          the corpus, the shipped 32k settings (input_sentence_size 3M: every line is used);
  10x-bounded the corpus repeated 10 times, input_sentence_size = the 1x run's line count: the same amount
              of text is sampled, so peak RSS must stay at the 1x figure although the input is 10x larger;
  10x-all     (--unbounded) the 10x corpus with input_sentence_size 3M, i.e. all 10x lines: what RAM
              does when the sampling limit is above the corpus size (slow: several minutes on 2 cores).
Without --corpus, stage 0 builds the man-page corpus first (needs manpages-ja). Prints a table; the
figures go in docs/benchmarks.md.

    python bench/bench_tokenizer.py --calibrate [--sizes 300000,1000000,2000000,3000000] [--calibration-mib 1100]

instead calibrates the stage's RAM estimate (RSS_BASE_MIB, RSS_PER_SAMPLE_BYTE in gptpipe/tokenizer/build.py):
a ~1.1 GB corpus of new documents recombined from the man pages' lines (calibration.jsonl in the workdir, kept
for reruns), then one training per input_sentence_size, each printing the sample size the stage expected
before sampling and got, and its RSS estimate against the measured peak (slow: ~1 hour on 2 cores).

    python bench/bench_tokenizer.py --compare [--vocab-sizes 32000,8000] [--steps 300] [--seeds 1234,1235]
        [--variants unigram:0.9995,unigram:1.0,bpe:0.9995]

instead compares tokenizer settings (model_type:character_coverage, default unigram and bpe at 0.9995) on the
man-page corpus (or --corpus), at each vocabulary size: stage 1's training time and peak RSS; characters per
token on stage 1's held-out documents and the share of their characters written as byte pieces; llama.cpp
exactness (a tiny random Llama with the tokenizer, written by `gptpipe gguf`'s writer, its ids on the held-out
documents and the tricky strings through llama-tokenize against transformers', and the share of 200 held-out
passages of 300 characters it reads as transformers does, sampled as `gptpipe gguf` samples them); and
language-model quality: stage 2 with the tokenizer, then the same tiny Llama trained by `gptpipe train` for the
same steps and tokens per step, once per seed, its validation loss over the whole validation split turned into
bits per character (loss per token x validation tokens / validation characters / ln 2), which compares across
tokenizers where per-token losses do not. Outputs are kept in --workdir, and a stage whose outputs are current
is skipped on a rerun (the training figures then come from its manifest). Prints a table and writes the
figures to compare-<vocab sizes>.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from gptpipe.config.core import load_config
from gptpipe.data.count import count_dataset
from gptpipe.data.split import split_documents
from gptpipe.export.agreement import runtime_report
from gptpipe.export.gguf import PASSAGE_CHARS, llamacpp, passages, write_gguf
from gptpipe.pipeline import PipelineConfig
from gptpipe.tokenizer.build import estimate_peak_mib
from gptpipe.tokenizer.config import TokenizerConfig
from gptpipe.tokenizer.hf import TRICKY_STRINGS
from gptpipe.tokenizer.sample import sample_corpus, scan_corpus

REPO = Path(__file__).resolve().parent.parent
REPEAT = 10
CALIBRATION_SIZES = "300000,1000000,2000000,3000000"


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
            f"corpus.sources.0.path={jsonl}", "corpus.dedup=false", f"corpus.output_dir=data/{name}",
            "corpus.join=true", cwd=workdir)


def train(workdir: Path, corpus: str, label: str, *overrides: str) -> dict:
    """Stage 1 (skipped when its outputs are current); its figures come from its manifest, so a rerun reports
    the run that made the outputs: wall_s is the stage's own time (sampling, training, export, verification)."""
    gptpipe("train-tokenizer", "--config", str(workdir / "sentence_piece_config.yaml"),
            f"input=data/{corpus}/corpus.jsonl", f"output_dir=tokenizers/{label}", *overrides, cwd=workdir)
    manifest = json.loads((workdir / "tokenizers" / label / "manifest.json").read_text(encoding="utf-8"))
    counts, timings = manifest["counts"], manifest["timings"]
    return {"run": label, "corpus_mib": (workdir / "data" / corpus / "corpus.jsonl").stat().st_size / 2**20,
            "lines": counts["training_lines_sampled"], "sample_mib": counts["sample_mib"],
            "train_s": timings["train_s"], "wall_s": timings["total_s"], "peak_rss_mib": counts["peak_rss_mib"],
            "estimated_mib": counts["estimated_peak_rss_mib"], "chars_per_token": counts["chars_per_token"]}


def recombined_corpus(source: Path, dest: Path, mib: int, seed: int = 0) -> None:
    """A ``mib``-MiB jsonl of new documents made from the source's lines: paragraphs of random lines, half of
    them spliced from two lines of different pages, so a large sample is not the same few lines repeated.
    Line lengths, blank lines between paragraphs and the mix of Japanese and ASCII stay those of the source."""
    rng = random.Random(seed)
    with open(source, encoding="utf-8") as fh:
        lines = [line for raw in fh for line in json.loads(raw)["text"].split("\n") if line]

    def line() -> str:
        a = rng.choice(lines)
        if rng.random() < 0.5:
            return a
        b = rng.choice(lines)
        return a[:rng.randint(1, len(a))] + b[rng.randint(0, len(b) - 1):]

    size, limit = 0, mib << 20
    with open(dest, "w", encoding="utf-8") as out:
        while size < limit:
            paragraphs = ("\n".join(line() for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 30)))
            record = json.dumps({"text": "\n\n".join(paragraphs)}, ensure_ascii=False) + "\n"
            out.write(record)
            size += len(record.encode("utf-8"))


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:")) / 1024


def training_peak(workdir: Path, corpus: str, size: int, full: bool) -> dict:
    """One stage-1 training at input_sentence_size ``size``; its peak RSS, and the sample sizes from its log.

    Unless ``full``, the training is stopped once SentencePiece's seed phase is over (RSS 20% below its
    high point after training started): the peak comes from that phase (suffix array and seed pieces of the
    whole sample), and the EM rounds after it, most of the time, stay below it (traced: 586 MiB in the seed
    phase at 300k lines, at most 391 MiB after it; 1,778 then 1,343 MiB at 1M). That saves hours per point."""
    started = time.time()
    child = subprocess.Popen([sys.executable, "-m", "gptpipe", "train-tokenizer", "--config",
                              str(workdir / "sentence_piece_config.yaml"), f"input=data/{corpus}/corpus.jsonl",
                              f"output_dir=tokenizers/calibration-{size}", f"input_sentence_size={size}", "--force"],
                             cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    reader = threading.Thread(target=lambda: [log.append(line) for line in child.stderr], daemon=True)
    reader.start()
    stopped, high = False, 0.0
    while not full and child.poll() is None:
        time.sleep(1)
        if any("training SentencePiece" in line for line in log):
            try:
                rss = _rss_mib(child.pid)
            except (OSError, StopIteration):  # it just ended
                break
            high = max(high, rss)
            if rss < 0.8 * high:
                child.send_signal(signal.SIGTERM)
                stopped = True
                break
    _, status, usage = os.wait4(child.pid, 0)
    reader.join()
    text = "".join(log)
    if os.waitstatus_to_exitcode(status) != 0 and not stopped:
        sys.exit(f"training at {size} lines failed:\n{text[-3000:]}")
    sampled = re.search(r"sampled ([\d,]+) lines: ([\d,.]+) MiB of text \(([\d,.]+) M characters\)", text)
    expected = re.search(r"\(expected\): ([\d,.]+) MiB", text)
    if not (sampled and expected):
        sys.exit(f"no sample sizes in the log of the training at {size} lines:\n{text[-3000:]}")
    sample_mib, sample_mchars = float(sampled[2].replace(",", "")), float(sampled[3].replace(",", ""))
    return {"lines": int(sampled[1].replace(",", "")), "expected_sample_mib": float(expected[1].replace(",", "")),
            "sample_mib": sample_mib, "estimated_mib": estimate_peak_mib(sample_mib * 2**20, sample_mchars * 1e6),
            "peak_rss_mib": usage.ru_maxrss / 1024, "wall_s": time.time() - started, "stopped": stopped}


def calibrate(workdir: Path, source: Path, mib: int, sizes: list[int], full: bool) -> None:
    large = workdir / "calibration.jsonl"
    if not large.exists():
        print(f"recombining {source} into a {mib} MiB corpus ...", file=sys.stderr)
        recombined_corpus(source, large, mib)
    corpus_stage(workdir, large, "calibration")
    print(f"{'lines':>10} {'expected sample MiB':>19} {'sample MiB':>10} {'estimated MiB':>13} "
          f"{'peak RSS MiB':>12} {'wall s':>7}", flush=True)
    for size in sizes:
        r = training_peak(workdir, "calibration", size, full)
        print(f"{r['lines']:>10,} {r['expected_sample_mib']:>19,.0f} {r['sample_mib']:>10,.0f} "
              f"{r['estimated_mib']:>13,.0f} {r['peak_rss_mib']:>12,.0f} {r['wall_s']:>7.0f}"
              + (" (stopped after the seed phase)" if r["stopped"] else ""), flush=True)
    print(f"(corpus {large.stat().st_size / 2**20:,.0f} MiB, outputs in {workdir}; {os.cpu_count()} CPUs)")


# --- unigram against bpe (--compare) ---------------------------------------------------------------------
# A short `gptpipe train` of the tiny preset: the demo's sequence length and batch, no samples or loggers.
LM_RUN = ("model.arch=llama", "model.preset=tiny", "train.seq_len=128", "train.global_batch_size=8",
          "train.train_tokens=null", "train.train_epochs=1", "train.precision=fp32", "train.log_interval=50",
          "train.sample_prompts=[]", "logging.wandb=false", "logging.tensorboard=false")


def heldout_documents(workdir: Path, corpus: Path) -> list[str]:
    """Stage 1's held-out documents: they depend on the corpus, seed and heldout_documents only, not on the
    model type, so every tokenizer of the comparison is measured on the same texts."""
    config = load_config(TokenizerConfig, workdir / "sentence_piece_config.yaml")
    with tempfile.TemporaryDirectory() as tmp:
        return sample_corpus([corpus], scan_corpus([corpus]), Path(tmp) / "sample.txt", 1000,
                             config.max_sentence_length, config.heldout_documents, config.seed).heldout


def byte_piece_share(model: Path, texts: list[str]) -> float:
    """Share of the texts' characters that the tokenizer writes as UTF-8 byte pieces (each such character
    starts with one byte piece that is not a continuation byte)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model))
    lead = {i for i in range(sp.get_piece_size())
            if sp.is_byte(i) and not 0x80 <= int(sp.id_to_piece(i)[3:5], 16) < 0xC0}
    return sum(i in lead for ids in sp.encode(texts) for i in ids) / sum(len(t) for t in texts)


def llamacpp_exactness(workdir: Path, tokenizer: Path, texts: list[str], passages: list[str]) -> dict:
    """`gptpipe gguf`'s writer on a tiny random Llama with the tokenizer, then its llama.cpp check on the
    held-out documents and the tricky strings, and on the held-out passages (`passages` in the result)."""
    sys.path.insert(0, str(REPO / "tests"))  # conftest imports its neighbours (prewarmed) by their names
    from conftest import tiny_llama  # the test suite's tiny model, so bench and tests check one thing

    folder = tiny_llama(tokenizer / "hf", workdir / "models" / tokenizer.name)
    gguf_path = workdir / "models" / f"{tokenizer.name}.gguf"
    write_gguf(folder, gguf_path, "f16", tokenizer.name)
    runtime = llamacpp(gguf_path, folder)
    report = runtime_report(runtime, folder, texts + list(TRICKY_STRINGS), 0)
    report["greedy"] = runtime_report(runtime, folder, ["このコマンドは"])
    report["passages"] = runtime_report(runtime, folder, passages, 0)
    return report


def validation_split(workdir: Path, prefix: str) -> tuple[int, int]:
    """(tokens, characters) of stage 2's validation documents, cut as training cuts them."""
    config = load_config(PipelineConfig, workdir / "config.yaml")
    counts = count_dataset(workdir / prefix, config.data.split, config.data.seed)
    with open(workdir / "data" / "corpus" / "corpus.jsonl", encoding="utf-8") as fh:
        lengths = [len(json.loads(line)["text"]) for line in fh]
    if len(lengths) != counts.documents:
        sys.exit(f"{prefix}: {counts.documents} documents, the corpus {len(lengths)}: cannot match characters")
    valid = split_documents(config.data.split, counts.documents, config.data.seed)[1]
    return counts.split_tokens[1], sum(lengths[i] for i in valid)


def bits_per_character(workdir: Path, tokenizer: Path, steps: int, seed: int) -> dict:
    """Stage 2 with the tokenizer, then `gptpipe train` of the tiny preset for ``steps`` steps; the validation
    loss at the end covers the whole validation split once (eval_iters from its token count)."""
    prefix = f"data/tokenized/{tokenizer.name}"
    gptpipe("tokenize", "--config", str(workdir / "config.yaml"), f"tokenize.tokenizer_dir={tokenizer}",
            f"tokenize.output_prefix={prefix}", cwd=workdir)
    prefix += "_text_document"
    tokens, chars = validation_split(workdir, prefix)
    eval_iters = math.ceil(tokens / (128 * 8))
    run = workdir / "runs" / f"{tokenizer.name}-{steps}steps-seed{seed}"
    wall, _ = gptpipe("train", "--config", str(workdir / "config.yaml"), *LM_RUN, f"tokenize.tokenizer_dir={tokenizer}",
                      f"data.prefixes=[{prefix}]",
                      f"train.train_iters={steps}", f"train.eval_interval={steps}", f"train.save_interval={steps}",
                      f"train.eval_iters={eval_iters}", f"train.seed={seed}", f"train.output_model_dir={run}",
                      cwd=workdir)
    with open(run / "metrics.jsonl", encoding="utf-8") as fh:
        loss = [row for row in map(json.loads, fh) if "val_loss" in row][-1]["val_loss"]
    return {"seed": seed, "val_loss": loss, "val_tokens": tokens, "val_chars": chars, "train_wall_s": wall,
            "bits_per_char": loss * tokens / chars / math.log(2)}


def compare(workdir: Path, source: Path, vocab_sizes: list[int], steps: int, seeds: list[int],
            variants: list[tuple[str, float]]) -> None:
    heldout = heldout_documents(workdir, source)
    heldout_passages = passages(heldout)
    rows = []
    for vocab in vocab_sizes:
        for model_type, coverage in variants:
            label = f"{model_type}_cc{coverage:g}_{vocab}"
            print(f"{label}: stage 1 ...", file=sys.stderr, flush=True)
            row = train(workdir, "corpus", label, f"model_type={model_type}", f"vocab_size={vocab}",
                        f"character_coverage={coverage}")
            tokenizer = workdir / "tokenizers" / label
            row["byte_share"] = byte_piece_share(tokenizer / "tokenizer.model", heldout)
            row["pieces"] = vocab
            print(f"{label}: llama.cpp check ...", file=sys.stderr, flush=True)
            row["llamacpp"] = llamacpp_exactness(workdir, tokenizer, heldout, heldout_passages)
            row["lm"] = []
            for seed in seeds:
                print(f"{label}: tiny Llama, seed {seed} ...", file=sys.stderr, flush=True)
                row["lm"].append(bits_per_character(workdir, tokenizer, steps, seed))
            rows.append(row)
            figures = json.dumps(rows, indent=1, ensure_ascii=False)
            (workdir / f"compare-{'-'.join(map(str, vocab_sizes))}.json").write_text(figures, encoding="utf-8")
    print(f"{'tokenizer':<22} {'train s':>8} {'stage s':>7} {'peak RSS MiB':>12} {'chars/token':>11} "
          f"{'byte chars':>10} {'llama.cpp ids differ':>20} {'passages exact':>14} {'greedy differ':>13} "
          f"{'val bits/char (per seed)':>26}")
    for r in rows:
        check, bpc = r["llamacpp"], [lm["bits_per_char"] for lm in r["lm"]]
        exact = 1 - check["passages"]["ids_differing"] / max(1, len(check["passages"]["requests"]))
        print(f"{r['run']:<22} {r['train_s']:>8.1f} {r['wall_s']:>7.1f} {r['peak_rss_mib']:>12.0f} "
              f"{r['chars_per_token']:>11.3f} {r['byte_share']:>10.4%} "
              f"{check['ids_differing']:>8}/{len(check['requests'])} texts {exact:>14.1%} "
              f"{len(check['greedy']['departures']):>11}/{len(check['greedy']['requests'])} "
              + (f"{sum(bpc) / len(bpc):>8.4f} ({', '.join(f'{b:.4f}' for b in bpc)})" if bpc else "-"))
    print(f"(held-out: {len(heldout)} documents, {len(heldout_passages)} passages of {PASSAGE_CHARS} characters; "
          f"tiny Llama {steps} steps x 8 x 128 tokens; outputs and compare-*.json in {workdir}; {os.cpu_count()} CPUs)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, help="an existing corpus.jsonl (default: build it with stage 0)")
    parser.add_argument("--workdir", type=Path, help="keep outputs here (default: a temporary folder)")
    parser.add_argument("--unbounded", action="store_true", help="also train on all lines of the 10x corpus")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure peak RSS against the stage's estimate on a large recombined corpus")
    parser.add_argument("--sizes", default=CALIBRATION_SIZES, help="input_sentence_size values for --calibrate")
    parser.add_argument("--full", action="store_true",
                        help="--calibrate: let every training finish instead of stopping it after its peak")
    parser.add_argument("--calibration-mib", type=int, default=1100, help="size of the --calibrate corpus")
    parser.add_argument("--compare", action="store_true", help="unigram against bpe (see above)")
    parser.add_argument("--vocab-sizes", default="32000,8000", help="--compare: vocabulary sizes")
    parser.add_argument("--steps", type=int, default=300, help="--compare: tiny Llama training steps")
    parser.add_argument("--seeds", default="1234,1235",
                        help="--compare: a tiny Llama training per seed (empty: no language-model runs)")
    parser.add_argument("--variants", default="unigram:0.9995,bpe:0.9995",
                        help="--compare: model_type:character_coverage pairs")
    args = parser.parse_args()

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_tokenizer_"))
    workdir.mkdir(parents=True, exist_ok=True)
    for name in ("config.yaml", "sentence_piece_config.yaml"):
        shutil.copy(REPO / name, workdir / name)
    source = args.corpus.resolve() if args.corpus else None
    if source is None:
        print("building the man-page corpus with stage 0 ...", file=sys.stderr)
        gptpipe("prepare", "--config", str(workdir / "config.yaml"), "corpus.join=true", cwd=workdir)
        source = workdir / "data" / "corpus" / "corpus.jsonl"
    else:
        corpus_stage(workdir, source, "corpus")
    if args.compare:
        variants = [(kind, float(coverage)) for kind, coverage in (v.split(":") for v in args.variants.split(","))]
        compare(workdir, source, [int(n) for n in args.vocab_sizes.split(",")], args.steps,
                [int(n) for n in args.seeds.split(",") if n], variants)
        return
    if args.calibrate:
        calibrate(workdir, source, args.calibration_mib, [int(n) for n in args.sizes.split(",")], args.full)
        return
    repeated = workdir / "repeated.jsonl"
    with open(repeated, "wb") as out:
        out.writelines(source.read_bytes() for _ in range(REPEAT))
    corpus_stage(workdir, repeated, "corpus10x")

    rows = [train(workdir, "corpus", "1x")]
    rows.append(train(workdir, "corpus10x", "10x-bounded", f"input_sentence_size={rows[0]['lines']}"))
    if args.unbounded:
        rows.append(train(workdir, "corpus10x", "10x-all"))

    header = f"{'run':<12} {'corpus MiB':>10} {'lines':>10} {'sample MiB':>10} {'train s':>8} {'stage s':>8} " \
             f"{'peak RSS MiB':>12} {'estimated':>9} {'chars/token':>11}"
    print(header)
    for r in rows:
        print(f"{r['run']:<12} {r['corpus_mib']:>10.1f} {r['lines']:>10,} {r['sample_mib']:>10.1f} "
              f"{r['train_s']:>8.1f} {r['wall_s']:>8.1f} {r['peak_rss_mib']:>12.0f} {r['estimated_mib']:>9} "
              f"{r['chars_per_token']:>11}")
    print(f"(outputs in {workdir}; {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
