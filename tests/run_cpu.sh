#!/usr/bin/env bash
# The test command: both CPU paths of every op, and the engine.
#  1. all tests; kernel ops run their vectorised torch implementations (the engine and CLI tests
#     run here, with the embedded model);
#  2. tests marked `kernel` again with TRITON_INTERPRET=1, so the Triton kernels run on the CPU.
# GPU-only tests (marked `gpu`) run on the lent GPU through tests/gpu/run.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
# OpenMP threads that spin while they wait make a loaded 2-core host 10x slower: wait passively,
# and with two test workers give each one thread. The engine tests share one worker (one model load).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
jobs=()
if python -c "import xdist" 2>/dev/null; then
  jobs=(-n 2 --dist loadgroup)
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
python -m pytest -q -m "not gpu" "${jobs[@]}" "$@"
TRITON_INTERPRET=1 python -m pytest -q -m "kernel and not gpu" "${jobs[@]}" "$@"
