"""`gptpipe evaluate`: zero/few-shot evaluation of an exported HF folder with lm-evaluation-harness.

Tasks are lm-eval registry names (their datasets come from the HuggingFace hub, so they need the network),
local task YAMLs, folders of llm-jp-eval's JSON task files (gptpipe.llmjp_eval), ``manpage_section``: the demo
task `gptpipe make-demo-task` wrote, which runs offline, or a suite (``suite: ja``, gptpipe.eval_suite): registry
tasks at their own shot counts, whose datasets `gptpipe evaluate --fetch` saved locally once. With no registry
name among the tasks and every task's data local, the run sets the HF offline modes: nothing reaches the hub.
Results (every metric ± its standard error, and for multiple-choice tasks the majority-class baseline beside
them) go to ``<model folder>/evaluation/``: results.json, results.md, manifest.json last. Generation tasks run
through vLLM where it runs (``generation``, gptpipe.eval_generation); results.json and the manifest say which ran.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from gptpipe.config.core import option
from gptpipe.finetune.demo_task import TASK_NAME, DemoTaskConfig
from gptpipe import eval_suite, llmjp_eval
from gptpipe.lm_tasks import built_objects, flatten, hub_offline, local_task, needs_hub, summarize
from gptpipe.log import get_logger
from gptpipe.stage import StageFailed, StageInputError, StageResult, atomic_path, tree_fingerprint
from gptpipe.artifacts import CONVERT, DEMO_TASK, EVALUATE, EVALUATION_FOLDER

STAGE = EVALUATE.name
log = get_logger(STAGE)


@dataclass
class EvaluateConfig:
    """`gptpipe evaluate` and `gptpipe make-demo-task` (its demo_task section): evaluate_config.yaml."""

    model_dir: Path = option(
        Path("models/hf/demo"), "HuggingFace folder to evaluate (stage 4's output_tokenizer_and_model_dir, or any)")
    tasks: list[str] = option(
        factory=lambda: [TASK_NAME],
        doc=f"lm-eval task or group names (hub datasets: need the network); {TASK_NAME}: the demo task")
    task_yamls: list[Path] = option(
        factory=list, doc="local lm-eval task YAMLs; relative data_files in them are relative to the YAML")
    task_dirs: list[Path] = option(
        factory=list, doc="folders of llm-jp-eval task files (its evaluation/test: one <task>.json per task), each "
                          "file a task llmjp_<task>, prompted, extracted and scored as llm-jp-eval does; few-shot "
                          "examples from ../train/<task>.json")
    suite: str | None = option(
        None, "a suite of registry tasks run offline from suite_data_dir, each at its own shot count (not "
              "num_fewshot): ja (lm-eval's japanese_leaderboard; the ja-eval extra). Fetch its data once with "
              "`gptpipe evaluate --fetch`")
    suite_tasks: list[str] = option(factory=list, doc="only these of the suite's tasks (empty: all)")
    suite_data_dir: Path = option(
        Path("data/eval_datasets"), "the suite's hub datasets as `gptpipe evaluate --fetch` saved them: "
                                    "<dataset_path>/<dataset_name or default>/<split>.parquet and dataset.json")
    num_fewshot: int = option(0, "examples from the task's few-shot split put before each question (llm-jp-eval "
                                 "tasks: unless the file's num_few_shots says; llm-jp-eval's own default is 4; "
                                 "a suite's tasks: their own)")
    max_gen_toks: int | None = option(
        None, "new tokens at most for the generation tasks that set no limit of their own (the ja suite's: lm-eval "
              "then allows 256, more than a short-context model holds); None: lm-eval's default")
    batch_size: int = option(8, "documents per forward pass")
    generation: Literal["auto", "transformers", "vllm"] = option(
        "auto", "who generates for the generation tasks (log-likelihoods are always transformers'): vllm (greedy, "
                "each request's own limit and stop strings, the same texts as transformers' where the greedy ids "
                "agree; in-process where vllm imports here, else scripts/setup_vllm.sh's venv), transformers, or "
                "auto: vllm where it runs and the model has 10M parameters or more (a smaller one generates faster "
                "than vLLM starts), else transformers (the log says which and why)")
    limit: int | None = option(None, "evaluate only the first N documents of each task (None: all)")
    device: str = option("auto", "cpu, cuda, cuda:1, ... (auto: cuda when available)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
        "auto", "weights' dtype while evaluating (auto: float32 on CPU, where bf16 is slow; as saved on GPU)")
    seed: int = option(1234, "seed of the few-shot example sampling")
    output_dir: Path | None = option(None, "where the results go (None: <model_dir>/evaluation)")
    demo_task: DemoTaskConfig = option(factory=DemoTaskConfig, doc="gptpipe make-demo-task")

    def check(self) -> list[tuple[str, str]]:
        problems = []
        if not self.tasks and not self.task_yamls and not self.task_dirs and not self.suite:
            problems.append(("tasks", "give at least one task name, task YAML, task folder (task_dirs) or suite"))
        if self.suite is not None and self.suite not in eval_suite.SUITES:
            problems.append(("suite", f"unknown suite {self.suite!r} (known: {', '.join(eval_suite.SUITES)})"))
        if self.suite_tasks and not self.suite:
            problems.append(("suite_tasks", "set suite too"))
        if self.num_fewshot < 0:
            problems.append(("num_fewshot", "must be >= 0"))
        if self.max_gen_toks is not None and self.max_gen_toks < 1:
            problems.append(("max_gen_toks", "must be >= 1 or null"))
        if self.batch_size < 1:
            problems.append(("batch_size", "must be >= 1"))
        if self.limit is not None and self.limit < 1:
            problems.append(("limit", "must be >= 1 or null"))
        return problems


def model_folder(config: EvaluateConfig) -> Path:
    """model_dir; it must hold a HF model."""
    folder = config.model_dir
    if not (folder / "config.json").is_file():
        raise StageInputError(f"{folder} holds no HuggingFace model (config.json missing). Export one first: "
                              "gptpipe convert, or set model_dir")
    return folder


def fetch_hint(config: EvaluateConfig) -> str:
    """The command that fetches the suite's data (the config file is not known here: the default one)."""
    return f"gptpipe evaluate --fetch suite={config.suite} suite_data_dir={config.suite_data_dir}"


def task_specs(config: EvaluateConfig) -> tuple[list[str | dict], dict[str, Any], set[str]]:
    """(what lm-eval is given, the inputs' fingerprints for the manifest, the tasks that keep their own shot
    count: a suite's, which come first)."""
    specs: list[str | dict] = []
    inputs: dict[str, Any] = {}
    own_shots: set[str] = set()
    if config.suite:
        suite_specs, inputs = eval_suite.offline_tasks(config.suite, config.suite_data_dir, config.suite_tasks,
                                                       fetch_hint(config))
        specs += suite_specs
        own_shots = {spec["task"] for spec in suite_specs}
    yamls = list(config.task_yamls)
    for name in config.tasks:
        if name == TASK_NAME:
            folder = config.demo_task.output_dir
            DEMO_TASK.require(folder)
            inputs[TASK_NAME] = DEMO_TASK.fingerprint(folder)
            yamls.append(folder / f"{TASK_NAME}.yaml")
        else:
            specs.append(name)
    for path in yamls:
        task = local_task(path)
        files = task.get("dataset_kwargs", {}).get("data_files")
        local = [Path(f) for f in flatten(files) if Path(f).is_file()]
        inputs.setdefault(str(path), tree_fingerprint([path, *local]))
        specs.append(task)
    for folder, tasks in llmjp_eval.read_folders(config.task_dirs, config.num_fewshot).items():
        inputs[str(folder)] = llmjp_eval.fingerprint(tasks)
        specs += [llmjp_eval.lm_eval_task(t) for t in tasks]
    return specs, inputs, own_shots


def majority_baselines(raw: dict[str, Any]) -> dict[str, float]:
    """Per multiple-choice task: the accuracy of always answering its most frequent gold label."""
    baselines = {}
    for task, rows in raw.get("samples", {}).items():
        targets = [str(r["target"]) for r in rows]
        if targets and raw["configs"].get(task, {}).get("output_type") == "multiple_choice":
            baselines[task] = Counter(targets).most_common(1)[0][1] / len(targets)
    return baselines


def results_markdown(results: dict[str, Any]) -> str:
    """The table of results.json, for the terminal, results.md and the model card."""
    lines = ["| task | shots | metric | value | ± stderr | majority baseline | documents |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for task, row in results["tasks"].items():
        baseline = row.get("majority_baseline")
        for metric, m in row["metrics"].items():
            stderr = f"{m['stderr']:.4f}" if m["stderr"] is not None else "—"
            base = f"{baseline:.4f}" if baseline is not None and metric.startswith("acc") else ""
            lines.append(f"| {task} | {row['n_shot']} | {metric} | {m['value']:.4f} | {stderr} | {base} | "
                         f"{row['samples'] or ''} |")
    return "\n".join(lines) + "\n"


def _device_and_dtype(config: EvaluateConfig) -> tuple[str, str]:
    import torch

    device = config.device if config.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    dtype = config.dtype if config.dtype != "auto" or device != "cpu" else "float32"
    return device, dtype


def _hf_lm(folder: Path, dtype: str, batch_size: int, device: str) -> Any:
    """lm-eval's HF model on the folder, generating plainly greedily (export/agreement.py's `plain`). An export's
    generation_config.json carries settings for people sampling from it: max_new_tokens, which transformers puts
    before the max_length lm-eval asks for (a generation task's own limit, its max_gen_toks or an llm-jp-eval
    file's output_length, would be ignored), and a repetition penalty, which would make lm-eval's greedy decoding
    other than the model's argmax and other than vLLM's (gptpipe.eval_generation)."""
    from lm_eval.models.huggingface import HFLM

    from gptpipe.export.agreement import plain

    lm = HFLM(pretrained=str(folder), dtype=dtype, batch_size=batch_size, device=device)
    plain(lm.model)
    return lm


def run_lm_eval(config: EvaluateConfig, force: bool = False) -> dict[str, Any]:
    """Run the tasks on the model unless results for the same model, tasks and settings exist."""
    folder = model_folder(config)
    out = config.output_dir or folder / EVALUATION_FOLDER
    specs, inputs, own_shots = task_specs(config)
    inputs["model"] = (CONVERT.fingerprint(folder) if CONVERT.has_manifest(folder)
                       else tree_fingerprint([p for p in folder.iterdir() if p.is_file()]))
    settings = {k: getattr(config, k) for k in ("tasks", "task_yamls", "task_dirs", "suite", "suite_tasks",
                                                 "num_fewshot", "max_gen_toks", "batch_size", "generation", "limit",
                                                 "device", "dtype", "seed")}

    def work() -> StageResult:
        import time

        import lm_eval

        from gptpipe import eval_generation

        # every dataset local (the suite's, the demo task's, ...): the hub is not asked, even for a file's freshness
        offline = contextlib.nullcontext() if any(map(needs_hub, specs)) else hub_offline()
        with offline:
            manager, built, tasks = built_objects(
                specs, f"tasks=[{TASK_NAME}], task_yamls=[your_task.yaml], task_dirs=[llm-jp-eval/evaluation/test] "
                       f"or suite: {', '.join(eval_suite.SUITES)}")
            for name, task in tasks.items():
                # num_fewshot for every task but a suite's, and (lm-eval's rule) one whose config says 0
                if name not in own_shots and task.get_config("num_fewshot") != 0:
                    task.set_config(key="num_fewshot", value=config.num_fewshot)
                generation = task.get_config("generation_kwargs")
                if config.max_gen_toks and generation is not None and "max_gen_toks" not in generation:
                    task.set_config(key="generation_kwargs", value={"max_gen_toks": config.max_gen_toks}, update=True)
            device, dtype = _device_and_dtype(config)
            started = time.time()
            hf = _hf_lm(folder, dtype, config.batch_size, device)
            generator = eval_generation.choose(config.generation, folder, hf.model.num_parameters())
            eval_generation.log_choice(generator)
            model = eval_generation.GeneratingLM(hf, generator, folder, dtype)
            raw = lm_eval.simple_evaluate(
                model=model,
                tasks=built, num_fewshot=None, limit=config.limit, task_manager=manager, log_samples=True,
                random_seed=config.seed, numpy_random_seed=config.seed, torch_random_seed=config.seed,
                fewshot_random_seed=config.seed)
        if raw is None:
            raise StageFailed("lm-eval returned no results")
        tasks = summarize(raw)
        for task, baseline in majority_baselines(raw).items():
            tasks[task]["majority_baseline"] = baseline
        results = {"model": str(folder), "device": device, "dtype": dtype, "num_fewshot": config.num_fewshot,
                   "limit": config.limit, "generation": generator.record(), "tasks": tasks,
                   "versions": raw.get("versions", {}), "configs": raw.get("configs", {})}
        written = []
        for name, text in (("results.json", json.dumps(results, ensure_ascii=False, indent=2, default=str) + "\n"),
                           ("results.md", results_markdown(results))):
            with atomic_path(out / name) as tmp:
                tmp.write_text(text, encoding="utf-8")
            written.append(out / name)
        counts: dict[str, Any] = {t: {m: v["value"] for m, v in r["metrics"].items()} for t, r in tasks.items()}
        return StageResult(written, counts={**counts, "generator": generator.name},
                           timings={"evaluate_s": round(time.time() - started, 3),
                                    "generate_s": round(generator.generate_s, 3)})

    EVALUATE.run(out, settings, inputs, work, force=force,
                 versions=("lm_eval", "transformers", "torch", "datasets"))
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    log.info(f"{folder} → {out}\n{results_markdown(results)}")
    return results


def run(config: EvaluateConfig, args) -> int:
    """`gptpipe evaluate`."""
    if getattr(args, "fetch", False):
        if not config.suite:
            raise StageInputError("--fetch needs a suite: suite=ja (the tasks' datasets it saves)")
        for folder, manifest in eval_suite.fetch(config.suite, config.suite_data_dir, config.suite_tasks,
                                                 force=args.force).items():
            log.info(f"{folder}: {manifest['dataset_path']} {manifest['dataset_name'] or ''} revision "
                     f"{manifest['revision']}: " + ", ".join(f"{s} {n} rows" for s, n in manifest["splits"].items()))
        return 0
    run_lm_eval(config, force=args.force)
    return 0
