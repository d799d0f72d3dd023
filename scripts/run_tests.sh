#!/usr/bin/env bash
# The README's test command: set up from scratch, build, run the test suite.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup_env.sh
python -m pytest -q "$@"
