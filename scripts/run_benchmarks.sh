#!/usr/bin/env bash
# The README's main command: set up, build, and run the benchmark suite on an
# emulated supernode (8 NPUs by default; pass arguments through).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup_env.sh
python -m benchmarks "$@"
