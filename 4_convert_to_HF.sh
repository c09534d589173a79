#!/usr/bin/env bash
# Stage 4: export the newest complete stage-3 checkpoint to a verified HuggingFace folder
# (safetensors, config, fast tokenizer, model card; manifest.json says whether verification passed).
# Usage: bash 4_convert_to_HF.sh [--config convert_config.yaml] [--force] [key=value ...]
#        e.g. bash 4_convert_to_HF.sh checkpoint_step=2000 dtype=fp32
# The work: src/gptpipe/export/convert.py (the gate: export/verify.py, the card: export/card.py).
set -euo pipefail
exec python -m gptpipe convert "$@"
