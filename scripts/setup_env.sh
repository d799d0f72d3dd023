#!/usr/bin/env bash
# Creates .venv (if missing) and builds stratacl_jax into it, in place.
# Sourced by the two README commands; safe to run again.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
# Build requirements first, then build without isolation so the extension
# compiles against the very jax/jaxlib it will run with.
python -m pip install --quiet "scikit-build-core>=0.10" "nanobind>=2.0" "cmake>=3.18" ninja "jax>=0.10.2" "jaxlib>=0.10.2"
python -m pip install --quiet --no-build-isolation -e ".[test,bench]"
