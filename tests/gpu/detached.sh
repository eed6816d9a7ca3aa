#!/usr/bin/env bash
# tests/gpu/run.sh in a process session of its own, for runs longer than one device call (10 min):
#
#   tests/gpu/detached.sh start [run.sh args...]   # starts it (setsid), then waits like `wait`
#   tests/gpu/detached.sh wait                     # waits for it, up to $WAIT s (default 560)
#
# The device machine keeps a process of its own session running between calls while it stays warm
# (30 s after a call returns), so issue `wait` calls back to back until it prints "finished". The
# whole GPU suite then runs in one process however long it takes (`start tests`). Each call prints
# the progress and copies run.sh's files (env.txt, pytest.log, ...) to $OUT; run.sh's last line
# (its summary) appears in detached.log once it has finished.
set -uo pipefail
cd "$(dirname "$0")/../.."
DIR=/tmp/gpu-detached
WAIT=${WAIT:-560}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
case "${1:-}" in
  start)
    shift
    rm -rf "$DIR"; mkdir -p "$DIR/out"
    OUT="$DIR/out" setsid bash -c 'bash tests/gpu/run.sh "$@" > "'"$DIR"'/detached.log" 2>&1; echo $? > "'"$DIR"'/rc"' \
      run "$@" < /dev/null > /dev/null 2>&1 &
    echo "started: tests/gpu/run.sh $*" ;;
  wait) ;;
  *) echo "usage: $0 start [run.sh args...] | wait" >&2; exit 2 ;;
esac
[ -d "$DIR" ] || { echo "nothing started on this machine (a fresh one: start again)"; exit 1; }
t0=$(date +%s)
while [ ! -f "$DIR/rc" ] && [ $(( $(date +%s) - t0 )) -lt "$WAIT" ]; do sleep 5; done
cp "$DIR"/out/* "$DIR/detached.log" "$OUT/" 2>/dev/null
if [ -f "$DIR/rc" ]; then
  echo "finished: rc=$(cat "$DIR/rc")"; tail -3 "$DIR/detached.log"
  [ -f "$DIR/out/pytest.log" ] && tail -2 "$DIR/out/pytest.log"
  exit "$(cat "$DIR/rc")"
fi
echo "still running after $(( $(date +%s) - t0 )) s: call 'tests/gpu/detached.sh wait' again within 30 s"
[ -f "$DIR/out/pytest.log" ] && tail -c 400 "$DIR/out/pytest.log"
exit 0
