#!/usr/bin/env bash
# One device call (< 10 min) for a session short of device time: build once, then the whole GPU test
# suite and the default pair's training side by side on the one GPU.  The tests do not time anything,
# so sharing the card costs them nothing but wall time; the training's phases are capped by time, so
# it trains for fewer steps than alone (pre-training capped at TRAIN_MINUTES, default 3.0).  The pair
# is written outside the checkout (PAIR_ROOT) so no test sees it half-written.  $OUT gets logs.tgz
# (gpu.txt, build.log, tests.log, train.log), metrics.json, pair.tar.part-* and pair.sha256: at most
# the device tool's 8 files.  Here: `bash scripts/unpack_pair.sh <files_at>`.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
bash scripts/gpu_run.sh "" "" "" || exit 1
rm -rf /tmp/kdtree_pair && mkdir -p /tmp/kdtree_pair
PAIR_ROOT=/tmp/kdtree_pair TRAIN_TIMEOUT=${TRAIN_TIMEOUT:-520} TRAIN_ARGS="--minutes ${TRAIN_MINUTES:-3.0}" \
  bash scripts/train_pair_device.sh > /tmp/train_driver.log 2>&1 &
train=$!
XDIST=${XDIST:-8} TEST_TIMEOUT=${TEST_TIMEOUT:-500} bash scripts/gpu_run.sh "${TESTS:-tests}" ""
wait $train
echo "--- training (rc=$?)"
grep -v "^build:" /tmp/train_driver.log | tail -45
( cd "$OUT" && tar czf logs.tgz gpu.txt build.log tests.log train.log 2>/dev/null; rm -f gpu.txt build.log tests.log train.log )
ls -l "$OUT"
