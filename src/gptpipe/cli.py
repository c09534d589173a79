"""The `gptpipe` command: one subcommand per stage; the numbered top-level scripts call these.

Every subcommand takes ``--config PATH``, ``--force`` and any number of ``section.key=value`` overrides,
anywhere on the line; ``--help`` lists every config key with its type, default and one-line doc. Stage
modules are imported only when their subcommand runs, so light commands (count, --help) start instantly.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

from gptpipe.config.core import ConfigError, describe, load_config, redact
from gptpipe.export.config import generate_arguments, upload_arguments
from gptpipe.train.config import plan_arguments


@dataclass(frozen=True)
class Command:
    """A subcommand: which config file and class it reads, and which function does the work."""

    name: str
    help: str
    target: str  # "module:function", called as function(config, args)
    config_class: str  # "module:Class"
    default_config: str
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None


def _shard_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shard", metavar="I/N", help="tokenize only shard I of N (0-based), for several "
                        "machines; join the parts with `gptpipe merge`")


def _fetch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fetch", action="store_true",
                        help="save the suite's hub datasets under suite_data_dir (needs the network, or the HF "
                             "cache with HF_DATASETS_OFFLINE=1), then stop; --force fetches again")


def _prepare_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--explain", type=Path, metavar="FILE",
                        help="print, for each document of FILE (.jsonl: one per line; any other file: one "
                             "document), what each rule measures and which one would drop it, then exit without "
                             "writing anything (duplicates are looked for among FILE's own documents only)")
    parser.add_argument("--contamination-report", type=Path, nargs="?", const=True, metavar="FILE",
                        help="print, per task of corpus.decontamination, how many of its items the corpus "
                             "(the corpus files of output_dir, or FILE) quotes and in how many documents, with the "
                             "first few, then exit without changing anything")


def _count_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-write", action="store_true", help="print the plan without writing "
                        "train.train_tokens into the config file")


def _merge_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shards", type=int, required=True, help="number of shards to merge (N of --shard I/N)")


def _predict_arguments(parser: argparse.ArgumentParser) -> None:
    from gptpipe.finetune.config import predict_arguments

    predict_arguments(parser)


def _gguf_arguments(parser: argparse.ArgumentParser) -> None:
    from gptpipe.export.gguf import gguf_arguments

    gguf_arguments(parser)


FINETUNE = "gptpipe.finetune.config:FinetuneConfig"
EVALUATE = "gptpipe.evaluate:EvaluateConfig"
PIPELINE = "gptpipe.pipeline:PipelineConfig"
CONVERT = "gptpipe.export.config:ConvertConfig"
COMMANDS = [
    Command("prepare", "stage 0: build the jsonl corpus from the sources in config.yaml",
            "gptpipe.corpus.prepare:run", PIPELINE, "config.yaml", _prepare_arguments),
    Command("train-tokenizer", "stage 1: train the SentencePiece tokenizer and export the HF fast tokenizer",
            "gptpipe.tokenizer.build:run", "gptpipe.tokenizer.config:TokenizerConfig",
            "sentence_piece_config.yaml"),
    Command("tokenize", "stage 2: tokenize the corpus into a Megatron .bin/.idx dataset",
            "gptpipe.data.tokenize:run", PIPELINE, "config.yaml", _shard_arguments),
    Command("merge", "stage 2: join the shards written with --shard I/N into one dataset",
            "gptpipe.data.tokenize:merge", PIPELINE, "config.yaml", _merge_arguments),
    Command("count", "count documents and tokens from the .idx and write train_tokens into config.yaml",
            "gptpipe.data.count:run", PIPELINE, "config.yaml", _count_arguments),
    Command("plan", "stage 3 preflight: parameters, FLOPs, memory per GPU, steps and LR schedule; refuses what "
            "won't fit",
            "gptpipe.train.plan_report:run", PIPELINE, "config.yaml", plan_arguments),
    Command("train", "stage 3: pretrain the GPT with DeepSpeed (resumes from the newest checkpoint; exit 75 = "
            "saved on SIGTERM/SIGINT, rerun to continue)", "gptpipe.train.train:run", PIPELINE, "config.yaml"),
    Command("convert", "stage 4: export a stage-3 checkpoint to a verified HuggingFace folder",
            "gptpipe.export.convert:run", CONVERT, "convert_config.yaml"),
    Command("gguf", "stage 4: write the exported folder as a GGUF file for llama.cpp / Ollama (f16, bf16, q8_0)",
            "gptpipe.export.gguf:run", CONVERT, "convert_config.yaml", _gguf_arguments),
    Command("generate", "stage 5: generate text from the exported folder (streamed; --interactive for a prompt loop)",
            "gptpipe.export.generate:run", CONVERT, "convert_config.yaml", generate_arguments),
    Command("upload", "stage 6: upload the verified folder to the HuggingFace hub (token: HF_TOKEN or `hf auth login`)",
            "gptpipe.export.upload:run", CONVERT, "convert_config.yaml", upload_arguments),
    Command("finetune", "stage 7: fine-tune the exported model on labelled TSV/jsonl rows, keeping the best checkpoint "
            "by the validation metric (resumes; exit 75 = saved on SIGTERM/SIGINT, rerun to continue)",
            "gptpipe.finetune.finetune:run", FINETUNE, "finetune_config.yaml"),
    Command("predict", "stage 7: greedy or beam-search predictions of a fine-tuned model on a TSV/jsonl file or stdin "
            "(jsonl out; metrics when labels are present)", "gptpipe.finetune.predict:run", FINETUNE,
            "finetune_config.yaml", _predict_arguments),
    Command("chat", "stage 7: chat with a chat fine-tune (task.kind chat) or an HF folder with a chat template: one "
            "user turn per stdin line, answers streamed; /reset, /exit", "gptpipe.finetune.chat:run", FINETUNE,
            "finetune_config.yaml"),
    Command("make-demo-task", "stage 7 demo: build the man-page section task (description → section) as "
            "train/validation/test TSV files", "gptpipe.finetune.demo_task:run", EVALUATE, "evaluate_config.yaml"),
    Command("evaluate", "stage 7: zero/few-shot evaluation of an exported HF folder with lm-evaluation-harness",
            "gptpipe.evaluate:run", EVALUATE, "evaluate_config.yaml", _fetch_arguments),
]


def _load_object(spec: str) -> Any:
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def _keys_help(config_class: type, config_name: str) -> str:
    rows = describe(config_class)
    lines = [f"config keys ({config_name}; override any with key=value):"]
    for key, type_name, default, doc in rows:
        lines.append(f"  {key} ({type_name}, default {default})")
        if doc:
            lines.append(f"      {doc}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gptpipe", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help,
                           epilog=_keys_help(_load_object(cmd.config_class), cmd.default_config),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--config", type=Path, default=Path(cmd.default_config),
                       help=f"YAML config (default: ./{cmd.default_config})")
        p.add_argument("--force", action="store_true", help="redo the stage even if its outputs are current")
        p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.lr=3e-4")
        if cmd.add_arguments:
            cmd.add_arguments(p)
    return parser


def parse_command_line(argv: list[str] | None = None) -> argparse.Namespace:
    """The subcommand's arguments, with ``key=value`` overrides taken from anywhere on the line."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    # argparse fills the nargs="*" overrides from one run of words only: those after an option land in extras
    # (an option's own value, e.g. --prompt a=b, never does).
    unknown = [word for word in extras if word.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides += extras
    return args


def main(argv: list[str] | None = None) -> int:
    from gptpipe.stage import StageFailed, StageInputError  # light; kept here so --help needs nothing else
    from gptpipe.artifacts import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK

    args = parse_command_line(argv)
    cmd = next(c for c in COMMANDS if c.name == args.command)
    try:
        config = load_config(_load_object(cmd.config_class), args.config, args.overrides)
        if getattr(config, "storage", None) is not None:  # config.yaml's storage: endpoint for every command
            config.storage.apply()
        result = _load_object(cmd.target)(config, args)
    except (ConfigError, StageInputError) as exc:
        print(f"gptpipe {cmd.name}: {redact(str(exc))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except StageFailed as exc:
        print(f"gptpipe {cmd.name}: FAILED: {redact(str(exc))}", file=sys.stderr)
        return EXIT_FAILED
    return int(result or EXIT_OK)


def run_script(command: str) -> None:
    """Entry point of the numbered top-level scripts: ``python 0_prepare_corpus.py [args]``."""
    raise SystemExit(main([command, *sys.argv[1:]]))
