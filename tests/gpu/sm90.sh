#!/usr/bin/env bash
# On the lent H100/H200 (carry .whl): the Hopper (Gluon) kernels' GPU tests, then bench_cascade with the
# Hopper node kernel and, in the same run, with PAGED_BACKEND_SM90=0 (the portable node kernel on the same
# plans), and bench_prefill (which times both prefill kernels). Everything lands in $OUT in seven files
# (the device tool returns at most eight): sm90.log, cascade_{sm90,portable}.{json,md}, results.{json,md}.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
LOG="$OUT/sm90.log"
export PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi-ws}
mkdir -p "$FLASHINFER_WORKSPACE_BASE"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -3
. tests/gpu/env.sh
timeout ${TEST_S:-300} python3 -m pytest -q -x -p no:cacheprovider -m gpu ${TESTS:-tests/test_cascade_sm90.py \
  tests/test_prefill_sm90.py tests/test_cascade.py} 2>&1 | tail -25 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
# cascade: the Hopper node kernel with its plans, then the portable one with its own (wider) plans
python3 benchmarks/bench_cascade.py --out "$OUT/cascade_sm90.json" --md "$OUT/cascade_sm90.md" 2>&1 \
  | tail -15 | tee -a "$LOG"
PAGED_BACKEND_SM90=0 python3 benchmarks/bench_cascade.py --impls ours_cascade --out "$OUT/cascade_portable.json" \
  --md "$OUT/cascade_portable.md" 2>&1 | tail -12 | tee -a "$LOG"
# prefill: times the portable kernel beside the Hopper one itself; writes benchmarks/results/<gpu>.*
python3 benchmarks/bench_prefill.py 2>&1 | tail -8 | tee -a "$LOG"
for f in benchmarks/results/h*.json benchmarks/results/h*.md; do
  [ "$f" -nt tests/gpu/sm90.sh ] && cp "$f" "$OUT/results.${f##*.}"
done
exit $rc
