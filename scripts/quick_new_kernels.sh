#!/usr/bin/env bash
# One short device call for the kernels written without a GPU in session 40: build, then the
# gemm_rows and drafter live-attention CUDA tests and a few bench cells, logs under $OUT as they go.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
bash scripts/gpu_run.sh "" "" "" || exit 1
timeout ${QT:-60} python3 -m pytest tests/test_gemm_rows.py tests/test_dflash.py -q -p no:cacheprovider -rfE -x \
  -k "cuda" > "$OUT/quick_tests.log" 2>&1
echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|Error" "$OUT/quick_tests.log" | head -12
timeout ${QB:-60} python3 -m pytest bench/bench_gemm_rows.py --benchmark-only -q -s -p no:cacheprovider \
  -k "k2_q_a or k2_o_proj or k2_mlp_down" > "$OUT/quick_bench.log" 2>&1
echo "bench rc=$?"; grep -E "op=" "$OUT/quick_bench.log" | sed -E 's/ ceiling_gbs.*//' | head -14
