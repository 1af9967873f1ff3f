#!/usr/bin/env bash
# Create .venv (if missing), install torch and this package with its test extras, and build the
# extension in place (CUDA kernels for TORCH_CUDA_ARCH_LIST, default "9.0;12.0", when nvcc is found).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch>=2.11,<2.15" setuptools wheel ninja
export MAX_JOBS=${MAX_JOBS:-2}
python -m pip install -q --no-build-isolation -e '.[test]'
python -c "import torch_kdtree, json; print(json.dumps(torch_kdtree.build_info()))"
