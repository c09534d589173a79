"""Does vLLM serve an exported folder as the model runs? Prompt ids and greedy tokens, compared.

vLLM lives in its own venv (scripts/setup_vllm.sh: it pins its own torch and transformers), where
scripts/vllm_greedy.py decodes the prompts, and a folder with a chat template the conversations through it; here
transformers encodes the same prompts as agreement.py does (`tokenizer(prompt)`, the chat template), which must
give vLLM's prompt ids, and agreement.py judges vLLM's greedy tokens against the fp32 model on the folder's
weights, as it judges stage 4's gate and llama.cpp: the same ids, or other ids at near-ties only (every token vLLM
chose within the near-tie allowance of the best logit for the dtype vLLM ran, stopping where the model stops).
Where the two continuations differ is reported. An adapter folder (stage 4's lora_export: adapter) is served as
`vllm serve BASE --enable-lora` serves it, and judged against peft's model of it (adapter.py's load_export).

    python -m gptpipe.export.vllm_check models/hf/demo          # exit 0: agrees, 1: differs, 2: no vLLM venv
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gptpipe.export.agreement import (DEPARTS, EXACT, GREEDY_TOKENS, NEAR_TIE, Verdict, check, prompt_ids,
                                      reference_model)

VLLM_HOME = Path(os.environ.get("GPTPIPE_VLLM", Path.home() / ".cache" / "gptpipe-vllm"))
GREEDY_SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "vllm_greedy.py"
PROMPTS = ("ディレクトリの内容を", "ls -la を実行すると", "NAME\n    cp - ファイルをコピーする\n\n")
CONVERSATIONS = (
    [{"role": "user", "content": "ls は何をするコマンドですか?"}],
    [{"role": "system", "content": "あなたは Linux に詳しいアシスタントです。"},
     {"role": "user", "content": "cp の使い方を教えてください。"},
     {"role": "assistant", "content": "cp 元 先 でファイルをコピーします。"},
     {"role": "user", "content": "ディレクトリごとコピーするには?"}],
)


def vllm_python() -> Path | None:
    """The python of the venv scripts/setup_vllm.sh finished (its stamp written), or None."""
    venv = VLLM_HOME / "venv"
    return venv / "bin" / "python" if (venv / "gptpipe-vllm-setup").exists() else None


def vllm_greedy(folder: Path, prompts: Sequence[str], conversations: Sequence[list[dict]], max_tokens: int) -> dict:
    """scripts/vllm_greedy.py's JSON for ``folder``, run in vLLM's venv."""
    python = vllm_python()
    if python is None:
        raise FileNotFoundError(f"no vLLM venv in {VLLM_HOME}: run scripts/setup_vllm.sh")
    with tempfile.TemporaryDirectory() as tmp:
        requests, out = Path(tmp) / "requests.json", Path(tmp) / "out.json"
        requests.write_text(json.dumps({"prompts": list(prompts), "conversations": list(conversations)}),
                            encoding="utf-8")
        # A few GiB of KV cache is vLLM's CPU default; these checks need little, on machines that share memory.
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
        subprocess.run([str(python), str(GREEDY_SCRIPT), str(folder), str(requests), str(out),
                        "--max-tokens", str(max_tokens)], check=True, env=env)
        return json.loads(out.read_text(encoding="utf-8"))


def _entry(ids: list[int], served: dict, verdict: Verdict) -> dict[str, Any]:
    """One prompt: vLLM's prompt ids against transformers', its greedy ids against the fp32 model's."""
    return {"prompt_ids_equal": served["prompt_token_ids"] == ids, "tokens_equal": verdict.kind == EXACT,
            "vllm_tokens": served["token_ids"], "transformers_tokens": verdict.expected, **verdict.as_dict()}


def vllm_report(folder: Path, prompts: Sequence[str] = PROMPTS,
                conversations: Sequence[list[dict]] | None = None, max_tokens: int = GREEDY_TOKENS) -> dict[str, Any]:
    """vLLM against transformers on ``folder``: per prompt (and conversation, through the folder's chat template;
    the shipped CONVERSATIONS when it has one and none are given) the comparison, plus ``agrees``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if conversations is None:
        conversations = list(CONVERSATIONS) if tokenizer.chat_template else []
    served = vllm_greedy(folder, prompts, conversations, max_tokens)
    requests, outs = [*prompts, *conversations], served["prompts"] + served["conversations"]
    ids = [prompt_ids(tokenizer, request) for request in requests]
    verdicts = check(reference_model(folder), ids, [out["token_ids"] for out in outs], served["dtype"], max_tokens)
    report: dict[str, Any] = {"vllm": served["vllm"], "dtype": served["dtype"], "lora": served["lora"],
                              "max_tokens": max_tokens, "prompts": [], "conversations": []}
    for request, out, request_ids, verdict in zip(requests, outs, ids, verdicts):
        if isinstance(request, str):
            report["prompts"].append({"prompt": request, **_entry(request_ids, out, verdict)})
        else:
            text = tokenizer.apply_chat_template(request, add_generation_prompt=True, tokenize=False)
            report["conversations"].append({"prompt": text, "prompt_text_equal": out["prompt"] == text,
                                            **_entry(request_ids, out, verdict)})
    entries = report["prompts"] + report["conversations"]
    report["differences"] = [f"{e['prompt']!r}: {v.describe(tokenizer)}" for e, v in zip(entries, verdicts)
                             if v.kind != EXACT]
    report["agrees"] = all(e["prompt_ids_equal"] and e.get("prompt_text_equal", True) and e["verdict"] != DEPARTS
                           for e in entries)
    how = f"{served['dtype']}, a LoRARequest on its base" if served["lora"] else served["dtype"]
    report["summary"] = (f"vLLM {served['vllm']} ({how}): "
                         f"{sum(e['prompt_ids_equal'] for e in entries)}/{len(entries)} prompts identical ids, "
                         f"{sum(e['tokens_equal'] for e in entries)}/{len(entries)} the fp32 model's greedy tokens, "
                         f"{sum(e['verdict'] == NEAR_TIE for e in entries)} other at near-ties ({max_tokens} max)")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="vLLM against transformers on an exported folder")
    parser.add_argument("folder", type=Path)
    parser.add_argument("--max-tokens", type=int, default=GREEDY_TOKENS)
    args = parser.parse_args(argv)
    if vllm_python() is None:
        print(f"no vLLM venv in {VLLM_HOME}: run scripts/setup_vllm.sh", file=sys.stderr)
        return 2
    report = vllm_report(args.folder, max_tokens=args.max_tokens)
    print(json.dumps(report, ensure_ascii=False, indent=1))
    print(report["summary"], file=sys.stderr)
    return 0 if report["agrees"] else 1


if __name__ == "__main__":
    sys.exit(main())
