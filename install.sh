#!/usr/bin/env bash
# Set up adaattn from this source tree: ./install.sh [extras], e.g. ./install.sh test
# Installs torch only where none is importable (a GPU machine keeps its own torch), then
# the package in editable mode with the extras asked for.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
extras=${1:-}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    # 2.13.0 resolves to the CPU build where a local wheel of it exists; plain "torch" would
    # pull a multi-GB CUDA build onto a machine that has no GPU.
    "$PY" -m pip install -q "torch==2.13.0"
fi
spec="."
[ -n "$extras" ] && spec=".[$extras]"
flags=(-q -e "$spec")
# Without network (the GPU machine) build isolation cannot fetch setuptools: use the local one.
if "$PY" -c "import setuptools" >/dev/null 2>&1; then flags+=(--no-build-isolation); fi
"$PY" -m pip install "${flags[@]}"
