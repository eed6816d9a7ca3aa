# Sourced by tests/gpu/run.sh (and by one-off commands on the lent GPU machine, run from the
# repository root): makes `paged_backend` importable as pip installs it - paged_backend/ with
# kernels/, scheduler/ and integration/ inside - from links into this tree (nothing to build, no
# setuptools needed), plus the peers' wheels in /tmp/site.
PB_PKG=${PB_PKG:-/tmp/pb-pkg}
rm -rf "$PB_PKG" && mkdir -p "$PB_PKG/paged_backend"
ln -s "$PWD"/paged_backend/*.py "$PB_PKG/paged_backend/"
for d in kernels scheduler integration; do ln -s "$PWD/$d" "$PB_PKG/paged_backend/$d"; done
export PYTHONPATH="$PB_PKG:/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
