#!/usr/bin/env bash
# Run here (the CPU machine): another commit's code, for a same-run A/B on the lent GPU (tests/gpu/ab.sh).
#
#   bash tests/gpu/ab_prepare.sh REF      # -> .ab/ (gitignored, ~2 MB); carry [".whl", ".ab"]
#
# Its benchmarks/results/ and docs/ stay out.
set -euo pipefail
cd "$(dirname "$0")/../.."
ref=${1:?usage: tests/gpu/ab_prepare.sh REF}
rm -rf .ab && mkdir -p .ab
git archive "$ref" -- . ':!benchmarks/results' ':!docs' | tar -x -C .ab
git rev-parse --short "$ref" > .ab/REF
echo ".ab: $(cat .ab/REF), $(du -sh .ab | cut -f1); carry [\".whl\", \".ab\"]"
