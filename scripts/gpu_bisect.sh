#!/usr/bin/env bash
# On the device (carry [".bisect"]): for each tree under .bisect/ (scripts/bisect_prepare.sh), in
# the order given (default: all, by name), build the extension for the local GPU and run TESTS;
# one line per commit: passed / failed.  Stops before a commit that would not finish by DEADLINE.
#   bash scripts/gpu_bisect.sh [sha ...]
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# the sacred CUDA cases that failed in run 174 (test_any_config.py exists from 5a75a93 on: a test
# whose file a tree lacks is left out for that tree)
TESTS=${TESTS:-"tests/test_generate.py::test_cuda_bf16_ddtree_equals_autoregressive tests/test_generate.py::test_cuda_int4_ddtree_equals_autoregressive tests/test_any_config.py::test_cuda_small_configs_generate_with_the_plans_fallbacks"}
ARCH=$(python3 -c "import torch; p = torch.cuda.get_device_capability(); print(f'{p[0]}.{p[1]}')")
start=$(date +%s)
shas=("$@"); [ ${#shas[@]} -gt 0 ] || shas=($(ls .bisect))
for sha in "${shas[@]}"; do
  t0=$(date +%s)
  if [ $(( t0 - start + ${PER_COMMIT:-100} )) -gt ${DEADLINE:-570} ]; then echo "$sha: not run (deadline)"; continue; fi
  ( cd ".bisect/$sha" && TORCH_CUDA_ARCH_LIST=$ARCH MAX_JOBS=16 KDTREE_BUILD_CUDA=1 python3 setup.py build_ext --inplace \
      > "$OUT/build_$sha.log" 2>&1 ) || { echo "$sha: build failed"; continue; }
  here=""
  for t in $TESTS; do [ -f ".bisect/$sha/${t%%::*}" ] && here="$here $t"; done
  ( cd ".bisect/$sha" && PYTHONPATH=$PWD timeout 240 python3 -m pytest $here -q -p no:cacheprovider -n 8 --tb=line \
      > "$OUT/tests_$sha.log" 2>&1 )
  echo "$sha: $(grep -E '[0-9]+ (passed|failed)' "$OUT/tests_$sha.log" | tail -1) ($(( $(date +%s) - t0 )) s)"
  grep -E "diverges" "$OUT/tests_$sha.log" | head -3 | cut -c1-160
done
# at most 8 files come back from $OUT: the logs as one archive
( cd "$OUT" && tar czf bisect_logs.tgz build_*.log tests_*.log 2>/dev/null && rm -f build_*.log tests_*.log )
