"""Stage 3: `gptpipe train` (3_train_node1.sh) — plan, build, then runtime/loop.py's loop over train_step.

Pretraining's part of the loop, from scratch or continued from a base model (model.init_from, see
runtime/base_model.py: its weights when no checkpoint exists yet, after the step-0 gate): batches from the
Megatron dataset by samples consumed (so a resumed run reads exactly what the killed one would have), the
train line with tokens, throughput and MFU, the validation loss and sample generations at each evaluation,
and the run record in every checkpoint.

Exit codes (runtime/loop.py): 0 finished; 1 failed (e.g. too many non-finite steps in a row); 2 refused before
starting (config, inputs, or a plan that does not fit); 75 stopped by SIGTERM/SIGINT after saving a
checkpoint — run the same command again to continue from it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch

from gptpipe.train.config import TrainingRun
from gptpipe.data.count import DatasetCounts, count_dataset
from gptpipe.storage import is_url
from gptpipe.config.core import to_plain
from gptpipe.log import get_logger
from gptpipe.stage import StageInputError
from gptpipe.artifacts import EXIT_BAD_INPUT
from gptpipe.runtime import checkpoint, fp8
from gptpipe.runtime.base_model import BASE_STATE_KEY, BaseModel, base_record, check_unchanged
from gptpipe.train.continued import gate_batch, new_row_problems, old_rows_loss, reference_loss, stage3_model
from gptpipe.data.tokenizer_check import tokenizer_problems
from gptpipe.data.config import source_names
from gptpipe.train.data import DataError, build_datasets, collate, eval_batches, mixture, source_counts
from gptpipe.runtime.batching import sample_positions, to_device
from gptpipe.runtime.engine import Dist, EngineConfigError, build_engine, deepspeed_config
from gptpipe.train.eval_tasks import STATE_KEY as TASKS_STATE_KEY, TaskScorer, compare
from gptpipe.runtime.loop import LogWindow, TrainLoop, run_ranks
from gptpipe.runtime.metrics_rows import MixtureRow, TrainRow, ValidationRow
from gptpipe.tolerance import loss_tolerance
from gptpipe.runtime.model import ExpertBias, build_model, expert_biases, expert_shares, lm_forward, router_loss
from gptpipe.train.plan import Plan, PlanError, check_parameter_count, make_plan
from gptpipe.train.plan_report import format_plan


log = get_logger("train")


def run(config: TrainingRun, args: argparse.Namespace) -> int:
    """`gptpipe train`: returns the exit code documented in the module doc."""
    if config.train.precision == "fp8":
        # an explicit request: refused here, before any rank starts or writes, never trained in bf16 instead
        why = fp8.unavailable()
        if why:
            raise StageInputError(f"train.precision fp8 cannot run here: {why}; on this machine use "
                                  "train.precision=bf16")
    return run_ranks(lambda dist: _train(config, dist))


def _train(config: TrainingRun, dist: Dist) -> int:
    tokenizer, hf_config, base = stage3_model(config)
    try:
        plan = make_plan(config, tokenizer.vocab_size, dp=dist.world_size, base_config=base.config if base else None,
                         model_config=hf_config, stats=counted_once(config))
        ds_config, wandb_block = deepspeed_config(config.train, plan.settings.micro_batch, plan.accumulation,
                                                  dist.world_size, dist.device.type == "cuda")
    except (PlanError, DataError, EngineConfigError) as exc:
        if dist.is_main:
            log.error(f"refused: {exc}")
        return EXIT_BAD_INPUT
    if dist.is_main:
        check_parameter_count(plan, hf_config)
        log.info(f"plan:\n{format_plan(plan, config)}")
    return Pretrainer(config, plan, ds_config, wandb_block, hf_config, tokenizer, dist, base).fit()


def counted_once(config: TrainingRun) -> list[DatasetCounts]:
    """The datasets' counts for the plan, made by rank 0 alone and given to every rank: each split's tokens need the
    split order, which rank 0 caches for the index build where the run folder is local, with the counts themselves
    for the next start (a bucket run's staging folder must stay empty until its mirror opens it)."""
    data, out = config.data, config.train.output_model_dir
    counts: list[Any] = [None]
    if torch.distributed.get_rank() == 0:
        cache = data.cache_dir or (None if is_url(out) else Path(out) / "data_cache")
        try:
            counts = [[count_dataset(p, data.split, data.seed, cache) for p in data.prefixes]]
        except Exception as exc:  # every rank raises it, not only rank 0 (the others would wait forever)
            counts = [exc]
    torch.distributed.broadcast_object_list(counts, src=0)
    if isinstance(counts[0], Exception):
        raise counts[0]
    return counts[0]


class Pretrainer(TrainLoop):
    """Pretraining, from scratch or continued from a base model (`base`), on the tokenized corpus, as the plan
    says."""

    name = "train"

    def __init__(self, config: TrainingRun, plan: Plan, ds_config: dict[str, Any], wandb_block: dict[str, Any],
                 hf_config: Any, tokenizer: Any, dist: Dist, base: BaseModel | None = None):
        super().__init__(config, config.train, dist, ds_config, wandb_block)
        self.plan, self.tokenizer, self.hf_config, self.base = plan, tokenizer, hf_config, base
        self.steps = plan.steps
        train = config.train
        if self.mirror and dist.is_main:  # the plan of this run beside its checkpoints, in the bucket
            (self.run_dir / "plan.txt").write_text(format_plan(plan, config) + "\n", encoding="utf-8")
        sizes = [plan.train_samples, plan.eval_samples, plan.eval_samples]
        # Built once per folder and memory-mapped by every rank: nodes staging on disks of their own build one each.
        cache = config.data.cache_dir or self.run_dir / "data_cache"
        self.train_data, self.valid_data, _ = build_datasets(config.data, plan.stats, train.seq_len, sizes, cache,
                                                             tokenizer.vocab_size, tokenizer.eod_id,
                                                             train.document_mask)
        self.sources = source_names(config.data.prefixes)
        # What each source really gives the run: megatron's blend index over the samples the run will read.
        self.mixture = mixture(source_counts(self.train_data, plan.steps * train.global_batch_size,
                                             len(plan.stats)), plan.stats, train.seq_len)
        # A base model's weights initialise the model only when there is no checkpoint to resume from.
        self.initialising = base is not None and checkpoint.newest_checkpoint(self.ckpt_root) is None
        self.base_record: dict[str, Any] | None = None
        if base is not None and not self.initialising:
            self.base_record = self._check_resumed_base(base)
        elif self.initialising:
            self._prepare_gate(base)
        new_rows = base.extension.new_rows if base is not None and base.extension else None
        make_model = (lambda: build_model(hf_config, dist.device, base.folder, new_rows)) if self.initialising \
            else None
        self.engine, self.loss_kwargs = build_engine(train, plan.shape.arch, hf_config, ds_config, plan.schedule,
                                                     dist.device, make_model)
        biases = expert_biases(self.engine)
        self.balance = ExpertBias(biases, config.model.moe_bias_update_rate) if biases else None
        self.consumed = 0
        self.last_val_loss: float | None = None
        # lm-eval tasks on the live model at each evaluation, with the tokenizer the data was encoded with
        # (a stage-1 tokenizer's documents follow the separator, EOD; a base's, its BOS or else EOS as lm-eval does)
        self.tasks = TaskScorer(train, base.tokenizer.folder if base else tokenizer.hf_dir,
                                None if base else tokenizer.eod_id, train.seq_len, plan.settings.micro_batch,
                                dist) if train.scores_tasks else None

    # --- continued pretraining: the base model ----------------------------------------------------------------
    def _check_resumed_base(self, base: BaseModel) -> dict[str, Any]:
        """The base's record in the checkpoint resumed from, after checking the folder still holds those files."""
        folder = checkpoint.newest_checkpoint(self.ckpt_root)
        state_file = folder / checkpoint.STATE
        record = json.loads(state_file.read_text(encoding="utf-8")).get(BASE_STATE_KEY)
        if record is None:
            raise StageInputError(f"{folder} was trained from scratch, not from a base model: model.init_from "
                                  f"{base.folder} cannot continue it; set train.output_model_dir to a new folder")
        check_unchanged(record, base, str(state_file))
        return record

    def _prepare_gate(self, base: BaseModel) -> None:
        """What the step-0 gate compares the engine with, computed before Liger may patch the model classes (rank
        0): transformers' fp32 loss of the base on the gate's sample (over the base's own rows, with a tokenizer
        extension: train/continued.py's doc), and the tokenizer's re-encoding of held-out documents. Also records
        the base's files (their hashes) for the checkpoints."""
        self.gate_sample = gate_batch(self.valid_data, base.extension)
        self.gate_reference: float | None = None
        self.gate_problems: list[str] = []
        self.tokenizer_checked = ""
        if not self.dist.is_main:
            return
        from transformers import AutoTokenizer

        self.base_record = base_record(base)
        self.gate_reference = reference_loss(base.folder, self.gate_sample,
                                             base.old_rows() if base.extension else None)
        data = self.config.data
        self.gate_problems, self.tokenizer_checked = tokenizer_problems(
            AutoTokenizer.from_pretrained(base.tokenizer.folder), base.tokenizer, self.plan.stats[0].prefix, data.split,
            data.seed)

    @torch.no_grad()
    def _step0_gate(self) -> bool:
        """Before the first optimizer step of an initialising run: does the engine hold the base model, and does
        its tokenizer match the data? Logs the comparison; True when every rank may train."""
        base, precision = self.base, self.train_cfg.precision
        batch = to_device(self.gate_sample, self.dist.device)
        self.engine.eval()
        sample, rows = "the first validation sample", ""
        if base.extension:
            # logits (no labels: Liger's fused loss would skip them) over the base's own rows, and the new rows
            logits = self.engine(input_ids=batch["input_ids"], use_cache=False).logits
            got = old_rows_loss(logits, batch["labels"], base.old_rows())
            extension_problems, rows = new_row_problems(self.engine.module, base.extension, precision)
            sample = (f"{sample} with its new pieces spelled in base ids, over the base's {base.base_rows:,} rows "
                      f"(the {self.plan.shape.vocab_size - base.base_rows:,} added left out of the softmax)")
        else:
            got, extension_problems = float(lm_forward(self.engine, batch, **self.loss_kwargs).loss), []
        self.engine.train()
        problems = []
        if self.dist.is_main:
            want = self.gate_reference
            tolerance = loss_tolerance(want, precision)
            line = (f"the engine's loss on {sample} ({batch['input_ids'].shape[1]} tokens) is "
                    f"{got:.6f} in {precision}, transformers' from_pretrained of {base.folder} gives {want:.6f} in "
                    f"fp32 (|Δ| {abs(got - want):.2g}, tolerance {tolerance:.2g})")
            if not abs(got - want) <= tolerance:
                problems.append(line)
            problems += extension_problems + self.gate_problems
            line += f"; {rows}" if rows else ""
            if not problems:
                self.say(f"step-0 gate passed: {line}; the tokenizer {self.tokenizer_checked}")
        refused = torch.tensor([len(problems)], dtype=torch.int32, device=self.dist.device)
        torch.distributed.all_reduce(refused)  # every rank stops when rank 0 refuses
        if problems:
            log.error(f"refused: the run would not train model.init_from {base.folder}:\n  - "
                      + "\n  - ".join(problems))
        return int(refused.item()) == 0

    def fit(self) -> int:
        if self.initialising:
            if not self._step0_gate():
                return EXIT_BAD_INPUT
            extension = self.base.extension
            self.say(f"initialised from {self.base.folder} ({self.base.model_type}, "
                     f"{self.plan.parameters:,} parameters)" + (
                         f"; vocabulary extended by {len(extension.new_rows):,} pieces ({extension.folder}): "
                         f"{self.base.base_rows:,} → {self.plan.shape.vocab_size:,} embedding rows" if extension
                         else ""))
        return super().fit()

    # --- data and position --------------------------------------------------------------------------
    def batches(self):
        plan = self.plan
        for micro_step in range(plan.accumulation):
            positions = sample_positions(self.consumed, micro_step, plan.settings.micro_batch, self.dist.rank,
                                         self.dist.world_size)
            yield collate(self.train_data, positions, self.dist.device)

    def after_step(self) -> None:
        self.consumed += self.train_cfg.global_batch_size
        if self.step == self.plan.schedule.frozen_steps:
            self.say(f"embedding warm-up over after step {self.step}: the whole model trains from here")

    def position(self) -> str:
        return f"step {self.step}, {self.consumed:,} samples consumed"

    def checkpoint_state(self) -> dict[str, Any]:
        return {
            "consumed_samples": self.consumed,
            "tokens": self.consumed * self.train_cfg.seq_len,
            "final_val_loss": self.last_val_loss if self.step >= self.steps else None,
            "val_loss": self.last_val_loss,
            # the task scores of the first evaluation, which later ones are compared with, across resumes
            **({TASKS_STATE_KEY: self.tasks.reference} if self.tasks and self.tasks.reference else {}),
            # The run record: the whole resolved config.yaml this run trained with. Stage 4 reads the tokenizer,
            # the data and its split from here, never from a config.yaml that may have changed since.
            "config": to_plain(self.config),
            # The base model's files as the run initialised from them: a resume and stage 4 refuse other ones.
            **({BASE_STATE_KEY: self.base_record} if self.base_record else {}),
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.consumed = state["consumed_samples"]
        self.last_val_loss = state.get("val_loss")
        if self.tasks:
            self.tasks.reference = state.get(TASKS_STATE_KEY) or {}

    # --- what the run shows -------------------------------------------------------------------------
    def begin(self) -> None:
        """The data mixture as megatron built it; with several sources or train.eval_tasks, an evaluation before
        the first step, so each source's validation loss and each task's score has its starting point (the base
        model's, when continuing pretraining)."""
        console = "data mixture of the run (megatron's blend index):\n" + "\n".join(f"  {m.line()}"
                                                                                   for m in self.mixture)
        row = MixtureRow(self.step, {m.name: {"tokens": m.tokens, "share": m.share, "epochs": m.epochs}
                                     for m in self.mixture})
        if len(self.sources) > 1:
            # eval_batches keeps a multiple of the ranks of each source's validation samples
            world = self.dist.world_size
            counts = [n // world * world for n in source_counts(self.valid_data, self.plan.eval_samples,
                                                                len(self.sources))]
            row.validation_samples = dict(zip(self.sources, counts))
            console += "\n  validation samples per source: " + ", ".join(
                f"{name} {n}" for name, n in zip(self.sources, counts))
            if not all(counts):
                console += " (a source without any has no val_loss/<name>: raise train.eval_iters)"
        self.log.record(row, console=console)
        warmup = self.plan.schedule.frozen_steps
        if self.step < warmup:
            self.say(f"embedding warm-up: steps {self.step + 1}–{warmup} train only the token embedding and output "
                     "matrices (train.embedding_warmup_steps); the rest of the model is at a learning rate of 0")
        if self.step == 0 and (len(self.sources) > 1 or self.tasks):
            self.validate()

    def log_train(self, window: LogWindow) -> None:
        plan = self.plan
        tokens_per_s = window.steps * plan.tokens_per_step / max(window.seconds, 1e-9)
        row = TrainRow(self.step, **window.row(), tokens_per_s=tokens_per_s,
                       tokens=self.consumed * self.train_cfg.seq_len, setup=str(plan.setup),
                       skipped_steps=self.skipped)
        routing = ""
        if window.last.aux_loss is not None:
            row.aux_loss = float(window.last.aux_loss)
            routing = f"  router-aux {row.aux_loss:.3f}" + self._routing(window.last.aux_loss.counts, row)
        if plan.peak_flops:
            row.mfu = plan.flops_per_token * tokens_per_s / (plan.peak_flops * self.dist.world_size)
        row.mem_gib = self.memory_gib()
        self.log.record(row, console=(
            f"step {self.step}/{self.steps}  tokens {row.tokens:,}  {window.line()}"
            + routing
            + f"  {tokens_per_s:,.0f} tok/s" + (f"  MFU {row.mfu:.1%}" if row.mfu is not None else "")
            + f"  mem {row.mem_gib:.2f} GiB" + (f"  skipped {self.skipped}" if self.skipped else "")
            + (self.mirror.status() if self.mirror else "")))

    def _routing(self, counts: torch.Tensor, row: TrainRow | ValidationRow) -> str:
        """A mixture of experts' routing over this step's (or the validation's) tokens of every rank: each
        layer's smallest expert share into `row` (a fair share is 1/num_experts) and the experts under a
        quarter of a fair share; returns the console text. Collective: every rank calls it."""
        counts = counts.clone()
        torch.distributed.all_reduce(counts)
        smallest, starved = row.expert_share_min, row.experts_starved = expert_shares(counts)
        return f"  expert-min {'/'.join(f'{share:.1%}' for share in smallest)}  starved {starved}"

    @torch.no_grad()
    def validate(self) -> bool:
        """Validation loss over the same eval_iters × global_batch_size samples every time, and each source's
        over its part of them (val_loss/<source>, with several prefixes), then samples."""
        engine, plan = self.engine, self.plan
        engine.eval()
        totals = torch.zeros(len(self.sources), 2, dtype=torch.float64, device=self.dist.device)
        moe = hasattr(self.hf_config, "output_router_logits")
        # the routing on held-out text; Liger's skip_logits (it skips them only in training mode unless told)
        extra = {**self.loss_kwargs, **({"output_router_logits": True} if moe else {})}
        counts = None
        for source, batch in eval_batches(self.valid_data, plan.eval_samples, plan.settings.micro_batch,
                                          self.dist.rank, self.dist.world_size, self.dist.device):
            out = lm_forward(engine, batch, **extra)
            count = (batch["labels"] != -100).sum()
            totals[source] += torch.stack([out.loss.double() * count, count.double()])
            if moe:
                step_counts = router_loss(out.router_logits, self.hf_config.num_experts_per_tok,
                                          expert_biases(engine)).counts
                counts = step_counts if counts is None else counts + step_counts
        torch.distributed.all_reduce(totals)
        overall = totals.sum(0)
        loss = (overall[0] / overall[1]).item()
        self.last_val_loss = loss
        ppl = math.exp(min(loss, 50.0))
        row = ValidationRow(self.step, val_loss=loss, val_ppl=ppl)
        per_source = ""
        if len(self.sources) > 1:
            for name, (loss_sum, count) in zip(self.sources, totals.tolist()):
                if count:  # a source with no validation sample in the budget has no loss to show
                    row.per_source[name] = loss_sum / count
            per_source = "  (" + ", ".join(f"{name} {row.per_source[name]:.4f}" if name in row.per_source
                                           else f"{name} -" for name in self.sources) + ")"
        routing = self._routing(counts, row) if counts is not None else ""
        self.log.record(row, console=f"validation  step {self.step}  loss {loss:.4f}{per_source}  "
                                     f"perplexity {ppl:.2f}{routing}")
        self.log.samples(self.step, self._generate())
        if self.tasks:
            self._score_tasks()
        engine.train()
        return False  # checkpoints follow save_interval

    def _score_tasks(self) -> None:
        """train.eval_tasks on the live model (every rank: the documents are sharded over them), a row beside the
        validation's and a warning line per task that fell more than the tolerance below its reference."""
        # A compiled model would recompile for every new batch shape: score eagerly.
        with torch.compiler.set_stance("force_eager") if self.train_cfg.compile else contextlib.nullcontext():
            scores = self.tasks.score(self.engine.module, self.step)
        if scores is None:  # ranks other than 0
            return
        line, warnings = compare(scores, self.tasks.reference, self.train_cfg.eval_tasks_tolerance,
                                 self.dist.world_size)
        self.log.record(scores.row, console=line)
        for warning in warnings:
            self.log.say(f"warning: {warning}")

    def _generate(self) -> list[tuple[str, str]]:
        """Greedy continuations of train.sample_prompts (every rank runs them: ZeRO-3 needs all in step)."""
        train, tok = self.train_cfg, self.tokenizer
        if not train.sample_prompts or train.sample_tokens < 1:
            return []
        encode, decode = self._codec()
        # Documents in the data start right after a separator (and the base's BOS where its tokenizer adds one).
        start = [tok.eod_id] + ([tok.bos_id] if self.base and tok.bos_id is not None else [])
        padding = list(range(tok.vocab_size, self.plan.shape.vocab_size)) or None
        results = []
        # A compiled model would recompile for every new sequence length: generate eagerly.
        with torch.compiler.set_stance("force_eager") if train.compile else contextlib.nullcontext():
            for prompt in train.sample_prompts:
                ids = start + encode(prompt)
                out = self.engine.module.generate(
                    torch.tensor([ids], device=self.dist.device), max_new_tokens=train.sample_tokens,
                    do_sample=False, suppress_tokens=padding, eos_token_id=tok.eod_id, pad_token_id=tok.eod_id,
                    synced_gpus=train.zero_stage == 3 and self.dist.world_size > 1)
                results.append((prompt, decode([i for i in out[0, len(ids):].tolist() if i < tok.vocab_size])))
        return results

    def _codec(self) -> tuple[Callable[[str], list[int]], Callable[[list[int]], str]]:
        """(encode, decode) of the run's tokenizer: the base's HF tokenizer, or the stage-1 SentencePiece model."""
        if self.base:
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(self.base.tokenizer.folder)
            return (lambda text: hf(text, add_special_tokens=False)["input_ids"],
                    lambda ids: hf.decode(ids, skip_special_tokens=True))
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(self.tokenizer.model_path))
        return sp.encode, sp.decode

    def finish(self) -> None:
        self.say(f"finished {self.step} steps, {self.consumed * self.train_cfg.seq_len:,} tokens; "
                 f"final validation loss {self.last_val_loss:.4f}; checkpoints in {self.ckpt_root}")
