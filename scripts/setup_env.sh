#!/usr/bin/env bash
# Set-up shared by demo.sh, run_tests.sh and .ci/run: a virtual environment with the tested torch and gptpipe,
# and the Japanese man pages (the offline demo corpus) plus groff (their converter) where apt and root are available.
#   TORCH_SPEC   torch requirement installed first (default torch==2.13.0, the tested version). On a machine
#                whose pip serves CPU wheels locally this is the CPU build; on a CUDA machine PyPI's wheel is
#                the CUDA build. For a CPU-only build elsewhere, point PIP_EXTRA_INDEX_URL at PyTorch's CPU index.
#   PYTHON       interpreter for the venv (default python3, 3.10+)
#   EXTRAS       gptpipe's extras (default ja,datasets,notebook,eval,ja-eval,cloud,gguf,gpu,fp8,test; gpu is Liger's kernels
#                and Triton, whose interpreter checks them on CPU in the tests; fp8 is torchao, train.precision fp8,
#                whose float8 linears the tests run on CPU; ja-eval is the ja suite's packages, which the tests
#                run on fixture data)
#   CONSTRAINTS  the tested versions of every other package (default constraints.txt); empty: newest within
#                pyproject.toml's ranges
# pip runs only when .venv is new or one of these inputs changed since the last install (a hash in .venv).
#   bash scripts/setup_env.sh --freeze   writes constraints.txt from .venv (after a run of the tests on it)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
EXTRAS=${EXTRAS:-ja,datasets,notebook,eval,ja-eval,cloud,gguf,gpu,fp8,test}
CONSTRAINTS=${CONSTRAINTS-constraints.txt}
STAMP=.venv/gptpipe-setup.sha256

if [ "${1:-}" = --freeze ]; then
  # torch is left out (TORCH_SPEC chooses it per machine), gptpipe itself too; pip freeze --all keeps setuptools,
  # which torch and tensorboard import at run time.
  { echo "# Tested versions (CPython $(.venv/bin/python -c 'import platform; print(platform.python_version())'), Linux)," \
         "installed by scripts/setup_env.sh; refresh: README.md, Installs."
    .venv/bin/python -m pip freeze --all --exclude-editable --exclude torch --exclude pip; } > constraints.txt
  echo "[setup] wrote constraints.txt ($(grep -vc '^#' constraints.txt) packages)"
  exit 0
fi

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
constrain=()
[ -n "$CONSTRAINTS" ] && constrain=(-c "$CONSTRAINTS")
inputs=$({ echo "$TORCH_SPEC|$EXTRAS|$CONSTRAINTS"; cat pyproject.toml ${CONSTRAINTS:+"$CONSTRAINTS"}; } | sha256sum)
if [ "$(cat "$STAMP" 2>/dev/null)" = "$inputs" ]; then
  echo "[setup] .venv matches pyproject.toml, ${CONSTRAINTS:-no constraints}, $TORCH_SPEC and [$EXTRAS]: no install"
else
  rm -f "$STAMP"
  # torch first and pinned: an unpinned torch pulled in by another package means GBs of CUDA wheels.
  # A CUDA build of torch requires the one Triton it was built with: that requirement replaces constraints.txt's
  # triton (the version the CPU tests interpret Liger's kernels with).
  if .venv/bin/python -m pip install -q "${constrain[@]}" "$TORCH_SPEC" && [ -n "$CONSTRAINTS" ] \
     && .venv/bin/python -c 'import importlib.metadata as m, sys; sys.exit(not any(r.startswith("triton") for r in m.requires("torch") or []))'; then
    grep -v '^triton==' "$CONSTRAINTS" > .venv/constraints-torch-triton.txt
    constrain=(-c .venv/constraints-torch-triton.txt)
  fi
  if ! .venv/bin/python -c 'import torch' 2>/dev/null \
     || ! .venv/bin/python -m pip install -q "${constrain[@]}" -e ".[${EXTRAS}]"; then
    [ -n "$CONSTRAINTS" ] && echo "[setup] the tested versions ($CONSTRAINTS) did not install here (another Python" \
      "or TORCH_SPEC?); 'CONSTRAINTS= bash $0' installs the newest within pyproject.toml's ranges instead" >&2
    exit 1
  fi
  echo "$inputs" > "$STAMP"
  echo "[setup] $(.venv/bin/python -c 'import torch, deepspeed, transformers; print(f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, transformers {transformers.__version__}")')"
fi

apt_packages=()
pages=$(find /usr/share/man/ja -name '*.gz' 2>/dev/null | wc -l || true)  # no folder: 0
[ "$pages" -ge 1000 ] || apt_packages+=(manpages-ja manpages-ja-dev)
command -v groff >/dev/null || apt_packages+=(groff-base)
if [ ${#apt_packages[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[setup] installing the demo corpus and its converter: ${apt_packages[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apt_packages[@]}" >/dev/null
  else
    echo "[setup] the demo corpus or its converter is missing: run 'sudo apt-get install ${apt_packages[*]}'" >&2
  fi
fi
