#!/usr/bin/env bash
# Stage 3 on several machines with the deepspeed launcher and a hostfile, one line per node ("node1 slots=8").
# The repository, the .venv and the data at the same path on every node; the run folder (train.output_model_dir)
# on a shared filesystem, or in a bucket (gs://, s3://: each node then stages and uploads its own ranks' files).
# Check the fit for the whole job first: python -m gptpipe plan --gpus TOTAL_GPUS
#
# Two ways to start it:
#   with passwordless ssh (pdsh) from the first node, run once there:
#     HOSTFILE=hostfile bash 3_train_multi_node.sh [--config config.yaml] [key=value ...]
#   without ssh, run the same command on every node, each with its own NODE_RANK (0 on the first node,
#   whose address is MASTER_ADDR):
#     HOSTFILE=hostfile NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash 3_train_multi_node.sh [key=value ...]
# A one-line hostfile ("localhost slots=2") with NODE_RANK=0 MASTER_ADDR=127.0.0.1 runs on this machine alone:
# that is how the tests run it. Exit codes as in 3_train_node1.sh; without ssh on every node: 75 when its ranks
# saved on SIGTERM/SIGINT (sent to this script or to its whole process group).
# Nodes with several network interfaces: set NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME (gptpipe's stop flag
# and bucket mirror use gloo groups besides NCCL) to the interface the nodes reach each other on, e.g. eth0.
set -euo pipefail
HOSTFILE=${HOSTFILE:-hostfile}
[ -f "$HOSTFILE" ] || { echo "hostfile $HOSTFILE not found (one 'host slots=N' line per node)" >&2; exit 2; }
MASTER_PORT=${MASTER_PORT:-29500}
PYTHON=${PYTHON:-python}
NODE_ARGS=()
if [ -n "${NODE_RANK:-}" ]; then
  [ -n "${MASTER_ADDR:-}" ] || { echo "NODE_RANK is set: also set MASTER_ADDR (the first node's address)" >&2; exit 2; }
  NODE_ARGS=(--no_ssh --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR")
fi
# The work: src/gptpipe/train/train.py. The launcher starts `python -m gptpipe train` on every node in this directory with LOCAL_RANK, RANK,
# WORLD_SIZE and MASTER_ADDR set (--no_local_rank: the rank goes in the environment, not the arguments);
# gptpipe joins that process group (NCCL on GPUs, gloo on CPU).
# The deepspeed launcher dies of a SIGTERM (its no-ssh path) or stops its ranks within 30 s and exits 1: it
# runs in a session of its own, out of reach of signals to this script's process group, and a SIGTERM or
# SIGINT here goes to this node's ranks alone (with pdsh: to the launcher, which signals every node), which
# save and exit 75; the launcher then passes that code on.
# The first local rank also writes it to GPTPIPE_EXIT_FILE (runtime/loop.py, run_ranks) for any launcher that
# would not.
export GPTPIPE_EXIT_FILE
GPTPIPE_EXIT_FILE=$(mktemp)
trap 'rm -f "$GPTPIPE_EXIT_FILE"' EXIT
setsid $PYTHON -m deepspeed.launcher.runner --hostfile "$HOSTFILE" --master_port "$MASTER_PORT" "${NODE_ARGS[@]}" \
  --no_local_rank --module gptpipe train "$@" &
LAUNCHER=$!
stop_ranks() {
  if [ -z "${NODE_RANK:-}" ]; then  # pdsh: the runner forwards it to every node
    kill -TERM "$LAUNCHER" 2>/dev/null || true
    return
  fi
  local launch
  for launch in $(pgrep -P "$LAUNCHER"); do  # the runner's child is deepspeed.launcher.launch; its children the ranks
    pkill -TERM -P "$launch" || true
  done
}
trap stop_ranks TERM INT
source "$(dirname "${BASH_SOURCE[0]}")/scripts/wait_launcher.sh"
wait_launcher_and_exit
