"""Does vLLM serve an exported folder exactly as transformers runs it? Prompt ids and greedy tokens, compared.

vLLM lives in its own venv (scripts/setup_vllm.sh: it pins its own torch and transformers), where
scripts/vllm_greedy.py decodes the prompts, and a folder with a chat template the conversations through it; here
transformers encodes the same prompts (`tokenizer(prompt)`, `apply_chat_template`) and decodes greedily
(`generate(do_sample=False)`) on the same folder in its dtype. Prompt ids must be identical. Greedy tokens may
part only at a near-tie, as in stage 4's gate: every token vLLM chose must be within `GREEDY_GAP_FACTOR` logit
tolerances of the best logit at its step under the exact model (transformers in fp32 on the folder's weights,
reading vLLM's continuation, so one near-tie cannot derail the rest). The tolerance is fp32's for an fp32 folder;
for a 16-bit one, tolerance.py's allowance for a 16-bit forward against fp32 (two engines round differently).
Where the two continuations differ is reported.

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

from gptpipe.export.verify import GREEDY_GAP_FACTOR
from gptpipe.tolerance import half_forward_logits_tolerance

VLLM_HOME = Path(os.environ.get("GPTPIPE_VLLM", Path.home() / ".cache" / "gptpipe-vllm"))
GREEDY_SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "vllm_greedy.py"
GREEDY_TOKENS = 20
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


def _compare(model: Any, exact: Any, prompt_ids: list[int], served: dict, max_tokens: int) -> dict[str, Any]:
    """One prompt: vLLM's ids and tokens against transformers' (``model``, the folder's dtype) on the same prompt,
    and how far below the exact model's (fp32) best logit each of vLLM's tokens was."""
    import torch

    ids = torch.tensor([prompt_ids], dtype=torch.long)
    with torch.no_grad():
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=max_tokens)[0, len(prompt_ids):].tolist()
    tokens = served["token_ids"]
    entry: dict[str, Any] = {"prompt_ids_equal": served["prompt_token_ids"] == prompt_ids,
                             "tokens_equal": tokens == generated, "vllm_tokens": tokens,
                             "transformers_tokens": generated}
    if not tokens:
        return {**entry, "max_gap": 0.0, "gap_tolerance": 0.0}
    if tokens != generated:
        entry["first_difference"] = next((i for i, (a, b) in enumerate(zip(tokens, generated)) if a != b),
                                         min(len(tokens), len(generated)))
    # The exact model's logits at the positions where vLLM chose each of its tokens.
    sequence = torch.tensor([prompt_ids + tokens], dtype=torch.long)
    with torch.no_grad():
        logits = exact(sequence).logits[0, len(prompt_ids) - 1:-1]
    gaps = logits.max(dim=-1).values - logits.gather(-1, sequence[0, len(prompt_ids):, None])[:, 0]
    tolerance = half_forward_logits_tolerance(logits.abs().max().item(),
                                              "fp32" if model.dtype == torch.float32 else "half")
    entry.update(max_gap=gaps.max().item(), gap_tolerance=GREEDY_GAP_FACTOR * tolerance)
    return entry


def vllm_report(folder: Path, prompts: Sequence[str] = PROMPTS,
                conversations: Sequence[list[dict]] | None = None, max_tokens: int = GREEDY_TOKENS) -> dict[str, Any]:
    """vLLM against transformers on ``folder``: per prompt (and conversation, through the folder's chat template;
    the shipped CONVERSATIONS when it has one and none are given) the comparison, plus ``agrees``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if conversations is None:
        conversations = list(CONVERSATIONS) if tokenizer.chat_template else []
    served = vllm_greedy(folder, prompts, conversations, max_tokens)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=served["dtype"]).eval()
    exact = AutoModelForCausalLM.from_pretrained(folder, dtype="float32").eval()
    report: dict[str, Any] = {"vllm": served["vllm"], "dtype": served["dtype"], "max_tokens": max_tokens,
                              "prompts": [], "conversations": []}
    for prompt, out in zip(prompts, served["prompts"]):
        report["prompts"].append({"prompt": prompt, **_compare(model, exact, tokenizer(prompt)["input_ids"], out,
                                                               max_tokens)})
    for messages, out in zip(conversations, served["conversations"]):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        report["conversations"].append({"prompt": text, "prompt_text_equal": out["prompt"] == text,
                                        **_compare(model, exact, list(ids), out, max_tokens)})
    entries = report["prompts"] + report["conversations"]
    report["agrees"] = all(e["prompt_ids_equal"] and e.get("prompt_text_equal", True)
                           and e["max_gap"] <= e["gap_tolerance"] for e in entries)
    report["summary"] = (f"vLLM {served['vllm']} ({served['dtype']}): "
                         f"{sum(e['prompt_ids_equal'] for e in entries)}/{len(entries)} prompts identical ids, "
                         f"{sum(e['tokens_equal'] for e in entries)}/{len(entries)} identical greedy tokens "
                         f"({max_tokens} max)")
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
