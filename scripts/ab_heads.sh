#!/usr/bin/env bash
# A/B of two builds on one GPU, in one device call: the working tree (head) against BASE_DIR, a
# checkout of an earlier commit carried along (e.g. `git worktree add .ab/base <commit>`, with
# `.ab/` in .git/info/exclude and `carry: [".ab/base"]`).  Builds both for this GPU, then alternates
# base / head processes: greedy AR ms / step (bench_kimi_decode's model and prompt; tokens hashed)
# and the AR and B = 16 step replays of a DDTree session, for each configuration.
# Usage: bash scripts/ab_heads.sh BASE_DIR [ROUNDS] [CONFIGS...]   (logs under $OUT)
set -uo pipefail
BASE=${1:?usage: bash scripts/ab_heads.sh BASE_DIR [ROUNDS] [CONFIGS...]}
ROUNDS=${2:-2}
shift $(( $# >= 2 ? 2 : 1 ))
CONFIGS=${*:-2p2b k2_slice}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
HEAD_DIR=$PWD
ARCH=$(python3 -c "import torch; p = torch.cuda.get_device_capability(); print(f'{p[0]}.{p[1]}')")
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.mem --format=csv,noheader | tee "$OUT/ab_gpu.txt"
for dir in "$HEAD_DIR" "$BASE"; do
  (cd "$dir" && TORCH_CUDA_ARCH_LIST=$ARCH MAX_JOBS=16 KDTREE_BUILD_CUDA=1 python3 setup.py build_ext --inplace \
     > "$OUT/ab_build_$(basename "$dir").log" 2>&1) || { echo "build failed in $dir"; tail -30 "$OUT/ab_build_$(basename "$dir").log"; exit 1; }
done
# where each tree keeps its A/B and profiling scripts (tools/ since issue 45, bench/ before)
ab() { if [ -f "$1/tools/ab_decode.py" ]; then echo "tools/ab_decode.py $2 --label $3"; else echo "bench/ab_decode.py $2"; fi; }
prof() { if [ -f "$1/tools/profile_decode.py" ]; then echo tools.profile_decode; else echo bench.profile_decode; fi; }
for round in $(seq "$ROUNDS"); do
  for name in $CONFIGS; do
    for side in base head; do
      dir=$HEAD_DIR; [ "$side" = base ] && dir=$BASE
      (cd "$dir" && AB_LABEL=$side PYTHONPATH=. timeout 280 python3 $(ab "$dir" "$name" "$side")) 2>&1 \
        | tee -a "$OUT/ab.log" | grep -E "^AB " | sed "s/^/round $round /"
      (cd "$dir" && PYTHONPATH=. timeout 280 python3 -c \
        "import $(prof "$dir") as p; p.replay_times('$name', 'combo')") 2>&1 \
        | tee -a "$OUT/ab.log" | grep -E "compile_step=" | sed "s/^/round $round $side /"
    done
  done
done
