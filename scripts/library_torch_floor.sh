#!/usr/bin/env bash
# Proves jagg-core's lowest declared torch (lib/jagg-core/pyproject.toml's `torch>=X`) once, outside the suite: a fresh
# venv of the oldest Python found holding torch X and pytest, the library installed by pip from this repository's
# git URL (`jagg-core @ git+file://…@HEAD#subdirectory=lib/jagg-core`, the form a trainer uses, so commit first),
# then jagg_core imported and the library's tests run there (tests/test_library_dist.py does the work; docs/library.md
# records the runs). The first run downloads that torch and its CUDA wheels (~3 GB) into uv's cache.
#
#   scripts/library_torch_floor.sh            # the declared floor
#   scripts/library_torch_floor.sh 2.5.0      # any other torch, e.g. a trainer's pin
set -euo pipefail
cd "$(dirname "$0")/.."
floor=$(sed -n 's/^dependencies = \["torch>=\([0-9.]*\)"\]$/\1/p' lib/jagg-core/pyproject.toml)
torch=${1:-$floor}
[ -n "$torch" ] || { echo "no torch floor found in lib/jagg-core/pyproject.toml" >&2; exit 2; }
commit=$(git rev-parse HEAD)
git diff --quiet HEAD -- lib/jagg-core jagg_core || echo "note: lib/jagg-core or jagg_core has uncommitted changes;" \
    "the git URL installs HEAD ($commit), the tests are the working tree's" >&2
echo "torch $torch (declared floor: $floor), jagg-core from git+file://$PWD@$commit" >&2
start=$(date +%s)
.venv/bin/python tests/test_library_dist.py --python oldest --torch "$torch" --pip \
    --library "jagg-core @ git+file://$PWD@$commit#subdirectory=lib/jagg-core"
echo "$(( $(date +%s) - start )) s on $(getconf _NPROCESSORS_ONLN) cores, $(date -u +%F)" >&2
