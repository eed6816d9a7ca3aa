#!/usr/bin/env bash
# On the lent GPU machine (carry .whl and .vllm-py, made by tests/gpu/vllm_carry.sh): vLLM's Python
# files and light requirements installed under /tmp (tests/gpu/env.sh), then the vLLM plug-in's GPU
# tests alone (builder and forward with CUDA tensors through vLLM's classes; tests/gpu/run.sh tests
# runs them with the rest where .vllm-py is carried) and benchmarks/bench_vllm.py.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
[ -f .vllm-py/vllm-0.33.0-py.tar.xz ] || { echo "no .vllm-py/ carried: bash tests/gpu/vllm_carry.sh here first"; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -3
export PYTHONUNBUFFERED=1
. tests/gpu/env.sh
python3 -c "import vllm, torch; print('vllm', vllm.__version__, '| torch', torch.__version__)" 2>&1 | tail -3 | tee "$OUT/vllm_env.txt"
python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_vllm_backend.py 2>&1 | tee "$OUT/vllm_pytest.log"
rc=$?
python3 benchmarks/bench_vllm.py --out "$OUT/vllm.json" --md "$OUT/vllm.md" 2>&1 | grep -v "^WARNING\|^INFO" | tee "$OUT/vllm_bench.log"
exit $rc
