#!/usr/bin/env bash
# The one script run on the lent GPU machine (python3 3.12, torch 2.11, Triton 3.6, no network).
#
#   tests/gpu/run.sh [all | tests | decode | <name> ...] [-- extra args for the benchmark scripts]
#
# all (default) = the gpu-marked pytest tests + every benchmarks/bench_*.py; <name> runs
# benchmarks/bench_<name>.py with its default output files (benchmarks/results/<gpu>.json and
# <gpu>.md, one section per benchmark); args after -- go to every benchmark run (so give one).
# Peers come from the carried wheels in .whl/ (installed into /tmp/site). What comes back, in $OUT
# (default /tmp/gpu-out): env.txt, pytest.log, test_times.txt, bench.log, <gpu>.json, <gpu>.md.
# Longer than one device call (10 min; the whole suite on a fresh H200 is): tests/gpu/detached.sh.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi-ws}  # JIT cache: $BASE/.cache/flashinfer
mkdir -p "$FLASHINFER_WORKSPACE_BASE"
if ! command -v nvcc >/dev/null 2>&1; then
  for d in "${CUDA_HOME:-}" /usr/local/cuda /usr/local/cuda-*; do
    if [ -n "$d" ] && [ -x "$d/bin/nvcc" ]; then export PATH="$d/bin:$PATH"; break; fi
  done
fi
if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null 2>&1; then
  CUDA_HOME="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"; export CUDA_HOME
fi

WHAT=(); EXTRA=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; EXTRA=("$@"); break; fi
  WHAT+=("$1"); shift
done
[ ${#WHAT[@]} -eq 0 ] && WHAT=(all)
if [ "${WHAT[*]}" = "all" ]; then
  WHAT=(tests)
  for f in benchmarks/bench_*.py; do n=${f#benchmarks/bench_}; WHAT+=("${n%.py}"); done
fi

STATUS=0; SUMMARY=()
{
  echo "== $(date -u '+%F %T UTC')  steps: ${WHAT[*]}"
  nvidia-smi -L
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,driver_version --format=csv
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -5
  else
    echo "no .whl/*.whl carried: FlashInfer and xformers will be skipped"
  fi
  echo "nvcc: $(command -v nvcc || echo missing) $(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*')"
  echo "ninja: $(command -v ninja || echo missing)  CUDA_HOME=${CUDA_HOME:-unset}"
} 2>&1 | tee "$OUT/env.txt"
. tests/gpu/env.sh

python3 - <<'EOF' 2>&1 | tee -a "$OUT/env.txt"
import importlib, torch, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "| triton", triton.__version__,
      "|", torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).multi_processor_count, "SMs")
for m in ("flashinfer", "xformers", "pytest"):
    try:
        print(m, getattr(importlib.import_module(m), "__version__", "?"))
    except Exception as e:
        print(m, "unavailable:", type(e).__name__, str(e)[:200])
EOF
GPU=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from common import gpu_slug; print(gpu_slug())" 2>/dev/null || echo gpu)

warm_flashinfer() {  # JIT-build FlashInfer's decode module (~20 s) before anything is timed
  timeout 300 python3 - <<'EOF' 2>&1 | tail -20 | tee -a "$OUT/env.txt"
import time, torch
try:
    import flashinfer
except Exception as e:
    raise SystemExit(f"flashinfer import failed: {e}")
dev, bf = "cuda", torch.bfloat16
i32 = dict(dtype=torch.int32, device=dev)
ws = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
t = time.time()
try:  # CUDA-core decode (GQA 4; MQA runs it with group 8, benchmarks/peers.py)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(torch.tensor([0, 4], **i32), torch.arange(4, **i32), torch.tensor([16], **i32), 32, 8, 128, 16,
           q_data_type=bf, kv_data_type=bf)
    k = torch.randn(4, 16, 8, 128, dtype=bf, device=dev)
    w.run(torch.randn(1, 32, 128, dtype=bf, device=dev), (k, k), return_lse=True)
    torch.cuda.synchronize()
    print(f"flashinfer warm (decode): {time.time() - t:.1f} s")
except Exception as e:
    print(f"flashinfer warm (decode) FAILED after {time.time() - t:.1f} s: {type(e).__name__}: {str(e)[-1500:]}")
EOF
}

WARMED=0
for step in "${WHAT[@]}"; do
  if [ "$step" = "tests" ]; then
    # (--durations: the suite outgrew one device call on a fresh H200, 2026-11-28; see what costs -
    # test_times.txt says it as the tests finish, for a run cut short: tests/conftest.py)
    PAGED_BACKEND_TEST_TIMES="$OUT/test_times.txt" \
      python3 -m pytest -m gpu -q -p no:cacheprovider --durations=30 tests 2>&1 | tee "$OUT/pytest.log"
    rc=$?
    if [ $rc -eq 5 ]; then SUMMARY+=("tests: none marked gpu"); rc=0; else SUMMARY+=("tests: rc=$rc"); fi
  elif [ -f "benchmarks/bench_$step.py" ]; then
    if [ $WARMED -eq 0 ]; then warm_flashinfer; WARMED=1; fi
    t0=$(date +%s)
    echo "===== bench_$step $(date -u '+%T UTC')" >> "$OUT/bench.log"
    if [ "$step" = "parallel" ]; then  # one process per GPU; NVLink multicast stays off
      ngpu=$(nvidia-smi -L | wc -l)
      if [ "$ngpu" -lt 2 ]; then
        echo "bench_parallel needs >= 2 GPUs (this machine has $ngpu): skipped" | tee -a "$OUT/bench.log"
        SUMMARY+=("parallel: skipped (1 GPU)"); continue
      fi
      NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        torchrun --nproc_per_node="$ngpu" benchmarks/bench_parallel.py --out "$OUT/parallel_${GPU}x$ngpu.json" \
        ${EXTRA[@]+"${EXTRA[@]}"} 2>&1 | tee -a "$OUT/bench.log"
    else
      python3 "benchmarks/bench_$step.py" ${EXTRA[@]+"${EXTRA[@]}"} 2>&1 | tee -a "$OUT/bench.log"
    fi
    rc=$?
    SUMMARY+=("$step: rc=$rc ($(( $(date +%s) - t0 )) s)")
  else
    echo "unknown step '$step' (no benchmarks/bench_$step.py)"; rc=2; SUMMARY+=("$step: unknown")
  fi
  [ $rc -ne 0 ] && STATUS=1
done
for f in "benchmarks/results/$GPU.json" "benchmarks/results/$GPU.md"; do [ -f "$f" ] && cp "$f" "$OUT/"; done
echo; echo "== run.sh summary: ${SUMMARY[*]}  -> $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $STATUS
