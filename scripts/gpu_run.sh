#!/usr/bin/env bash
# One device call: build for the local GPU, run the CUDA tests, sanitizers and benchmarks.
# Usage on the GPU machine: bash scripts/gpu_run.sh "<pytest test selection>" "<bench selection>" "<sanitize scripts>"
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
ARCH=$(python3 -c "import torch; p = torch.cuda.get_device_capability(); print(f'{p[0]}.{p[1]}')")
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
t0=$(date +%s)
TORCH_CUDA_ARCH_LIST=$ARCH MAX_JOBS=16 KDTREE_BUILD_CUDA=1 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
TESTS=${1:-tests}
BENCH=${2:-}
SAN=${3:-}
python3 -m pytest $TESTS -q -x -p no:cacheprovider -rs 2>&1 | tee "$OUT/tests.log" | tail -25
for s in $SAN; do
  for tool in memcheck racecheck; do
    compute-sanitizer --tool $tool --error-exitcode 9 python3 "$s" > "$OUT/san_${tool}_$(basename $s .py).log" 2>&1
    echo "sanitizer $tool $s: rc=$? $(tail -1 "$OUT/san_${tool}_$(basename $s .py).log")"
  done
done
if [ -n "$BENCH" ]; then
  python3 -m pytest $BENCH --benchmark-only -q -s -p no:cacheprovider --benchmark-json="$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | grep -E "op=|passed|failed|error" | tail -60
fi
