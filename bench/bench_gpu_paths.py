"""The stage paths issue 45 names that had never run on a GPU, each run once there in bf16: a continued run from a
base with an extended vocabulary (step-0 gate, export), train.eval_tasks at an evaluation (the peak memory against
the plan), "did pretraining help" (llama 125m pretrained for a few minutes on the demo's man pages and Debian's
Japanese documentation, fine-tuned on the demo task beside the same architecture fine-tuned from random weights and
the classical baseline), LoRA and DPO (task.kind preference) from that export.

The GPU machine has neither the man pages nor Debian's documentation, so `kit` builds, where they are (this
project's CPU machine, with the packages bench_vocab_extension.py names installed), every input the rows read, in
one folder to carry (16 MiB; `tar --format=posix` keeps the stage outputs' mtimes, which stage 3 checks):
  - demo/: the demo's YAMLs, tokenizer, stage-2 data and make-demo-task's rows (classification, chat, preference),
    copied from a demo folder whose stages 0-2 and make-demo-task ran (`bash demo.sh` makes one);
  - debian/: Debian's Japanese documentation (bench_vocab_extension.py's training corpus) as stage 2 encodes it
    with the demo's tokenizer: the second source of the 125m pretraining;
  - vocab/: bench_vocab_extension.py's English base (a small Llama with a byte-level BPE), stage 1's extension
    of its tokenizer by the Japanese documentation, and stage 2's encoding of it with the extension.

    .venv/bin/python bench/bench_gpu_paths.py kit --demo demo --out .gckit
    python bench/bench_gpu_paths.py run --kit .gckit --out $OUT/paths        # bench/gpu_check.sh's paths rows
    .venv/bin/python bench/bench_gpu_paths.py run --kit .gckit --out /tmp/paths --tiny   # every row on CPU

`run` runs the rows in order (pretrain before the three fine-tunes that start from its export), prints a markdown
table of their figures and writes it to <out>/paths.md (bench/gpu_check_report.py adds it to its report), each
row's figures as a JSON line to <out>/paths.jsonl and each command's output to <out>/logs/. --tiny is the CPU try:
the tiny preset at 128 tokens and a few steps of each, so every command and its checks run, none of the figures
means anything.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from gptpipe.runtime.metrics_rows import (EvalTasksRow, Row, TaskEvalRow, TrainRow, ValidationRow, of_kind,
                                          read_metrics)

REPO = Path(__file__).resolve().parents[1]
DEMO_YAMLS = ("config.yaml", "convert_config.yaml", "finetune_config.yaml")
TASK = Path("data/finetune/manpage_section")  # make-demo-task's rows, under a demo folder
TASK_YAML = TASK / "manpage_section.yaml"
ROWS = ("continued-vocab", "pretrain", "helped", "lora", "dpo")
PLAN_TOTAL = re.compile(r"^\s*total\s+~([\d.]+) GiB", re.MULTILINE)  # the plan's line in the run's log
GATE = re.compile(r"step-0 gate passed: [^|]*\|Δ\| ([\d.e-]+), tolerance ([\d.e-]+)")  # its loss comparison


@dataclass
class Scale:
    """What the rows train: the GPU's sizes, or --tiny's for a CPU try."""

    preset: str
    seq: int
    precision: str
    pretrain_steps: int
    micro: int
    continued_steps: int
    finetune_iters: int | None  # None: the demo's two epochs
    task_limit: int  # eval_tasks documents per evaluation


GPU = Scale("125m", 2048, "bf16", 400, 16, 200, None, 166)
TINY = Scale("tiny", 128, "bf16", 20, 4, 10, 8, 16)


def gptpipe(log: Path, *argv: object) -> str:
    """`python -m gptpipe ARGV` from the repository root, its output to `log`; returns the output, exits on failure
    with the last lines."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w", encoding="utf-8") as file:  # written as it runs: a row cut by a timeout keeps its log
        done = subprocess.run([sys.executable, "-m", "gptpipe", *map(str, argv)], cwd=REPO, text=True, stdout=file,
                               stderr=subprocess.STDOUT)
    output = log.read_text(encoding="utf-8")
    if done.returncode:
        raise SystemExit(f"gptpipe {argv[0]} failed (exit {done.returncode}); {log}:\n{output[-3000:]}")
    return output


def metric_rows(run: Path) -> list[Row]:
    """The run folder's metrics.jsonl, read as the stages' own rows."""
    return read_metrics(run / "metrics.jsonl")


def peak_gib(rows: list[Row]) -> float | None:
    """The largest memory a train row of `rows` recorded (stage 3's and 7's `mem_gib`)."""
    return max((row.mem_gib for row in of_kind(rows, TrainRow) if row.mem_gib), default=None)


# ---------------------------------------------------------------------------------------------------- the kit


def make_kit(demo: Path, out: Path, base_pages: int, base_steps: int, new_pieces: int) -> None:
    """The folder `run` reads (module docstring), from `demo` and this machine's Japanese documentation."""
    sys.path.insert(0, str(REPO / "bench"))
    import bench_vocab_extension as vocab_bench  # its corpus, base and held-out choices: one definition

    missing = [p for p in (*(demo / y for y in DEMO_YAMLS), demo / TASK_YAML, demo / "data" / "tokenized")
               if not p.exists()]
    if missing:
        raise SystemExit(f"{demo} lacks {', '.join(map(str, missing))}: run demo.sh's stages 0-2 and make-demo-task")
    if not all(p.is_dir() for p in vocab_bench.JA_TRAIN + vocab_bench.JA_HELDOUT):
        raise SystemExit("Debian's Japanese documentation is not installed "
                         f"({vocab_bench.JA_TRAIN + vocab_bench.JA_HELDOUT}): "
                         "see bench/bench_vocab_extension.py")
    logs = out / "logs"
    kit_demo = out / "demo"
    for part in (*DEMO_YAMLS, "tokenizers", "data/tokenized", str(TASK)):
        source, target = demo / part, kit_demo / part
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        # copy2 keeps the mtimes to the nanosecond: stage 3 refuses stage-2 outputs changed after their stage
        (shutil.copytree if source.is_dir() else shutil.copy2)(source, target)

    # The documents as jsonl for stages 1 and 2, outside the kit (stage 3 needs only stage 2's output; the step-0
    # gate decodes and re-encodes held-out documents where their source is gone): 3.7 MiB less to carry
    with tempfile.TemporaryDirectory(prefix="gpu-kit-sources-") as folder:
        sources = Path(folder)
        debian, vocab = out / "debian" / "ja_debian", out / "vocab"
        debian.parent.mkdir(parents=True, exist_ok=True)
        vocab.mkdir(parents=True, exist_ok=True)
        # pretraining's second source: all of it (the vocabulary bench holds two manuals out; the task here is the
        # man pages' sections, which none of them is about)
        if not Path(f"{debian}_text_document.idx").is_file():
            text = vocab_bench.write_jsonl(sources / "ja_debian.jsonl", vocab_bench.japanese_documents(
                vocab_bench.JA_TRAIN + vocab_bench.JA_HELDOUT))
            gptpipe(logs / "kit-debian.log", "tokenize", "--config", kit_demo / "config.yaml",
                    f"tokenize.input=[{text}]", f"tokenize.output_prefix={debian}")
        base, extension = vocab / "base", vocab / "ext"
        encoded = vocab / "ext"  # stage 2's prefix: vocab/ext_text_document.{bin,idx}
        if not (base / "model.safetensors").is_file():
            vocab_bench.english_base(base, base_pages, base_steps)
        if not ((extension / "hf").is_dir() and Path(f"{encoded}_text_document.idx").is_file()):
            # the extension's corpus, as bench_vocab_extension.py's
            corpus = vocab_bench.write_jsonl(sources / "ja_train.jsonl",
                                             vocab_bench.japanese_documents(vocab_bench.JA_TRAIN))
            gptpipe(logs / "kit-extension.log", "train-tokenizer", "--config", REPO / "sentence_piece_config.yaml",
                    f"input={corpus}", f"base_tokenizer={base}", f"output_dir={extension}", f"new_pieces={new_pieces}",
                    "--force")
            gptpipe(logs / "kit-vocab-tokenize.log", "tokenize", "--config", REPO / "config.yaml",
                    f"tokenize.input=[{corpus}]", f"tokenize.tokenizer_dir={extension / 'hf'}",
                    f"tokenize.output_prefix={encoded}", "--force")
    shutil.rmtree(logs, ignore_errors=True)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"kit in {out}: {size / 2**20:.1f} MiB")


# ---------------------------------------------------------------------------------------------------- the rows


class Rows:
    """Runs the rows on a kit; each returns its figures (a dict) and leaves its folder under `out`."""

    def __init__(self, kit: Path, out: Path, scale: Scale):
        self.kit, self.out, self.scale = kit.resolve(), out.resolve(), scale
        self.demo = self.kit / "demo"
        self.logs = self.out / "logs"
        self.export = self.out / "pretrain-hf"  # the 125m export the fine-tunes start from

    def common(self, run: Path) -> list[str]:
        return [f"train.output_model_dir={run}", f"train.precision={self.scale.precision}", "logging.wandb=false",
                "logging.tensorboard=false"]

    def continued_vocab(self) -> dict:
        """Stage 3 from the English base on Japanese text encoded by its extended tokenizer (the matrices grown,
        the step-0 gate in bf16), two steps of embedding warmup, the demo task scored at each evaluation; stage 4
        (its gate: logits against the checkpoint, the extension's tokenizer files)."""
        s, vocab, run = self.scale, self.kit / "vocab", self.out / "continued-vocab"
        started = time.time()
        log = gptpipe(self.logs / "continued-vocab.log", "train", "--config", REPO / "config.yaml",
                      f"model.init_from={vocab / 'base'}", "model.arch=null", "model.preset=null",
                      f"tokenize.tokenizer_dir={vocab / 'ext'}", f"data.prefixes=[{vocab / 'ext'}_text_document]",
                      "data.split=98,2,0", f"train.train_iters={s.continued_steps}", "train.seq_len=128",
                      "train.global_batch_size=8", "train.lr=1e-3", "train.min_lr=1e-4", "train.warmup_steps=10",
                      "train.embedding_warmup_steps=2", f"train.eval_interval={s.continued_steps}",
                      "train.eval_iters=4", f"train.save_interval={s.continued_steps}", "train.log_interval=10",
                      "train.sample_prompts=[]", f"train.eval_task_yamls=[{self.demo / TASK_YAML}]",
                      f"train.eval_tasks_limit={s.task_limit}", *self.common(run))
        seconds = time.time() - started
        gptpipe(self.logs / "continued-vocab-export.log", "convert", "--config", REPO / "convert_config.yaml",
                f"input_model_dir={run}", f"output_tokenizer_and_model_dir={self.out / 'continued-vocab-hf'}",
                "dtype=bf16")
        rows = metric_rows(run)
        train = of_kind(rows, TrainRow)
        gate = GATE.search(log)
        return {"step-0 gate": f"passed, loss Δ {gate.group(1)} (tolerance {gate.group(2)})" if gate else "no line",
                "loss": f"{train[0].loss:.3f} → {train[-1].loss:.3f}",
                "tokens_per_s": statistics.median(r.tokens_per_s for r in train),
                "peak_gib": peak_gib(rows), "wall_s": seconds, "export": "verified"}

    def pretrain(self) -> dict:
        """Stage 3, the preset from random weights on the demo's man pages and the Debian documentation (blended by
        tokens), the demo task scored at every evaluation (train.eval_task_yamls); stage 4 of the last step. The
        peak memory of the log windows holding an evaluation against the plan's total."""
        s, run = self.scale, self.out / "pretrain"
        every = max(s.pretrain_steps // 4, 1)
        started = time.time()
        log = gptpipe(self.logs / "pretrain.log", "train", "--config", self.demo / "config.yaml",
                      f"model.preset={s.preset}", f"train.seq_len={s.seq}",
                      f"data.prefixes=[{self.demo / 'data/tokenized/ja_text_document'},"
                      f"{self.kit / 'debian/ja_debian_text_document'}]", "data.split=95,5,0",
                      f"train.global_batch_size={s.micro}", f"train.micro_batch_size={s.micro}", "train.lr=6e-4",
                      "train.min_lr=6e-5", "train.train_tokens=null", "train.train_epochs=20",
                      f"train.train_iters={s.pretrain_steps}", "train.log_interval=10",
                      f"train.eval_interval={every}", f"train.save_interval={s.pretrain_steps}",
                      "train.eval_iters=4", "train.sample_prompts=[]",
                      f"train.eval_task_yamls=[{self.demo / TASK_YAML}]", f"train.eval_tasks_limit={s.task_limit}",
                      *self.common(run))
        seconds = time.time() - started
        gptpipe(self.logs / "pretrain-export.log", "convert", "--config", self.demo / "convert_config.yaml",
                f"input_model_dir={run}", f"output_tokenizer_and_model_dir={self.export}", "dtype=bf16")
        rows = metric_rows(run)
        train, validation = of_kind(rows, TrainRow), of_kind(rows, ValidationRow)
        tasks = of_kind(rows, EvalTasksRow)
        evaluated = {r.step for r in [*validation, *tasks]}  # the tasks' reference scoring is at step 0
        # A log row's mem_gib is the peak since the previous log row, split here by whether its window held an
        # evaluation: the loop logs step S before it evaluates at S, so that evaluation falls in the next row's
        # window (the reference at step 0 in the first one); the final evaluation, after the last row, in none.
        peaks: dict[bool, list[float]] = {True: [], False: []}
        for start, row in zip([0, *(r.step for r in train)], train):
            if row.mem_gib:
                peaks[any(start <= step < row.step for step in evaluated)].append(row.mem_gib)
        total = PLAN_TOTAL.search(log)
        planned = float(total.group(1)) if total else None
        acc = [r.scores.get("manpage_section", {}).get("acc") for r in tasks]
        # issue 45's goal: peak memory within ±10% of the plan, an evaluation with task scoring included
        against = {kind: f"{max(peaks[held]) / planned:.2f}×" for kind, held in (("with", True), ("without", False))
                   if planned and peaks[held]}
        return {"tokens_per_s": statistics.median(r.tokens_per_s for r in train[1:] or train),
                "mfu": statistics.median(r.mfu or 0 for r in train[1:] or train),
                "val_loss": f"{validation[0].val_loss:.3f} → {validation[-1].val_loss:.3f}",
                "task_acc": " → ".join(f"{a:.3f}" for a in acc if a is not None),
                "eval_tasks_s": max((r.seconds for r in tasks), default=0),
                "peak_gib_eval": max(peaks[True], default=None), "peak_gib_train": max(peaks[False], default=None),
                "planned_gib": planned, "peak_vs_plan": ", ".join(f"{v} {k} evaluations" for k, v in against.items()),
                "wall_s": seconds}

    def finetune(self, name: str, *overrides: str) -> tuple[dict, list[Row]]:
        """Stage 7 on the demo task from the pretrained export; (finetune_summary.json, its metric rows)."""
        run = self.out / name
        iters = [] if self.scale.finetune_iters is None else [
            f"train.train_iters={self.scale.finetune_iters}", f"train.eval_interval={self.scale.finetune_iters}"]
        gptpipe(self.logs / f"{name}.log", "finetune", "--config", self.demo / "finetune_config.yaml",
                f"model.path={self.export}", *iters, *self.common(run), *overrides)
        return json.loads((run / "finetune_summary.json").read_text(encoding="utf-8")), metric_rows(run)

    def helped(self) -> dict:
        """The demo task fine-tuned from the pretrained export, from random weights (baseline.model scratch) and the
        classical baseline, the same rows and settings; lr 1e-4 (the config's advice for a real pretrained model)."""
        summary, _ = self.finetune("helped", "train.lr=1e-4", "baseline.model=scratch", "baseline.classical=true")
        table = summary["comparison"]
        return {metric: {name: figures.get(metric) for name, figures in table.items()}
                for metric in ("accuracy", "macro_f1")}

    def lora(self) -> dict:
        """The same task with LoRA adapters (rank 8) at a LoRA learning rate."""
        summary, rows = self.finetune("lora", "train.lr=1e-3", "train.lora.rank=8")
        best = summary["best"]["metrics"]
        return {"accuracy": best.get("accuracy"), "macro_f1": best.get("macro_f1"),
                "peak_gib": peak_gib(rows)}

    def dpo(self) -> dict:
        """Preference tuning (DPO + the chosen answer's NLL) of the export on make-demo-task's pairs with demo.sh's
        overrides (seq 128, batch 8, lr 3e-4, beta 0.5, 50 steps); reward accuracy on the held-out pairs at each
        evaluation."""
        pairs = self.demo / TASK / "preference"
        _, rows = self.finetune(
            "dpo", "task.kind=preference", f"data.train={pairs / 'train.jsonl'}",
            f"data.validation={pairs / 'validation.jsonl'}", f"data.test={pairs / 'test.jsonl'}", "train.seq_len=128",
            "train.global_batch_size=8", "train.lr=3e-4", "train.train_epochs=1",
            f"train.train_iters={self.scale.finetune_iters or 50}",
            f"train.eval_interval={self.scale.finetune_iters or 50}", "task.beta=0.5")
        return {"reward_accuracy": " → ".join(f"{r.metrics.get('reward_accuracy', float('nan')):.3f}"
                                              for r in of_kind(rows, TaskEvalRow)),
                "peak_gib": peak_gib(rows)}


def show(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if value >= 100 else f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {show(v)}" for k, v in value.items())
    return str(value)


def run_rows(kit: Path, out: Path, names: list[str], scale: Scale) -> int:
    """The rows in ROWS order; a failed row is reported and counted (a fine-tune without the pretrained export is
    not run). Returns the number of failed rows."""
    if out.exists() and any(out.iterdir()):  # its runs would resume, a failed pretrain leave an old export
        raise SystemExit(f"{out} is not empty: give a new --out")
    rows = Rows(kit, out, scale)
    out.mkdir(parents=True, exist_ok=True)
    lines, failed = ["| row | figures | wall |", "|---|---|---|"], 0
    for name in (n for n in ROWS if n in names):
        started = time.time()
        if name in ("helped", "lora", "dpo") and not (rows.export / "config.json").is_file():
            lines.append(f"| paths-{name} | not run: no pretrained export (the pretrain row) | - |")
            failed += 1
        else:
            try:
                figures = getattr(rows, name.replace("-", "_"))()
            except (SystemExit, Exception) as exc:  # SystemExit: a command failed; others: figures that did not parse
                print(f"paths-{name}: {exc!r}", file=sys.stderr)
                lines.append(f"| paths-{name} | FAILED: logs/{name}*.log | {time.time() - started:.0f} s |")
                failed += 1
            else:
                with (out / "paths.jsonl").open("a", encoding="utf-8") as file:
                    file.write(json.dumps({"label": f"paths-{name}", "scale": scale.preset, **figures}) + "\n")
                lines.append(f"| paths-{name} | {'; '.join(f'{k} {show(v)}' for k, v in figures.items())} | "
                             f"{time.time() - started:.0f} s |")
        print(lines[-1], flush=True)
        # after every row: a timeout of the whole leaves the rows before it in the report
        (out / "paths.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    kit = commands.add_parser("kit", help="build the kit the rows read (on the machine with the documents)")
    kit.add_argument("--demo", type=Path, default=REPO / "demo", help="a demo folder after stages 0-2 and "
                                                                       "make-demo-task")
    kit.add_argument("--out", type=Path, required=True)
    kit.add_argument("--base-pages", type=int, default=600, help="English man pages the vocabulary base learns")
    kit.add_argument("--base-steps", type=int, default=200)
    kit.add_argument("--new-pieces", type=int, default=1000)
    rows = commands.add_parser("run", help="run the rows on a kit")
    rows.add_argument("--kit", type=Path, required=True)
    rows.add_argument("--out", type=Path, required=True)
    rows.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    rows.add_argument("--tiny", action="store_true", help="toy sizes, for a CPU try")
    args = parser.parse_args()
    if args.command == "kit":
        make_kit(args.demo.resolve(), args.out.resolve(), args.base_pages, args.base_steps, args.new_pieces)
    else:
        sys.exit(run_rows(args.kit, args.out, args.rows, TINY if args.tiny else GPU))


if __name__ == "__main__":
    main()
