"""`gptpipe chat`: a conversation with a chat fine-tune (its run folder's best checkpoint, one checkpoint) or
an HF folder whose tokenizer has a chat template (an export).

Each line read from stdin is a user turn; the answer is streamed to stdout as it is generated and ends with a
newline, so the command works the same typed at a terminal or scripted through a pipe. `/reset` starts the
conversation again (the system prompt stays), `/exit` or the end of input ends it. The prompt is the model's
chat template over the whole conversation, exactly as training rendered it; when it outgrows the run's
seq_len, the oldest exchanges are left out.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Any

import torch

from gptpipe.finetune.chat_data import ChatEncoder
from gptpipe.finetune.config import FinetuneConfig
from gptpipe.runtime.scoring import decode, generate
from gptpipe.finetune.predict import load_predictor
from gptpipe.log import get_logger
from gptpipe.stage import StageInputError
from gptpipe.artifacts import EXIT_BAD_INPUT, EXIT_OK

log = get_logger("chat")
RESET, EXIT = "/reset", "/exit"


class ChatSession:
    """The turns so far, and the model's next answer to a user turn."""

    def __init__(self, model: Any, encoder: ChatEncoder, config: FinetuneConfig, device: torch.device):
        self.model, self.encoder, self.settings, self.device = model, encoder, config.chat, device
        self.start = [{"role": "system", "content": self.settings.system}] if self.settings.system else []
        self.messages = list(self.start)

    def reset(self) -> None:
        self.messages = list(self.start)

    def prompt(self) -> list[int]:
        """The conversation's ids and the assistant's header, the oldest exchanges left out for good while they
        do not leave max_new_tokens within seq_len (the system prompt and the last user turn always stay)."""
        self.messages, ids = self.encoder.fit_turns(self.messages, self.settings.max_new_tokens)
        return ids

    def answer(self, text: str, streamer: Any = None) -> str:
        from transformers import TextStreamer

        self.messages.append({"role": "user", "content": text})
        s = self.settings
        streamer = streamer or TextStreamer(self.encoder.tokenizer, skip_prompt=True, skip_special_tokens=True)
        sampling = {"temperature": s.temperature, "top_p": s.top_p} if s.sample else None
        ids = generate(self.model, self.encoder, [self.prompt()], self.device, max_new_tokens=s.max_new_tokens,
                       sampling=sampling, streamer=streamer)[0]
        reply = decode(self.encoder.tokenizer, ids)
        self.messages.append({"role": "assistant", "content": reply})
        return reply


def run(config: FinetuneConfig, args: argparse.Namespace) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    source = config.chat.model or config.train.output_model_dir
    try:
        # A folder without task.json (an HF folder with a chat template) is read as a chat model.
        predictor = load_predictor(replace(config, task=replace(config.task, kind="chat")), source, device)
        if not predictor.kind.converses:
            raise StageInputError(f"{source} was fine-tuned for task.kind {predictor.task.kind}, which does not "
                                  f"converse (chat does)")
        encoder = predictor.encoder
    except StageInputError as exc:
        log.error(f"refused: {exc}")
        return EXIT_BAD_INPUT
    torch.manual_seed(config.chat.seed)
    conversation = ChatSession(predictor.model.eval(), encoder, config, device)
    interactive = sys.stdin.isatty()
    log.info(f"{predictor.source}: {'sampling' if config.chat.sample else 'greedy'}; "
             f"{RESET} starts again, {EXIT} (or end of input) ends")
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == EXIT:
            return EXIT_OK
        text = line.strip()
        if text == RESET:
            conversation.reset()
            log.info("conversation reset")
        elif text:
            conversation.answer(text)
