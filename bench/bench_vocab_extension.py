"""Continued pretraining with the base's tokenizer as it is vs extended by stage 1 (issue 33), on CPU.

An English base made here: the tests' byte-level BPE (1,500 pieces, tests/conftest.py's byte_level_bpe) trained on
the first 300 English man pages (their roff source), and a small Llama trained on the first --base-pages of them in
a plain loop. A Japanese corpus the project never saw: Debian's Japanese documentation installed on this machine
(debian-reference-ja, developers-reference-ja, debian-policy's ja, aptitude-doc-ja: the training corpus; the Debian
FAQ's ja and maint-guide-ja: held out, never trained on nor used to extend the tokenizer). Stage 1 extends the base's
tokenizer on the training corpus (`new_pieces`), stage 2 encodes it with each tokenizer, stage 3 continues the base
for the same steps and tokens per step on each, scoring the demo task (make-demo-task) at every evaluation
(train.eval_task_yamls), and stage 4 exports it. Measured on the exports: characters per token and bits per
character of the held-out Japanese, the loss on held-out English man pages (pages the base never saw) against the
base's, training characters per second, and the task rows.

The base is trained with a cosine from 3e-3 to 1e-4 and saved with a trainer_state.json recording its last rate, as
transformers' Trainer does, so stage 3 re-warms from it (train.start_lr unset: the continued-run default). With
--sweep, the extended tokenizer only, at each replay share (--replays) × peak rate (--lrs): the held-out English
loss against the base's and the held-out Japanese bits per character of each, to choose the shipped defaults.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_vocab_extension.py --workdir /tmp/bench-vocab --replay 0
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_vocab_extension.py --workdir /tmp/bench-vocab  # the defaults
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_vocab_extension.py --workdir /tmp/bench-vocab --sweep

(later ones reuse the first's base, extension and datasets; figures in docs/benchmarks.md)
"""

from __future__ import annotations

import argparse
import gzip
import html.parser
import json
import math
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gptpipe.train.config import CONTINUED_REPLAY

REPO = Path(__file__).resolve().parents[1]
ENGLISH = Path("/usr/share/man/man1")
DOC = Path("/usr/share/doc")
# debian-reference-ja and developers-reference-ja install their pages under /usr/share (their docs/ links there)
JA_TRAIN = [Path("/usr/share/debian-reference"), Path("/usr/share/developers-reference/ja"),
            DOC / "debian-policy" / "ja", DOC / "aptitude" / "html" / "ja"]
JA_HELDOUT = [DOC / "debian" / "FAQ" / "ja", DOC / "maint-guide-ja" / "html"]
SEQ = 128  # the base's and stage 3's sequence length
BASE_LR, BASE_MIN_LR = 3e-3, 1e-4  # the base's cosine schedule; its trainer_state.json records the end rate
# stage 3's peak rate by default: the sweep's best for this base (10x its end rate: train/config.py's
# CONTINUED_PEAK_RATIO_MAX); the replay share by default: the shipped one (the plan's suggestion)
PEAK_LR = 1e-3
JAPANESE = re.compile(r"[\u3040-\u30ff\u4e00-\u9fff]")


class _Text(html.parser.HTMLParser):
    """An HTML page's visible text, one line per block."""

    SKIP = frozenset({"script", "style", "head"})
    BLOCK = frozenset({"p", "div", "br", "li", "pre", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "dt", "dd", "table",
                       "title"})

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self.skipping = 0

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.skipping += tag in self.SKIP
        if tag in self.BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        self.skipping -= tag in self.SKIP and self.skipping > 0
        if tag in self.BLOCK:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if not self.skipping:
            self.parts.append(data)

    def text(self) -> str:
        lines = (re.sub(r"[ \t\r\f\v]+", " ", line).strip() for line in "".join(self.parts).splitlines())
        return "\n".join(line for line in lines if line)


def japanese_documents(folders: list[Path], chunk: int = 3000) -> list[str]:
    """The Japanese HTML pages under `folders` as plain text, cut at line ends into documents of ~`chunk`
    characters (a page of the Debian Reference is a whole chapter)."""
    documents = []
    for page in sorted(p for folder in folders for p in folder.rglob("*.htm*") if p.is_file()):
        parser = _Text()
        parser.feed(page.read_text(encoding="utf-8", errors="replace"))
        text = parser.text()
        if len(JAPANESE.findall(text)) < 0.2 * len(text):  # an English page or an index of names
            continue
        current: list[str] = []
        for line in text.splitlines():
            current.append(line)
            if sum(map(len, current)) >= chunk:
                documents.append("\n".join(current))
                current = []
        if current:
            documents.append("\n".join(current))
    return documents


def english_pages(start: int, count: int) -> list[str]:
    """English man pages' roff source, as the tests' English base tokenizer is trained on."""
    pages = sorted(ENGLISH.glob("*.gz"))[start:start + count]
    return [gzip.decompress(p.read_bytes()).decode("utf-8", "replace") for p in pages]


# The English task's labels: a man page's section, told from its NAME line's description.
SECTIONS = {"1": "command", "2": "system call", "3": "library function", "5": "file format",
            "8": "administration command"}


def english_task(folder: Path, skip_man1: int, per_section: int = 40) -> Path:
    """A local lm-eval task in English shaped like the demo task: a man page's one-line description (its NAME
    section) → its section, zero-shot multiple choice, `per_section` pages of each (man1's past the first
    `skip_man1`, which the base trained on or which are held out). Returns its YAML."""
    rows, seen = [], set()
    for section, label in SECTIONS.items():
        pages = sorted(Path(f"/usr/share/man/man{section}").glob("*.gz"))[skip_man1 if section == "1" else 0:]
        found = 0
        for page in pages:
            text = gzip.decompress(page.read_bytes()).decode("utf-8", "replace")
            name = re.search(r'^\.SH "?NAME"?\s*\n(.*?)\n\.S[HS]', text, re.MULTILINE | re.DOTALL)
            if not name or "\\-" not in name.group(1):
                continue
            description = name.group(1).split("\\-", 1)[1]
            roff = r"\\f[BIRP]|\\\(..|\\[&-]|^\..*$"  # font changes, special characters, requests
            description = " ".join(re.sub(roff, "", description, flags=re.MULTILINE).split())
            if len(description) < 10 or "\t" in description or description in seen:
                continue
            seen.add(description)
            rows.append(f"{description}\t{label}")
            found += 1
            if found == per_section:
                break
    random.Random(0).shuffle(rows)  # lm-eval's limit takes the first documents: every section among them
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "test.tsv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    choices = "".join(f"- {label}\n" for label in SECTIONS.values())
    (folder / "man_section_en.yaml").write_text(f"""task: man_section_en
dataset_path: csv
dataset_kwargs:
  data_files:
    test: test.tsv
  delimiter: "\\t"
  column_names: [input, label]
  quoting: 3
  na_filter: false
output_type: multiple_choice
test_split: test
doc_to_text: "Description: {{{{input}}}}\\nManual section:"
doc_to_target: "{{{{label}}}}"
doc_to_choice:
{choices}target_delimiter: " "
metric_list:
- metric: acc
  aggregation: mean
  higher_is_better: true
- metric: acc_norm
  aggregation: mean
  higher_is_better: true
metadata:
  version: 1.0
""", encoding="utf-8")
    return folder / "man_section_en.yaml"


def text_task(folder: Path, name: str, texts: list[str]) -> Path:
    """A local lm-eval task scoring `texts` as whole documents (loglikelihood_rolling): bits per byte first, the
    main metric (lower is better), so the console line compares it with the reference. Returns its YAML."""
    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(folder / "test.jsonl", texts)
    (folder / f"{name}.yaml").write_text(f"""task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: test.jsonl
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
- metric: bits_per_byte
  aggregation: bits_per_byte
  higher_is_better: false
- metric: byte_perplexity
  aggregation: weighted_perplexity
  higher_is_better: false
metadata:
  version: 1.0
""", encoding="utf-8")
    return folder / f"{name}.yaml"


def english_base(folder: Path, pages: int, steps: int) -> Path:
    """The tests' byte-level BPE on 300 English man pages and a Llama (4 layers, 128 wide) trained on `pages`."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(REPO / "tests"))
    from conftest import byte_level_bpe  # the tests' English base tokenizer, so bench and tests check one thing

    texts = english_pages(0, pages)
    byte_level_bpe(texts, folder, adds_bos=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    stream = torch.tensor([i for t in texts for i in tokenizer(t)["input_ids"] + [tokenizer.eos_token_id]])
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    def lr_at(step: int) -> float:  # cosine from BASE_LR to BASE_MIN_LR at the last step
        return BASE_MIN_LR + (BASE_LR - BASE_MIN_LR) * 0.5 * (1 + math.cos(math.pi * step / (steps - 1)))

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr_at(0), weight_decay=0.1)
    generator = torch.Generator().manual_seed(0)
    for step in range(steps):
        starts = torch.randint(0, len(stream) - SEQ - 1, (16,), generator=generator)
        batch = torch.stack([stream[s:s + SEQ + 1] for s in starts.tolist()])
        targets = batch[:, 1:].contiguous()
        loss = model(input_ids=batch[:, :-1], labels=targets, shift_labels=targets).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step + 1)
        if step % 100 == 0 or step == steps - 1:
            print(f"English base: step {step + 1}/{steps} loss {loss.item():.3f}", flush=True)
    model.save_pretrained(folder)
    # what transformers' Trainer.save_state writes: the rate of the last step, which a continued run re-warms from
    history = [{"step": steps, "learning_rate": lr_at(steps - 1), "loss": round(loss.item(), 4)}]
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": steps, "log_history": history}, indent=1)
                                               + "\n", encoding="utf-8")
    return folder


def gptpipe(*argv: object) -> str:
    done = subprocess.run([sys.executable, "-m", "gptpipe", *map(str, argv)], capture_output=True, text=True,
                          cwd=REPO)
    if done.returncode:
        raise SystemExit(f"gptpipe {argv[0]} failed:\n{done.stderr[-3000:]}")
    return done.stderr


def nats(model_dir: Path, texts: list[str]) -> tuple[float, int, int]:
    """(summed negative log-likelihood in nats, tokens predicted, characters) of `texts` under the HF folder's model
    and tokenizer: each text from its BOS, in windows of SEQ tokens striding by SEQ/2, so every token after the
    first window is predicted from at least SEQ/2 tokens of context."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, predicted, stride = 0.0, 0, SEQ // 2
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text)["input_ids"]
            for start in range(0, max(1, len(ids) - 1), stride):
                begin = max(0, start + stride - SEQ) if start else 0
                window = torch.tensor([ids[begin:start + stride + 1]])
                logits = model(input_ids=window[:, :-1]).logits[0].float()
                targets = window[0, 1:]
                scored = slice(start - begin, None)  # the tokens after `start`, not those the last window scored
                losses = torch.nn.functional.cross_entropy(logits, targets, reduction="none")[scored]
                total += float(losses.sum())
                predicted += len(losses)
    return total, predicted, sum(map(len, texts))


def chars_per_token(tokenizer_dir: Path, texts: list[str]) -> float:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokens = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
    return sum(map(len, texts)) / tokens


def first_characters(texts: list[str], budget: int) -> list[str]:
    """The first texts that together hold at most `budget` characters (at least one)."""
    kept, total = [], 0
    for text in texts:
        if kept and total + len(text) > budget:
            break
        kept.append(text)
        total += len(text)
    return kept


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    return path


def continued_run(work: Path, args: argparse.Namespace, name: str, tokenizer_dir: Path, replay: float, lr: float,
                  tasks: list[Path]) -> tuple[dict, str]:
    """Stage 3 continuing the base on the Japanese corpus (its `name` prefixes, encoded with `tokenizer_dir`), with
    a `replay` token share of the base's English pages, peak rate `lr` (a tenth at the end; the re-warm from the
    base's recorded end rate, the continued-run default), then stage 4. Returns (the run's facts, its log)."""
    prefixes, weights = [f"{work / name}_text_document"], []
    if replay:
        prefixes.append(f"{work / name}_en_text_document")
        weights = [f"data.weights=[{1 - replay:g},{replay:g}]"]
    suffix = (f"-replay{replay:g}" + (f"-lr{lr:g}" if args.sweep else "")
              + (f"-start{args.start_lr:g}" if args.start_lr is not None else ""))
    start = [] if args.start_lr is None else [f"train.start_lr={args.start_lr}"]
    run, export = work / f"run-{name}{suffix}", work / f"hf-{name}{suffix}"
    started = time.time()
    log = gptpipe("train", "--config", REPO / "config.yaml", f"model.init_from={work / 'base'}", "model.arch=null",
                  "model.preset=null", f"tokenize.tokenizer_dir={tokenizer_dir}",
                  f"data.prefixes=[{','.join(prefixes)}]", *weights, "data.split=98,2,0",
                  f"train.output_model_dir={run}", f"train.train_iters={args.steps}", f"train.seq_len={SEQ}",
                  "train.global_batch_size=8", f"train.lr={lr}", f"train.min_lr={lr / 10}",
                  f"train.warmup_steps={args.warmup}", *start, f"train.eval_interval={args.steps // 4}",
                  "train.eval_iters=4",
                  "train.precision=fp32", f"train.save_interval={args.steps}", "train.log_interval=10",
                  "train.sample_prompts=[]", f"train.eval_task_yamls=[{','.join(map(str, tasks))}]",
                  f"train.eval_tasks_limit={args.task_limit}", "logging.wandb=false", "logging.tensorboard=false",
                  "train.seed=1234")
    seconds = time.time() - started
    gptpipe("convert", "--config", REPO / "convert_config.yaml", f"input_model_dir={run}",
            f"output_tokenizer_and_model_dir={export}", "dtype=fp32")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    speed = [r["tokens_per_s"] for r in rows if r.get("kind") == "train"]
    lrs = [r["lr"] for r in rows if r.get("kind") == "train"]
    schedule = next(line.split(" lr ", 1)[1].strip() for line in log.splitlines() if line.lstrip().startswith("lr "))
    return {"replay": replay, "lr": lr, "schedule": schedule, "first_logged_lr": lrs[0], "last_lr": lrs[-1],
            "export": export, "run": run, "tokens_per_s": sum(speed) / len(speed), "wall_s": seconds,
            "tasks": [{"step": r["step"], "seconds": r["eval_tasks_s"],
                       **{task: r[f"eval_task/{task}/acc"] for task in ("manpage_section", "man_section_en")
                          if f"eval_task/{task}/acc" in r},
                       **{task: r[f"eval_task/{task}/bits_per_byte"] for task in ("debian_faq_ja", "man_en")}}
                      for r in rows if r.get("kind") == "eval_tasks"]}, log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-pieces", type=int, default=1000)
    parser.add_argument("--base-pages", type=int, default=2000, help="English man pages the base is trained on")
    parser.add_argument("--base-steps", type=int, default=600)
    parser.add_argument("--steps", type=int, default=300, help="stage-3 steps of each run")
    parser.add_argument("--lr", type=float, default=PEAK_LR, help="stage-3 peak learning rate")
    parser.add_argument("--warmup", type=int, default=10, help="stage-3 re-warm steps (train.warmup_steps)")
    parser.add_argument("--start-lr", type=float, default=None,
                        help="train.start_lr: where the warmup starts (default: the base's recorded end rate)")
    parser.add_argument("--task-limit", type=int, default=120, help="demo-task documents per evaluation")
    parser.add_argument("--heldout-chars", type=int, default=100_000,
                        help="held-out Japanese and English characters scored (the first documents up to this)")
    parser.add_argument("--text-docs", type=int, default=12,
                        help="held-out Japanese and English documents in the whole-document tasks")
    parser.add_argument("--replay", type=float, default=CONTINUED_REPLAY,
                        help="token share of the base's own English pages blended into stage 3 (0: Japanese only)")
    parser.add_argument("--sweep", action="store_true",
                        help="the extended tokenizer only, at each --replays share × --lrs peak rate")
    parser.add_argument("--replays", type=lambda v: [float(x) for x in v.split(",")], default=[0.05, 0.25])
    parser.add_argument("--lrs", type=lambda v: [float(x) for x in v.split(",")], default=[1e-3, 3e-4])
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-vocab-"))
    work.mkdir(parents=True, exist_ok=True)
    clock = time.time()
    base = work / "base"
    if not (base / "model.safetensors").is_file():
        english_base(base, args.base_pages, args.base_steps)
        print(f"English base trained in {time.time() - clock:.0f} s", flush=True)
    train_docs = japanese_documents(JA_TRAIN)
    heldout = first_characters(japanese_documents(JA_HELDOUT), args.heldout_chars)
    english_heldout = first_characters(english_pages(args.base_pages + 1000, 1000), args.heldout_chars)  # unseen
    corpus = write_jsonl(work / "ja_train.jsonl", train_docs)
    print(f"Japanese corpus: {len(train_docs)} documents, {sum(map(len, train_docs)):,} characters to train on; "
          f"held out {len(heldout)} documents, {sum(map(len, heldout)):,} characters; held-out English: "
          f"{len(english_heldout)} man pages, {sum(map(len, english_heldout)):,} characters", flush=True)
    extension = work / "ext"
    if not (extension / "hf").is_dir():
        gptpipe("train-tokenizer", "--config", REPO / "sentence_piece_config.yaml", f"input={corpus}",
                f"base_tokenizer={base}", f"output_dir={extension}", f"new_pieces={args.new_pieces}")
    # the held-out texts' first documents as whole-document tasks: bits per byte in the task rows at every evaluation
    tasks = [text_task(work / "task-ja-text", "debian_faq_ja", heldout[:args.text_docs]),
             text_task(work / "task-en-text", "man_en", english_heldout[:args.text_docs])]
    if not args.sweep:  # the two classification tasks (at chance on a model this small: docs/benchmarks.md)
        task_config = work / "evaluate_config.yaml"
        task_config.write_text((REPO / "evaluate_config.yaml").read_text(encoding="utf-8"), encoding="utf-8")
        gptpipe("make-demo-task", "--config", task_config, f"demo_task.output_dir={work / 'task'}")
        tasks = [work / "task" / "manpage_section.yaml", english_task(work / "task-en", args.base_pages + 2000),
                 *tasks]

    # replay: the pages the base was trained on, blended in by token share (data.weights)
    replays = args.replays if args.sweep else [args.replay]
    replay = write_jsonl(work / "en_replay.jsonl", english_pages(0, args.base_pages)) if any(replays) else None
    base_total, base_predicted, base_chars = nats(base, english_heldout)
    base_english = base_total / base_predicted
    results = []
    tokenizers = (("extended", extension / "hf"),) if args.sweep else (("base tokenizer", base),
                                                                        ("extended", extension / "hf"))
    for tag, tokenizer_dir in tokenizers:
        name = "ext" if tokenizer_dir != base else "base"
        for source, prefix in ((corpus, work / name), (replay, Path(f"{work / name}_en"))):
            if source is not None and not Path(f"{prefix}_text_document.idx").is_file():
                gptpipe("tokenize", "--config", REPO / "config.yaml", f"tokenize.input=[{source}]",
                        f"tokenize.tokenizer_dir={tokenizer_dir}", f"tokenize.output_prefix={prefix}")
        for share in replays:
            for lr in args.lrs if args.sweep else [args.lr]:
                result, log = continued_run(work, args, name, tokenizer_dir, share, lr, tasks)
                export = result.pop("export")
                ja_total, _, ja_chars = nats(export, heldout)
                en_total, en_predicted, en_chars = nats(export, english_heldout)
                train_cpt = chars_per_token(tokenizer_dir, train_docs)
                result.update({
                    "tokenizer": tag, "heldout_chars_per_token": chars_per_token(tokenizer_dir, heldout),
                    "train_chars_per_token": train_cpt,
                    # Japanese characters trained per second: the Japanese share of the tokens, at its characters
                    # per token
                    "chars_per_s": result["tokens_per_s"] * (1 - share) * train_cpt,
                    "ja_bits_per_char": ja_total / ja_chars / math.log(2), "en_loss": en_total / en_predicted,
                    "en_nats_per_char": en_total / en_chars, "run": str(result["run"]),
                    "warnings": [line.split("warning: ", 1)[1] for line in log.splitlines() if "warning: " in line]})
                results.append(result)
                print(json.dumps(results[-1]), flush=True)

    base_ja_total, _, base_ja_chars = nats(base, heldout)
    print(f"\nthe base on the held-out Japanese: {base_ja_total / base_ja_chars / math.log(2):.4f} bits per character; "
          f"on the held-out English: {base_english:.4f} nats per token, {base_total / base_chars:.4f} per character\n")
    print("| replay | peak lr | tokenizer | held-out Japanese chars/token | Japanese chars/s trained (tokens/s) | "
          "held-out Japanese bits/char | held-out English loss (change) | stage 3 wall |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['replay']:.0%} | {r['lr']:g} | {r['tokenizer']} | {r['heldout_chars_per_token']:.3f} | "
              f"{r['chars_per_s']:,.0f} ({r['tokens_per_s']:,.0f}) | {r['ja_bits_per_char']:.4f} | "
              f"{r['en_loss']:.4f} ({r['en_loss'] / base_english - 1:+.1%}) | {r['wall_s']:.0f} s |")
    print("\nthe schedules (the plan's lr line):\n" + "\n".join(f"{r['replay']:.0%} {r['lr']:g}: {r['schedule']}"
                                                             for r in results))
    print("\nthe task rows: accuracy on manpage_section (Japanese) / man_section_en (English), where scored; bits per "
          "byte on debian_faq_ja / man_en; the seconds the scoring took\n")
    print("| replay | peak lr | tokenizer | " + " | ".join(f"step {t['step']}" for t in results[0]["tasks"]) + " |")
    print("| --- | --- | --- |" + " --- |" * len(results[0]["tasks"]))
    for r in results:
        print(f"| {r['replay']:.0%} | {r['lr']:g} | {r['tokenizer']} | " + " | ".join(
            (f"{t['manpage_section']:.3f} / {t['man_section_en']:.3f}; " if "manpage_section" in t else "")
            + f"{t['debian_faq_ja']:.3f} / {t['man_en']:.3f} ({t['seconds']:.0f} s)" for t in r["tasks"]) + " |")
    name = ("results-sweep" if args.sweep else f"results-replay{args.replay:g}-lr{args.lr:g}") + (
        f"-start{args.start_lr:g}" if args.start_lr is not None else "")
    (work / f"{name}.json").write_text(json.dumps({"base_en_loss": base_english, "runs": results}, indent=1) + "\n",
                                       encoding="utf-8")
    for r in results:
        print(f"\n{r['tokenizer']} {r['replay']:.0%} {r['lr']:g}: the warning lines of the run\n"
              + "\n".join(r["warnings"]))
    print(f"work folder: {work}")


if __name__ == "__main__":
    main()
