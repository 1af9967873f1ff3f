#!/usr/bin/env bash
# Create .venv (if missing), install torch and this package with its test extras, and build the
# extension in place.  Without a visible GPU (and KDTREE_BUILD_CUDA unset) the build is CPU-only;
# with one, the CUDA kernels are compiled for TORCH_CUDA_ARCH_LIST (default: this machine's GPU).
# KDTREE_BUILD_CUDA=1 compiles them anyway (CI: sm_90 and sm_120).  A second run with unchanged
# sources and build settings does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -z "${KDTREE_BUILD_CUDA:-}" ]; then
  if arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1) && [ -n "$arch" ]; then
    export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$arch}
    echo "setup: GPU found (sm_${arch/./}): CUDA kernels for ${TORCH_CUDA_ARCH_LIST}"
  else
    export KDTREE_BUILD_CUDA=0
    echo "setup: no GPU visible: CPU-only build (KDTREE_BUILD_CUDA=1 compiles the CUDA kernels anyway)"
  fi
fi
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
. .venv/bin/activate
STAMP=.venv/.kdtree-build-stamp
KEY=$(cat setup.py pyproject.toml torch_kdtree/envs.py torch_kdtree/csrc/* | sha256sum | cut -d' ' -f1)-${TORCH_CUDA_ARCH_LIST:-default}-${KDTREE_BUILD_CUDA:-auto}-${KDTREE_TRACE:-0}
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$KEY" ] && ls torch_kdtree/_C*.so > /dev/null 2>&1; then
  echo "setup: up to date"
else
  echo "setup: installing torch and the dependencies"
  python -m pip install -q --upgrade pip
  python -m pip install -q "torch>=2.11,<2.15" setuptools wheel ninja numpy
  export MAX_JOBS=${MAX_JOBS:-2}
  if [ "${KDTREE_BUILD_CUDA:-auto}" = "0" ]; then
    echo "setup: building torch_kdtree (CPU-only, about a minute)"
  else
    echo "setup: building torch_kdtree with its CUDA kernels (about 10 minutes on 2 cores)"
  fi
  python -m pip install -q --no-build-isolation -e '.[test]'
  echo "$KEY" > "$STAMP"
fi
python -c "import torch_kdtree, json; print(json.dumps(torch_kdtree.build_info()))"
