#!/usr/bin/env bash
# The test command: sets up .venv (scripts/setup_env.sh), then runs the whole test suite.
# Extra arguments go to pytest, e.g. `bash run_tests.sh -k tokenizer`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
bash scripts/setup_env.sh
# One CPU thread per process: DeepSpeed/gloo ranks on a small machine get slower with more.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}
export WANDB_MODE=${WANDB_MODE:-offline}
# Two pytest-xdist workers, one per core of a small machine (TEST_WORKERS=0: one process), a test file's tests on
# one worker, the files in conftest.py's order (not xdist's: most tests first); conftest.py builds each run the
# tests share once, for both.
status=0
.venv/bin/python -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@" || status=$?
# pytest's 5 is "no tests collected": a typo in -k or a path, never a pass.
[ "$status" != 5 ] || echo "run_tests.sh: pytest collected no tests (exit 5): check the -k expression or paths" >&2
exit "$status"
