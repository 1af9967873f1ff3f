#!/usr/bin/env bash
# Rebuild models/default_pair/ from the parts scripts/train_pair_device.sh left under the device
# call's $OUT (pair.tar.part-00, -01, ... and pair.sha256), check every file's checksum, and load the
# pair once through load_default_pair.  Usage: bash scripts/unpack_pair.sh DIR_WITH_THE_PARTS
set -euo pipefail
SRC=${1:?usage: bash scripts/unpack_pair.sh DIR_WITH_THE_PARTS}
cd "$(dirname "$0")/.."
rm -rf models/default_pair.unpack && mkdir -p models/default_pair.unpack
cat "$SRC"/pair.tar.part-* | tar xf - -C models/default_pair.unpack
( cd models/default_pair.unpack/models/default_pair && sha256sum -c --quiet "$SRC/pair.sha256" )
rm -rf models/default_pair && mv models/default_pair.unpack/models/default_pair models/default_pair
rm -rf models/default_pair.unpack
PY=python3; [ -x .venv/bin/python ] && PY=.venv/bin/python  # the checkout's venv (scripts/setup.sh) when there is one
"$PY" -c "from torch_kdtree.models import load_default_pair; t, d, tok = load_default_pair(); print('loaded:', type(t).__name__, type(d).__name__, len(tok), 'tokens')"
du -sh models/default_pair
