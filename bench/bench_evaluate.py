"""`gptpipe evaluate` benchmark: wall time on the demo task (man-page section, test split), zero- and few-shot.

    python bench/bench_evaluate.py [--config evaluate_config.yaml] [--shots 0 5] [--batch-size 8] [key=value ...]

Needs the exported model (stage 4, or model_dir=...) and the demo task (`gptpipe make-demo-task`). Every run
is `gptpipe evaluate --force` in its own child process, so the figure includes what a user waits for: Python,
torch and lm-eval imports, model load, dataset load, the log-likelihood passes. Results go to a temporary
folder, not to the model's evaluation/. Prints a table; the figures go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("evaluate_config.yaml"))
    parser.add_argument("--shots", type=int, nargs="+", default=[0, 5])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("overrides", nargs="*", help="more evaluate_config keys, e.g. model_dir=models/hf/ft")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shots in args.shots:
            out = Path(tmp) / f"{shots}shot"
            started = time.time()
            subprocess.run([sys.executable, "-m", "gptpipe", "evaluate", "--force", "--config", str(args.config),
                            f"num_fewshot={shots}", f"batch_size={args.batch_size}", f"output_dir={out}",
                            *args.overrides], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wall = time.time() - started
            manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
            for task, row in json.loads((out / "results.json").read_text(encoding="utf-8"))["tasks"].items():
                rows.append((task, shots, row["samples"], wall, manifest["timings"]["evaluate_s"],
                             row["metrics"]["acc"]["value"], row.get("majority_baseline")))
    print("| task | shots | documents | wall s (whole command) | lm-eval s (model load + passes) | acc | majority |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for task, shots, n, wall, inner, acc, base in rows:
        print(f"| {task} | {shots} | {n} | {wall:.1f} | {inner:.1f} | {acc:.3f} | {base:.3f} |")


if __name__ == "__main__":
    main()
