#!/usr/bin/env bash
# The test command: both CPU paths of every op, and the engine.
#  1. all tests; kernel ops run their vectorised torch implementations (the engine and CLI tests
#     run here, with the embedded model);
#  2. tests marked `kernel` again with TRITON_INTERPRET=1, so the Triton kernels run on the CPU.
# Two tiers (tests/conftest.py marks tier 2 `exhaustive`; each case is in exactly one tier):
#   bash tests/run_cpu.sh               tier 1, the README's command: every op, path and integration
#                                       once (~5.5 min on 2 idle cores, 2026-11-30)
#   bash tests/run_cpu.sh --exhaustive  tier 2: the rest of the matrices (.ci/run runs it after tier 1)
#   bash tests/run_cpu.sh --all         both tiers in one go
# Other arguments go to both pytest runs (e.g. -x -k decode).
# GPU-only tests (marked `gpu`) run on the lent GPU through tests/gpu/run.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
tier="not exhaustive"
case "${1:-}" in
  --exhaustive) tier="exhaustive"; shift ;;
  --all) tier=""; shift ;;
esac
# OpenMP threads that spin while they wait make a loaded 2-core host 10x slower: wait passively,
# and with two test workers give each one thread. The engine tests share one worker (one model load).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
jobs=()
if python -c "import xdist" 2>/dev/null; then
  jobs=(-n 2 --dist loadgroup)
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
run() {  # a pass that selects nothing (exit 5, e.g. -k with tier 2) is not a failure
  local rc=0
  "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then echo "(no tests selected in this pass)"; rc=0; fi
  return "$rc"
}
run python -m pytest -q -m "not gpu${tier:+ and $tier}" "${jobs[@]}" "$@"
TRITON_INTERPRET=1 run python -m pytest -q -m "kernel and not gpu${tier:+ and $tier}" "${jobs[@]}" "$@"
