#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m torch_kdtree.demo "$@"
