"""Does vLLM serve an exported folder as the model runs? Prompt ids and greedy tokens, compared
(export/runtimes/vllm.py runs vLLM; agreement.py's runtime_report judges it as every runtime is judged).

The shipped PROMPTS go through vLLM's completions path and, for a folder with a chat template, the shipped
CONVERSATIONS through its chat path: vLLM's prompt ids must be transformers' (and a conversation's text the
folder's template's), its greedy tokens the fp32 model's, or other ids at near-ties only. An adapter folder
(stage 4's lora_export: adapter) is served as `vllm serve BASE --enable-lora` serves it, judged against peft's
model of it.

    python -m gptpipe.export.vllm_check models/hf/demo          # exit 0: agrees, 1: differs, 2: no vLLM venv
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gptpipe.export.agreement import GREEDY_TOKENS, runtime_report
from gptpipe.export.runtimes.vllm import CONVERSATIONS, PROMPTS, Vllm


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="vLLM against transformers on an exported folder")
    parser.add_argument("folder", type=Path)
    parser.add_argument("--max-tokens", type=int, default=GREEDY_TOKENS)
    args = parser.parse_args(argv)
    runtime = Vllm(args.folder)
    if runtime.missing():
        print(runtime.missing(), file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    chat = AutoTokenizer.from_pretrained(args.folder).chat_template is not None
    report = runtime_report(runtime, args.folder, [*PROMPTS, *(CONVERSATIONS if chat else ())], args.max_tokens)
    print(json.dumps(report, ensure_ascii=False, indent=1))
    print(report["summary"], file=sys.stderr)
    return 0 if report["agrees"] else 1


if __name__ == "__main__":
    sys.exit(main())
