# Sourced by tests/gpu/run.sh (and by one-off commands on the lent GPU machine, run from the
# repository root): the peers' wheels in /tmp/site, and this project installed as pip installs it
# (kernels/, scheduler/, integration/ as paged_backend.*), editable and without dependencies (the
# machine has torch and Triton; nothing can be downloaded there).
# Compile caches (Triton's kernels, Inductor's graphs) in /tmp/gpu-cache; a copy carried from an
# earlier machine (.gpu-cache/*.tar.xz*, made by `tests/gpu/detached.sh pack`) is unpacked first, so
# a fresh machine skips the compiles an earlier run made. Entries are keyed by their source and
# versions: a changed kernel compiles again.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/gpu-cache/triton}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/gpu-cache/inductor}
if ls .gpu-cache/*.tar.xz* >/dev/null 2>&1 && [ ! -e /tmp/gpu-cache/.unpacked ]; then
  mkdir -p /tmp/gpu-cache && cat .gpu-cache/*.tar.xz* | tar -xJf - -C /tmp/gpu-cache \
    && touch /tmp/gpu-cache/.unpacked && echo "env.sh: compile caches unpacked ($(du -sh /tmp/gpu-cache | cut -f1))"
fi
export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | grep -v -i "warning\|notice" | tail -3
python3 -c "import paged_backend.scheduler, paged_backend.kernels.decode" || echo "env.sh: paged_backend is not importable"
