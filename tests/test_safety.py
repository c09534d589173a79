"""What gptpipe refuses so that a wrong path never costs a user data: a stage writes only where it wrote before (or
into a new or empty folder), never over its inputs, the working directory or a folder above it, and never under a
name a user's file has."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, corpus_texts, train_env

from gptpipe.artifacts import EXIT_BAD_INPUT


def script(name: str, *argv: object, cwd: Path) -> subprocess.CompletedProcess:
    """One of the numbered scripts as a user runs it, from `cwd`."""
    env = {**train_env(), "PYTHON": sys.executable, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return subprocess.run(["bash", str(REPO / name), *map(str, argv)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def tree(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under `folder` with its size and mtime: what must stay as it was."""
    return {p.relative_to(folder).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def settled(folder: Path) -> dict[str, tuple[int, int]]:
    """tree(folder) once a stopped process's last write has landed (a write in flight when SIGSTOP arrives still
    completes): two reads a beat apart agree."""
    import time

    now = tree(folder)
    for _ in range(20):
        time.sleep(0.25)
        now, before = tree(folder), now
        if now == before:
            return now
    raise AssertionError(f"{folder} kept changing while its writer was stopped")


def jsonl_source(folder: Path, count: int = 40) -> Path:
    """A user's own jsonl source of `count` distinct Japanese documents."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "docs.jsonl"
    lines = [json.dumps({"text": f"これは{i}番目の文書です。日本語の文章を十分な長さで書いておきます。"
                                 f"番号{i * 7919}は重複を避けるためのものです。"}, ensure_ascii=False)
             for i in range(count)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def prepare(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "0_prepare_corpus.py"), "--config", str(cwd / "config.yaml"),
                           *overrides], cwd=cwd, env=train_env(), capture_output=True, text=True, timeout=600)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A user's project folder: the shipped config.yaml (comments and all) and a jsonl source under raw/."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "config.yaml").write_text((REPO / "config.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    jsonl_source(folder / "raw")
    return folder


SOURCE = ("corpus.sources=[{type: jsonl, path: raw/docs.jsonl}]", "corpus.languages=[]", "corpus.min_chars=10")


def test_stage_4_into_the_run_folder_is_refused_and_the_checkpoints_stay(tiny_run, tmp_path: Path) -> None:
    """A typo that names the training run as the export folder: exit 2 naming both paths and the key, and every
    checkpoint file as it was; an export folder above the run (it would hold the run) is refused the same way."""
    run = tiny_run()
    before = tree(run)
    for output in (run, run.parent):
        done = script("4_convert_to_HF.sh", "--config", REPO / "convert_config.yaml", f"input_model_dir={run}",
                      f"output_tokenizer_and_model_dir={output}", cwd=tmp_path)
        assert done.returncode == EXIT_BAD_INPUT, done.stderr[-3000:]
        assert f"output_tokenizer_and_model_dir {output}" in done.stderr and str(run) in done.stderr
        assert "Traceback" not in done.stderr
    assert tree(run) == before


def test_stage_0_into_the_working_directory_keeps_the_users_config(project: Path) -> None:
    """corpus.output_dir=. would have replaced the commented config.yaml by the resolved corpus section."""
    config = (project / "config.yaml").read_bytes()
    before = tree(project)
    done = prepare(project, *SOURCE, "corpus.output_dir=.")
    assert done.returncode == EXIT_BAD_INPUT, done.stderr[-3000:]
    assert f"corpus.output_dir {project} is the working directory" in done.stderr and "Traceback" not in done.stderr
    assert (project / "config.yaml").read_bytes() == config and tree(project) == before


def test_stage_0_refuses_an_output_folder_that_holds_its_source(project: Path) -> None:
    """The source's own folder as the corpus folder (it holds files stage 0 did not write), then a corpus folder
    the first run made that a later source lies inside: both refused, the source untouched."""
    source = project / "raw" / "docs.jsonl"
    text = source.read_bytes()
    done = prepare(project, *SOURCE, "corpus.output_dir=raw")
    assert done.returncode == EXIT_BAD_INPUT, done.stderr[-3000:]
    assert f"corpus.output_dir {project / 'raw'} holds files the prepare stage did not write (docs.jsonl" in done.stderr

    done = prepare(project, *SOURCE, "corpus.output_dir=out")
    assert done.returncode == 0, done.stderr[-3000:]
    inside = project / "out" / "more.jsonl"
    inside.write_bytes(text)
    done = prepare(project, "corpus.sources=[{type: jsonl, path: out/more.jsonl}]", *SOURCE[1:],
                   "corpus.output_dir=out")
    assert done.returncode == EXIT_BAD_INPUT, done.stderr[-3000:]
    assert f"corpus.output_dir {project / 'out'} holds corpus.sources[0].path {inside}" in done.stderr
    assert source.read_bytes() == text and inside.read_bytes() == text


def test_a_stage_writes_its_resolved_config_under_its_own_name(project: Path) -> None:
    """Beside the manifest: prepare.resolved.yaml, never config.yaml; a rerun into its own folder is allowed."""
    done = prepare(project, *SOURCE, "corpus.output_dir=out")
    assert done.returncode == 0, done.stderr[-3000:]
    out = project / "out"
    assert (out / "prepare.resolved.yaml").is_file() and not (out / "config.yaml").exists()
    done = prepare(project, *SOURCE, "corpus.output_dir=out", "--force")
    assert done.returncode == 0, done.stderr[-3000:]


# --- a trust boundary for pickles and task code --------------------------------------------------------------
class Payload:
    """What a hostile pickle holds: loading it runs a shell command that creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


def poison(run: Path, marker: Path) -> None:
    """Every checkpoint of `run`: its rank-0 RNG state replaced by a pickle that creates `marker` when loaded."""
    import torch

    for folder in (run / "checkpoints").glob("global_step*"):
        torch.save(Payload(marker), folder / "rng_state_rank0.pt")


REFUSED = "would run code when loaded (rng_state_rank0.pt: posix.system)"


def test_a_hostile_pretraining_checkpoint_runs_nothing_on_convert_or_resume(tiny_run, workspace: Path,
                                                                           tmp_path: Path) -> None:
    """convert and a resumed train refuse it naming the file and what it would call; nothing ran. Trusted on
    purpose (GPTPIPE_TRUST=checkpoints), the resume loads it: the payload was real."""
    from conftest import TINY_RUN, TINY_STEPS, gptpipe_command, run_train

    run, marker = tmp_path / "run", tmp_path / "ran"
    shutil.copytree(tiny_run(), run)
    poison(run, marker)
    export = ("--config", REPO / "convert_config.yaml", f"input_model_dir={run}",
              f"output_tokenizer_and_model_dir={tmp_path / 'export'}")
    done = gptpipe_command("convert", *export)
    assert done.returncode == EXIT_BAD_INPUT and REFUSED in done.stderr, done.stderr[-3000:]
    resume = ("--config", workspace / "config.yaml", *TINY_RUN, f"train.train_iters={TINY_STEPS + 2}",
              f"train.output_model_dir={run}")
    resumed = run_train(*resume)
    assert resumed.returncode == EXIT_BAD_INPUT and REFUSED in resumed.stderr, resumed.stderr[-3000:]
    assert not marker.exists()

    from prewarmed import Forked

    Forked(["train", *map(str, resume)], {**train_env(), "GPTPIPE_TRUST": "checkpoints"}).finish(600)
    assert marker.exists()


def test_a_hostile_fine_tune_checkpoint_runs_nothing_on_predict_or_chat(classifier_run, task_files,
                                                                        tmp_path: Path) -> None:
    from conftest import gptpipe_command

    original, args, _ = classifier_run
    run, marker = tmp_path / "run", tmp_path / "ran"
    shutil.copytree(original, run)
    poison(run, marker)
    done = gptpipe_command("predict", "--input", task_files[1], "--output", tmp_path / "out.jsonl", *args,
                           f"predict.model={run}")
    assert done.returncode == EXIT_BAD_INPUT and REFUSED in done.stderr, done.stderr[-3000:]
    done = gptpipe_command("chat", *args, f"chat.model={run}", stdin="/exit\n")
    assert done.returncode == EXIT_BAD_INPUT and REFUSED in done.stderr, done.stderr[-3000:]
    assert not marker.exists()


def test_a_task_yaml_with_python_runs_only_when_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture) -> None:
    """A local lm-eval task whose YAML (through an include) names `!function`: refused before lm-eval imports it."""
    from gptpipe.cli import main

    marker, tasks = tmp_path / "ran", tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "utils.py").write_text(f"open({str(marker)!r}, 'w').close()\n\ndef docs(d):\n    return d\n")
    (tasks / "base.yaml").write_text("output_type: multiple_choice\nprocess_docs: !function utils.docs\n")
    (tasks / "task.yaml").write_text("include: base.yaml\ntask: hostile\ndataset_path: json\n")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    argv = ["evaluate", "--config", str(REPO / "evaluate_config.yaml"), f"model_dir={tmp_path / 'model'}", "tasks=[]",
            f"task_yamls=[{tasks / 'task.yaml'}]"]
    assert main(argv) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert f"task YAML {tasks / 'task.yaml'} imports Python when loaded ({tasks / 'base.yaml'}: !function " \
           "utils.docs)" in err and "GPTPIPE_TRUST=task-code" in err
    assert not marker.exists()


def test_a_hostile_index_cache_runs_nothing(tiny_run, workspace: Path, tmp_path: Path) -> None:
    """megatron-core loads its cached indices with allow_pickle: an object array in the run's data cache is
    refused before the datasets are built."""
    import numpy as np
    from conftest import TINY_RUN, TINY_STEPS, run_train

    run, marker = tmp_path / "run", tmp_path / "ran"
    shutil.copytree(tiny_run(), run)
    hostile = run / "data_cache" / "hostile.npy"
    hostile.parent.mkdir(exist_ok=True)
    np.save(hostile, np.array([Payload(marker)], dtype=object), allow_pickle=True)
    done = run_train("--config", workspace / "config.yaml", *TINY_RUN, f"train.train_iters={TINY_STEPS + 2}",
                     f"train.output_model_dir={run}")
    assert done.returncode == EXIT_BAD_INPUT, done.stderr[-3000:]
    assert f"{hostile} holds Python objects" in done.stderr and not marker.exists()


# --- one writer per folder -----------------------------------------------------------------------------------
def test_a_second_train_on_a_live_run_folder_exits_and_the_first_finishes_as_alone(reference_run, workspace: Path,
                                                                                 tmp_path: Path) -> None:
    """The first run paused mid-training (SIGSTOP keeps its lock): the second exits 2 naming the holder, having
    written nothing; the first, continued, ends with the uninterrupted run's losses."""
    import signal

    from conftest import QUICK_TRAIN, REFERENCE_RUN, run_train, start_train, train_losses, wait_for_step

    run = tmp_path / "run"
    first = start_train(workspace / "config.yaml", *REFERENCE_RUN, f"train.output_model_dir={run}")
    wait_for_step(run, 2, first)
    first.send_signal(signal.SIGSTOP)
    try:
        before = settled(run)
        second = run_train("--config", workspace / "config.yaml", *QUICK_TRAIN, *REFERENCE_RUN,
                           f"train.output_model_dir={run}")
        assert second.returncode == EXIT_BAD_INPUT, second.stderr[-3000:]
        assert f"{run} is in use by another gptpipe train (host " in second.stderr
        assert f"pid {first.pid}," in second.stderr and tree(run) == before
    finally:
        first.send_signal(signal.SIGCONT)
    assert first.wait() == 0
    assert train_losses(run) == train_losses(reference_run())


def test_a_second_prepare_on_a_live_corpus_folder_exits_and_leaves_it_alone(project: Path) -> None:
    """Another stage 0 holds the folder (here this test, through the same lock): exit 2 naming the holder; its
    .work (the first one's finished shards) untouched."""
    from gptpipe.lock import FolderLock

    work = project / "out" / ".work"
    work.mkdir(parents=True)
    (work / "shard-000000").mkdir()
    holder = FolderLock(project / "out", "gptpipe prepare")
    try:
        done = prepare(project, *SOURCE, "corpus.output_dir=out")
    finally:
        holder.release()
    assert done.returncode == EXIT_BAD_INPUT, done.stderr[-3000:]
    assert f"{project / 'out'} is in use by another gptpipe prepare (host " in done.stderr
    assert f"pid {os.getpid()}," in done.stderr and (work / "shard-000000").is_dir()


def test_a_cache_folder_another_user_could_write_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bucket cache lives in the user's own <tmp>/gptpipe-cache-<uid> (0700); a folder at that name that
    others may write, or a link planted there, is refused rather than trusted."""
    from gptpipe.storage import cache_folder

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    folder = cache_folder("s3://bucket/data/x").parents[1]
    assert folder == tmp_path / f"gptpipe-cache-{os.getuid()}" and (folder.stat().st_mode & 0o777) == 0o700
    folder.chmod(0o777)
    with pytest.raises(OSError, match="is not a private folder of this user"):
        cache_folder("s3://bucket/data/x")
    folder.rmdir()
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    folder.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError, match="a link"):
        cache_folder("s3://bucket/data/x")


# --- bounded input, errors instead of tracebacks -------------------------------------------------------------
def peak_rss_mib(command: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    """Run `command` under a fresh Python whose only children it starts: (its result, the largest RSS of any
    process it waited for, in MiB)."""
    probe = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
             "sys.stderr.write(done.stderr); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
             "sys.exit(done.returncode)")
    done = subprocess.run([sys.executable, "-c", probe, *command], cwd=cwd, env=train_env(), capture_output=True,
                          text=True, timeout=600)
    return done, int(done.stdout.split()[-1]) / 1024


def test_one_huge_line_in_a_small_gzip_is_dropped_without_holding_it(project: Path) -> None:
    """A gzip of 1.4 MB holding one 300 MB line (1.3-3.3 GB RSS before): dropped as too long with its file:line,
    the documents after it kept, and no process of the stage over 400 MiB (57 MiB measured)."""
    import gzip

    path = project / "raw" / "huge.jsonl.gz"
    good = (project / "raw" / "docs.jsonl").read_bytes()
    with gzip.open(path, "wb", compresslevel=1) as fh:
        fh.write(b'{"text": "')
        for _ in range(300):
            fh.write(b"\xe3\x81\x82" * (1 << 18) + b"a" * (1 << 18))
        fh.write(b'"}\n' + good)
    assert path.stat().st_size < 2 << 20
    done, peak = peak_rss_mib([sys.executable, str(REPO / "0_prepare_corpus.py"), "--config", "config.yaml",
                               "corpus.sources=[{type: jsonl, path: raw/huge.jsonl.gz}]", *SOURCE[1:],
                               "corpus.output_dir=out"], project)
    assert done.returncode == 0, done.stderr[-3000:]
    assert peak < 400, f"peak RSS {peak:.0f} MiB"
    assert any("too long" in line and f"{path}:1" in line for line in done.stderr.splitlines()), done.stderr[-3000:]
    kept = corpus_texts(project / "out")
    assert len(kept) == len(good.splitlines())


def test_a_truncated_gzip_source_is_named_not_a_traceback(project: Path) -> None:
    import gzip

    whole = gzip.compress((project / "raw" / "docs.jsonl").read_bytes() * 50)
    path = project / "raw" / "cut.jsonl.gz"
    path.write_bytes(whole[:len(whole) // 2])
    done = prepare(project, "corpus.sources=[{type: jsonl, path: raw/cut.jsonl.gz}]", *SOURCE[1:],
                   "corpus.output_dir=out")
    assert done.returncode == EXIT_BAD_INPUT, done.stderr[-3000:]
    assert f"{path}: the gzip data is truncated or corrupt after line " in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("override,message", [
    ("train.seq_len=.inf", "train.seq_len: expected a finite integer, got inf"),
    ("train.seq_len=nan", "train.seq_len: expected a finite integer, got 'nan'"),
    ("train.global_batch_size=1e400", "train.global_batch_size: expected a finite integer, got '1e400'"),
    ("train.lr=.nan", "train.lr: expected a finite number, got nan"),
    ("model.init_from=s3://AKIAKEY:topsecret@bucket/x", "'s3://***@bucket/x' is a URL"),
])
def test_a_bad_number_or_a_credential_in_a_value_is_an_error_naming_the_key(override: str, message: str,
                                                                         capsys: pytest.CaptureFixture) -> None:
    from gptpipe.cli import main

    assert main(["plan", "--config", str(REPO / "config.yaml"), override]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert message in err and "topsecret" not in err and "AKIAKEY" not in err


def test_a_config_that_is_not_utf8_names_its_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from gptpipe.cli import main

    config = tmp_path / "config.yaml"
    config.write_bytes(b"corpus:\n  min_chars: 50\n  output_dir: \"caf\xe9\"\n")
    assert main(["plan", "--config", str(config)]) == EXIT_BAD_INPUT
    assert f"{config}:3: not UTF-8 text (byte 0xe9)" in capsys.readouterr().err


# --- nothing private leaves ----------------------------------------------------------------------------------
def test_the_model_card_names_no_path_of_the_training_machine(tiny_export, workspace: Path) -> None:
    """The card states the run's settings, with the machine's folders cut to their last component."""
    card = (tiny_export("llama") / "README.md").read_text(encoding="utf-8")
    assert "## Training" in card and "output_model_dir: …/export-run-llama" in card
    assert str(workspace) not in card and str(Path(workspace).parents[1]) not in card
