# Sourced by tests/gpu/run.sh (and by one-off commands on the lent GPU machine, run from the
# repository root): the peers' wheels in /tmp/site, and this project installed as pip installs it
# (kernels/, scheduler/, integration/ as paged_backend.*), editable and without dependencies (the
# machine has torch and Triton; nothing can be downloaded there).
export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | grep -v -i "warning\|notice" | tail -3
python3 -c "import paged_backend.scheduler, paged_backend.kernels.decode" || echo "env.sh: paged_backend is not importable"
