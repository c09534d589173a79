"""Greedy decoding of a Hugging Face folder with vLLM, as JSON: run with the python of scripts/setup_vllm.sh's venv.

    python scripts/vllm_greedy.py FOLDER REQUESTS.json OUT.json --max-tokens 20

REQUESTS.json: {"prompts": ["...", ...], "conversations": [[{"role": "user", "content": "..."}, ...], ...]}.
OUT.json: {"vllm": version, "dtype": ..., "prompts": [...], "conversations": [...]}, each entry with
"prompt_token_ids" and greedy "token_ids"; a conversation also has "prompt", the text the folder's chat template
made of it (with the generation prompt). Prompts are encoded as `vllm serve`'s completions endpoint does (the
tokenizer's special tokens added as configured), conversations as its chat endpoint does. This script imports
nothing from gptpipe: vLLM's venv has its own torch and transformers, and gptpipe is not installed there.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

# vLLM's "auto" dtype runs an fp32 checkpoint in 16 bits; the folder's own dtype is compared with transformers'.
VLLM_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def folder_dtype(folder: Path) -> str:
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    return VLLM_DTYPES[config.get("dtype") or config.get("torch_dtype") or "float32"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("requests", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-tokens", type=int, default=20)
    args = parser.parse_args()
    requests = json.loads(args.requests.read_text(encoding="utf-8"))

    # The engine in this process: by default vLLM starts it in a process of its own, which imports vLLM a second
    # time (a check took 27.5 s that way, 12.1 s in one process, the same tokens, on 2 cores).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm
    from vllm import LLM, SamplingParams

    dtype = folder_dtype(args.folder)
    llm = LLM(model=str(args.folder), dtype=dtype, enforce_eager=True, seed=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    prompts = llm.generate(requests.get("prompts", []), greedy, use_tqdm=False) if requests.get("prompts") else []
    chats = (llm.chat(requests["conversations"], greedy, use_tqdm=False, add_generation_prompt=True)
             if requests.get("conversations") else [])
    result = {
        "vllm": vllm.__version__,
        "dtype": dtype,
        "prompts": [{"prompt_token_ids": list(out.prompt_token_ids), "token_ids": list(out.outputs[0].token_ids)}
                    for out in prompts],
        "conversations": [{"prompt": out.prompt, "prompt_token_ids": list(out.prompt_token_ids),
                           "token_ids": list(out.outputs[0].token_ids)} for out in chats],
    }
    args.out.write_text(json.dumps(result, ensure_ascii=False), encoding="utf-8")


if __name__ == "__main__":
    main()
