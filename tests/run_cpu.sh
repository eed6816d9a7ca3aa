#!/usr/bin/env bash
# The test command: both CPU paths of every op.
#  1. all tests; kernel ops run their vectorised torch implementations;
#  2. tests marked `kernel` again with TRITON_INTERPRET=1, so the Triton kernels run on the CPU.
# GPU-only tests (marked `gpu`) run on the lent GPU through tests/gpu/run.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=()
if python -c "import xdist" 2>/dev/null; then jobs=(-n 2); fi
python -m pytest -q -m "not gpu" "${jobs[@]}" "$@"
TRITON_INTERPRET=1 python -m pytest -q -m "kernel and not gpu" "${jobs[@]}" "$@"
