"""llama.cpp running the GGUF file `gptpipe gguf` writes (export/gguf.py), through two small tools built beside its
own (scripts/build_llamacpp.sh): scripts/llamacpp_tokenize.cpp gives llama-tokenize's ids for many texts from one
process, scripts/llamacpp_greedy.cpp its greedy ids after given ids. llama.cpp has a tokenizer of its own (its UGM
has no byte fallback), so its prompt ids are reported, and only its greedy tokens decide; it renders no chat
template here, so requests are text."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Collection, Sequence
from pathlib import Path

from gptpipe.export.runtimes.base import Prompt, Runtime, Served, Serving

LLAMACPP_HOME = Path(os.environ.get("GPTPIPE_LLAMACPP", Path.home() / ".cache" / "gptpipe-llamacpp"))
GREEDY_TOOL = "gptpipe-llama-greedy"  # scripts/llamacpp_greedy.cpp, built beside llama.cpp's tools
TOKENIZE_TOOL = "gptpipe-llama-tokenize"  # scripts/llamacpp_tokenize.cpp, likewise
# The HF architectures export/gguf.py writes, under llama.cpp's names for them.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "GPT2LMHeadModel": "gpt2", "Ernie4_5_MoeForCausalLM": "ernie4_5-moe"}


def llamacpp_tool(name: str) -> Path | None:
    """A llama.cpp tool built by scripts/build_llamacpp.sh, or None when the build is absent."""
    path = LLAMACPP_HOME / "build" / "bin" / name
    return path if path.is_file() else None


def llamacpp_version() -> str:
    path = LLAMACPP_HOME / "build" / "bin" / "VERSION"
    return path.read_text(encoding="utf-8").strip().replace("\n", ", ") if path.is_file() else "not built"


def llamacpp_ids(gguf_path: Path, texts: list[str], parse_special: bool = False) -> list[list[int]]:
    """llama.cpp's ids for each of ``texts`` (BOS as the GGUF says), from one process (llama-tokenize's ids,
    without loading the vocabulary once per text). Literal special-token text stays text unless
    ``parse_special``, as with an HF tokenizer that splits special tokens (a chat run's does not: its template
    writes "</s>" as text)."""
    tool = llamacpp_tool(TOKENIZE_TOOL)
    if tool is None:
        raise FileNotFoundError(f"{TOKENIZE_TOOL} not built: run scripts/build_llamacpp.sh")
    framed = b"".join(b"%d\n%s" % (len(data), data) for data in (text.encode() for text in texts))
    done = subprocess.run([str(tool), str(gguf_path), *(["--parse-special"] if parse_special else [])],
                          input=framed, capture_output=True, check=True)
    ids = [json.loads(line) for line in done.stdout.decode().splitlines()]
    if len(ids) != len(texts):
        raise RuntimeError(f"{tool} gave ids for {len(ids)} of {len(texts)} texts: {done.stderr.decode()[-500:]}")
    return ids


def llamacpp_greedy(gguf_path: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """llama.cpp's greedy ids after the ``prompt`` ids, ending with the end-of-generation token where llama.cpp
    stops at one."""
    tool = llamacpp_tool(GREEDY_TOOL)
    if tool is None:
        raise FileNotFoundError(f"{GREEDY_TOOL} not built: run scripts/build_llamacpp.sh")
    done = subprocess.run([str(tool), str(gguf_path), str(max_new_tokens)], input=" ".join(map(str, prompt)).encode(),
                          capture_output=True, check=True)
    return json.loads(done.stdout)["ids"]


def gguf_outtype(gguf_path: Path) -> str:
    """The weight type (an export/gguf.py OUTTYPES name) the GGUF file states."""
    from gguf import GGUFReader, LlamaFileType

    names = {LlamaFileType.MOSTLY_F16: "f16", LlamaFileType.MOSTLY_BF16: "bf16", LlamaFileType.MOSTLY_Q8_0: "q8_0"}
    return names[LlamaFileType(int(GGUFReader(gguf_path).fields["general.file_type"].contents()))]


class LlamaCpp(Runtime):
    name = "llama.cpp"
    setup = "scripts/build_llamacpp.sh"
    ids_must_match = False

    def __init__(self, gguf_path: Path, parse_special: bool = False):
        """`parse_special`: read special-token text as the token, as the folder's HF tokenizer does when it does
        not split special tokens."""
        self.gguf_path, self.parse_special = gguf_path, parse_special

    def missing(self) -> str | None:
        absent = [tool for tool in (TOKENIZE_TOOL, GREEDY_TOOL) if llamacpp_tool(tool) is None]
        return f"{', '.join(absent)} not built in {LLAMACPP_HOME}: run {self.setup}" if absent else None

    def serve(self, requests: Sequence[Prompt], max_new_tokens: int) -> Serving:
        texts = [request for request in requests if isinstance(request, str)]
        if len(texts) < len(requests):
            raise ValueError("llama.cpp is checked on text prompts only (it renders no chat template here)")
        ids = llamacpp_ids(self.gguf_path, texts, self.parse_special)
        outputs = [Served(prompt, llamacpp_greedy(self.gguf_path, prompt, max_new_tokens) if max_new_tokens else [])
                   for prompt in ids]
        return Serving(llamacpp_version(), gguf_outtype(self.gguf_path), outputs)

    @classmethod
    def serving_line(cls, architectures: Collection[str], adapter_rank: int | None) -> str | None:
        if adapter_rank is not None or not set(architectures) & set(ARCHITECTURES):
            return None
        return ("- llama.cpp / Ollama: `gptpipe gguf --model PATH --outtype f16` writes the GGUF (the tokenizer as "
                "this folder's, no space prefix, the chat template if any) and an Ollama `Modelfile` beside it.")
