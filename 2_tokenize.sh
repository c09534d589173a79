#!/usr/bin/env bash
# Stage 2: tokenize the corpus into a Megatron dataset (data/tokenized/ja_text_document.bin/.idx).
# Usage: bash 2_tokenize.sh [--config config.yaml] [--shard I/N] [--force] [key=value ...]
#        several machines: bash 2_tokenize.sh --shard I/N on each, then python -m gptpipe merge --shards N
# The work: src/gptpipe/data/tokenize.py (the .bin/.idx format: data/indexed.py).
set -euo pipefail
exec python -m gptpipe tokenize "$@"
