"""Stage 3's task evaluation (train.eval_tasks): lm-eval tasks scored zero-shot on the live model at each
evaluation, each task's main metric compared with the run's first evaluation (the reference, before step 1).

The documents are sharded over the ranks (lm-eval's own data-parallel path: every rank scores its share, the
shares padded to one length so every rank runs the same number of forward passes, and the results gathered on
rank 0). So no rank waits for another's scoring, and under ZeRO-3, where every forward needs every rank to
gather the partitioned parameters, the ranks' forwards stay in step. The padding is why the logits cache is
off: it would merge requests that share a context differently on each rank and break the equal count.

The reference scores go into every checkpoint (`checkpoint_state`), so a resumed run compares with the same
reference without scoring the start again.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptpipe.llmjp_eval import read_folders, lm_eval_task
from gptpipe.lm_tasks import load_tasks, local_task, summarize
from gptpipe.train.config import TrainConfig
from gptpipe.runtime.engine import Dist
from gptpipe.runtime.metrics_rows import EvalTasksRow

STATE_KEY = "eval_tasks_reference"  # gptpipe_state.json: {task: {"metric", "value", "higher_is_better", "step"}}


@dataclass
class Scores:
    """One task evaluation, on rank 0: every metric of every task, each task's main one, and its cost."""

    row: EvalTasksRow
    main: dict[str, str]  # task → its main metric (the first of its metric_list)
    higher_is_better: dict[str, bool]  # task → whether its main metric improves upwards


class TaskScorer:
    """Scores train.eval_tasks, train.eval_task_yamls and train.eval_task_dirs on the model each evaluation (every
    rank calls score())."""

    def __init__(self, train: TrainConfig, tokenizer_dir: Path, document_start: int | None, max_length: int,
                 batch_size: int, dist: Dist):
        """`document_start`: the token the run's documents follow, which lm-eval puts before a document scored
        from its start (None: lm-eval's choice, BOS or else EOS, as a base model's data has it)."""
        self.train, self.tokenizer_dir, self.document_start = train, tokenizer_dir, document_start
        self.max_length, self.batch_size, self.dist = max_length, batch_size, dist
        self.specs: list[str | dict] = [*train.eval_tasks, *(local_task(p) for p in train.eval_task_yamls),
                                        *(lm_eval_task(t) for ts in read_folders(train.eval_task_dirs).values()
                                          for t in ts)]
        # Loaded once before training, so an unknown task or an unreachable dataset refuses the run at its start.
        with _quiet():
            self.manager = load_tasks(self.specs, "train.eval_task_yamls=[your_task.yaml] (the demo task: "
                                                  "data/finetune/manpage_section/manpage_section.yaml, which "
                                                  "gptpipe make-demo-task writes)")
        self.reference: dict[str, dict[str, Any]] = {}
        self.lm: Any = None  # lm-eval's wrapper of the live model, built at the first evaluation

    def score(self, model: Any, step: int) -> Scores | None:
        """Every task on `model` (the engine's module, in eval mode), zero-shot, at most train.eval_tasks_limit
        documents each; the scores on rank 0, None elsewhere. The RNG states are put back afterwards, so
        scoring changes nothing the training draws (dropout, exact resume)."""
        import lm_eval

        states = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
                  torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
        started = time.perf_counter()
        try:
            with _quiet():
                if self.lm is None:
                    self.lm = _ranked_lm(model, self.tokenizer_dir, self.document_start, self.max_length,
                                         self.batch_size, self.dist)
                # no seeds: lm-eval would reseed the global generators (zero-shot samples nothing)
                raw = lm_eval.simple_evaluate(
                    model=self.lm, tasks=self.specs, num_fewshot=0, limit=self.train.eval_tasks_limit,
                    task_manager=self.manager, log_samples=False, random_seed=None, numpy_random_seed=None,
                    torch_random_seed=None, fewshot_random_seed=None)
        finally:
            random.setstate(states[0])
            np.random.set_state(states[1])
            torch.set_rng_state(states[2])
            if states[3] is not None:
                torch.cuda.set_rng_state_all(states[3])
        if raw is None:  # ranks other than 0
            return None
        seconds = time.perf_counter() - started
        summary = summarize(raw)
        main, better = {}, {}
        for task in summary:
            metrics = raw["configs"].get(task, {}).get("metric_list") or [{}]
            name = metrics[0].get("metric") or next(iter(summary[task]["metrics"]))
            main[task] = name
            better[task] = bool(raw.get("higher_is_better", {}).get(task, {}).get(name, True))
        row = EvalTasksRow(step, {task: {m: v["value"] for m, v in s["metrics"].items()}
                                  for task, s in summary.items()},
                           {task: s["samples"] for task, s in summary.items()}, seconds)
        return Scores(row, main, better)


def compare(scores: Scores, reference: dict[str, dict[str, Any]], tolerance: float,
            ranks: int) -> tuple[str, list[str]]:
    """(the console line of `scores`, a warning per task whose main metric is worse than its entry in `reference`
    by more than `tolerance`, in the direction lm-eval says is better). A task's first scores become its
    reference (`reference` is updated)."""
    parts, warnings = [], []
    for task, metric in scores.main.items():
        value = scores.row.scores[task][metric]
        ref = reference.get(task)
        if ref is None or ref["metric"] != metric:
            reference[task] = {"metric": metric, "value": value, "step": scores.row.step,
                               "higher_is_better": scores.higher_is_better[task]}
            parts.append(f"{task} {metric} {value:.4f} (reference)")
            continue
        change = value - ref["value"]
        parts.append(f"{task} {metric} {value:.4f} ({change:+.4f} vs step {ref['step']})")
        drop = -change if ref["higher_is_better"] else change
        if drop > tolerance:
            warnings.append(
                f"task {task} fell below its reference: {metric} {value:.4f} at step {scores.row.step}, "
                f"{ref['value']:.4f} at step {ref['step']} (worse by {drop:+.4f}, more than "
                f"train.eval_tasks_tolerance {tolerance:g})")
    documents = sorted(set(scores.row.documents.values()))
    line = (f"tasks  step {scores.row.step}  " + "  ".join(parts)
            + f"  ({'/'.join(map(str, documents))} documents per task, zero-shot, "
              f"{scores.row.seconds:.1f} s on {ranks} rank{'s' if ranks > 1 else ''})")
    return line, warnings


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """lm-eval without its per-call notices (e.g. that num_fewshot is set to 0), which would otherwise repeat at
    every evaluation: the run's own line says what was scored."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _ranked_lm(model: Any, tokenizer_dir: Path, document_start: int | None, max_length: int, batch_size: int,
               dist: Dist) -> Any:
    """lm-eval's HFLM around the live model, taking part in lm-eval's data-parallel path over this run's process
    group (HFLM only does so for a model it loaded itself, through accelerate)."""
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    class RankedLM(HFLM):
        def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
            parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
            torch.distributed.all_gather(parts, tensor)
            return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

        def barrier(self) -> None:
            torch.distributed.barrier()

        # without their progress bars, which would interleave with the training bar at every evaluation
        def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list:
            return super().loglikelihood(requests, disable_tqdm=True)

        def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list:
            return super().loglikelihood_rolling(requests, disable_tqdm=True)

        def generate_until(self, requests: list, disable_tqdm: bool = False) -> list:
            return super().generate_until(requests, disable_tqdm=True)

        def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False,
                                  override_bs: int | None = None) -> list:  # loglikelihood_rolling's windows
            return super()._loglikelihood_tokens(requests, disable_tqdm=True, override_bs=override_bs)

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    lm = RankedLM(pretrained=model, tokenizer=tokenizer, max_length=max_length, batch_size=batch_size,
                  logits_cache=False, prefix_token_id=document_start)
    lm._rank, lm._world_size = dist.rank, dist.world_size
    return lm
