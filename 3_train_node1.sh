#!/usr/bin/env bash
# Stage 3 on this machine: DeepSpeed ZeRO pretraining of the GPT described in config.yaml.
#   bash 3_train_node1.sh [--config config.yaml] [key=value ...]     e.g. bash 3_train_node1.sh train.lr=3e-4
# Ranks: every local GPU (torchrun); on a machine without GPU, NPROC CPU ranks over gloo (default 1),
# each with OMP_NUM_THREADS = cores / NPROC. Override with NPROC=N (scripts/launch_ranks.sh starts them).
# It prints the plan first and refuses a run that will not fit. Rerunning resumes from the newest
# complete checkpoint. Exit codes: 0 done, 1 failed, 2 refused before starting, 75 stopped by
# SIGTERM/SIGINT after saving a checkpoint (run the same command again to continue).
# The work: src/gptpipe/train/train.py (loop: runtime/loop.py, engine: runtime/engine.py, data: train/data.py,
# plan: train/plan.py).
exec bash "$(dirname "${BASH_SOURCE[0]}")/scripts/launch_ranks.sh" train "$@"
