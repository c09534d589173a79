#!/usr/bin/env bash
# Stage 3 on several machines with the deepspeed launcher: one line per node in a hostfile
# ("node1 slots=8"), passwordless ssh from this node to the others, the repository, the .venv and the
# data at the same path on every node, and the run folder (train.output_model_dir) on a shared filesystem.
#   HOSTFILE=hostfile bash 3_train_multi_node.sh [--config config.yaml] [key=value ...]
# Check the fit first for the whole job: python -m gptpipe plan --gpus TOTAL_GPUS
set -euo pipefail
HOSTFILE=${HOSTFILE:-hostfile}
[ -f "$HOSTFILE" ] || { echo "hostfile $HOSTFILE not found (one 'host slots=N' line per node)" >&2; exit 2; }
MASTER_PORT=${MASTER_PORT:-29500}
# The launcher starts `python -m gptpipe train` on every node in this directory with LOCAL_RANK, RANK,
# WORLD_SIZE and MASTER_ADDR set (--no_local_rank: the rank goes in the environment, not the arguments);
# gptpipe joins that process group (NCCL).
exec deepspeed --hostfile "$HOSTFILE" --master_port "$MASTER_PORT" --no_local_rank --module gptpipe train "$@"
