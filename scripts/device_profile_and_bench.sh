#!/usr/bin/env bash
# One device call (< 10 min) for issue 44's item 3 and table: build if needed, the kernel tables and
# replay times of the AR and B = 4 / 8 / 16 steps of both configurations (tools.profile_decode
# --budgets), the launch timelines of the AR and B = 16 steps, then bench/bench_generate.py with
# whatever time is left (BENCH_ARGS narrows it).  Everything under $OUT is packed into profile.tgz
# and bench.tgz so the device tool's 8-file limit holds.  PHASES picks and orders the parts (default
# "profile timeline bench"; run 189 spent 325 s on the first two and left the bench no time:
# PHASES="bench profile" puts the table first).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/p"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
start=$(date +%s)
left() { echo $(( ${DEADLINE:-575} - ($(date +%s) - start) )); }
cap() { local t; t=$(left); echo $(( $1 < t ? $1 : (t > 1 ? t : 1) )); }  # a phase's limit within the deadline
bash scripts/gpu_run.sh "" "" "" || exit 1
profile() {
  timeout $(cap ${PROFILE_TIMEOUT:-220}) python3 -m tools.profile_decode --budgets 0,4,8,16 --out "$OUT/p" k2_slice 2p2b \
    > "$OUT/p/profile.log" 2>&1
  echo "profile rc=$? ($(( $(date +%s) - start )) s)"; grep -iE "replay|ms|error" "$OUT/p/profile.log" | tail -24
}
timeline() {
  timeout $(cap ${TIMELINE_TIMEOUT:-120}) python3 -m tools.profile_decode --timeline --out "$OUT/p" k2_slice 2p2b \
    > "$OUT/p/timeline.log" 2>&1
  echo "timeline rc=$? ($(( $(date +%s) - start )) s)"; tail -5 "$OUT/p/timeline.log"
}
bench() {
  local t
  t=$(left)
  [ "$t" -gt 60 ] || { echo "bench skipped: ${t} s left"; return; }
  args=${BENCH_ARGS:-"--bench-step-budgets 0,4,8,16,32 -k 'step_time or autoregressive or oracle'"}
  eval "timeout $t python3 -m pytest bench/bench_generate.py --benchmark-only -q -s -p no:cacheprovider $args \
    --benchmark-json=\"$OUT/bench.json\"" > "$OUT/bench.log" 2>&1
  echo "bench rc=$? ($(( $(date +%s) - start )) s)"; grep -E "op=|passed|failed" "$OUT/bench.log" | tail -30
}
for phase in ${PHASES:-profile timeline bench}; do
  case "$phase" in
    profile|timeline|bench) "$phase" ;;
    *) echo "unknown phase $phase (profile, timeline, bench)" >&2; exit 2 ;;
  esac
done
( cd "$OUT" && [ -d p ] && [ -n "$(ls p)" ] && tar czf profile.tgz p; rm -rf p )
ls -l "$OUT"
