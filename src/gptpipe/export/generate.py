"""Stage 5: play with the exported model: `gptpipe generate` (streamed) and the 5_play_with_model notebook."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

from gptpipe.export.agreement import prompt_ids
from gptpipe.export.config import ConvertConfig
from gptpipe.log import get_logger
from gptpipe.stage import StageInputError
from gptpipe.artifacts import CONVERT, EXIT_OK, export_problems
from gptpipe.runtime.model import inference_config

log = get_logger("generate")


@dataclass
class Sampling:
    """How to pick the next token; temperature 0 means greedy."""

    max_new_tokens: int = 128
    temperature: float = 0.8
    top_p: float = 0.95

    def generate_kwargs(self) -> dict[str, Any]:
        if self.temperature <= 0:
            return {"max_new_tokens": self.max_new_tokens, "do_sample": False}
        return {"max_new_tokens": self.max_new_tokens, "do_sample": True, "temperature": self.temperature,
                "top_p": self.top_p}


def verification_note(folder: Path) -> str | None:
    """A warning when a local folder was not verified by stage 4 (it may not match the trained model)."""
    if not folder.is_dir():
        return None  # a hub id: the hub copy was verified before upload
    return "; ".join(export_problems(folder)) or None


def load(model_dir: str | Path) -> tuple[Any, Any]:
    """(model, tokenizer) from an exported folder or a hub id, in the dtype it was saved in."""
    from transformers import AutoTokenizer

    from gptpipe.export.adapter import load_export

    note = verification_note(Path(model_dir))
    if note:
        log.warning(note)
    model = load_export(model_dir, seq2seq=False)  # an adapter folder: with peft on its base
    inference_config(model.config)  # an export made before its config left the router switch off
    return model, AutoTokenizer.from_pretrained(model_dir)


def generate(model: Any, tokenizer: Any, prompt: str, sampling: Sampling,
             on_text: Callable[[str], None] | None = None) -> str:
    """The continuation of ``prompt``; ``on_text`` receives it piece by piece while it is generated."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Stream(BaseStreamer):
        """Hands on_text each new piece as soon as the decoded text is whole. transformers' TextStreamer waits
        for a space or an ideograph, so Japanese punctuation or kana could arrive only at the end; a piece here
        ends wherever the text does not end inside a character (byte-fallback tokens)."""

        def __init__(self) -> None:
            self.ids: list[int] = []
            self.sent = 0
            self.prompt_seen = False

        def put(self, value: torch.Tensor) -> None:
            if not self.prompt_seen:  # generate() hands the prompt over first
                self.prompt_seen = True
                return
            self.ids += value.reshape(-1).tolist()
            self._send(final=False)

        def end(self) -> None:
            self._send(final=True)

        def _send(self, final: bool) -> None:
            text = tokenizer.decode(self.ids, skip_special_tokens=True)
            if (final or not text.endswith("\ufffd")) and len(text) > self.sent:
                on_text(text[self.sent:])
                self.sent = len(text)

    ids = torch.tensor([prompt_ids(tokenizer, prompt)])  # encoded as the runtimes' agreement checks encode it
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), streamer=Stream() if on_text else None,
                             pad_token_id=tokenizer.pad_token_id, **sampling.generate_kwargs())
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _print_piece(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def run(config: ConvertConfig, args: Any) -> int:
    import torch

    model_dir = args.model or CONVERT.local_copy(config.output_tokenizer_and_model_dir)  # a URL: the verified cache
    if args.model is None and not model_dir.is_dir():
        raise StageInputError(f"{model_dir} does not exist: export a model first (bash 4_convert_to_HF.sh) "
                              "or name one with --model")
    model, tokenizer = load(model_dir)
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p)
    log.info(f"{model_dir}: max_new_tokens={sampling.max_new_tokens} temperature={sampling.temperature} "
             f"top_p={sampling.top_p}" + ("" if args.seed is None else f" seed={args.seed}"))
    if args.seed is not None:
        torch.manual_seed(args.seed)

    def answer(prompt: str) -> None:
        _print_piece(prompt)
        generate(model, tokenizer, prompt, sampling, on_text=_print_piece)
        _print_piece("\n")

    if not args.interactive:
        for prompt in args.prompt or [config.test_prompt_text]:
            answer(prompt)
        return EXIT_OK
    log.info("type a prompt and press Enter; an empty line repeats the last prompt; Ctrl-D quits")
    last = (args.prompt or [config.test_prompt_text])[-1]
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        last = line or last
        answer(last)
    return EXIT_OK
