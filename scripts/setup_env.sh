#!/usr/bin/env bash
# Set-up shared by demo.sh and run_tests.sh: a virtual environment with the tested torch and gptpipe,
# and the Japanese man pages (the offline demo corpus) where apt and root are available.
#   TORCH_SPEC   torch requirement installed first (default torch==2.13.0, the tested version). On a machine
#                whose pip serves CPU wheels locally this is the CPU build; on a CUDA machine PyPI's wheel is
#                the CUDA build. For a CPU-only build elsewhere, point PIP_EXTRA_INDEX_URL at PyTorch's CPU index.
#   PYTHON       interpreter for the venv (default python3, 3.10+)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
EXTRAS=${EXTRAS:-ja,datasets,notebook,test}

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
# torch first and pinned: an unpinned torch pulled in by another package means GBs of CUDA wheels.
.venv/bin/python -m pip install -q "$TORCH_SPEC"
.venv/bin/python -m pip install -q -e ".[${EXTRAS}]"
echo "[setup] $(.venv/bin/python -c 'import torch, deepspeed, transformers; print(f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, transformers {transformers.__version__}")')"

pages=$(find /usr/share/man/ja -name '*.gz' 2>/dev/null | wc -l)
if [ "$pages" -lt 1000 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[setup] installing the demo corpus: manpages-ja manpages-ja-dev"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq manpages-ja manpages-ja-dev >/dev/null
  else
    echo "[setup] the demo corpus is missing: run 'sudo apt-get install manpages-ja manpages-ja-dev'" >&2
  fi
fi
