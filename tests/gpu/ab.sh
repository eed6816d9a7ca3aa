#!/usr/bin/env bash
# On the lent GPU machine: one command run on this tree ("after") and then on .ab/ ("before": another
# commit's code, made by tests/gpu/ab_prepare.sh and carried), each installed as paged_backend in turn
# (editable, as tests/gpu/env.sh does), in one call - the same machine and process kind for both sides:
#
#   bash tests/gpu/ab.sh 'python3 benchmarks/bench_sampler.py --out $OUT/$SIDE.json --md $OUT/$SIDE.md'
#
# The command runs under bash -c in that side's root with $SIDE (after, before) and $OUT set; the
# working tree is installed again at the end.
set -uo pipefail
cd "$(dirname "$0")/../.."
cmd=${1:?usage: tests/gpu/ab.sh COMMAND}
[ -f .ab/REF ] || { echo "no .ab/: run tests/gpu/ab_prepare.sh REF on the CPU machine and carry .ab"; exit 2; }
OUT=${OUT:-/tmp/gpu-out}
export OUT PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
fi
install() { (cd "$1" && python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1); }
rc=0
for side in after before; do
  dir=.; name="the working tree"
  if [ "$side" = before ]; then dir=.ab; name=$(cat .ab/REF); fi
  install "$dir" || { echo "installing $name failed"; rc=1; break; }
  echo "== $side: $name ($(date -u +%T))"
  (cd "$dir" && SIDE=$side bash -c "$cmd") || rc=1
done
install . || { echo "reinstalling the working tree failed"; rc=1; }
exit $rc
