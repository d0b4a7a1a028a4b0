#!/usr/bin/env bash
# The one-command GPU smoke test: a tiny random Flux (256 px, bf16) trained 4 iterations with each method through
# the real trainer; checks that the first PPO ratio is exactly 1 and reports peak memory and update speedups.
#
#   scripts/gpu_smoke.sh                     # on the GPU (nothing is downloaded)
#   scripts/gpu_smoke.sh --device cpu        # the same code at a reduced size, on CPU
#
# Any argument is passed to `jagg smoke` (see `.venv/bin/jagg smoke --help`). Exit status 1 if a check fails.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [[ ! -x .venv/bin/jagg ]]; then
    echo "gpu_smoke.sh: .venv/bin/jagg not found; set up the environment first: make setup." >&2
    exit 2
fi
exec .venv/bin/jagg smoke "$@"
