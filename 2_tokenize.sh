#!/usr/bin/env bash
# Stage 2: tokenize the corpus into a Megatron dataset (data/tokenized/ja_text_document.bin/.idx).
# Usage: bash 2_tokenize.sh [--config config.yaml] [--shard I/N] [--force] [key=value ...]
#        a Ray cluster: tokenize.executor=ray tokenize.ray_address=auto (partitions a rerun keeps, put in place
#        by Ray tasks); without Ray: bash 2_tokenize.sh --shard I/N on each machine, then gptpipe merge --shards N
# The work: src/gptpipe/data/tokenize.py (the .bin/.idx format: data/indexed.py).
set -euo pipefail
exec python -m gptpipe tokenize "$@"
