#!/usr/bin/env bash
# On the lent GPU machine (carry .whl and .vllm-py, made by tests/gpu/vllm_carry.sh): vLLM's Python
# files and light requirements installed under /tmp, then the vLLM plug-in's GPU tests (builder and
# forward with CUDA tensors through vLLM's classes) and benchmarks/bench_vllm.py. vLLM's platform is
# its CPU one (VLLM_TARGET_DEVICE=cpu): its CUDA platform needs the compiled ops of its full wheel.
# A process of its own, not the whole suite's: importing vLLM sets TORCHINDUCTOR_COMPILE_THREADS=1 and
# patches Inductor's memory planning (vllm/env_override.py), which must not reach the engine's tests.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT" /tmp/vllm-py
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -3
tar -xJf .vllm-py/vllm-0.33.0-py.tar.xz -C /tmp/vllm-py
export PYTHONPATH=/tmp/vllm-py PYTHONUNBUFFERED=1 VLLM_TARGET_DEVICE=cpu PAGED_BACKEND_REQUIRE_VLLM=1
. tests/gpu/env.sh
python3 -c "import vllm, torch; print('vllm', vllm.__version__, '| torch', torch.__version__)" 2>&1 | tail -3 | tee "$OUT/vllm_env.txt"
python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_vllm_backend.py 2>&1 | tee "$OUT/vllm_pytest.log"
rc=$?
python3 benchmarks/bench_vllm.py --out "$OUT/vllm.json" --md "$OUT/vllm.md" 2>&1 | grep -v "^WARNING\|^INFO" | tee "$OUT/vllm_bench.log"
exit $rc
