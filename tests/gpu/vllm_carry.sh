#!/usr/bin/env bash
# Run here (CPU machine, after tests/install_vllm.sh): what the lent GPU machine needs to import
# vLLM 0.33's attention, config and plug-in modules, which its full wheel (900 MB, CUDA ops for
# torch 2.14) cannot bring: vLLM's Python files (.vllm-py/, 6.5 MB) and Python 3.12 wheels of the
# light requirements that machine lacks (.whl/). Carry both; tests/gpu/vllm.sh installs them there.
set -euo pipefail
cd "$(dirname "$0")/../.."
site=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
mkdir -p .vllm-py .whl
(cd "$site" && find vllm vllm-0.33.0.dist-info -type f \( -name "*.py" -o -path "*dist-info*" \) \
   ! -path "vllm/third_party/*" ! -path "*__pycache__*" -print0 | tar --null -T - -cJf - ) > .vllm-py/vllm-0.33.0-py.tar.xz
plat=(--platform manylinux2014_x86_64 --platform any)
for n in 39 38 35 34 31 28 27 24 17; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
# tests/vllm-requirements.txt and xgrammar, less what the GPU image has (aiohttp, pillow, psutil, ...), plus
# the transformers the project pins (the image has 5.17) and
# their own requirements that it lacks
for p in annotated-types==0.8.0 apache-tvm-ffi==0.1.11 cachetools==8.0.2 cbor2==6.3.0 fastapi==0.136.3 \
         httpcore2==2.16.2 httpx2==2.16.2 jiter==0.19.0 llguidance==1.7.6 msgspec==0.22.0 openai==3.57.0 \
         oss-harmony==0.0.11 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 pydantic==2.14.4 \
         pydantic-core==2.50.5 pyzmq==27.3.0 sniffio==1.3.1 starlette==1.10.0 truststore==0.10.5 \
         typing-inspection==0.4.5 xgrammar==0.2.8 transformers==5.20.2; do
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d .whl "$p"
done
du -sh .vllm-py .whl
