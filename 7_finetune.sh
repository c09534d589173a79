#!/usr/bin/env bash
# Stage 7 on this machine: fine-tune the exported model on a labelled task (finetune_config.yaml).
#   bash 7_finetune.sh [--config finetune_config.yaml] [key=value ...]   e.g. bash 7_finetune.sh train.lr=1e-4
# Ranks: every local GPU (torchrun); on a machine without GPU, NPROC CPU ranks over gloo (default 1),
# each with OMP_NUM_THREADS = cores / NPROC. Override with NPROC=N.
# It evaluates on the validation rows every train.eval_interval steps and at the end, and marks the best
# checkpoint (checkpoints/best). Rerunning resumes from the newest complete checkpoint. Exit codes: 0 done,
# 1 failed, 2 refused before starting, 75 stopped by SIGTERM/SIGINT after saving a checkpoint (run the same
# command again to continue).
set -euo pipefail
PYTHON=${PYTHON:-python}
GPUS=$($PYTHON -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
NPROC=${NPROC:-$(( GPUS > 0 ? GPUS : 1 ))}
if [ "$GPUS" -eq 0 ]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))}
fi
if [ "$NPROC" -eq 1 ]; then
  exec $PYTHON -m gptpipe finetune "$@"  # one rank needs no launcher (and keeps the exit code)
fi
# torchrun forwards SIGTERM to every rank and waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT s for their save.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-300}
# torchrun turns any rank's non-zero exit into 1: rank 0 writes its real code (2, 75) to this file.
export GPTPIPE_EXIT_FILE
GPTPIPE_EXIT_FILE=$(mktemp)
trap 'rm -f "$GPTPIPE_EXIT_FILE"' EXIT
$PYTHON -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m gptpipe finetune "$@" &
LAUNCHER=$!
trap 'kill -TERM "$LAUNCHER" 2>/dev/null || true' TERM INT
code=0
wait "$LAUNCHER" || code=$?
while kill -0 "$LAUNCHER" 2>/dev/null; do  # a trapped signal ends `wait` early: wait for the save
  code=0
  wait "$LAUNCHER" || code=$?
done
if [ "$code" -ne 0 ] && [ -s "$GPTPIPE_EXIT_FILE" ]; then
  code=$(cat "$GPTPIPE_EXIT_FILE")
fi
exit "$code"
