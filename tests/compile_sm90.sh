#!/usr/bin/env bash
# The Hopper (Gluon) kernels compiled for sm_90a on this (CPU) machine with the Triton release they
# are checked on (kernels/dispatch.py SM90_TRITON), which goes to build/triton-sm90/ (gitignored,
# ~650 MB, not the venv's Triton: Gluon's API moves between releases) - and the sampler's kernels
# with it: tests/test_kernels_compile.py. CI runs it after the two test tiers (.ci/run).
#
#   bash tests/compile_sm90.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
release=3.6.0  # kernels/dispatch.py SM90_TRITON
target=build/triton-sm90
if ! PYTHONPATH=$target python -c "import triton, sys; sys.exit(triton.__version__ != '$release')" 2>/dev/null; then
  rm -rf "$target"
  python -m pip install -q --no-deps --target "$target" "triton==$release"
fi
PYTHONPATH=$target PAGED_BACKEND_REQUIRE_SM90_COMPILE=1 python -m pytest -q tests/test_kernels_compile.py "$@"
