"""`gptpipe` subcommands in processes forked from one that has already imported torch, DeepSpeed, transformers and
Megatron's datasets: a `python -m gptpipe` subprocess spends ~7 of a tiny run's 8 s importing them.

Each run is still a process of its own (multiprocessing's forkserver forks a fresh copy of the imported, never
used, single-threaded server per run): its process group, signal handlers, environment and globals die with it,
as a subprocess's would. What differs: settings a package reads from the environment at import time come from the
server's start (the test session's environment), and the program name is `gptpipe`, not `python -m gptpipe`.
Tests of launchers, scripts and the command line itself start real subprocesses instead.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path

import psutil

# What `gptpipe train`, `finetune`, `predict`, `convert` and `chat` import, in the order they do.
PRELOAD = ["torch", "deepspeed", "transformers", "wandb", "torch.utils.tensorboard",
           "megatron.core.datasets.gpt_dataset", "megatron.core.datasets.blended_megatron_dataset_builder",
           "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2",
           "transformers.models.mixtral.modeling_mixtral", "transformers.models.t5.modeling_t5",
           "gptpipe.cli", "gptpipe.train.train", "gptpipe.finetune.finetune", "gptpipe.finetune.predict",
           "gptpipe.export.convert",
           # transformers imports its quantizers, torchao's too when the [fp8] extra is installed, when it first
           # builds a model: ~2-6 s on this machine, paid once here instead of in every run
           "transformers.quantizers.auto", "torchao.float8"]

_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(PRELOAD)
_starting = threading.Lock()  # the trained run starts from a thread of its own (conftest.py)


def _gptpipe(argv: list[str], env: dict[str, str], stdin: str | None, out: str, err: str) -> None:
    """The forked process: `gptpipe argv` with this environment and its stdio on files, as `python -m gptpipe`."""
    # A process group of its own, as a launcher gives a run: a fault that loses the "machine" (the run and its
    # uploader: checkpoint.fault's machine) ends there, not in the test session.
    os.setpgrp()
    # What the server's imports registered to clean up at exit (wandb's media folder...) is the server's: a run's
    # exit must not delete it from under the runs after it. The run's own exit handlers and finalizers still run.
    atexit._clear()
    for finalizer in list(weakref.finalize._registry):
        finalizer.atexit = False
    weakref.finalize._registered_with_atexit = False
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # the server's imports fixed it from the session's TMPDIR; this run's may differ
    # A new interpreter puts PYTHONPATH's folders first on its path (a fine-tune's own task kind is found there).
    sys.path[:0] = [folder for folder in env.get("PYTHONPATH", "").split(os.pathsep) if folder]
    for fd, path, flags in ((0, stdin or os.devnull, os.O_RDONLY), (1, out, os.O_WRONLY), (2, err, os.O_WRONLY)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, encoding="utf-8", closefd=False)
    sys.argv = ["gptpipe", *argv]
    import torch

    from gptpipe.cli import main

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or 1))  # a new process reads it at start
    try:
        code = main(argv)
    finally:
        atexit._run_exitfuncs()  # multiprocessing ends its processes with os._exit, which skips them
    sys.exit(code)


class _Followed:
    """A run's stderr file read as a pipe is: `read()` and iterating wait for more until the run has ended."""

    def __init__(self, path: Path, run: Forked) -> None:
        self._file = open(path, encoding="utf-8", errors="replace")
        self._run = run

    def read(self) -> str:
        self._run.wait()
        return self._file.read()

    def __iter__(self) -> Iterator[str]:
        partial = ""
        while True:
            ended = self._run.poll() is not None  # before reading: nothing written after it is missed
            partial += self._file.readline()
            if partial.endswith("\n"):
                yield partial
                partial = ""
            elif ended:
                if partial:
                    yield partial
                return
            else:
                time.sleep(0.05)

    def close(self) -> None:
        self._file.close()


class Forked:
    """A started `gptpipe` run, with the part of subprocess.Popen's interface the tests use; stdout and stderr
    go to files (no pipe to drain), ``stderr`` reads them as a pipe would."""

    def __init__(self, argv: Sequence[object], env: dict[str, str], stdin: str | None = None) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="gptpipe-run-")
        folder = Path(self._folder.name)
        self._out, self._err = folder / "stdout", folder / "stderr"
        self._out.touch()
        self._err.touch()
        stdin_path = None
        if stdin is not None:
            (folder / "stdin").write_text(stdin, encoding="utf-8")
            stdin_path = str(folder / "stdin")
        self.args = ["gptpipe", *map(str, argv)]
        self._process = _context.Process(target=_gptpipe, args=(self.args[1:], env, stdin_path, str(self._out),
                                                                 str(self._err)))
        with _starting:
            # The server starts with the first run and prints what its imports warn (megatron's missing
            # Transformer Engine...) to the test session's stderr; the tests' runs ignore warnings (train_env).
            previous = os.environ.get("PYTHONWARNINGS")
            os.environ["PYTHONWARNINGS"] = "ignore"
            try:
                self._process.start()
            finally:
                if previous is None:
                    del os.environ["PYTHONWARNINGS"]
                else:
                    os.environ["PYTHONWARNINGS"] = previous
        self.pid = self._process.pid
        self.stderr = _Followed(self._err, self)

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def kill_all(self) -> None:
        """SIGKILL the run and every process it started (the bucket uploader...): what a lost machine does. The
        run is stopped first, so that it cannot start another helper in between."""
        with contextlib.suppress(psutil.NoSuchProcess):
            run = psutil.Process(self.pid)
            run.suspend()
            for process in [*run.children(recursive=True), run]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self._out.read_text(encoding="utf-8", errors="replace"), self._err.read_text(
            encoding="utf-8", errors="replace")

    def finish(self, timeout: float | None = None) -> subprocess.CompletedProcess:
        """Wait for the end (killing the run past `timeout`) → CompletedProcess with stdout and stderr as text."""
        try:
            stdout, stderr = self.communicate(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait()
            raise
        return subprocess.CompletedProcess(self.args, self.returncode, stdout, stderr)

    def __del__(self) -> None:
        if getattr(self, "_process", None) is not None and self._process.exitcode is None:
            self.kill()
        if getattr(self, "stderr", None) is not None:
            self.stderr.close()


def run_gptpipe(argv: Sequence[object], env: dict[str, str], stdin: str | None = None,
                timeout: float | None = None) -> subprocess.CompletedProcess:
    """`gptpipe argv` in a forked process, to its end: what subprocess.run(capture_output=True, text=True) gives."""
    return Forked(argv, env, stdin).finish(timeout)


def torchrun_env(rank: int, world: int, per_node: int, port: int) -> dict[str, str]:
    """The process-group variables torchrun gives global rank `rank` of `world` on nodes of `per_node` ranks."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank % per_node), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(per_node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def run_ranks(argv: Sequence[object], env: dict[str, str], ranks: int, port: int,
              timeout: float | None = None) -> subprocess.CompletedProcess:
    """`gptpipe argv` on `ranks` forked processes of one node, each with the variables torchrun gives its ranks,
    to their end. As torchrun does, the first rank to fail ends the others; the exit code is that rank's (torchrun
    would say 1), stderr is every rank's in rank order."""
    runs = [Forked(argv, {**env, **torchrun_env(rank, ranks, ranks, port)}) for rank in range(ranks)]
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while any(run.poll() is None for run in runs):
            if any(run.poll() for run in runs):  # one failed: the others would wait for it in a collective
                for run in runs:
                    run.kill()
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(["gptpipe", *map(str, argv)], timeout)
            time.sleep(0.05)
    finally:
        for run in runs:
            run.kill()
    outputs = [run.communicate() for run in runs]
    code = next((run.returncode for run in runs if run.returncode), 0)
    return subprocess.CompletedProcess(runs[0].args, code, "".join(out for out, _ in outputs),
                                       "".join(err for _, err in outputs))
