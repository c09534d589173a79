#!/usr/bin/env bash
# One training command on the ranks of this machine: what 3_train_node1.sh (train) and 7_finetune.sh (finetune)
# run.   bash scripts/launch_ranks.sh COMMAND [gptpipe arguments ...]     e.g. ... train train.lr=3e-4
# Ranks: every local GPU (torchrun); on a machine without GPU, NPROC CPU ranks over gloo (default 1),
# each with OMP_NUM_THREADS = cores / NPROC. Override with NPROC=N.
# The exit code is the command's own (0 done, 1 failed, 2 refused before starting, 75 stopped by
# SIGTERM/SIGINT after saving a checkpoint), through torchrun too.
set -euo pipefail
COMMAND=${1:?usage: launch_ranks.sh COMMAND [gptpipe arguments ...]}
shift
PYTHON=${PYTHON:-python}
GPUS=$($PYTHON -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
NPROC=${NPROC:-$(( GPUS > 0 ? GPUS : 1 ))}
if [ "$GPUS" -eq 0 ]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))}
fi
if [ "$NPROC" -eq 1 ]; then
  exec $PYTHON -m gptpipe "$COMMAND" "$@"  # one rank needs no launcher (and keeps the exit code)
fi
# torchrun forwards SIGTERM to every rank and waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT s for their save.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-300}
# torchrun turns any rank's non-zero exit into 1: rank 0 writes its real code (2, 75) to this file
# (runtime/loop.py, run_ranks).
export GPTPIPE_EXIT_FILE
GPTPIPE_EXIT_FILE=$(mktemp)
trap 'rm -f "$GPTPIPE_EXIT_FILE"' EXIT
$PYTHON -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m gptpipe "$COMMAND" "$@" &
LAUNCHER=$!
trap 'kill -TERM "$LAUNCHER" 2>/dev/null || true' TERM INT
source "$(dirname "${BASH_SOURCE[0]}")/wait_launcher.sh"
wait_launcher_and_exit
