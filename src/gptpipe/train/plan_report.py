"""The plan as the table `gptpipe plan` and `gptpipe train` print before training, and `gptpipe plan` itself."""

from __future__ import annotations

import argparse

from gptpipe.train.config import TrainingRun
from gptpipe.log import get_logger
from gptpipe.artifacts import EXIT_BAD_INPUT
from gptpipe.storage import is_url
from gptpipe.train.data import DataError, mixture
from gptpipe.runtime.fp8 import describe, largest_converted
from gptpipe.runtime.memory import GIB, fp8_cast_bytes
from gptpipe.train.plan import (ASSUMED_MFU, Plan, PlanError, check_parameter_count, continued_suggestions,
                                make_plan)


log = get_logger("plan")


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h" if seconds < 48 * 3600 else f"{seconds / 86400:.1f} days"


def format_plan(plan: Plan, config: TrainingRun) -> str:
    """The plan as the table printed before training."""
    s, train = plan.shape, config.train
    g = lambda b: f"{b / GIB:.2f} GiB"
    m, c = plan.memory, plan.memory_checkpointed
    base = config.model.init_from
    schedule = plan.schedule
    start = f"{schedule.start_lr:g} ({schedule.start_origin})" if schedule.start_origin else "0"
    planned_mixture = ""
    if plan.weights:  # the weights' shares of the run; training prints those megatron's blend index gives
        run_samples = plan.steps * train.global_batch_size
        planned_mixture = "; ".join(share.line() for share in mixture(
            [run_samples * w / sum(plan.weights) for w in plan.weights], plan.stats, train.seq_len)) + (
            f" (data.weights {'as given' if config.data.weights else 'from the token counts'}, normalised)")
    rows = [
        ("model", f"{s.arch} {f'from {base}' if base else config.model.preset}: {s.num_layers} layers, hidden "
                  f"{s.hidden_size}, {s.num_attn_heads} heads ({s.num_kv_heads} KV), head_dim {s.head_dim}, FFN "
                  f"{s.ffn_hidden_size}" + (f", {s.num_experts} experts top-{s.experts_top_k}" if s.num_experts > 1
                                            else "")
                  + (", tied embeddings" if s.tie_word_embeddings else "")),
        ("parameters", f"{plan.parameters:,} (vocab {s.vocab_size:,} "
                       + ("as the base model has it, or as its extended tokenizer needs, padded to a multiple of "
                          "128; counted on the meta device)" if base else
                          "padded to a multiple of 128)")),
        ("FLOPs per token", f"{plan.flops_per_token:.3g} (6·N + 12·L·h·s, training)"),
        ("data", ", ".join(f"{st.prefix.name}: {st.documents:,} docs, {st.tokens:,} tokens" for st in plan.stats)),
        ("split", f"{config.data.split}: train/valid/test documents "
                  f"{'/'.join(str(sum(st.split_documents[i] for st in plan.stats)) for i in range(3))}"),
        *([("mixture", planned_mixture)] if planned_mixture else []),
        ("batch", f"global {train.global_batch_size} = micro {plan.settings.micro_batch} × accumulation "
                  f"{plan.accumulation} × {plan.dp} data-parallel ranks; {plan.tokens_per_step:,} tokens/step"),
        ("run", f"{plan.steps:,} steps, {plan.train_tokens:,} tokens, from {plan.run_length}"
                + (f"; capped by train.train_iters={train.train_iters}" if train.train_iters else "")),
        ("lr", (f"{plan.schedule.kind}: warmup {plan.schedule.warmup_steps} steps from {start} to {train.lr:g}, "
                f"{train.min_lr:g} at step {plan.steps}" if plan.schedule.kind != "constant"
                else f"constant {train.lr:g} after a warmup of {plan.schedule.warmup_steps} steps from {start}")
         + (f" (warmup from train.warmup_steps={train.warmup_steps}" if train.warmup_steps is not None else
            f" (warmup from train.warmup_fraction={train.warmup_fraction:g}")
         + ("; unset lr/min_lr/warmup default to continued pretraining's re-warm from model.init_from)" if base
            else ")")),
        *[("suggestion", line) for line in continued_suggestions(plan, config)],
        ("engine", f"{train.precision}{' (a bf16 engine)' if plan.fp8 else ''}, "
                   f"{plan.settings.describe(plan.dp, train.global_batch_size)}"),
        *([("fp8", describe(plan.fp8, train.fp8_recipe) + "; weights, gradients, optimizer and checkpoints "
                   "as in bf16; MFU counts against the dense bf16 peak")] if plan.fp8 else []),
        (f"memory/{'GPU' if plan.on_gpu else 'process'}",
         f"weights {g(m.weights)}, gradients {g(m.gradients)}, optimizer {g(m.optimizer)}, logits {g(m.logits)}"),
        ("activations", f"{g(m.activations)} without checkpointing, {g(c.activations)} with"
                        + (f" (each with {g(fp8_cast_bytes(plan.settings.micro_batch * train.seq_len, *largest))} "
                           f"of FP8 casts of the largest converted linear, estimated)"
                           if (largest := plan.fp8 and largest_converted(plan.fp8)) else "")),
        ("loss", f"{'fused' if plan.loss.fused else 'unfused'}: {plan.loss.why}"),
        ("total", f"~{g(plan.planned_memory.total)} on {plan.device_name}: {plan.budget.describe()}"),
        ("host RAM", f"dataset index {g(plan.index_ram)} (built once per node by a process holding up to "
                     f"{g(plan.index_build_ram)}, cached, memory-mapped by its ranks) and "
                     f"{g(plan.rank_index_ram)} of split indices in each rank; ~{g(plan.host_ram_needed)} needed of "
                     f"{g(plan.host_ram)} available ({plan.ranks_per_node} ranks on this node)"),
        ("disk", f"~{g(plan.checkpoint_bytes)} per checkpoint, keeping {train.keep_checkpoints}"),
    ]
    speed = plan.expected_tokens_per_s
    # A speed measured in the run folder counts only for the same setup (model shape, precision, seq_len, device)
    elsewhere = (f"the speeds in {train.output_model_dir / 'metrics.jsonl'} were measured for "
                 f"{plan.measured_elsewhere}, not this setup ({plan.setup})" if plan.measured_elsewhere else "")
    if speed:
        source = (f"measured: median of the last log steps in {train.output_model_dir / 'metrics.jsonl'}"
                  if plan.measured_tokens_per_s else
                  f"estimated: assumed {ASSUMED_MFU:.0%} MFU of {plan.peak_flops / 1e12:.0f} TFLOP/s per GPU; "
                  + (elsewhere or "no measured figure yet"))
        rows.append(("expected speed", f"~{speed:,.0f} tokens/s ({source}); the whole run "
                                       f"≈ {_duration(plan.train_tokens / speed)}"))
    elif elsewhere:
        rows.append(("expected speed", f"unknown: no estimate on CPU, and {elsewhere}"))
    if is_url(train.output_model_dir):
        from gptpipe.runtime.mirror import describe_run_folder

        line, warning = describe_run_folder(str(train.output_model_dir), train.local_dir, plan.checkpoint_bytes,
                                            train.save_interval, plan.tokens_per_step / speed if speed else None)
        rows.append(("run folder", line))
        if warning:
            rows.append(("warning", warning))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def run(config: TrainingRun, args: argparse.Namespace) -> int:
    """`gptpipe plan`: print the plan; exit 2 when the run would not fit."""
    from gptpipe.train.continued import stage3_model

    tokenizer, hf_config, base = stage3_model(config)
    try:
        plan = make_plan(config, tokenizer.vocab_size, dp=args.gpus, device_memory_gib=args.gpu_memory,
                         device_name=args.gpu_name, gpus_per_node=args.gpus_per_node,
                         base_config=base.config if base else None, model_config=hf_config)
    except (PlanError, DataError) as exc:
        log.error(f"refused: {exc}")
        return EXIT_BAD_INPUT
    check_parameter_count(plan, hf_config)
    log.info(f"stage 3 with {args.config}:\n{format_plan(plan, config)}")
    return 0
