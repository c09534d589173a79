"""The runtimes besides transformers that run an exported folder (vLLM: runtimes/vllm.py; llama.cpp: the GGUF
`gptpipe gguf` writes, runtimes/llamacpp.py), in one shape: given requests (text prompts, or conversations where
the runtime renders chat templates), a runtime gives the prompt ids it made of each and its greedy continuation.
export/agreement.py's `runtime_report` judges both against the folder's tokenizer and fp32 model, the same way
for every runtime; the model card's "Run it elsewhere" lines come from `serving_line`. A new runtime is a module
here and one entry in RUNTIMES (runtimes/base.py: the interface)."""

from __future__ import annotations

from collections.abc import Collection

from gptpipe.export.runtimes.base import Runtime
from gptpipe.export.runtimes.llamacpp import LlamaCpp
from gptpipe.export.runtimes.vllm import Vllm

RUNTIMES: tuple[type[Runtime], ...] = (Vllm, LlamaCpp)


def serving_lines(architectures: Collection[str], adapter_rank: int | None) -> list[str]:
    """Every runtime's card line for a folder of these architectures (`adapter_rank`: a LoRA adapter folder)."""
    lines = (runtime.serving_line(architectures, adapter_rank) for runtime in RUNTIMES)
    return [line for line in lines if line]
