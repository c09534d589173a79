"""vLLM (its CPU build in a venv of its own, scripts/setup_vllm.sh: it pins its own torch and transformers), serving
an exported folder as `vllm serve` does: scripts/vllm_greedy.py encodes text prompts as the completions endpoint
does and conversations through the folder's chat template as the chat endpoint does, and decodes greedily. An
adapter folder (stage 4's lora_export: adapter) is served as `vllm serve BASE --enable-lora` serves it."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Collection, Sequence
from pathlib import Path

from gptpipe.export.runtimes.base import Prompt, Runtime, Served, Serving

VLLM_HOME = Path(os.environ.get("GPTPIPE_VLLM", Path.home() / ".cache" / "gptpipe-vllm"))
GREEDY_SCRIPT = Path(__file__).resolve().parents[4] / "scripts" / "vllm_greedy.py"
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


class Vllm(Runtime):
    name = "vLLM"
    setup = "scripts/setup_vllm.sh"
    renders_conversations = True

    def __init__(self, folder: Path):
        self.folder = folder

    def missing(self) -> str | None:
        return None if vllm_python() else f"no vLLM venv in {VLLM_HOME}: run {self.setup}"

    def _run(self, requests: dict, max_new_tokens: int) -> dict:
        """scripts/vllm_greedy.py in vLLM's venv over `requests` (its REQUESTS.json): one process, whose start
        dominates (~12 s on 2 cores)."""
        python = vllm_python()
        if python is None:
            raise FileNotFoundError(self.missing())
        with tempfile.TemporaryDirectory() as tmp:
            asked, out = Path(tmp) / "requests.json", Path(tmp) / "out.json"
            asked.write_text(json.dumps(requests), encoding="utf-8")
            # A few GiB of KV cache is vLLM's CPU default; these checks need little, on machines that share memory.
            env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
            # vLLM generates at least one token: the ids-only requests drop it.
            subprocess.run([str(python), str(GREEDY_SCRIPT), str(self.folder), str(asked), str(out),
                            "--max-tokens", str(max(1, max_new_tokens))], check=True, env=env)
            return json.loads(out.read_text(encoding="utf-8"))

    def serve(self, requests: Sequence[Prompt], max_new_tokens: int) -> Serving:
        """One vLLM process over every request."""
        served = self._run({"prompts": [r for r in requests if isinstance(r, str)],
                            "conversations": [list(r) for r in requests if not isinstance(r, str)]}, max_new_tokens)
        texts, chats = iter(served["prompts"]), iter(served["conversations"])
        outputs = []
        for request in requests:
            one = next(texts) if isinstance(request, str) else next(chats)
            outputs.append(Served(one["prompt_token_ids"], one["token_ids"][:max_new_tokens], one.get("prompt")))
        return Serving(served["vllm"], served["dtype"], outputs, {"lora": served["lora"]},
                       ("a LoRARequest on its base",) if served["lora"] else ())

    def complete(self, prompt_ids: Sequence[Sequence[int]], max_new_tokens: Sequence[int]) -> Serving:
        """One vLLM process over every prompt, each with its own max_tokens."""
        served = self._run({"token_prompts": [{"prompt_token_ids": list(ids), "max_tokens": n}
                                              for ids, n in zip(prompt_ids, max_new_tokens, strict=True)]}, 1)
        outputs = [Served(one["prompt_token_ids"], one["token_ids"]) for one in served["token_prompts"]]
        return Serving(served["vllm"], served["dtype"], outputs, {"lora": served["lora"]},
                       ("a LoRARequest on its base",) if served["lora"] else ())

    @classmethod
    def serving_line(cls, architectures: Collection[str], adapter_rank: int | None) -> str | None:
        check = "`python -m gptpipe.export.vllm_check PATH` compares its prompt ids and greedy tokens with "
        if adapter_rank is not None:
            return ("- vLLM: `vllm serve BASE --enable-lora --lora-modules adapter=PATH --tokenizer PATH "
                    "--generation-config PATH` (BASE: adapter_config.json's base_model_name_or_path; "
                    f"--max-lora-rank at least {adapter_rank}) and request model `adapter`; {check}transformers' "
                    "and peft's.")
        return f"- vLLM: `vllm serve PATH --dtype float32` (or the folder's dtype); {check}transformers'."
