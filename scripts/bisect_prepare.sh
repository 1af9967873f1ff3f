#!/usr/bin/env bash
# Here, before a device call: export the source trees of the given commits into .bisect/<commit>/
# (git archive; ignored through .git/info/exclude; models/default_pair left out), so that one device
# call can build and test each (scripts/gpu_bisect.sh, with carry [".bisect"]).  ~2.5 MB a commit.
#   bash scripts/bisect_prepare.sh 3ec0daf fcbc886 9b638b9 2a853eb 252ff0a HEAD
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.bisect/" .git/info/exclude 2>/dev/null || echo "/.bisect/" >> .git/info/exclude
rm -rf .bisect && mkdir -p .bisect
for c in "$@"; do
  sha=$(git rev-parse --short "$c")
  mkdir -p ".bisect/$sha"
  git archive "$sha" -- . ':(exclude)models/default_pair' | tar xf - -C ".bisect/$sha"
  echo "$sha $(git log -1 --format=%s "$sha" | cut -c1-80)"
done
du -sh .bisect
