"""Stage 7's chat tuning (task.kind chat) and `gptpipe chat`, on a small chat set built from the installed
Japanese man pages ("What does `ls` do?" → the page's NAME description; a follow-up about its section) and a
tiny Llama whose SentencePiece tokenizer is trained here on the same pages in seconds: reading and counting
bad rows, ids equal to apply_chat_template, assistant-only masks, templates refused, a fine-tune that
resumes exactly after SIGKILL, predict on messages rows, a scripted two-turn `gptpipe chat`, and the run's
verified export (stage 4) with its template, its stop token and its GGUF.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prewarmed import Forked
from conftest import (chat_args, gptpipe_command, manifest_counts, manpages_installed, metrics,
                      train_env,
                      write_jsonl)
from gptpipe.data.jsonl import (EMPTY, INVALID_JSON, MISSING_KEY, NO_ASSISTANT_TURN, NOT_A_MESSAGE_LIST,
                                NOT_A_STRING, TEMPLATE_ERROR, TOO_LONG, UNKNOWN_ROLE, Reasons)
from gptpipe.finetune.chat_data import (ALPACA_JA_TEMPLATE, GPTPIPE_TEMPLATE, ChatEncoder, Conversation,
                                        TemplateError, distinct_pad, install_template, read_conversations,
                                        save_tokenizer, special_tokens_as_tokens)
from gptpipe.runtime.batching import IGNORE
from gptpipe.runtime.metrics_rows import TaskEvalRow, TrainRow


@pytest.fixture(scope="module")
def chat_lm(manpage_chat_rows: list[dict], chat_lm_export) -> Path:
    """A stage-4 export: a small Llama and a 1,200-piece SentencePiece unigram tokenizer stage 1 trained (newline
    piece, byte fallback, pad distinct from EOS) on 700 chats' texts; no chat template."""
    return chat_lm_export("chat-lm", manpage_chat_rows)


def chat_tokenizer(folder: Path, template: str = "auto"):
    """The folder's tokenizer as a chat run prepares it: the template installed, and the special tokens it writes
    read as tokens (a stage-1 tokenizer splits them, as pretraining text needs)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    install_template(tokenizer, template)
    special_tokens_as_tokens(tokenizer)
    return tokenizer


# --- reading ---------------------------------------------------------------------------------------------
def test_bad_chat_rows_are_counted_by_reason_and_the_rest_kept(tmp_path: Path) -> None:
    good = {"messages": [{"role": "user", "content": "ls とは?"}, {"role": "assistant", "content": "一覧表示"}]}
    path = write_jsonl(tmp_path / "rows.jsonl", [
        good,
        {"instruction": "cp とは?", "input": "短く", "output": "コピー", "system": "簡潔に"},
        "{not json",
        {"messages": "ls"},
        {"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]},
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "  "}]},
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": 3}]},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}]},
        {"instruction": "no output"},
        {"text": "neither shape"},
    ])
    skipped = Reasons()
    rows = read_conversations(path, skipped)
    assert [r.messages for r in rows] == [tuple(good["messages"]), (
        {"role": "system", "content": "簡潔に"}, {"role": "user", "content": "cp とは?\n\n短く"},
        {"role": "assistant", "content": "コピー"})]
    assert dict(skipped.counts) == {INVALID_JSON: 1, NOT_A_MESSAGE_LIST: 1, UNKNOWN_ROLE: 1, EMPTY: 1,
                                    NOT_A_STRING: 1, NO_ASSISTANT_TURN: 2, MISSING_KEY: 1}
    assert skipped.examples[UNKNOWN_ROLE] == [f"{path}:5: turn 1: 'bot'"]
    # Prediction input may end without an answer: it is what the model is asked.
    unanswered = read_conversations(path, Reasons(), need_answer=False)
    assert [r.where for r in unanswered] == [f"{path}:{n}" for n in (1, 2, 8, 9)]
    assert unanswered[2].label is None and unanswered[2].prompt == list(unanswered[2].messages)


# --- ids and masks ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("template", ["gptpipe", "alpaca_ja"])
def test_ids_are_apply_chat_template_and_the_loss_is_on_assistant_turns_and_eos_only(
        chat_lm: Path, chat_files: tuple[Path, Path], template: str) -> None:
    tokenizer = chat_tokenizer(chat_lm, template)
    encoder = ChatEncoder(tokenizer, seq_len=512)
    rows = read_conversations(chat_files[0], Reasons())
    assert any(len(r.messages) >= 4 for r in rows) and any(r.messages[0]["role"] == "system" for r in rows)
    for row in rows:
        e = encoder.encode(row, Reasons())
        assert e.input_ids == tokenizer.apply_chat_template(list(row.messages), return_dict=False)
        # The learnt tokens, turn by turn, are each answer's own ids and the EOS after it; nothing else.
        trained = [t for t, label in zip(e.input_ids, e.labels) if label != IGNORE]
        answers = [m["content"] for m in row.messages if m["role"] == "assistant"]
        assert trained == [t for a in answers for t in tokenizer(a, add_special_tokens=False)["input_ids"]
                           + [tokenizer.eos_token_id]]
        assert [label for label in e.labels if label != IGNORE] == trained
        # transformers' own mask from the templates' {% generation %} markers agrees.
        out = tokenizer.apply_chat_template(list(row.messages), return_dict=True, return_assistant_tokens_mask=True)
        assert out["assistant_masks"] == [int(label != IGNORE) for label in e.labels]
    assert encoder.stop_ids == [tokenizer.eos_token_id]


def test_a_generation_prompt_continues_the_conversation_exactly(chat_lm: Path, chat_files) -> None:
    tokenizer = chat_tokenizer(chat_lm)
    encoder = ChatEncoder(tokenizer, seq_len=512)
    row = next(r for r in read_conversations(chat_files[0], Reasons()) if len(r.messages) == 4)
    prompt = encoder.prompt_ids(row.prompt)
    whole = encoder.encode(row, Reasons()).input_ids
    answer = tokenizer(row.label, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert whole == prompt + answer


def test_over_long_conversations_are_dropped_and_counted(chat_lm: Path, chat_files) -> None:
    encoder = ChatEncoder(chat_tokenizer(chat_lm), seq_len=40)
    skipped = Reasons()
    rows = read_conversations(chat_files[0], Reasons())
    kept = [e for r in rows if (e := encoder.encode(r, skipped)) is not None]
    assert kept and all(len(e.input_ids) <= 40 for e in kept)
    assert skipped.counts[TOO_LONG] == len(rows) - len(kept) > 0
    assert encoder.uncut_length(rows[0]) == len(ChatEncoder(chat_tokenizer(chat_lm), 512).encode(
        rows[0], Reasons()).input_ids)


def test_templates_that_cannot_mask_exactly_are_refused_naming_the_row(chat_lm: Path, tmp_path: Path) -> None:
    tokenizer = chat_tokenizer(chat_lm)
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    # A header ending in a piece's first character, the answer starting with the rest: one token crosses.
    piece = next(p for p in sorted(tokenizer.get_vocab(), key=len, reverse=True)
                 if len(p) >= 2 and all("\u3040" <= c <= "\u9fff" for c in p) and ids(p) != ids(p[0]) + ids(p[1:]))
    row = Conversation(({"role": "user", "content": "ls とは?"}, {"role": "assistant", "content": piece[1:]}),
                       "rows.jsonl:7")
    tokenizer.chat_template = GPTPIPE_TEMPLATE.replace("'アシスタント:\\n'", f"'アシスタント:{piece[0]}'")
    with pytest.raises(TemplateError, match=r"rows.jsonl:7: turn 1: .*crosses the turn's boundary"):
        ChatEncoder(tokenizer, 512).encode(row, Reasons())
    row = Conversation(({"role": "user", "content": "ls とは?"}, {"role": "assistant", "content": "一覧"}),
                       "rows.jsonl:7")
    # No special token ends the answer: a model trained on it would never stop.
    tokenizer.chat_template = GPTPIPE_TEMPLATE.replace(" + eos_token", "")
    with pytest.raises(TemplateError, match=r"rows.jsonl:7: turn 1: .*no special token"):
        ChatEncoder(tokenizer, 512).encode(row, Reasons())
    # A template that renders the last turn differently from earlier ones.
    tokenizer.chat_template = ALPACA_JA_TEMPLATE.replace("{%- if add_generation_prompt -%}",
                                                         "{%- if add_generation_prompt -%}{{ '!' }}")
    with pytest.raises(TemplateError, match=r"rows.jsonl:7: turn 1: .*does not render turn by turn"):
        ChatEncoder(tokenizer, 512).encode(row, Reasons())


def test_rows_the_template_raises_on_are_counted(chat_lm: Path) -> None:
    tokenizer = chat_tokenizer(chat_lm)
    tokenizer.chat_template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('the user speaks first') }}"
                               "{% endif %}" + GPTPIPE_TEMPLATE)
    encoder, skipped = ChatEncoder(tokenizer, 512), Reasons()
    good = Conversation(({"role": "user", "content": "ls?"}, {"role": "assistant", "content": "一覧"}), "f:1")
    bad = Conversation(({"role": "assistant", "content": "一覧"},), "f:2")
    assert encoder.encode(good, skipped) is not None and encoder.encode(bad, skipped) is None
    assert dict(skipped.counts) == {TEMPLATE_ERROR: 1} and skipped.examples[TEMPLATE_ERROR] == [
        "f:2: the user speaks first"]


def test_the_template_travels_in_both_files_and_a_pad_equal_to_eos_is_replaced(chat_lm: Path,
                                                                               tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = chat_tokenizer(chat_lm, "alpaca_ja")
    save_tokenizer(tokenizer, tmp_path)
    assert (tmp_path / "chat_template.jinja").read_text(encoding="utf-8") == ALPACA_JA_TEMPLATE
    assert json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"] == \
        ALPACA_JA_TEMPLATE
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded.chat_template == ALPACA_JA_TEMPLATE
    assert install_template(reloaded, "auto") == "the model's own chat template"
    assert distinct_pad(reloaded) is None
    reloaded.pad_token = reloaded.eos_token
    assert "padding with <unk>" in distinct_pad(reloaded)
    assert reloaded.pad_token_id not in (None, reloaded.eos_token_id)


def test_a_tokenizer_that_splits_special_tokens_reads_the_templates_eos_as_eos(tiny_lm: Path, chat_files,
                                                                             tmp_path: Path) -> None:
    """Stage 1's tokenizer splits special tokens (literal "</s>" in pretraining text stays text, as SentencePiece
    reads it), so the EOS a template writes after each answer became ordinary pieces and every row of the demo's
    chat set was refused. The chat task turns that off in the run's tokenizer: each answer ends in the EOS id,
    and the saved tokenizer keeps the setting, so the export and `gptpipe chat` read templates the same way."""
    from gptpipe.config.core import load_config
    from gptpipe.finetune.config import FinetuneConfig
    from gptpipe.finetune.task import load_task

    config = load_config(FinetuneConfig, None, chat_args(tiny_lm, chat_files, tmp_path / "run"))
    task = load_task(config)
    assert any("split_special_tokens turned off" in note for note in task.notes)
    eos = task.tokenizer.eos_token_id
    for row, encoded in zip(task.train_rows, task.train):
        answers = sum(m["role"] == "assistant" for m in row.messages)
        assert encoded.input_ids.count(eos) == answers and encoded.input_ids[-1] == eos
    save_tokenizer(task.tokenizer, tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())["split_special_tokens"] is False


# --- fine-tuning, predict, gptpipe chat -------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_run(chat_lm: Path, chat_files: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[Path, str]:
    """The 12-step chat fine-tune of `chat_lm` (its run folder) and its log."""
    run = tmp_path_factory.mktemp("chat-run") / "whole"
    done = gptpipe_command("finetune", *chat_args(chat_lm, chat_files, run))
    assert done.returncode == 0, done.stderr[-3000:]
    return run, done.stderr


@pytest.mark.parametrize(("kind", "best"), [("classification", "macro_f1"), ("generation", "chrf"),
                                            ("chat", "val_loss")])
def test_the_best_metric_follows_the_task_kind_unless_set(kind: str, best: str) -> None:
    from conftest import REPO
    from gptpipe.config.core import ConfigError, load_config
    from gptpipe.finetune.config import FinetuneConfig
    from gptpipe.finetune.kinds import task_kind

    shipped = REPO / "finetune_config.yaml"
    for overrides, resolved in (([], best), (["train.best_metric=val_loss"], "val_loss")):
        config = load_config(FinetuneConfig, shipped, [f"task.kind={kind}", *overrides])
        assert task_kind(kind).best_metric(config.train.best_metric) == resolved
    if kind == "chat":
        with pytest.raises(ConfigError, match="train.best_metric: must be one of chrf, val_loss"):
            load_config(FinetuneConfig, shipped, ["task.kind=chat", "train.best_metric=accuracy"])


def test_a_seq2seq_model_is_refused_for_chat(tiny_t5: Path, chat_files, tmp_path: Path) -> None:
    done = gptpipe_command("finetune", *chat_args(tiny_t5, chat_files, tmp_path / "run"))
    assert done.returncode == 2 and "encoder-decoder; chat tuning needs a causal LM" in done.stderr


@pytest.mark.slow
def test_chat_finetune_resumes_exactly_predicts_and_chats(chat_lm: Path, chat_files, chat_run: tuple[Path, str],
                                                          tmp_path: Path) -> None:
    import signal
    import time

    from transformers import AutoTokenizer

    from gptpipe.finetune.predict import resolve_checkpoint
    from gptpipe.runtime import checkpoint

    whole, log = chat_run
    assert "the shipped 'gptpipe' chat template" in log
    evals = metrics(whole, TaskEvalRow)
    assert [r.step for r in evals] == [4, 8, 12] and all(r.metrics["generated"] == 4 for r in evals)
    assert all(isinstance(r.metrics["chrf"], float) for r in evals)
    losses = {r.step: r.loss for r in metrics(whole, TrainRow)}
    assert losses[12] < losses[1]
    assert (whole / "tokenizer" / "chat_template.jinja").read_text(encoding="utf-8") == GPTPIPE_TEMPLATE
    # The best checkpoint is the evaluation with the lowest assistant-token loss, kept and marked.
    lowest = min(evals, key=lambda r: r.val_loss).step
    assert checkpoint.best_tag(whole / "checkpoints") == checkpoint.tag_of(lowest)
    summary = json.loads((whole / "finetune_summary.json").read_text(encoding="utf-8"))
    eos = AutoTokenizer.from_pretrained(whole / "tokenizer").eos_token_id
    assert summary["best"]["step"] == lowest and summary["task"]["stop_ids"] == [eos]

    # Killed (no handler runs) after step 6, then resumed from step 4: the same losses as the whole run.
    killed = tmp_path / "killed"
    args = chat_args(chat_lm, chat_files, killed)
    process = Forked(["finetune", *args], train_env())
    deadline = time.time() + 300
    while not any(r.step == 6 for r in metrics(killed, TrainRow)):
        assert process.poll() is None and time.time() < deadline
        time.sleep(0.2)
    process.send_signal(signal.SIGKILL)
    process.wait()
    resumed = gptpipe_command("finetune", *args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = {r.step: r.loss for r in metrics(killed, TrainRow)}
    assert again == losses

    # predict on messages rows: the assistant's answer to the turns before the last one.
    best = resolve_checkpoint(whole)
    out = tmp_path / "predictions.jsonl"
    predicted = gptpipe_command("predict", *chat_args(chat_lm, chat_files, whole), f"predict.model={whole}",
                                "--input", chat_files[1], "--output", out)
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    results = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    validation = read_conversations(chat_files[1], Reasons())
    assert [r["messages"] for r in results] == [v.prompt for v in validation]
    assert [r["label"] for r in results] == [v.label for v in validation]

    # gptpipe chat through a pipe: two turns, /reset, the first question again. Each answer is the model's
    # greedy continuation of the whole conversation so far, rendered with the run's template.
    import torch

    model = checkpoint.model_from_checkpoint(checkpoint.find_checkpoint(best)).eval()
    tokenizer = AutoTokenizer.from_pretrained(whole / "tokenizer")
    first, follow_up = validation[0].messages[-4]["content"], "マニュアルの何章ですか?"

    def greedy(messages: list[dict]) -> str:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)

    one = greedy([{"role": "user", "content": first}])
    two = greedy([{"role": "user", "content": first}, {"role": "assistant", "content": one.strip()},
                  {"role": "user", "content": follow_up}])
    talked = gptpipe_command("chat", *chat_args(chat_lm, chat_files, whole), f"chat.model={whole}",
                             stdin=f"{first}\n{follow_up}\n/reset\n{first}\n")
    assert talked.returncode == 0, talked.stderr[-3000:]
    assert talked.stdout == f"{one}\n{two}\n{one}\n"
    assert "conversation reset" in talked.stderr


@pytest.mark.slow
def test_a_chat_run_exports_verified_with_its_template_stop_token_and_gguf(chat_lm: Path, chat_files,
                                                                          chat_run: tuple[Path, str],
                                                                          tmp_path: Path) -> None:
    """`gptpipe convert` on the chat run: the gate passes on its validation conversations, the folder's
    tokenizer renders the prompts the run trained on, generation stops at the end of the assistant's turn,
    `gptpipe chat` answers as on the run, the card says how to chat, the GGUF carries the template."""
    from gguf import GGUFReader
    from transformers import AutoTokenizer, GenerationConfig

    run, _ = chat_run
    out = tmp_path / "chat-export"
    done = gptpipe_command("convert", f"input_model_dir={run}", f"output_tokenizer_and_model_dir={out}")
    assert done.returncode == 0, done.stderr[-3000:]
    counts = manifest_counts(out)
    assert counts["verified"] and counts["failures"] == [] and counts["task"] == "chat"
    assert counts["chat_template_identical"] is True
    validation = read_conversations(chat_files[1], Reasons())[:8]
    # Each conversation's whole ids and its generation prompt, by the folder's tokenizer and the run's; and,
    # the start being a stage-4 export that ships its SentencePiece model, that model's ids on their texts.
    assert counts["tokenizer_reference"] == "the fine-tune's tokenizer and SentencePiece"
    assert counts["tokenizer_texts"] > 2 * len(validation) and counts["tokenizer_mismatches"] == 0
    assert [s["messages"] for s in counts["greedy_samples"]] == [v.prompt for v in validation[:4]]
    assert counts["heldout_source"] == "first 8 rows of validation.jsonl"

    # The template travels in both files, equal to the run's; apply_chat_template on the folder gives the
    # prompt part of the ids the run trained on, the answer and its EOS follow.
    assert (out / "chat_template.jinja").read_text(encoding="utf-8") == GPTPIPE_TEMPLATE
    assert json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"] == \
        GPTPIPE_TEMPLATE
    exported, trained = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(run / "tokenizer")
    encoder = ChatEncoder(trained, seq_len=160)
    for row in validation:
        prompt = exported.apply_chat_template(row.prompt, add_generation_prompt=True, return_dict=False)
        ids = encoder.encode(row, Reasons()).input_ids
        assert ids == prompt + trained(row.label, add_special_tokens=False)["input_ids"] + [trained.eos_token_id]
    # generate stops at the token that ends an assistant turn, with the run's answer length.
    summary = json.loads((run / "finetune_summary.json").read_text(encoding="utf-8"))
    generation = GenerationConfig.from_pretrained(out)
    assert summary["task"]["stop_ids"] == [trained.eos_token_id]
    assert generation.eos_token_id == summary["task"]["stop_ids"]
    assert generation.max_new_tokens == 12 and generation.do_sample is False
    assert generation.pad_token_id == trained.pad_token_id != trained.eos_token_id
    # ... and the model learnt to produce it: greedy answers to validation conversations with the folder's own
    # generation settings, each ending either in the end-of-turn id or at max_new_tokens; some end early (a
    # model trained with EOS masked as padding would never produce it).
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    lengths = {}
    for row in read_conversations(chat_files[1], Reasons()):
        prompt = exported.apply_chat_template(row.prompt, add_generation_prompt=True, return_dict=False)
        with torch.no_grad():
            answer = model.generate(torch.tensor([prompt]), generation_config=generation)[0, len(prompt):].tolist()
        assert answer[-1] in generation.eos_token_id or len(answer) == generation.max_new_tokens, row.where
        assert all(t not in generation.eos_token_id for t in answer[:-1])
        if answer[-1] in generation.eos_token_id:
            lengths[row.where] = len(answer)
    print("generation ended at the end-of-turn token:", lengths)
    assert lengths and max(lengths.values()) <= generation.max_new_tokens // 2

    # gptpipe chat on the export answers exactly as on the run.
    stdin = f"{validation[0].prompt[-1]['content']}\nマニュアルの何章ですか?\n"
    answers = [gptpipe_command("chat", *chat_args(chat_lm, chat_files, run), f"chat.model={model}", stdin=stdin)
               for model in (run, out)]
    assert all(a.returncode == 0 for a in answers), answers[1].stderr[-3000:]
    assert answers[1].stdout == answers[0].stdout and answers[0].stdout.count("\n") == 2

    card = (out / "README.md").read_text(encoding="utf-8")
    assert "chat template: gptpipe's shipped `gptpipe` template" in card and GPTPIPE_TEMPLATE in card
    assert "gptpipe chat chat.model=PATH" in card and "apply_chat_template(messages, add_generation_prompt=True" in card
    assert "| chrF |" in card and "nats per assistant token" in card

    # The GGUF carries the template for llama.cpp / Ollama to render.
    written = gptpipe_command("gguf", "--model", out)
    assert written.returncode == 0, written.stderr[-3000:]
    reader = GGUFReader(out.with_name(f"{out.name}-gguf-f16") / f"{out.name}-f16.gguf")
    assert reader.fields["tokenizer.chat_template"].contents() == GPTPIPE_TEMPLATE
    # llama.cpp stops at its EOS (the end-of-turn id here) and at an end-of-turn token, when one is named.
    assert [reader.fields["tokenizer.ggml.eos_token_id"].contents()] == generation.eos_token_id
    assert "tokenizer.ggml.eot_token_id" not in reader.fields


@pytest.mark.slow
def test_packed_and_grouped_chat_runs_take_the_padded_runs_steps(chat_lm: Path, chat_files, tmp_path: Path) -> None:
    """Chat rows pack like any other: the per-step losses of a packed run equal the padded run's."""
    common = ("train.micro_batch_size=4", "train.train_iters=3", "train.eval_interval=1000")
    losses = {}
    for name, overrides in {"padded": (), "packed": ("train.packing=true",)}.items():
        done = gptpipe_command("finetune", *chat_args(chat_lm, chat_files, tmp_path / name, *common, *overrides))
        assert done.returncode == 0, done.stderr[-3000:]
        losses[name] = [r.loss for r in metrics(tmp_path / name, TrainRow)]
    assert len(losses["packed"]) == 3
    assert losses["packed"] == pytest.approx(losses["padded"], rel=1e-5)


@pytest.mark.skipif(not manpages_installed(), reason="needs the Japanese man pages")
def test_chat_answers_from_an_hf_folder_with_a_template(chat_lm: Path, tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "hf"
    shutil.copytree(chat_lm, folder)
    save_tokenizer(chat_tokenizer(chat_lm, "alpaca_ja"), folder)
    talked = gptpipe_command("chat", f"chat.model={folder}", "chat.max_new_tokens=5", "chat.sample=true",
                             "chat.system=簡潔に答えます。", stdin="ls とは?\n")
    assert talked.returncode == 0, talked.stderr[-3000:]
    assert talked.stdout.count("\n") >= 1
    # predict reads one user turn a line from stdin and answers each.
    out = tmp_path / "answers.jsonl"
    # The folder has no task.json: train.seq_len is the limit (the template's preamble alone is 68 tokens here).
    predicted = gptpipe_command("predict", f"predict.model={folder}", "task.kind=chat", "predict.max_new_tokens=4",
                                "train.seq_len=128", "--input", "-", "--output", out, stdin="ls とは?\n\ncp とは?\n")
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    answers = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [a["messages"] for a in answers] == [[{"role": "user", "content": q}] for q in ("ls とは?", "cp とは?")]
    assert all(isinstance(a["prediction"], str) and "label" not in a for a in answers)
    refused = gptpipe_command("chat", f"chat.model={chat_lm}", stdin="ls とは?\n")
    assert refused.returncode == 2 and "has no chat template" in refused.stderr


@pytest.mark.skipif(not manpages_installed(), reason="needs the Japanese man pages")
def test_predict_cuts_a_long_conversation_as_chat_does_and_reports_one_that_cannot_fit(chat_lm: Path,
                                                                                      tmp_path: Path) -> None:
    """A conversation whose prompt leaves no room for predict.max_new_tokens within seq_len loses its oldest
    exchanges (the system prompt stays), as in `gptpipe chat`; one too long even with only its last user turn
    gets no answer, said in its line and in the log, and the other rows are answered."""
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path / "hf"
    shutil.copytree(chat_lm, folder)
    save_tokenizer(chat_tokenizer(chat_lm), folder)
    system = {"role": "system", "content": "Linux のコマンドについて簡潔に答えます。"}
    exchange = [{"role": "user", "content": "`ls` は何をしますか?"},
                {"role": "assistant", "content": "ディレクトリの内容をリスト表示する。"}]
    last = {"role": "user", "content": "マニュアルの何章ですか?"}
    answer = {"role": "assistant", "content": "1章 (コマンド) です。"}
    long, short = [system, *exchange * 3, last], [system, last]
    hopeless = [system, {"role": "user", "content": " ".join(["`ls` は何をしますか?"] * 40)}]
    encoder, new_tokens = ChatEncoder(AutoTokenizer.from_pretrained(folder), seq_len=512), 4
    seq_len = len(encoder.prompt_ids(short)) + new_tokens  # one exchange more would not fit
    assert len(encoder.prompt_ids([system, *exchange, last])) + new_tokens > seq_len
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"messages": [*m, answer]} for m in (long, short, hopeless)])
    out = tmp_path / "answers.jsonl"
    predicted = gptpipe_command("predict", f"predict.model={folder}", "task.kind=chat", f"train.seq_len={seq_len}",
                                f"predict.max_new_tokens={new_tokens}", "predict.batch_size=1", "--input", rows,
                                "--output", out)
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    cut, whole, unanswered = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert cut["messages"] == long and cut["cut"] == 6 and cut["prediction"] == whole["prediction"]
    assert whole["messages"] == short and "cut" not in whole and isinstance(whole["prediction"], str)
    assert unanswered["messages"] == hopeless and unanswered["prediction"] is None
    assert unanswered["too_long"].endswith(
        f"seq_len {seq_len} less max_new_tokens {new_tokens} leaves {seq_len - new_tokens}")
    assert "1 conversations cut (their oldest exchanges left out)" in predicted.stderr
    assert f"1 conversations too long to leave predict.max_new_tokens {new_tokens}" in predicted.stderr
    assert f"{rows}:3: " in predicted.stderr
    assert [r["label"] for r in (cut, whole, unanswered)] == [answer["content"]] * 3
    assert set(json.loads(out.with_suffix(".metrics.json").read_text())) == {"exact_match", "chrf"}
