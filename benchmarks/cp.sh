#!/usr/bin/env bash
# Context parallelism on every GPU of this host (issue 20): adaattn.distributed against ideal
# scaling and torch's context_parallel, one process per GPU under torchrun. Writes the suite's
# JSON and PNG to benchmarks/results (or $OUT_DIR). Arguments are passed to `adaattn bench`,
# e.g. `benchmarks/cp.sh --seq-lens 131072,524288` or `GPUS=2 benchmarks/cp.sh`.
# Runs from the source tree (nothing installed): PYTHONPATH=src.
set -euo pipefail
cd "$(dirname "$0")/.."
GPUS="${GPUS:-$(python3 -c 'import torch; print(max(torch.cuda.device_count(), 1))')}"
COMMIT="${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec torchrun --standalone --nproc-per-node "$GPUS" -m adaattn bench --suite cp \
    --out "${OUT_DIR:-benchmarks/results}" --commit "$COMMIT" --no-progress "$@"
