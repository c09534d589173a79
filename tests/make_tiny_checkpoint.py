"""Write a small stage-3-shaped DeepSpeed checkpoint, for the export tests (run as a script, one process per rank).

It follows the stage-3 contract: ``<run>/checkpoints/global_step{N}/`` saved by ``engine.save_checkpoint``
(any ZeRO stage, any number of ranks), plus ``hf_config.json``, ``gptpipe_state.json``, the completion
marker and a metrics.jsonl. The model trains a few steps on the real dataset so its weights are not the
initialization. Launch: ``python make_tiny_checkpoint.py ...`` or ``torchrun --nproc_per_node 2 ...``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533", "RANK": "0", "WORLD_SIZE": "1",
                   "LOCAL_RANK": "0"}.items():  # one rank without a launcher
    os.environ.setdefault(key, value)

import deepspeed  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from gptpipe.config.core import to_plain  # noqa: E402
from gptpipe.config.pipeline import PipelineConfig  # noqa: E402
from gptpipe.train.checkpoint import COMPLETE_MARKER, HF_CONFIG, STATE  # noqa: E402

SEQ = 64


def tiny_config(arch: str, vocab: int, bos: int, eos: int, pad: int) -> transformers.PretrainedConfig:
    ids = {"vocab_size": vocab, "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}
    if arch == "gpt2":
        return transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, **ids)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, **ids)
    if arch == "mixtral":
        return transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
    return transformers.LlamaConfig(**common)


def dataset_tokens(prefix: Path, count: int) -> np.ndarray:
    """The first tokens of the .bin (uint16 for vocabularies below 65,500)."""
    return np.fromfile(f"{prefix}.bin", dtype=np.uint16, count=count).astype(np.int64)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--arch", default="llama")
    p.add_argument("--zero", type=int, default=1)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tokenizer-dir", type=Path, required=True)
    p.add_argument("--dataset-prefix", type=Path, required=True)
    p.add_argument("--vocab", type=int, required=True, help="the tokenizer's vocabulary (padded here to 128)")
    p.add_argument("--ids", type=int, nargs=3, required=True, metavar=("BOS", "EOS", "PAD"))
    args = p.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    padded = (args.vocab + 127) // 128 * 128
    config = tiny_config(args.arch, padded, *args.ids)
    model = transformers.AutoModelForCausalLM.from_config(config)
    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                 "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
                 "zero_optimization": {"stage": args.zero}, "bf16": {"enabled": args.bf16}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tokens = torch.from_numpy(dataset_tokens(args.dataset_prefix, args.steps * world * 2 * SEQ))
    batches = tokens.view(args.steps, world, 2, SEQ)[:, rank]
    metrics = []
    for step, batch in enumerate(batches, 1):
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        metrics.append({"step": step, "loss": loss.item(), "val_loss": loss.item() + 0.1})
    tag = f"global_step{args.steps}"
    engine.save_checkpoint(str(args.run_dir / "checkpoints"), tag=tag)
    if rank == 0:
        folder = args.run_dir / "checkpoints" / tag
        (folder / HF_CONFIG).write_text(json.dumps(config.to_dict(), indent=2))
        # The run record stage 3 keeps in every checkpoint: the resolved config.yaml (stage 4 reads only that).
        record = PipelineConfig()
        record.tokenize.tokenizer_dir, record.data.prefixes = args.tokenizer_dir, [args.dataset_prefix]
        record.data.split, record.data.seed = "969,30,1", 1234
        state = {"step": args.steps, "consumed_samples": args.steps * 2 * world, "tokens": args.steps * 2 * world * SEQ,
                 "final_val_loss": metrics[-1]["val_loss"], "config": to_plain(record)}
        (folder / STATE).write_text(json.dumps(state, indent=2))
        (folder / COMPLETE_MARKER).write_text("")
        with open(args.run_dir / "metrics.jsonl", "a") as fh:
            fh.writelines(json.dumps(m) + "\n" for m in metrics)


if __name__ == "__main__":
    main()
