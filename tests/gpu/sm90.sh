#!/usr/bin/env bash
# On the lent H100/H200 (carry .whl): the Hopper (Gluon) kernels' GPU tests, then bench_cascade with the
# Hopper node kernel and, in the same run, with PAGED_BACKEND_SM90=0 (the portable kernels and their
# plans), and bench_prefill (which times both prefill kernels). Results and logs land in $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi-ws}
mkdir -p "$FLASHINFER_WORKSPACE_BASE"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -3
. tests/gpu/env.sh
timeout ${TEST_S:-300} python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/test_prefill_sm90.py \
  tests/test_cascade_sm90.py tests/test_cascade.py 2>&1 | tail -25 | tee "$OUT/sm90_pytest.log"
rc=${PIPESTATUS[0]}
# cascade: the Hopper node kernel with its plans, then the portable one with its own (wider) plans
python3 benchmarks/bench_cascade.py --out "$OUT/cascade_sm90.json" --md "$OUT/cascade_sm90.md" 2>&1 \
  | tail -15 | tee "$OUT/cascade_sm90.log"
PAGED_BACKEND_SM90=0 python3 benchmarks/bench_cascade.py --impls ours_cascade --out "$OUT/cascade_portable.json" \
  --md "$OUT/cascade_portable.md" 2>&1 | tail -12 | tee "$OUT/cascade_portable.log"
# prefill: times the portable kernel beside the Hopper one itself; writes benchmarks/results/<gpu>.*
python3 benchmarks/bench_prefill.py 2>&1 | tail -8 | tee "$OUT/prefill.log"
cp benchmarks/results/*.json benchmarks/results/*.md "$OUT/" 2>/dev/null
exit $rc
