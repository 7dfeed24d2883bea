#!/usr/bin/env bash
# Set up adaattn from this source tree: ./install.sh [extras], e.g. ./install.sh test,triton
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
isolation=()
# Without network (the GPU machine) build isolation cannot fetch setuptools: use the local one.
if "$PY" -c "import setuptools" >/dev/null 2>&1; then isolation=(--no-build-isolation); fi
if ! "$PY" -m pip install -q "${isolation[@]}" -e "$spec"; then
    # No package index reachable: use the packages present, and say so.
    echo "install.sh: could not install the extras '$extras'; installing adaattn alone against the packages present" >&2
    "$PY" -m pip install -q "${isolation[@]}" --no-deps -e .
fi
