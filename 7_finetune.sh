#!/usr/bin/env bash
# Stage 7 on this machine: fine-tune the exported model on a labelled task (finetune_config.yaml).
#   bash 7_finetune.sh [--config finetune_config.yaml] [key=value ...]   e.g. bash 7_finetune.sh train.lr=1e-4
# Ranks: every local GPU (torchrun); on a machine without GPU, NPROC CPU ranks over gloo (default 1),
# each with OMP_NUM_THREADS = cores / NPROC. Override with NPROC=N (scripts/launch_ranks.sh starts them).
# It evaluates on the validation rows every train.eval_interval steps and at the end, and marks the best
# checkpoint (checkpoints/best). Rerunning resumes from the newest complete checkpoint. Exit codes: 0 done,
# 1 failed, 2 refused before starting, 75 stopped by SIGTERM/SIGINT after saving a checkpoint (run the same
# command again to continue).
# The work: src/gptpipe/finetune/finetune.py (the loop: runtime/loop.py).
exec bash "$(dirname "${BASH_SOURCE[0]}")/scripts/launch_ranks.sh" finetune "$@"
