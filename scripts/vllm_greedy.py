"""Greedy decoding of a Hugging Face folder with vLLM, as JSON: run with the python of scripts/setup_vllm.sh's venv.

    python scripts/vllm_greedy.py FOLDER REQUESTS.json OUT.json --max-tokens 20

REQUESTS.json: {"prompts": ["...", ...], "conversations": [[{"role": "user", "content": "..."}, ...], ...],
"token_prompts": [{"prompt_token_ids": [...], "max_tokens": N}, ...]} (every key optional; a token prompt is
taken as its ids, nothing added, and generates up to its own N rather than --max-tokens: an evaluation's requests).
OUT.json: {"vllm": version, "dtype": ..., "lora": served as an adapter folder, "prompts": [...],
"conversations": [...], "token_prompts": [...]}, each entry with "prompt_token_ids" and greedy "token_ids"; a
conversation also has "prompt", the text the folder's chat template made of it (with the generation prompt).
Prompts are encoded as `vllm serve`'s completions endpoint does (the tokenizer's special tokens added as
configured), conversations as its chat endpoint does. An adapter folder (stage 4's lora_export: adapter) is
served as `vllm serve BASE --enable-lora` serves it: the base its adapter_config.json names, with the folder's
tokenizer and generation config, every request through a LoRARequest of the folder. This script imports nothing
from gptpipe: vLLM's venv has its own torch and transformers, and gptpipe is not installed there.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

# vLLM's "auto" dtype runs an fp32 checkpoint in 16 bits; the folder's own dtype is compared with transformers'.
VLLM_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


# vLLM's max_lora_rank takes these values only (vllm.config.lora.MaxLoRARanks, vLLM 0.32).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def folder_dtype(folder: Path) -> str:
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    return VLLM_DTYPES[config.get("dtype") or config.get("torch_dtype") or "float32"]


def engine_arguments(folder: Path) -> tuple[dict, object]:
    """(LLM's arguments, the LoRARequest of every request or None) for a model folder or an adapter folder."""
    adapter = folder / "adapter_config.json"
    if not adapter.is_file():
        return {"model": str(folder), "dtype": folder_dtype(folder)}, None
    from safetensors import safe_open
    from vllm.lora.request import LoRARequest

    config = json.loads(adapter.read_text(encoding="utf-8"))
    with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as weights:
        dtype = SAFETENSORS_DTYPES[weights.get_slice(next(iter(weights.keys()))).get_dtype()]
    rank = min(r for r in VLLM_LORA_RANKS if r >= config["r"])
    return ({"model": config["base_model_name_or_path"], "tokenizer": str(folder), "generation_config": str(folder),
             "dtype": dtype, "enable_lora": True, "max_lora_rank": rank, "max_loras": 1},
            LoRARequest("export", 1, str(folder)))


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

    engine, lora = engine_arguments(args.folder)
    llm = LLM(**engine, enforce_eager=True, seed=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    prompts = (llm.generate(requests["prompts"], greedy, use_tqdm=False, lora_request=lora)
               if requests.get("prompts") else [])
    chats = (llm.chat(requests["conversations"], greedy, use_tqdm=False, add_generation_prompt=True, lora_request=lora)
             if requests.get("conversations") else [])
    # An evaluation's requests: ids as lm-eval encoded them, each its task's own limit (one batch: vLLM schedules).
    token_prompts = requests.get("token_prompts") or []
    completions = (llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in token_prompts],
                                [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"]) for r in token_prompts],
                                use_tqdm=False, lora_request=lora) if token_prompts else [])
    result = {
        "vllm": vllm.__version__,
        "dtype": engine["dtype"],
        "lora": lora is not None,
        "prompts": [{"prompt_token_ids": list(out.prompt_token_ids), "token_ids": list(out.outputs[0].token_ids)}
                    for out in prompts],
        "conversations": [{"prompt": out.prompt, "prompt_token_ids": list(out.prompt_token_ids),
                           "token_ids": list(out.outputs[0].token_ids)} for out in chats],
        "token_prompts": [{"prompt_token_ids": list(out.prompt_token_ids), "token_ids": list(out.outputs[0].token_ids)}
                          for out in completions],
    }
    args.out.write_text(json.dumps(result, ensure_ascii=False), encoding="utf-8")


if __name__ == "__main__":
    main()
