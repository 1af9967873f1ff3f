#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite.  pytest's "no tests collected" (exit 5) fails.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
set +e
python -m pytest tests -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
