#!/usr/bin/env bash
# Issue 47 on one eight-GPU machine (nvidia-h200-x8 or nvidia-h100-x8): build the extension for the
# local GPUs, then bench/tp8_run.py under torchrun over every GPU (NCCL), in two device calls of less
# than 10 minutes each.  Minutes are ESTIMATES (bench/tp8_run.py's docstring): nothing here has run
# on eight GPUs yet.
#
#   bash scripts/tp8_run.sh 1     build (~1 min) + equality at TP-2/4/8 + the K2 layers at 4 decoder
#                                 layers (~4 min after the build)
#   bash scripts/tp8_run.sh 2     the K2 layers at 8 decoder layers + the oracle runs + the no-op
#                                 comparison + the projection (~4 min)
#   bash scripts/tp8_run.sh all   both in one call (~9 min: close to a call's 10-min limit)
#
# Results accumulate in $TP8_DIR (default /tmp/tp8, which lives as long as the machine stays warm)
# and are copied to $OUT/tp8 after each call, with the logs.  If the machine was given back between
# the calls, put call 1's tp8_run.json into the working tree and run call 2 with
# TP8_PREVIOUS=<its path> (the projection needs both depths).  Extra arguments for bench/tp8_run.py
# go in TP8_ARGS (e.g. TP8_ARGS="--rounds 7").
set -uo pipefail
START=$(date +%s)
STEP=${1:-all}
case "$STEP" in 1|2|all) ;; *) echo "usage: bash scripts/tp8_run.sh 1|2|all" >&2; exit 2 ;; esac
OUT=${OUT:-/tmp/out}
TP8_DIR=${TP8_DIR:-/tmp/tp8}
mkdir -p "$OUT/tp8" "$TP8_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
# NVLink multicast stays off (the machines' rule, .library/device/KINDS.md); eight ranks share the
# host's cores for inductor's compile workers
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-8}

if [ "$STEP" != 2 ] || ! ls torch_kdtree/_C*.so > /dev/null 2>&1; then
  bash scripts/gpu_run.sh "" "" "" || exit 1  # the build alone (gpu.txt, build.log under $OUT)
fi
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
nvidia-smi topo -m > "$OUT/tp8/topo.txt" 2>&1
echo "GPUs: $NGPU"

run() {  # $1: name, $2: time limit in seconds, then bench/tp8_run.py's arguments
  local name=$1 limit=$2
  shift 2
  local t0=$(date +%s)
  timeout "$limit" python3 -m torch.distributed.run --standalone --nproc-per-node "$NGPU" bench/tp8_run.py \
    --out "$TP8_DIR" ${TP8_PREVIOUS:+--previous "$TP8_PREVIOUS"} "$@" ${TP8_ARGS:-} > "$OUT/tp8/$name.log" 2>&1
  echo "tp8_run $name ($*): rc=$? in $(( $(date +%s) - t0 )) s"
  grep -E "^tp8_run: .* done in" "$OUT/tp8/$name.log"
  cp "$TP8_DIR"/tp8_run.* "$OUT/tp8/" 2> /dev/null
}

left() {  # seconds left of a 10-min call (570 s: margin for the copies), at most $1
  local rest=$(( 570 - ($(date +%s) - START) ))
  echo $(( rest < $1 ? rest : $1 ))
}
if [ "$STEP" = 1 ] || [ "$STEP" = all ]; then
  run call1 "$(left $([ "$STEP" = all ] && echo 300 || echo 570))" --parts equality,layers --depths 4
fi
if [ "$STEP" = 2 ] || [ "$STEP" = all ]; then
  run call2 "$(left 570)" --parts layers,oracle,projection --depths 8
fi
cat "$TP8_DIR/tp8_run.txt" 2> /dev/null | head -120
