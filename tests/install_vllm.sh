#!/usr/bin/env bash
# vLLM for tests/test_vllm_backend.py on a CPU-only machine: vLLM 0.33.0 without its requirements
# (they pull a CUDA build of torch), the light packages its attention, config and plug-in modules
# import (tests/vllm-requirements.txt), and xgrammar without its own (torch, triton: already here).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --no-deps vllm==0.33.0 xgrammar==0.2.8
python -m pip install -q -r tests/vllm-requirements.txt
