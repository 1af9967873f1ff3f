#!/usr/bin/env bash
# Pack a trained pair for the trip back through the device tool's $OUT (at most 8 files of at most
# 16 MiB): metrics.json, the pair as one tar split into 15 MiB parts, and every file's SHA-256.
# The inverse, here: bash scripts/unpack_pair.sh DIR_WITH_THE_PARTS.
# Usage: bash scripts/pack_pair.sh ROOT OUT   (the pair is ROOT/models/default_pair)
set -euo pipefail
ROOT=${1:?usage: bash scripts/pack_pair.sh ROOT OUT}
OUT=${2:?usage: bash scripts/pack_pair.sh ROOT OUT}
cp "$ROOT/models/default_pair/metrics.json" "$OUT/metrics.json"
tar cf - -C "$ROOT" models/default_pair | split -b 15M -d - "$OUT/pair.tar.part-"
( cd "$ROOT/models/default_pair" && find . -type f -exec sha256sum {} + | sort -k 2 ) > "$OUT/pair.sha256"
