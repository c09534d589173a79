# Sourced by scripts/launch_ranks.sh and 3_train_multi_node.sh once they have started the launcher ($LAUNCHER)
# and trapped SIGTERM/SIGINT. A trapped signal ends `wait` early while the ranks still save, so this waits
# until the launcher is gone, then exits with the ranks' code: the launcher's own, or where the launcher turns
# every failure into 1, the code a rank wrote to $GPTPIPE_EXIT_FILE (2 refused, 75 saved after a signal).
wait_launcher_and_exit() {
  local code=0
  wait "$LAUNCHER" || code=$?
  while kill -0 "$LAUNCHER" 2>/dev/null; do
    code=0
    wait "$LAUNCHER" || code=$?
  done
  if [ "$code" -ne 0 ] && [ -s "$GPTPIPE_EXIT_FILE" ]; then
    code=$(cat "$GPTPIPE_EXIT_FILE")
  fi
  exit "$code"
}
