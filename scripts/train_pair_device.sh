#!/usr/bin/env bash
# Issue 48 in one device call: build the extension for the local GPU, train the default pair
# (python -m training.run, FULL recipe: ~8.5 min on one H200 by run 195's phase times), then pack it
# so that it comes back through the device tool, which returns at most 8 files of at most 16 MiB each
# from $OUT: the pair (~23 MB in ~10 files) travels as one tar split into 15 MiB parts.
#
#   bash scripts/train_pair_device.sh            # on the device machine; logs and parts under $OUT
#   bash scripts/unpack_pair.sh <dir with the parts>   # here: models/default_pair/ rebuilt and checked
#   bash scripts/train_pair_device.sh drafter-only [MINUTES]   # a new drafter (MINUTES, default 7) for
#       the target of the checkout's models/default_pair (unpacked here from an earlier call on the same
#       machine image: its corpus must match the pair's manifest), packed the same way
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
bash scripts/gpu_run.sh "" "" "" || exit 1  # the build alone (gpu.txt, build.log under $OUT)
t0=$(date +%s)
# A call may run 600 s: ~40 s of build, then the pipeline (experts through grouped_padded on CUDA),
# whose long phases stop at their step counts or time caps (pre-training 4,600 steps / 4.5 min, QAT
# 0.75 min, drafter 9,000 steps / 2.75 min) plus ~1.3 min of corpus, tokenizer, held-out scoring,
# continuations and checks: run 201 took 396 s on an H100 (pre-training 217 s at 700 k tokens/s).
# PAIR_ROOT: where models/default_pair is written (default: the checkout; scripts/device_tests_and_pair.sh
# trains elsewhere so that the tests it runs beside the training never see a half-written pair)
ROOT=${PAIR_ROOT:-.}
if [ "${1:-}" = drafter-only ]; then
  timeout ${TRAIN_TIMEOUT:-545} python3 -m training.run --drafter-only models/default_pair --out "$ROOT/models/default_pair" \
    --device cuda --drafter-minutes "${2:-7}" --drafter-steps 40000 ${TRAIN_ARGS:-} > "$OUT/train.log" 2>&1
else
  timeout ${TRAIN_TIMEOUT:-545} python3 -m training.run --out "$ROOT/models/default_pair" --device cuda \
    ${TRAIN_ARGS:-} > "$OUT/train.log" 2>&1
fi
rc=$?
echo "training rc=$rc in $(( $(date +%s) - t0 )) s"
grep -E "^\[|held-out|agreement|acceptance|DDTree|wrote" "$OUT/train.log" | tail -40
[ $rc -eq 0 ] || exit $rc
bash scripts/pack_pair.sh "$ROOT" "$OUT"
ls -l "$OUT"
