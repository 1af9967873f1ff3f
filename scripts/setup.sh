#!/usr/bin/env bash
# Create .venv (if missing), install torch and this package with its test extras, and build the
# extension in place (CUDA kernels for TORCH_CUDA_ARCH_LIST, default "9.0;12.0", when nvcc is
# found).  A second run with unchanged sources and build settings does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
STAMP=.venv/.kdtree-build-stamp
KEY=$(cat setup.py pyproject.toml torch_kdtree/csrc/* | sha256sum | cut -d' ' -f1)-${TORCH_CUDA_ARCH_LIST:-default}-${KDTREE_BUILD_CUDA:-auto}-${KDTREE_TRACE:-0}
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$KEY" ] && ls torch_kdtree/_C*.so > /dev/null 2>&1; then
  echo "setup: up to date"
else
  python -m pip install -q --upgrade pip
  python -m pip install -q "torch>=2.11,<2.15" setuptools wheel ninja numpy
  export MAX_JOBS=${MAX_JOBS:-2}
  python -m pip install -q --no-build-isolation -e '.[test]'
  echo "$KEY" > "$STAMP"
fi
python -c "import torch_kdtree, json; print(json.dumps(torch_kdtree.build_info()))"
