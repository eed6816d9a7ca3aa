#!/usr/bin/env bash
# tests/gpu/run.sh in a process session of its own, for runs longer than one device call (10 min):
#
#   tests/gpu/detached.sh start [run.sh args...]   # starts it (setsid), then waits like `wait`
#   tests/gpu/detached.sh wait                     # waits for it, up to $WAIT s (default 560)
#   tests/gpu/detached.sh pack                     # the compile caches into $OUT (after `finished`)
#
# The device machine keeps a process of its own session running between calls while it stays warm
# (30 s after a call returns), so issue `wait` calls back to back until it prints "finished". The
# whole GPU suite then runs in one process however long it takes (`start tests`), on a copy of the
# tree taken at `start`: each later call copies the working tree over the repository again, which
# replaced the benchmarks/results/ files a detached benchmark had written (2026-12-01); paged_backend
# stays installed from the copy until tests/gpu/env.sh (run.sh, ab.sh) installs a tree again. Each call prints
# the progress and copies run.sh's files (env.txt, pytest.log, ...) to $OUT; run.sh's last line
# (its summary) appears in detached.log once it has finished. `pack` puts the compile caches the run
# filled (tests/gpu/env.sh) in $OUT as gpu-cache.tar.xz.00, .01, ... (15 MB parts, each one of the 8
# files a call brings back); copied here into .gpu-cache/ and carried, a later machine starts with them.
set -uo pipefail
cd "$(dirname "$0")/../.."
DIR=/tmp/gpu-detached
WAIT=${WAIT:-560}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
case "${1:-}" in
  start)
    shift
    rm -rf "$DIR"; mkdir -p "$DIR/out" "$DIR/tree"
    tar -cf - --exclude=./.git . | tar -xf - -C "$DIR/tree"
    (cd "$DIR/tree" && OUT="$DIR/out" setsid bash -c \
      'bash tests/gpu/run.sh "$@" > "'"$DIR"'/detached.log" 2>&1; echo $? > "'"$DIR"'/rc"' \
      run "$@" < /dev/null > /dev/null 2>&1 &)
    echo "started: tests/gpu/run.sh $* (in $DIR/tree)" ;;
  wait) ;;
  pack)
    [ -f "$DIR/rc" ] || { echo "pack: no finished run on this machine"; exit 1; }
    # (Triton's LLVM IR and input source are most of the bytes and no cache hit reads them: emptied)
    find /tmp/gpu-cache \( -name '*.llir' -o -name '*.source' \) -type f -exec truncate -s 0 {} +
    tar -C /tmp/gpu-cache --exclude=.unpacked -cf - . | xz -6 -T0 | split -b 15m -d - "$OUT/gpu-cache.tar.xz."
    du -sh /tmp/gpu-cache; ls -la "$OUT"/gpu-cache.tar.xz.*
    exit 0 ;;
  *) echo "usage: $0 start [run.sh args...] | wait | pack" >&2; exit 2 ;;
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
