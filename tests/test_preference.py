"""Stage 7's preference tuning (task.kind preference, DPO against the starting model) on a preference set built
from the installed Japanese man pages: for "`cmd` は何をしますか?" its NAME description is preferred over the page's
section line (an answer to another question), and after the two-turn conversation up to "マニュアルの何章ですか?"
the right section over a wrong one. Reading and counting bad rows, pair ids through the chat template, the loss,
rewards and gradients equal TRL's DPO on the same batch, reference log-probs stored and reused, a fine-tune that
raises the held-out reward accuracy and resumes exactly after SIGKILL, predict and `gptpipe chat` on the run, and
its verified export (stage 4).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import FINETUNE_QUICK, gptpipe_command, manpage_chats, metrics, write_jsonl
from gptpipe.data.jsonl import (EMPTY, IDENTICAL_ANSWERS, INVALID_JSON, MISSING_KEY, NO_CHOSEN, NOT_A_MESSAGE_LIST,
                                TEMPLATE_ERROR, TOO_LONG, UNKNOWN_ROLE, Reasons)
from gptpipe.finetune.chat_data import GPTPIPE_TEMPLATE, ChatEncoder, Conversation, install_template
from gptpipe.runtime.batching import IGNORE
from gptpipe.finetune.demo_task import manpage_pairs
from gptpipe.finetune.kinds.preference import (FIGURES, REFERENCE_FILE, PreferenceEncoder, PreferenceKind, dpo,
                                         read_pairs)
from gptpipe.runtime.metrics_rows import TaskEvalRow, TrainRow


@pytest.fixture(scope="module")
def pair_rows() -> list[dict]:
    return manpage_pairs(manpage_chats(400))


@pytest.fixture(scope="module")
def pair_files(pair_rows: list[dict], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """train.jsonl (96 pairs) and validation.jsonl (32 pairs, of other man pages)."""
    folder = tmp_path_factory.mktemp("pairs")
    return write_jsonl(folder / "train.jsonl", pair_rows[:96]), write_jsonl(folder / "validation.jsonl",
                                                                           pair_rows[96:128])


@pytest.fixture(scope="module")
def pair_lm(pair_rows: list[dict], chat_lm_export) -> Path:
    """A stage-4 export whose tokenizer stage 1 trained on the pairs' texts (conftest's chat_lm_export, as
    chat_lm); no chat template (the run installs gptpipe's)."""
    return chat_lm_export("pair-lm", pair_rows)


# DPO alone (rpo_alpha 0): on the untuned tiny model the NLL term takes most of 24 steps' updates (held-out reward
# accuracy 0.75 with it, 1.0 without); the term is held to TRL's below and measured in docs/benchmarks.md.
PREFERENCE_RUN = ("task.kind=preference", "train.seq_len=160", "train.global_batch_size=8", "train.train_iters=24",
                  "train.eval_interval=8", "train.save_interval=8", "task.chat_eval_rows=8",
                  "chat.max_new_tokens=12", "predict.max_new_tokens=12", "train.lr=3e-3", "task.rpo_alpha=0")


def pair_args(model: Path, files: tuple[Path, Path], run: Path, *overrides: str) -> list[str]:
    train, validation = files
    return [f"model.path={model}", f"data.train={train}", f"data.validation={validation}", "data.test=null",
            f"train.output_model_dir={run}", *FINETUNE_QUICK, *PREFERENCE_RUN, *overrides]


def pair_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    install_template(tokenizer, "gptpipe")
    tokenizer.split_special_tokens = False
    return tokenizer


# --- reading -----------------------------------------------------------------------------------------------
def test_bad_preference_rows_are_counted_by_reason_and_the_rest_kept(tmp_path: Path) -> None:
    turns = [{"role": "user", "content": "`ls` は何をしますか?"}]
    path = write_jsonl(tmp_path / "pairs.jsonl", [
        {"prompt": "`ls` は何をしますか?", "chosen": "一覧表示", "rejected": "1章 (コマンド) です。"},
        {"prompt": turns, "chosen": [{"role": "assistant", "content": " 一覧表示 "}],
         "rejected": [{"role": "assistant", "content": "複写"}]},
        "{not json",
        {"prompt": "ls?", "rejected": "複写"},
        {"prompt": "ls?", "chosen": [], "rejected": "複写"},
        {"prompt": "ls?", "chosen": "一覧", "rejected": " 一覧"},
        {"prompt": "ls?", "chosen": "一覧"},
        {"chosen": "一覧", "rejected": "複写"},
        {"prompt": "ls?", "chosen": [{"role": "user", "content": "一覧"}], "rejected": "複写"},
        {"prompt": [{"role": "bot", "content": "ls?"}], "chosen": "一覧", "rejected": "複写"},
        {"prompt": "", "chosen": "一覧", "rejected": "複写"},
        {"prompt": [], "chosen": "一覧", "rejected": "複写"},
    ])
    skipped = Reasons()
    rows = read_pairs(path, skipped)
    answer = ({"role": "assistant", "content": "一覧表示"},)
    assert [(r.turns, r.chosen) for r in rows] == [(tuple(turns), answer)] * 2
    assert rows[0].rejected == ({"role": "assistant", "content": "1章 (コマンド) です。"},)
    assert rows[1].prompt == turns and rows[1].label == "一覧表示" and rows[1].where == f"{path}:2"
    assert dict(skipped.counts) == {INVALID_JSON: 1, NO_CHOSEN: 2, IDENTICAL_ANSWERS: 1, MISSING_KEY: 2,
                                    NOT_A_MESSAGE_LIST: 1, UNKNOWN_ROLE: 1, EMPTY: 2}
    assert skipped.examples[MISSING_KEY][0] == f"{path}:7: 'rejected'"
    assert skipped.examples[NOT_A_MESSAGE_LIST] == [f"{path}:9: chosen holds ['user']: an answer is assistant turns"]
    # Prediction input: the prompt alone is enough; its answers, when given, are read as in training.
    asked = read_pairs(path, Reasons(), need_answer=False)
    assert [r.where.rsplit(":", 1)[1] for r in asked] == ["1", "2", "4", "5", "6", "7"]
    assert asked[2].chosen is None and asked[2].label is None


# --- ids ---------------------------------------------------------------------------------------------------
def test_a_pair_is_the_prompt_then_each_answer_through_the_template_the_loss_on_the_answer_only(
        pair_lm: Path, pair_files: tuple[Path, Path]) -> None:
    """A string prompt is one user turn and a string answer one assistant turn: the ids are apply_chat_template's
    of the conversation, as a chat run encodes it, and only the final answer and its EOS are learnt (an earlier
    assistant turn of a message-list prompt is context)."""
    tokenizer = pair_tokenizer(pair_lm)
    encoder, chat = PreferenceEncoder(tokenizer, 512), ChatEncoder(tokenizer, 512)
    rows = read_pairs(pair_files[0], Reasons())
    assert {isinstance(json.loads(line)["prompt"], str) for line in pair_files[0].read_text().splitlines()} == \
        {True, False}
    for row in rows:
        pair = encoder.encode(row, Reasons())
        prompt = encoder.prompt_ids(row.prompt)
        for answer, encoded in ((row.chosen, pair.chosen), (row.rejected, pair.rejected)):
            messages = [*row.prompt, *answer]
            assert encoded.input_ids == tokenizer.apply_chat_template(messages, return_dict=False)
            assert encoded.input_ids[:len(prompt)] == prompt
            assert encoded.labels == [IGNORE] * len(prompt) + encoded.input_ids[len(prompt):]
            assert encoded.input_ids[len(prompt):] == tokenizer(answer[-1]["content"], add_special_tokens=False)[
                "input_ids"] + [tokenizer.eos_token_id]
            # the chat kind's encoding of the same conversation has the same ids
            assert chat.encode(Conversation(tuple(messages), row.where), Reasons()).input_ids == encoded.input_ids
            assert encoder.uncut_length(row) >= len(encoded.input_ids)
        assert encoder.uncut_length(row) == max(len(pair.chosen.input_ids), len(pair.rejected.input_ids))


def test_over_long_pairs_and_rows_the_template_raises_on_are_dropped_and_counted(pair_lm: Path,
                                                                               pair_files) -> None:
    tokenizer = pair_tokenizer(pair_lm)
    rows = read_pairs(pair_files[0], Reasons())
    lengths = [PreferenceEncoder(tokenizer, 512).uncut_length(row) for row in rows]
    limit = sorted(lengths)[len(lengths) // 2]
    skipped = Reasons()
    kept = [p for row in rows if (p := PreferenceEncoder(tokenizer, limit).encode(row, skipped)) is not None]
    assert len(kept) == sum(n <= limit for n in lengths) and skipped.counts[TOO_LONG] == len(rows) - len(kept) > 0
    assert all(max(len(p.chosen.input_ids), len(p.rejected.input_ids)) <= limit for p in kept)
    tokenizer.chat_template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('the user speaks first') }}"
                               "{% endif %}" + GPTPIPE_TEMPLATE)
    skipped = Reasons()
    system = rows[0].__class__(({"role": "system", "content": "簡潔に"},) + rows[0].turns, rows[0].chosen,
                               rows[0].rejected, "f:3")
    assert PreferenceEncoder(tokenizer, 512).encode(system, skipped) is None
    assert dict(skipped.counts) == {TEMPLATE_ERROR: 1} and skipped.examples[TEMPLATE_ERROR] == [
        "f:3: the user speaks first"]


# --- the loss, against TRL ---------------------------------------------------------------------------------
def pairs_and_model(folder: Path, files: tuple[Path, Path], count: int = 6):
    """(rows, encoded pairs with the starting model's reference sums, the tokenizer, the starting model)."""
    from dataclasses import replace

    import torch
    from transformers import AutoModelForCausalLM

    from gptpipe.finetune.kinds.preference import pair_logprobs
    from gptpipe.runtime.engine import Dist

    tokenizer = pair_tokenizer(folder)
    rows = read_pairs(files[0], Reasons())[:count]
    encoder = PreferenceEncoder(tokenizer, 512)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    pairs = [encoder.encode(row, Reasons()) for row in rows]
    cpu = torch.device("cpu")
    sums = pair_logprobs(model, pairs, tokenizer.pad_token_id, cpu, 4, Dist(0, 1, 0, cpu))
    return rows, [replace(p, reference=s) for p, s in zip(pairs, sums)], tokenizer, model


def test_loss_rewards_and_gradients_equal_trls_dpo_on_the_same_batch(pair_lm: Path, pair_files,
                                                                    tmp_path: Path) -> None:
    """TRL's DPOTrainer (test-only dependency, pinned in constraints.txt), given the same rows as messages,
    tokenizes them to our ids and precomputes the same reference log-probs (its own fused LM head); on a policy
    moved off the start, its loss, rewards, reward accuracy and margin, log-probs and every parameter's gradient
    equal ours (ours: the run's micro-batch, task kind collate and loss)."""
    import copy

    import torch
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from gptpipe.finetune.config import TaskConfig

    rows, pairs, tokenizer, start = pairs_and_model(pair_lm, pair_files)
    torch.manual_seed(1)
    policy = copy.deepcopy(start)
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    kind, beta = PreferenceKind(), 0.2
    batch = kind.collate(pairs, tokenizer.pad_token_id, False, None, "cpu")
    loss, figures = kind.loss(policy, batch, False, TaskConfig(kind="preference", beta=beta, rpo_alpha=0.0))
    (loss / len(pairs)).backward()  # the run's scale: the mean over the global batch's pairs
    ours = dict(zip(FIGURES, (figures / len(pairs)).tolist()))

    # TRL's conversational rows: a string prompt is one user turn, a string answer one assistant turn.
    dataset = Dataset.from_list([{"prompt": r.prompt, "chosen": list(r.chosen), "rejected": list(r.rejected)}
                                 for r in rows])
    args = DPOConfig(output_dir=str(tmp_path / "trl"), beta=beta, bf16=False, use_cpu=True, report_to=[],
                     precompute_ref_log_probs=True, per_device_train_batch_size=len(rows), max_length=None)
    trainer = DPOTrainer(model=copy.deepcopy(start), args=args, train_dataset=dataset, processing_class=tokenizer)
    tokenized = [trainer.train_dataset[k] for k in range(len(rows))]
    for pair, theirs in zip(pairs, tokenized):
        cut = pair.chosen.labels.index(next(t for t in pair.chosen.labels if t != IGNORE))
        assert theirs["prompt_ids"] == pair.chosen.input_ids[:cut]
        assert theirs["prompt_ids"] + theirs["chosen_ids"] == pair.chosen.input_ids
        assert theirs["prompt_ids"] + theirs["rejected_ids"] == pair.rejected.input_ids
        assert (theirs["ref_chosen_logps"], theirs["ref_rejected_logps"]) == pytest.approx(pair.reference, rel=1e-6)
    trainer.model.load_state_dict(policy.state_dict())
    trainer.model.train()
    inputs = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id)(tokenized)
    their_loss = trainer._compute_loss(trainer.model, inputs, False)
    their_loss.backward()
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    assert their_loss.item() == pytest.approx(loss.item() / len(pairs), rel=1e-6)
    for key, name in (("reward_chosen", "rewards/chosen"), ("reward_rejected", "rewards/rejected"),
                      ("reward_accuracy", "rewards/accuracies"), ("reward_margin", "rewards/margins"),
                      ("logp_chosen", "logps/chosen"), ("logp_rejected", "logps/rejected")):
        # within float32 rounding of log-prob sums near -100 (1e-5 nats; ours sums the pairs interleaved)
        assert ours[key] == pytest.approx(logged[name], rel=1e-6, abs=1e-5 * (1 if "logp" in key else beta)), key
    theirs = dict(trainer.model.named_parameters())
    for name, parameter in policy.named_parameters():
        torch.testing.assert_close(parameter.grad, theirs[name].grad, rtol=1e-4, atol=1e-6 * parameter.grad.abs().max())

    # Label smoothing (conservative DPO) left TRL's sigmoid loss; for one pair it is TRL's "aot" loss (which
    # sorts the batch's log-ratios: one pair stays as it is).
    trainer.loss_types, trainer.label_smoothing = ["aot"], 0.3
    with torch.no_grad():
        policy_sums = torch.stack([kind.loss(policy, kind.collate([p], tokenizer.pad_token_id, False, None, "cpu"),
                                             False, TaskConfig(kind="preference", beta=beta, label_smoothing=0.3,
                                                               rpo_alpha=0.0))[0]
                                   for p in pairs])
        single = [DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id)([t]) for t in tokenized]
        aot = torch.stack([trainer._compute_loss(trainer.model, one, False) for one in single])
    torch.testing.assert_close(policy_sums, aot, rtol=1e-5, atol=1e-6)

    # RPO (task.rpo_alpha): the chosen answer's NLL per token added to DPO's, TRL's sigmoid and sft losses with
    # loss_weights [1, alpha]; for one pair TRL's token mean over the batch's chosen tokens is the pair's own.
    trainer.loss_types, trainer.loss_weights, trainer.label_smoothing = ["sigmoid", "sft"], [1.0, 0.5], 0.0
    with torch.no_grad():
        rpo = torch.stack([kind.loss(policy, kind.collate([p], tokenizer.pad_token_id, False, None, "cpu"), False,
                                     TaskConfig(kind="preference", beta=beta, rpo_alpha=0.5))[0] for p in pairs])
        theirs_rpo = torch.stack([trainer._compute_loss(trainer.model, one, False) for one in single])
    torch.testing.assert_close(rpo, theirs_rpo, rtol=1e-5, atol=1e-6)


def test_a_validation_whose_chosen_answers_fell_warns() -> None:
    """The chosen answers' mean log-ratio to the start below -log 2 nats (reward_chosen / beta) is a warning that
    names what to change; above it, none."""
    from gptpipe.finetune.config import TaskConfig

    kind, task = PreferenceKind(), TaskConfig(kind="preference", beta=0.1, rpo_alpha=0.0)
    assert kind.warnings({"reward_chosen": -0.05}, task) == []
    [warning] = kind.warnings({"reward_chosen": -1.675}, task)
    assert "16.75 nats less likely" in warning and "task.rpo_alpha" in warning


def test_the_dpo_loss_starts_at_log_2_and_label_smoothing_mixes_in_the_swapped_pair() -> None:
    import math

    import torch

    policy = torch.tensor([[-10.0, -12.0], [-5.0, -4.0]])
    losses, figures = dpo(policy, policy.clone(), beta=0.1)
    assert losses.tolist() == pytest.approx([math.log(2)] * 2)
    assert figures[:, 2].tolist() == [0.0, 0.0]  # equal rewards: not counted as the chosen one's win
    reference = torch.tensor([[-11.0, -11.0], [-5.0, -5.0]])
    plain, figures = dpo(policy, reference, beta=0.5)
    swapped, _ = dpo(policy.flip(1), reference.flip(1), beta=0.5)
    smoothed, _ = dpo(policy, reference, beta=0.5, label_smoothing=0.2)
    assert smoothed.tolist() == pytest.approx((0.8 * plain + 0.2 * swapped).tolist())
    assert dict(zip(FIGURES, figures[0].tolist())) == pytest.approx({
        "reward_chosen": 0.5, "reward_rejected": -0.5, "reward_accuracy": 1.0, "reward_margin": 1.0,
        "logp_chosen": -10.0, "logp_rejected": -12.0})
    assert plain[0].item() == pytest.approx(-math.log(1 / (1 + math.exp(-1.0))))


def test_packed_pairs_score_as_padded_ones(pair_lm: Path, pair_files) -> None:
    """train.packing puts a micro-batch's sequences one after another: each one's log-prob sum is the padded
    batch's, so the loss and the figures are too."""
    from dataclasses import replace

    import torch

    from gptpipe.finetune.config import TaskConfig
    from gptpipe.finetune.kinds.preference import sequence_logprobs

    _, pairs, tokenizer, model = pairs_and_model(pair_lm, pair_files)
    # References one nat off the starting model's sums, either way: rewards of ±β, not 0 up to float noise, whose
    # sign (the reward accuracy) the packed and the padded batch would decide at random.
    pairs = [replace(p, reference=(p.reference[0] + (-1) ** i, p.reference[1])) for i, p in enumerate(pairs)]
    kind, pad = PreferenceKind(), tokenizer.pad_token_id
    padded, packed = (kind.collate(pairs, pad, False, capacity, "cpu") for capacity in (None, 320))
    assert packed["input_ids"].shape[0] < padded["input_ids"].shape[0]
    with torch.no_grad():
        torch.testing.assert_close(sequence_logprobs(model, packed), sequence_logprobs(model, padded))
        task = TaskConfig(kind="preference")
        torch.testing.assert_close(kind.loss(model, packed, False, task), kind.loss(model, padded, False, task))


# --- settings ----------------------------------------------------------------------------------------------
def test_beta_rpo_alpha_and_label_smoothing_are_checked_and_the_best_metric_is_the_answers() -> None:
    from conftest import REPO
    from gptpipe.config.core import ConfigError, load_config
    from gptpipe.finetune.config import FinetuneConfig

    shipped = REPO / "finetune_config.yaml"
    config = load_config(FinetuneConfig, shipped, ["task.kind=preference"])
    kind = PreferenceKind()
    assert (kind.best_metric(config.train.best_metric), config.task.beta, config.task.rpo_alpha,
            config.task.label_smoothing) == ("greedy_chosen", 0.1, 1.0, 0.0)
    chosen = load_config(FinetuneConfig, shipped, ["task.kind=preference", "train.best_metric=reward_accuracy"])
    assert kind.best_metric(chosen.train.best_metric) == "reward_accuracy"
    with pytest.raises(ConfigError, match="task.beta: must be > 0"):
        load_config(FinetuneConfig, shipped, ["task.kind=preference", "task.beta=0"])
    with pytest.raises(ConfigError, match="task.rpo_alpha: must be >= 0"):
        load_config(FinetuneConfig, shipped, ["task.kind=preference", "task.rpo_alpha=-1"])
    with pytest.raises(ConfigError, match=r"task.label_smoothing: must be in \[0, 0.5\)"):
        load_config(FinetuneConfig, shipped, ["task.kind=preference", "task.label_smoothing=0.5"])
    with pytest.raises(ConfigError, match="must be one of reward_accuracy, reward_margin, greedy_chosen, val_loss"):
        load_config(FinetuneConfig, shipped, ["task.kind=preference", "train.best_metric=chrf"])


# --- fine-tuning, resume, predict, chat, export ----------------------------------------------------------------
@pytest.fixture(scope="module")
def pair_run(pair_lm: Path, pair_files: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[Path, str]:
    """The 24-step preference fine-tune of `pair_lm` (its run folder) and its log."""
    run = tmp_path_factory.mktemp("pair-run") / "whole"
    done = gptpipe_command("finetune", *pair_args(pair_lm, pair_files, run))
    assert done.returncode == 0, done.stderr[-3000:]
    return run, done.stderr


def train_figures(run: Path) -> dict[int, dict]:
    """Each step's train row as metrics.jsonl holds it (the task kind's figures beside the loss), the last one
    written for a step (a resumed run appends)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    return {row["step"]: {k: row[k] for k in ("loss", *FIGURES)} for row in rows if row["kind"] == "train"}


@pytest.mark.slow
def test_dpo_raises_held_out_reward_accuracy_resumes_exactly_predicts_and_chats(
        pair_lm: Path, pair_files, pair_run: tuple[Path, str], tmp_path: Path) -> None:
    import math
    import signal
    import time

    import torch
    from transformers import AutoTokenizer

    from conftest import train_env
    from prewarmed import Forked
    from gptpipe.finetune.predict import resolve_checkpoint
    from gptpipe.runtime import checkpoint

    whole, log = pair_run
    assert "the shipped 'gptpipe' chat template" in log
    assert "computed for 96 training and 32 validation pairs" in log and "no reference model is kept" in log
    stored = json.loads((whole / REFERENCE_FILE).read_text(encoding="utf-8"))
    assert len(stored["train"]) == 96 and len(stored["validation"]) == 32
    assert stored["derived_from"]["files"]["model.safetensors"]["sha256"]
    # Step 1 starts from the reference: every pair's loss is log 2; then the figures are logged at every step.
    figures = train_figures(whole)
    assert figures[1]["loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert set(figures) == set(range(1, 25))
    # The starting model is evaluated first (the reference), then every 8 steps.
    evals = metrics(whole, TaskEvalRow)
    assert [r.step for r in evals] == [0, 8, 16, 24] and all(r.metrics["generated"] == 8 for r in evals)
    start, tuned = evals[0], evals[1:]
    assert start.val_loss == pytest.approx(math.log(2), abs=1e-4)
    assert start.metrics["reward_margin"] == pytest.approx(0, abs=1e-4)
    accuracy = [r.metrics["reward_accuracy"] for r in tuned]
    print("held-out reward accuracy by evaluation:", accuracy, "greedy nearer the chosen:",
          [r.metrics["greedy_chosen"] for r in evals])
    assert accuracy[-1] >= 0.9 and tuned[-1].metrics["reward_margin"] > 0
    assert tuned[-1].val_loss < math.log(2)
    best = max(tuned, key=lambda r: r.metrics["greedy_chosen"]).step  # the first of equals
    assert checkpoint.best_tag(whole / "checkpoints") == checkpoint.tag_of(best)

    # Killed (no handler runs) after step 10, then resumed from step 8 with the stored reference: the same
    # losses and figures as the whole run.
    killed = tmp_path / "killed"
    args = pair_args(pair_lm, pair_files, killed)
    process = Forked(["finetune", *args], train_env())
    deadline = time.time() + 300
    while not any(r.step == 10 for r in metrics(killed, TrainRow)):
        assert process.poll() is None and time.time() < deadline
        time.sleep(0.2)
    process.send_signal(signal.SIGKILL)
    process.wait()
    resumed = gptpipe_command("finetune", *args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "(reused)" in resumed.stderr and "resumed from" in resumed.stderr
    assert train_figures(killed) == figures
    # A reference derived from another start does not train on with checkpoints made against the first one.
    record = json.loads((killed / REFERENCE_FILE).read_text(encoding="utf-8"))
    record["derived_from"]["precision"] = "bf16"
    (killed / REFERENCE_FILE).write_text(json.dumps(record), encoding="utf-8")
    refused = gptpipe_command("finetune", *args)
    assert refused.returncode == 2 and "was derived from another start than this run's (precision bf16 -> fp32)" \
        in refused.stderr

    # predict on preference rows answers each prompt; the chosen answer is its label.
    out = tmp_path / "predictions.jsonl"
    predicted = gptpipe_command("predict", *pair_args(pair_lm, pair_files, whole), "--input", pair_files[1],
                                "--output", out)
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    results = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    validation = read_pairs(pair_files[1], Reasons())
    assert [r["messages"] for r in results] == [v.prompt for v in validation]
    assert [r["label"] for r in results] == [v.label for v in validation]

    # gptpipe chat talks to the run as to a chat run: greedy answers through the run's template.
    best = resolve_checkpoint(whole)
    model = checkpoint.model_from_checkpoint(checkpoint.find_checkpoint(best)).eval()
    tokenizer = AutoTokenizer.from_pretrained(whole / "tokenizer")
    question = validation[0].prompt[0]["content"]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        return_dict=False)
    with torch.no_grad():
        out_ids = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    talked = gptpipe_command("chat", *pair_args(pair_lm, pair_files, whole), stdin=f"{question}\n")
    assert talked.returncode == 0, talked.stderr[-3000:]
    assert talked.stdout == tokenizer.decode(out_ids[0, len(ids):], skip_special_tokens=True) + "\n"


@pytest.mark.slow
def test_a_preference_run_exports_verified_and_chats_as_the_run(pair_lm: Path, pair_files,
                                                                pair_run: tuple[Path, str], tmp_path: Path) -> None:
    """`gptpipe convert` on the preference run: the gate passes on its validation pairs (both sequences' logits
    and ids, greedy answers to their prompts), the template ships, the card shows the preference figures, and
    `gptpipe chat` on the export answers as on the run."""
    from conftest import manifest_counts

    run, _ = pair_run
    out = tmp_path / "pair-export"
    # fp32: this barely trained model's greedy answers have near-ties a bf16 export may flip (the gate allows them)
    done = gptpipe_command("convert", f"input_model_dir={run}", f"output_tokenizer_and_model_dir={out}", "dtype=fp32")
    assert done.returncode == 0, done.stderr[-3000:]
    counts = manifest_counts(out)
    assert counts["verified"] and counts["failures"] == [] and counts["task"] == "preference"
    assert counts["chat_template_identical"] is True
    validation = read_pairs(pair_files[1], Reasons())[:8]
    # each pair's two encodings by the folder's tokenizer and the run's, and the shipped SentencePiece model's
    assert counts["tokenizer_reference"] == "the fine-tune's tokenizer and SentencePiece"
    assert counts["tokenizer_texts"] > 2 * len(validation) and counts["tokenizer_mismatches"] == 0
    assert [s["messages"] for s in counts["greedy_samples"]] == [v.prompt for v in validation[:4]]
    assert (out / "chat_template.jinja").read_text(encoding="utf-8") == GPTPIPE_TEMPLATE
    assert json.loads((out / "task.json").read_text(encoding="utf-8"))["kind"] == "preference"
    card = (out / "README.md").read_text(encoding="utf-8")
    assert "| reward accuracy |" in card and "DPO loss per pair" in card
    stdin = f"{validation[0].prompt[0]['content']}\n"
    answers = [gptpipe_command("chat", *pair_args(pair_lm, pair_files, run), f"chat.model={model}", stdin=stdin)
               for model in (run, out)]
    assert all(a.returncode == 0 for a in answers), answers[1].stderr[-3000:]
    assert answers[1].stdout == answers[0].stdout and answers[0].stdout.count("\n") == 1
