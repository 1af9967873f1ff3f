#!/usr/bin/env bash
# One device call: build for the local GPU, run tests, sanitizers and benchmarks; logs to $OUT.
# Usage: bash scripts/gpu_run.sh "<pytest test selection>" "<bench selection>" "<sanitizer drivers, e.g. tools/sanitize_gemv.py>"
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
ARCH=$(python3 -c "import torch; p = torch.cuda.get_device_capability(); print(f'{p[0]}.{p[1]}')")
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
t0=$(date +%s)
if ! ls torch_kdtree/_C*.so > /dev/null 2>&1 || [ -n "${REBUILD:-}" ]; then
  TORCH_CUDA_ARCH_LIST=$ARCH MAX_JOBS=16 KDTREE_BUILD_CUDA=1 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
fi
echo "build: $(( $(date +%s) - t0 )) s"
TESTS=${1:-}
BENCH=${2:-}
SAN=${3:-}
if [ -n "$TESTS" ]; then
  # eval: a selection may quote a -k expression ("tests/x.py -k 'a or b'")
  eval "timeout ${TEST_TIMEOUT:-400} python3 -m pytest $TESTS -q -p no:cacheprovider -rfEs --timeout 240 -n ${XDIST:-4}" > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/tests.log" | tail -40
fi
for s in $SAN; do
  for tool in memcheck racecheck; do
    log="$OUT/sanitizer_$tool.log"
    echo "=== $s" >> "$log"
    timeout 200 compute-sanitizer --tool $tool --error-exitcode 9 python3 "$s" >> "$log" 2>&1
    echo "sanitizer $tool $s: rc=$? | $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)"
  done
done
if [ -n "$BENCH" ]; then
  eval "timeout ${BENCH_TIMEOUT:-400} python3 -m pytest $BENCH --benchmark-only -q -s -p no:cacheprovider --benchmark-json=\"$OUT/bench.json\"" > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"; grep -E "op=|passed|failed" "$OUT/bench.log" | tail -40
fi
