"""Who generates for `gptpipe evaluate`'s generation tasks (evaluate_config.yaml `generation`): transformers (lm-eval's
HFLM, as every other request), or vLLM. Where vLLM imports in gptpipe's own environment (installed beside it, e.g.
on a GPU machine), lm-eval's own vLLM model generates in-process; else, where scripts/setup_vllm.sh made vLLM's
venv (its CPU build pins its own torch and transformers), one vLLM process (export/runtimes: `Runtime.complete`)
gets every generation request at once, as the ids HFLM would have generated after. Log-likelihood requests stay
with HFLM either way, so multiple-choice scores do not depend on the setting.

Both vLLM paths decode greedily, up to each request's max_gen_toks, and cut the text at the request's stop strings
as HFLM does: with greedy ids identical (export/agreement.py checks them), the generated texts and the scores are
transformers'."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from lm_eval.api.model import LM

from gptpipe.export.runtimes.base import Runtime
from gptpipe.export.runtimes.vllm import Vllm
from gptpipe.log import get_logger
from gptpipe.stage import StageInputError

log = get_logger("evaluate")

RUNTIME: type[Runtime] = Vllm  # the runtime that generates from ids where vLLM does not import here


@dataclass
class Generator:
    """What generates: its name (results.json, the manifest), why it was chosen, and the wall time it spent."""

    name: str  # transformers | vllm (in-process, lm-eval's model) | vllm-venv (the runtime's process)
    reason: str
    generate_s: float = 0.0
    requests: int = 0
    details: dict[str, Any] = field(default_factory=dict)  # the runtime's version and dtype

    def record(self) -> dict[str, Any]:
        return {"generator": self.name, "reason": self.reason, "generate_s": round(self.generate_s, 3),
                "requests": self.requests, **self.details}


# auto's smallest model for vLLM: below it vLLM's start (~12 s on a CPU) costs more than its faster decoding saves
# (docs/benchmarks.md, 400 documents of 32 tokens: 0.34x on the tests' 2 x 128 toy, 3.5x on a 12 x 768 Llama of
# ~90M; the lines through the two meet near 4M)
VLLM_FROM_PARAMETERS = 10_000_000


def choose(generation: str, folder: Path, parameters: int) -> Generator:
    """The generator `generation` (evaluate_config's: auto, transformers or vllm) asks for on this machine for a
    model of `parameters`; auto falls back to transformers, saying why; vllm where it cannot run: an error naming
    what to install."""
    if generation == "transformers":
        return Generator("transformers", "generation: transformers")
    if generation == "auto" and parameters < VLLM_FROM_PARAMETERS:
        return Generator("transformers", f"generation: auto, and a model of {parameters / 1e6:.1f}M parameters "
                                         f"generates faster than vLLM starts (vLLM from "
                                         f"{VLLM_FROM_PARAMETERS // 1_000_000}M; generation: vllm forces it)")
    if find_spec("vllm") is not None:
        return Generator("vllm", "vLLM imports here: lm-eval's vLLM model")
    missing = RUNTIME(folder).missing()
    if missing is None:
        return Generator("vllm-venv", f"vLLM's own venv ({RUNTIME.setup}): one {RUNTIME.name} process")
    if generation == "vllm":
        raise StageInputError(f"generation: vllm, but vLLM does not import here and {missing} (or pip install vllm "
                              "beside gptpipe), or set generation: auto")
    return Generator("transformers", f"generation: auto, and vLLM does not import here and {missing}")


class GeneratingLM(LM):
    """lm-eval's model for one run: HFLM's log-likelihoods, and generation by `generator` (timed)."""

    def __init__(self, hf: Any, generator: Generator, folder: Path, dtype: str):
        super().__init__()
        self.hf = hf
        self.generator = generator
        self.folder, self.dtype = folder, dtype
        generate: dict[str, Callable[[list], list[str]]] = {
            "transformers": hf.generate_until, "vllm": lambda r: self.in_process().generate_until(r),
            "vllm-venv": lambda r: self.runtime_generate(RUNTIME(folder), r)}
        self._generate = generate[generator.name]
        self._vllm: Any = None

    def __getattr__(self, name: str) -> Any:
        # what lm-eval reads of its model besides the requests (tokenizer_name, chat_template, device, ...): HFLM's
        if "hf" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["hf"], name)

    def in_process(self) -> Any:
        """lm-eval's vLLM model of the folder (made at the first generation request), with HFLM's context length
        and generation limit."""
        if self._vllm is None:
            from lm_eval.models.vllm_causallms import VLLM

            self._vllm = VLLM(pretrained=str(self.folder), dtype=self.dtype, max_gen_toks=self.hf.max_gen_toks,
                              max_length=self.hf.max_length, batch_size="auto")
        return self._vllm

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list:
        return self.hf.loglikelihood(requests, disable_tqdm=disable_tqdm)

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list:
        return self.hf.loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        started = time.time()
        texts = self._generate(requests)
        self.generator.generate_s += time.time() - started
        self.generator.requests += len(requests)
        return texts

    def runtime_generate(self, runtime: Runtime, requests: list) -> list[str]:
        """Every request's generation by `runtime` in one run: its context encoded and left-truncated as HFLM does,
        greedy up to its max_gen_toks, decoded and cut at its stop strings (and the end-of-text token's text) as
        HFLM does. A request that samples goes to HFLM: the runtime decodes greedily only."""
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

        hf = self.hf
        eos = hf.tok_decode(hf.eot_token_id, skip_special_tokens=False)
        asked = []
        for request in requests:
            context, gen_kwargs = request.args
            kwargs = normalize_gen_kwargs(gen_kwargs, hf.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            new = kwargs.pop("max_gen_toks")
            greedy = not kwargs.get("do_sample") and not kwargs.get("temperature")
            ids = hf.tok_encode(context, left_truncate_len=hf.max_length - new) if greedy else None
            asked.append((ids, new, until))
        sampled = [r for r, (ids, _, _) in zip(requests, asked, strict=True) if ids is None]
        sampled_texts = iter(hf.generate_until(sampled) if sampled else [])
        served = iter([])
        if len(sampled) < len(requests):
            serving = runtime.complete([ids for ids, _, _ in asked if ids is not None],
                                       [new for ids, new, _ in asked if ids is not None])
            self.generator.details.update({"version": serving.version, "dtype": serving.dtype})
            served = iter(serving.outputs)
        texts = []
        for ids, _, until in asked:
            if ids is None:
                texts.append(next(sampled_texts))
                continue
            text = hf.tok_decode(next(served).tokens)
            texts.append(postprocess_generated_text(generation=text, stop=until, think_end_token=None))
        return texts


def log_choice(generator: Generator) -> None:
    log.info(f"generation tasks: {generator.name} ({generator.reason})")
