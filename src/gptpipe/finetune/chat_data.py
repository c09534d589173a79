"""Chat rows for instruction tuning (task.kind: chat): reading conversations, the chat template, and ids
with the loss on the assistant's turns only.

A row is a jsonl object with `messages` (system/user/assistant turns, the HF/OpenAI shape) or an
instruction/input/output object (Alpaca/Dolly shape), mapped onto one user and one assistant turn. Bad rows
are counted by data/jsonl.py's reasons and skipped.

Ids are `tokenizer.apply_chat_template(messages)` itself. Each assistant turn's span is found by rendering
the conversation before it (with the generation prompt) and through it: both renders' ids must be prefixes
of the whole conversation's ids, which holds when the template renders turn by turn and the tokenizer does
not merge tokens across the turn boundaries. The span is cut after its last special token (the EOS or
end-of-turn token that ends the turn, which the model must learn to produce); a template whose assistant turns
end with none, or whose prefixes do not hold, is refused naming the row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptpipe.data.jsonl import (EMPTY, INVALID_JSON, LONE_SURROGATE, MISSING_KEY, NO_ASSISTANT_TURN,
                                NOT_A_MESSAGE_LIST, NOT_A_STRING, NOT_AN_OBJECT, TEMPLATE_ERROR, TOO_LONG, UNDECODABLE,
                                UNKNOWN_ROLE, Reasons, parse_record)
from gptpipe.runtime.batching import IGNORE, Encoded
from gptpipe.finetune.data import Problem
from gptpipe.stage import StageInputError, write_text_atomic

ROLES = ("system", "user", "assistant")

# The shipped templates, by task.chat_template name. Each assistant turn ends with the EOS token, inside the
# {% generation %} markers transformers' return_assistant_tokens_mask reads; "\n" before the content is a
# piece of its own in gptpipe's tokenizers, so no token crosses a turn boundary.
GPTPIPE_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ 'システム:\\n' + message['content'] + '\\n' }}"
    "{%- elif message['role'] == 'user' -%}{{ 'ユーザー:\\n' + message['content'] + '\\n' }}"
    "{%- else -%}{{ 'アシスタント:\\n' }}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'アシスタント:\\n' }}{%- endif -%}"
)
# The original pipeline's instruction-tuning prompt (Japanese Alpaca): "### 指示:" / "### 応答:"; a system
# turn replaces the preamble.
ALPACA_JA_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' -%}{{ messages[0]['content'] }}"
    "{%- else -%}{{ '以下は、タスクを説明する指示です。要求を適切に満たす応答を書きなさい。' }}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{{ '\\n\\n### 指示:\\n' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}{{ '\\n\\n### 応答:\\n' }}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '\\n\\n### 応答:\\n' }}{%- endif -%}"
)
TEMPLATES = {"gptpipe": GPTPIPE_TEMPLATE, "alpaca_ja": ALPACA_JA_TEMPLATE}
DEFAULT_TEMPLATE = "gptpipe"


def describe_template(template: str) -> str:
    """Which template `template` is, for a model card: a shipped one by name, else the model's or a file's."""
    shipped = next((name for name, text in TEMPLATES.items() if text == template), None)
    return (f"gptpipe's shipped `{shipped}` template (task.chat_template={shipped})" if shipped else
            "the base model's own template or one from a .jinja file (task.chat_template)")


class TemplateError(StageInputError):
    """The chat template (with this tokenizer) cannot give exact assistant-only masks."""


@dataclass(frozen=True)
class Conversation:
    """One chat row: its turns ({"role", "content"}) and "file:line"."""

    messages: tuple[dict[str, str], ...]
    where: str

    @property
    def last_answer(self) -> int | None:
        """Index of the last assistant turn (the answer evaluation and predict compare), None without one."""
        return next((i for i in range(len(self.messages) - 1, -1, -1)
                     if self.messages[i]["role"] == "assistant"), None)

    @property
    def prompt(self) -> list[dict[str, str]]:
        """The turns before the last answer (all turns when there is none): what the model answers."""
        end = self.last_answer
        return list(self.messages[:end] if end is not None else self.messages)

    @property
    def label(self) -> str | None:
        end = self.last_answer
        return self.messages[end]["content"] if end is not None else None


# --- reading ---------------------------------------------------------------------------------------------
def read_conversations(path: Path, skipped: Reasons, messages_key: str = "messages",
                       need_answer: bool = True) -> list[Conversation]:
    """The good conversations of a jsonl file; bad rows are counted in `skipped`. With need_answer=False
    (prediction input) a row may end without an assistant turn."""
    rows = []
    for number, raw in enumerate(path.read_bytes().split(b"\n"), 1):
        if not raw.strip():
            continue
        where = f"{path}:{number}"
        found = conversation(raw, messages_key, need_answer)
        if isinstance(found, Problem):
            skipped.add(found.reason, f"{where}: {found.detail}" if found.detail else where)
        else:
            rows.append(Conversation(found, where))
    return rows


def conversations_from_lines(lines: list[str], source: str = "stdin") -> list[Conversation]:
    """One user turn per non-blank line (`gptpipe predict --input -`)."""
    return [Conversation(({"role": "user", "content": line.strip()},), f"{source}:{n}")
            for n, line in enumerate(lines, 1) if line.strip()]


def conversation(raw: bytes, messages_key: str, need_answer: bool
                 ) -> tuple[dict[str, str], ...] | Problem:
    """The turns of one jsonl line, or why it holds none."""
    obj, reason = parse_record(raw)
    if reason:
        return Problem(reason, "" if reason in (UNDECODABLE, INVALID_JSON) else repr(raw[:60]))
    if not isinstance(obj, dict):
        return Problem(NOT_AN_OBJECT, "")
    if messages_key in obj:
        messages = message_list(obj[messages_key], messages_key)
        if isinstance(messages, Problem):
            return messages
    elif "instruction" in obj:
        if need_answer and obj.get("output") is None:
            return Problem(NO_ASSISTANT_TURN, "no 'output'")
        optional = ("system", "input") if need_answer else ("system", "input", "output")
        for key in ("system", "instruction", "input", "output"):
            problem = None if key in optional and obj.get(key) in (None, "") else text_problem(obj.get(key), key)
            if problem:
                return problem
        extra = (obj.get("input") or "").strip()
        messages = [{"role": "system", "content": obj["system"].strip()}] if obj.get("system") else []
        messages.append({"role": "user", "content": obj["instruction"].strip() + (f"\n\n{extra}" if extra else "")})
        if obj.get("output"):
            messages.append({"role": "assistant", "content": obj["output"].strip()})
    else:
        return Problem(MISSING_KEY, f"{messages_key!r} or 'instruction'")
    if not messages or (need_answer and all(m["role"] != "assistant" for m in messages)):
        return Problem(NO_ASSISTANT_TURN, "")
    return tuple(messages)


def message_list(turns: Any, key: str) -> list[dict[str, str]] | Problem:
    """The turns of a jsonl row's message list (`key` names it in a problem): each an object with a role of
    ROLES and non-empty text content (stripped), or why the list is none."""
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        return Problem(NOT_A_MESSAGE_LIST, f"{key} must be a list of objects")
    messages = []
    for k, turn in enumerate(turns):
        role, content = turn.get("role"), turn.get("content")
        if role not in ROLES:
            return Problem(UNKNOWN_ROLE, f"turn {k}: {role!r}")
        problem = text_problem(content, f"turn {k} content")
        if problem:
            return problem
        messages.append({"role": role, "content": content.strip()})
    return messages


def text_problem(value: Any, name: str) -> Problem | None:
    """Why `value` (a row's field called `name`) is no usable text, or None when it is."""
    if not isinstance(value, str):
        return Problem(NOT_A_STRING, name)
    if not value.strip():
        return Problem(EMPTY, name)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return Problem(LONE_SURROGATE, name)
    return None


# --- the template ----------------------------------------------------------------------------------------
def install_template(tokenizer: Any, choice: str) -> str:
    """Set the tokenizer's chat template from task.chat_template; returns what was chosen, for the log.
    auto: the model's own if its tokenizer has one, else the shipped default; a shipped name; or a .jinja
    file."""
    if choice == "auto":
        if tokenizer.chat_template:
            return "the model's own chat template"
        choice = DEFAULT_TEMPLATE
    if choice in TEMPLATES:
        tokenizer.chat_template = TEMPLATES[choice]
        return f"the shipped {choice!r} chat template"
    path = Path(choice)
    if not path.is_file():
        raise StageInputError(f"task.chat_template {choice!r} is neither auto, a shipped template "
                              f"({', '.join(TEMPLATES)}) nor a .jinja file")
    tokenizer.chat_template = path.read_text(encoding="utf-8")
    return f"the chat template in {path}"


def special_tokens_as_tokens(tokenizer: Any) -> str | None:
    """A template writes EOS and its other special tokens as text ("</s>"), to be read back as their ids. A
    tokenizer that splits special tokens into ordinary pieces (gptpipe's stage-1 tokenizer does, so that
    pretraining text reads as SentencePiece reads it) would end every answer with pieces the model cannot stop
    on: the run's tokenizer, saved with the run and its export, reads them as tokens. Returns what was done."""
    if not getattr(tokenizer, "split_special_tokens", False):
        return None
    tokenizer.split_special_tokens = False
    return "special tokens in the rendered template are read as tokens (split_special_tokens turned off)"


def distinct_pad(tokenizer: Any) -> str | None:
    """Make the tokenizer's pad token differ from its EOS (padding masked as EOS teaches a model never to
    stop): a missing or EOS pad becomes the unknown token. Returns what was done, None when nothing was; a
    StageInputError when there is no other token to pad with."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise StageInputError("the tokenizer has no EOS token: an assistant turn's end cannot be learnt")
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id != eos:
        return None
    if tokenizer.unk_token_id is None or tokenizer.unk_token_id == eos:
        raise StageInputError("the tokenizer's pad token is its EOS (or missing) and it has no other special "
                              "token to pad with; add a pad token to the model's tokenizer (and resize the "
                              "embedding)")
    tokenizer.pad_token = tokenizer.unk_token
    return f"pad token was {'EOS' if tokenizer.pad_token_id == eos else 'missing'}: padding with {tokenizer.unk_token}"


def save_tokenizer(tokenizer: Any, folder: Path) -> None:
    """save_pretrained, with the chat template both in chat_template.jinja (what transformers 5 writes and
    reads) and in tokenizer_config.json's `chat_template` (what older readers and servers look for)."""
    tokenizer.save_pretrained(folder)
    if isinstance(tokenizer.chat_template, str):
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config["chat_template"] = tokenizer.chat_template
        write_text_atomic(config_path, json.dumps(config, ensure_ascii=False, indent=2) + "\n")


# --- ids and masks ---------------------------------------------------------------------------------------
class ChatEncoder:
    """Chat template + tokenizer + length limit → Encoded conversations (loss on assistant turns) and
    generation prompts. Has what runtime/scoring.py's `generate` reads of an Encoder."""

    seq2seq = False

    def __init__(self, tokenizer: Any, seq_len: int):
        if not tokenizer.chat_template:
            raise StageInputError("the tokenizer has no chat template (task.chat_template installs one)")
        self.tokenizer, self.seq_len = tokenizer, seq_len
        self.eos = tokenizer.eos_token_id
        self.specials = set(tokenizer.all_special_ids)
        self.stop_ids = [self.eos]  # end-of-turn tokens found while encoding join it

    def render(self, messages: list[dict[str, str]], generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def ids(self, text: str) -> list[int]:
        # As apply_chat_template tokenizes its render: the template places every special token itself.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The conversation so far and the assistant's header: what the model continues."""
        return self.ids(self.render(messages, generation_prompt=True))

    def fit_turns(self, messages: list[dict[str, str]], max_new_tokens: int
                  ) -> tuple[list[dict[str, str]], list[int]]:
        """(the turns kept, their generation prompt): the oldest exchanges left out while the prompt does not
        leave ``max_new_tokens`` within seq_len. A leading system prompt and the last user turn always stay,
        so the prompt may still not leave them."""
        start = list(messages[:1]) if messages and messages[0]["role"] == "system" else []
        while True:
            ids = self.prompt_ids(messages)
            users = [i for i, m in enumerate(messages) if m["role"] == "user"]
            if len(ids) + max_new_tokens <= self.seq_len or len(users) < 2:
                return messages, ids
            messages = start + list(messages[users[1]:])

    def uncut_length(self, row: Conversation) -> int:
        """The train.seq_len that keeps ``row`` whole."""
        return len(self.tokenizer.apply_chat_template(list(row.messages), tokenize=True, return_dict=False))

    def encode(self, row: Conversation, skipped: Reasons) -> Encoded | None:
        """The conversation's ids with IGNORE outside the assistant turns; None (counted) when longer than
        seq_len or when the template raises on it. TemplateError when the spans cannot be exact."""
        from jinja2 import TemplateError as JinjaError

        try:
            return self._encode(row, skipped)
        except JinjaError as exc:  # the template's own check of the row (raise_exception), or a render error
            skipped.add(TEMPLATE_ERROR, f"{row.where}: {exc}")
            return None

    def _encode(self, row: Conversation, skipped: Reasons) -> Encoded | None:
        full = self.tokenizer.apply_chat_template(list(row.messages), tokenize=True, return_dict=False)
        if len(full) > self.seq_len:  # cutting a conversation would cut an answer or its context: dropped
            skipped.add(TOO_LONG, f"{row.where}: {len(full)} tokens, train.seq_len {self.seq_len}")
            return None
        return self.masked(row, full)

    def masked(self, row: Conversation, full: list[int]) -> Encoded:
        """The conversation's ids (`full`: apply_chat_template's) with IGNORE outside the assistant turns,
        whatever their length; TemplateError when the spans cannot be exact."""
        messages = list(row.messages)
        text = self.render(messages)
        labels = [IGNORE] * len(full)
        for i, turn in enumerate(messages):
            if turn["role"] != "assistant":
                continue
            start = self._prefix(self.render(messages[:i], generation_prompt=True), text, full, row, i)
            end = self._prefix(self.render(messages[:i + 1]), text, full, row, i)
            ends = [k for k in range(start, end) if full[k] in self.specials]
            if not ends:
                raise TemplateError(f"{row.where}: turn {i}: the chat template ends the assistant's turn with no "
                                    f"special token (EOS or end-of-turn), so a model trained on it never learns "
                                    f"to stop; use a template that does (task.chat_template)")
            stop = ends[-1] + 1
            if full[stop - 1] not in self.stop_ids:
                self.stop_ids.append(full[stop - 1])
            labels[start:stop] = full[start:stop]
        return Encoded(full, labels)

    def _prefix(self, prefix: str, text: str, full: list[int], row: Conversation, turn: int) -> int:
        """The number of ids of the render `prefix`, checked to be the first ids of the whole conversation."""
        ids = self.ids(prefix)
        if not text.startswith(prefix) or full[:len(ids)] != ids:
            why = ("does not render turn by turn (the conversation up to it is not the start of the whole)"
                   if not text.startswith(prefix) else
                   "is tokenized differently inside the whole conversation (a token crosses the turn's boundary)")
            raise TemplateError(f"{row.where}: turn {turn}: the chat template {why}, so the assistant tokens "
                                f"cannot be masked exactly; use another template (task.chat_template), e.g. "
                                f"one that ends each turn's header with a special token or a newline piece")
        return len(ids)

