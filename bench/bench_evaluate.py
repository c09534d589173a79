"""`gptpipe evaluate` benchmark: wall time on the demo task (man-page section, test split), zero- and few-shot, or
on a generation task by each generator (evaluate_config `generation`).

    python bench/bench_evaluate.py [--config evaluate_config.yaml] [--shots 0 5] [--batch-size 8] [key=value ...]
    python bench/bench_evaluate.py model_dir=EXPORT --generation transformers vllm --llmjp-docs 400 --shots 2
    python bench/bench_evaluate.py --random-llama EXPORT 12 768 --generation transformers vllm --llmjp-docs 400

Needs the exported model (stage 4, or model_dir=...) and the demo task (`gptpipe make-demo-task`); with
--llmjp-docs, instead an llm-jp-eval task written here from the Japanese man pages (/usr/share/man/ja): the command
a NAME description is about, answered in up to --gen-toks new tokens, that many test documents and a few-shot pool
(a vLLM run needs an export whose head size vLLM's CPU build runs: 32, 64, 80, ...). Every run is `gptpipe evaluate
--force` in its own child process, so the figure includes what a user waits for: Python, torch and lm-eval
imports, model load, dataset load, the passes; "generate s" is the generation part alone (the manifest's
generate_s: vLLM's start included). Results go to a temporary folder, not to the model's evaluation/. Prints a
table; the figures go in docs/benchmarks.md. --random-llama EXPORT LAYERS HIDDEN evaluates instead a Llama of that
shape (heads of 64, 4× the width in the MLP), randomly initialised, with EXPORT's tokenizer and context: the cost of
a real model's size, whose texts are noise (it rarely stops before the limit).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MAN_DIR = Path("/usr/share/man/ja")


def write_llmjp_task(root: Path, documents: int, gen_toks: int) -> Path:
    """An llm-jp-eval task folder (evaluation/{train,test}/manpage_name.json) from the man pages' section-1 NAME
    lines: the test folder."""
    from gptpipe.finetune.demo_task import read_rows

    rows = sorted((r for r in read_rows(MAN_DIR)[0] if r.section == "1"), key=lambda r: r.page)
    samples = [{"input": f"説明：{r.input}", "output": r.page.split(",")[0].split("/")[1].rsplit(".", 1)[0]}
               for r in rows]
    if len(samples) < documents + 4:
        raise SystemExit(f"{MAN_DIR} has {len(samples)} section-1 pages: ask for at most {len(samples) - 4}")
    head = {"instruction": "説明されているコマンドの名前を答えてください。", "output_length": gen_toks,
            "metrics": ["exact_match", "char_f1"], "few_shots": []}
    for split, part in (("train", samples[:4]), ("test", samples[4:4 + documents])):
        folder = root / "evaluation" / split
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "manpage_name.json").write_text(json.dumps({**head, "samples": part}, ensure_ascii=False),
                                                  encoding="utf-8")
    return root / "evaluation" / "test"


def random_llama(export: Path, layers: int, hidden: int, out: Path) -> Path:
    """A randomly initialised Llama of `layers` × `hidden` with `export`'s tokenizer files and config otherwise."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(export)
    config.update({"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": hidden // 64,
                   "num_key_value_heads": hidden // 64, "head_dim": 64, "intermediate_size": 4 * hidden,
                   "initializer_range": 0.02})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for path in export.iterdir():
        if path.is_file() and (path.name.startswith("tokenizer") or path.name in ("special_tokens_map.json",
                                                                                   "generation_config.json")):
            shutil.copy2(path, out / path.name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("evaluate_config.yaml"))
    parser.add_argument("--shots", type=int, nargs="+", default=[0, 5])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--generation", nargs="+", default=["auto"], help="generators to compare")
    parser.add_argument("--llmjp-docs", type=int, default=0, help="bench a generation task of this many documents")
    parser.add_argument("--gen-toks", type=int, default=16, help="its new tokens at most (output_length)")
    parser.add_argument("--random-llama", nargs=3, metavar=("EXPORT", "LAYERS", "HIDDEN"),
                        help="evaluate a random Llama of this shape with EXPORT's tokenizer")
    parser.add_argument("overrides", nargs="*", help="more evaluate_config keys, e.g. model_dir=models/hf/ft")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tasks = ([f"task_dirs=[{write_llmjp_task(Path(tmp) / 'llm-jp-eval', args.llmjp_docs, args.gen_toks)}]",
                  "tasks=[]"] if args.llmjp_docs else [])
        if args.random_llama:
            export, layers, hidden = args.random_llama
            model = random_llama(Path(export), int(layers), int(hidden), Path(tmp) / "random-llama")
            tasks.append(f"model_dir={model}")
        for shots in args.shots:
            for generation in args.generation:
                out = Path(tmp) / f"{shots}shot-{generation}"
                started = time.time()
                subprocess.run([sys.executable, "-m", "gptpipe", "evaluate", "--force", "--config", str(args.config),
                                f"num_fewshot={shots}", f"batch_size={args.batch_size}", f"generation={generation}",
                                f"output_dir={out}", *args.overrides, *tasks],
                               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                wall = time.time() - started
                manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
                results = json.loads((out / "results.json").read_text(encoding="utf-8"))
                for task, row in results["tasks"].items():
                    metric, value = next(iter(row["metrics"].items()))
                    rows.append((task, shots, results["generation"]["generator"], row["samples"], wall,
                                 manifest["timings"]["evaluate_s"], manifest["timings"]["generate_s"],
                                 f"{metric} {value['value']:.3f}", row.get("majority_baseline")))
    print("| task | shots | generator | documents | wall s (whole command) | lm-eval s (model load + passes) | "
          "generate s | score | majority |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for task, shots, generator, n, wall, inner, gen, score, base in rows:
        majority = f"{base:.3f}" if base is not None else ""
        print(f"| {task} | {shots} | {generator} | {n} | {wall:.1f} | {inner:.1f} | {gen:.1f} | {score} | "
              f"{majority} |")


if __name__ == "__main__":
    main()
