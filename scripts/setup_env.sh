#!/usr/bin/env bash
# Creates .venv (if missing) and builds stratacl_jax into it (editable: Python files are used
# from the checkout; CMake builds the C++ extension under build/). Sourced by the two README
# commands; safe to run again: a second run installs nothing new and rebuilds only what changed.
# jax/jaxlib are pinned by constraints.txt (STRATA_CONSTRAINTS=FILE to try other versions).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
say() { echo "[setup] $*"; }
t_setup=$(date +%s)
constraints="${STRATA_CONSTRAINTS:-constraints.txt}"
if [ ! -x .venv/bin/python ]; then
  say "creating the virtual environment .venv ($(python3 --version))"
  python3 -m venv .venv
  # shellcheck disable=SC1091
  . .venv/bin/activate
  say "upgrading pip inside the new .venv"
  python -m pip install --upgrade pip
else
  # shellcheck disable=SC1091
  . .venv/bin/activate
  say "using the existing .venv ($(python --version))"
fi
# Build requirements first, then build without isolation so the extension compiles against
# the very jax/jaxlib it will run with.
say "installing the build tools and jax/jaxlib (pinned by $constraints)"
set +e
python -m pip install --progress-bar on -c "$constraints" \
  "scikit-build-core>=0.10" "nanobind>=2.0" "cmake>=3.18" ninja jax jaxlib 2>&1 \
  | grep -v "^Requirement already satisfied"
status=${PIPESTATUS[0]}
set -e
[ "$status" -eq 0 ] || { say "installing the build tools failed (exit $status, see above)"; exit "$status"; }
mkdir -p build
# An extension left in the source tree by an older in-place build would shadow nothing (the
# editable finder maps stratacl_jax._core to site-packages) but would confuse a reader.
rm -f stratacl_jax/_core*.so
log=build/setup-build.log
if ls build/cp*/build.ninja >/dev/null 2>&1; then
  say "building the C++ extension (only what changed; the full log is in $log)"
else
  say "building the C++ extension: the first build takes 1-4 min on 2 cores (full log: $log)"
fi
# -v lets CMake's progress through; show ninja's [k/n] lines and keep the rest in the log.
set +e
python -m pip install -v --no-build-isolation -c "$constraints" -e ".[test,bench]" > "$log" 2>&1 &
pip_pid=$!
shown=0
show_progress() {  # print the ninja [k/n] lines that arrived since the last call
  local lines
  lines=$(grep -cE '^ *\[[0-9]+/[0-9]+\]' "$log" 2>/dev/null || true)  # none yet: grep exits 1
  if [ "${lines:-0}" -gt "$shown" ]; then
    grep -E '^ *\[[0-9]+/[0-9]+\]' "$log" | sed -n "$((shown + 1)),\$p" | sed 's/^ */[setup]   /' | cut -c1-110
    shown=$lines
  fi
}
while kill -0 "$pip_pid" 2>/dev/null; do
  sleep 2
  show_progress
done
wait "$pip_pid"
status=$?
set -e
show_progress
if grep -q "ninja: no work to do" "$log"; then say "the extension is up to date"; fi
if [ "$status" -ne 0 ]; then
  say "the build failed (exit $status); the end of $log:"
  tail -40 "$log"
  exit "$status"
fi
say "ready in $(( $(date +%s) - t_setup )) s: $(python -c 'import jax, jaxlib; print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}")')"
