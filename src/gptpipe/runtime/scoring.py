"""A model's uses beside training, shared by fine-tuning, `gptpipe predict` and the export checks: loading a
pretrained HF folder, logits and teacher-forced log-likelihoods of target tokens, batched generation, and rows
shared over the ranks."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from collections.abc import Callable

import torch

from gptpipe.runtime.batching import IGNORE, Encoded, collate, left_padded, pad_id
from gptpipe.runtime.lora import apply_lora
from gptpipe.runtime.model import inference_config, load_pretrained

if TYPE_CHECKING:
    from gptpipe.runtime.engine import Dist


class PromptEncoder(Protocol):
    """What generation needs of a task's encoder (finetune/data.py's Encoder, finetune/chat_data.py's ChatEncoder):
    the tokenizer, whether the model is an encoder-decoder, and the ids that end an answer."""

    tokenizer: Any
    seq2seq: bool
    eos: int
    stop_ids: list[int]


def is_seq2seq(folder: Path, kind: str) -> bool:
    """Whether the model in `folder` is an encoder-decoder (kind auto: its config says)."""
    if kind != "auto":
        return kind == "seq2seq"
    from transformers import AutoConfig

    return bool(getattr(AutoConfig.from_pretrained(folder), "is_encoder_decoder", False))


def model_class(seq2seq: bool) -> Any:
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM


def pretrained_factory(folder: Path, seq2seq: bool, device: torch.device, scratch: bool = False,
                       lora: dict[str, Any] | None = None) -> Callable[[], Any]:
    """A callable loading the pretrained weights in fp32 (DeepSpeed casts for bf16/fp16 itself); with `scratch`,
    the folder's architecture with freshly initialised weights instead (the loop seeds it); with `lora`
    (task.json's), those weights frozen under trainable adapters (runtime/lora.py)."""

    def make() -> Any:
        if scratch:
            from transformers import AutoConfig

            config = inference_config(AutoConfig.from_pretrained(folder))
            return model_class(seq2seq).from_config(config, dtype=torch.float32).to(device)
        model = load_pretrained(folder, seq2seq).to(device)
        inference_config(model.config)  # the fine-tune's loss has no router term; evaluation generates
        return apply_lora(model, lora, seq2seq) if lora else model

    return make


def logits(model: Any, batch: dict[str, torch.Tensor], seq2seq: bool) -> torch.Tensor:
    """Logits aligned with batch["targets"] (see data.collate; a packed batch, data.collate_packed, brings the
    position ids that keep its rows apart and no attention mask). A causal LM's batch names the columns that
    hold targets (`target_columns`): the logits are those columns' only, [batch, columns, vocab]. Prompts and
    padding then cost no output-layer work and no logits memory, which for short labels is most of both.
    Without `target_columns` (the export gate compares every position) they are every column's."""
    if seq2seq:
        module = getattr(model, "module", model)  # a DeepSpeed engine or the bare model
        decoder_input_ids = module.prepare_decoder_input_ids_from_labels(labels=batch["labels"])
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     decoder_input_ids=decoder_input_ids, use_cache=False).logits
    extra = {"position_ids": batch["position_ids"]} if "position_ids" in batch else {}  # not every model takes it
    columns = batch.get("target_columns")
    if columns is not None and _keeps_logits(model):
        extra["logits_to_keep"] = columns
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False, **extra).logits
    if columns is None or out.shape[1] == len(columns):
        return out
    return out[:, columns]  # a model that computed every column


def _keeps_logits(model: Any) -> bool:
    """Whether a causal LM's forward takes `logits_to_keep` (transformers' Llama, GPT-2 and Mixtral do)."""
    forward = getattr(getattr(model, "module", model), "forward", model)
    parameters = inspect.signature(forward).parameters
    return "logits_to_keep" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def target_logprobs(model: Any, batch: dict[str, torch.Tensor], seq2seq: bool) -> torch.Tensor:
    """Per-token log-probabilities of the targets, [batch, length], 0 where the target is IGNORE."""
    out = logits(model, batch, seq2seq).float()
    columns = None if seq2seq else batch.get("target_columns")
    targets = batch["targets"] if columns is None else batch["targets"][:, columns]
    token = -torch.nn.functional.cross_entropy(out.transpose(1, 2), targets.clamp(min=0), reduction="none")
    token = token.masked_fill(targets == IGNORE, 0.0)
    if columns is None:
        return token
    return torch.zeros(batch["targets"].shape, dtype=token.dtype, device=token.device).index_copy(1, columns, token)


@torch.no_grad()
def score(model: Any, items: list[Encoded], pad: int, seq2seq: bool, device: torch.device,
          batch_size: int) -> list[float]:
    """Sum of the label tokens' log-probabilities of each item (label + EOS given the prompt)."""
    sums: list[float] = []
    for start in range(0, len(items), batch_size):
        batch = collate(items[start:start + batch_size], pad, seq2seq, device)
        sums += target_logprobs(model, batch, seq2seq).sum(dim=1).tolist()
    return sums


@torch.no_grad()
def generate(model: Any, encoder: PromptEncoder, prompts: list[list[int]], device: torch.device, *,
             num_beams: int = 1, max_new_tokens: int = 32, length_penalty: float = 1.0, synced_gpus: bool = False,
             sampling: dict[str, float] | None = None, streamer: Any = None) -> list[list[int]]:
    """Generated ids for each prompt (the stop token included when produced, padding removed). Causal prompts
    are left-padded; `synced_gpus` keeps ZeRO-3 ranks in step (each must run the same number of forwards);
    `sampling` (temperature, top_p) samples instead of searching; `streamer` (transformers') gets the tokens
    as they come."""
    tokenizer, seq2seq = encoder.tokenizer, encoder.seq2seq
    module = getattr(model, "module", model)
    pad = pad_id(tokenizer)
    batch = left_padded(prompts, pad, device)
    vocab = module.config.get_text_config().vocab_size
    # The embedding may be padded beyond the tokenizer (stage 3 pads to a multiple of 128): never emit those ids.
    unused = list(range(len(tokenizer), vocab)) or None
    out = module.generate(**batch, max_new_tokens=max_new_tokens, num_beams=num_beams,
                          do_sample=sampling is not None, **(sampling or {}),
                          length_penalty=length_penalty, early_stopping=num_beams > 1 or None,
                          eos_token_id=encoder.stop_ids, pad_token_id=pad, suppress_tokens=unused,
                          synced_gpus=synced_gpus, streamer=streamer)
    new = out if seq2seq else out[:, batch["input_ids"].shape[1]:]
    results = []
    for row in new.tolist():
        if seq2seq and row and row[0] == module.config.decoder_start_token_id:
            row = row[1:]
        ids = []
        for t in row:
            ids.append(t)
            if t in encoder.stop_ids:
                break
        while ids and ids[-1] == pad and pad != encoder.eos:
            ids.pop()
        results.append(ids)
    return results


def decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True).strip()


def as_scored(prompt: list[int], continuation: list[int], seq2seq: bool) -> Encoded:
    """A prompt and a generated continuation as an item for `score` (its log-likelihood)."""
    if seq2seq:
        return Encoded(prompt, continuation or [IGNORE])
    return Encoded(prompt + continuation, [IGNORE] * len(prompt) + continuation)


def shard(items: list[Any], dist: Dist) -> list[tuple[int, Any]]:
    """This rank's (index, item) share; every rank gets the same count (the last item repeats, index -1),
    so ZeRO-3 ranks run the same number of forward passes."""
    per_rank = -(-len(items) // dist.world_size)
    mine = []
    for k in range(per_rank):
        i = k * dist.world_size + dist.rank
        mine.append((i, items[i]) if i < len(items) else (-1, items[-1]))
    return mine


def gather(results: list[tuple[int, Any]], dist: Dist) -> list[Any]:
    """Every rank's (index, result) pairs, in index order (padding dropped)."""
    if dist.world_size > 1:
        parts: list[Any] = [None] * dist.world_size
        torch.distributed.all_gather_object(parts, results)
        results = [pair for part in parts for pair in part]
    return [r for i, r in sorted((p for p in results if p[0] >= 0), key=lambda p: p[0])]
