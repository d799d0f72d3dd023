#!/usr/bin/env bash
# Runs the test suite against the extension built with a sanitizer:
#   bash scripts/sanitize.sh asan [pytest args]   # ASan + UBSan, the whole suite
#   bash scripts/sanitize.sh tsan [pytest args]   # TSan, collectives + MoE + safety
#   SANITIZE_TESTS="tests/test_trust.py" bash scripts/sanitize.sh asan   # another selection
# The sanitized build lives in build/sanitize-<kind>/ (the normal in-place build
# is left alone); a shadow package there (symlinks to the Python sources plus
# the sanitized _core) goes first on PYTHONPATH, and the sanitizer runtime is
# preloaded, since python itself is not instrumented. Fails on any report in
# the project's code; reports from Python, XLA and jaxlib (not built with the
# sanitizer, so seen through interceptors only) are suppressed by
# scripts/sanitizers/<kind>.supp.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
kind="${1:-}"
shift || true
case "$kind" in
  asan) flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
        runtime="$(g++ -print-file-name=libasan.so)" ;;
  tsan) flags="-fsanitize=thread -fno-omit-frame-pointer"
        runtime="$(g++ -print-file-name=libtsan.so)" ;;
  *) echo "usage: $0 asan|tsan [pytest args]" >&2; exit 2 ;;
esac
[ -x .venv/bin/python ] || bash scripts/setup_env.sh
root="$PWD"
py="$root/.venv/bin/python"
build="$PWD/build/sanitize-$kind"
mkdir -p "$build"

start=$(date +%s)
cmake -S . -B "$build" -G Ninja -DPython_EXECUTABLE="$py" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_SHARED_LINKER_FLAGS="$flags" > "$build.cmake.log" 2>&1 \
  || { cat "$build.cmake.log"; exit 1; }
cmake --build "$build" > "$build.build.log" 2>&1 || { tail -50 "$build.build.log"; exit 1; }

# The shadow package: every Python source of the package, and the sanitized _core.
shadow="$build/pythonpath/stratacl_jax"
rm -rf "$build/pythonpath"
mkdir -p "$shadow"
for f in $(cd stratacl_jax && find . -name '*.py' -not -path '*/__pycache__/*'); do  # subpackages too
  mkdir -p "$shadow/$(dirname "$f")"
  ln -s "$PWD/stratacl_jax/$f" "$shadow/$f"
done
cp "$build"/stratacl_jax/_core*.so "$shadow/"
# The editable install's import hook resolves stratacl_jax to the source tree
# whatever PYTHONPATH says; drop it so the shadow package is the one found.
cat > "$build/pythonpath/sitecustomize.py" <<'PY'
# Every process of the sanitized run (pytest, and the children tests start from any working
# directory, e.g. `python -m benchmarks` from the checkout) imports stratacl_jax from this
# shadow package with the sanitized extension: not through the editable install's finder,
# and not from a checkout on sys.path.
import importlib.machinery
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.meta_path[:] = [f for f in sys.meta_path
                    if type(f).__name__ not in ("ScikitBuildInplaceFinder", "ScikitBuildRedirectingFinder")]


class _ShadowFinder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "stratacl_jax":
            return importlib.machinery.PathFinder.find_spec(name, [_here])
        return None


sys.meta_path.insert(0, _ShadowFinder())
PY
echo "sanitize: $kind build ready in $(( $(date +%s) - start )) s"

supp="$PWD/scripts/sanitizers/$kind.supp"
log_dir="$build/reports"
rm -rf "$log_dir" "$log_dir.all" "$log_dir.project.txt"
mkdir -p "$log_dir"
export PYTHONPATH="$build/pythonpath${PYTHONPATH:+:$PYTHONPATH}"
export STRATA_SANITIZER="$kind"
# tests/test_cpp_plans.py builds and runs the C++ plan tests in this build, with its flags.
export STRATA_CPP_BUILD_DIR="$build"
if [ "$kind" = asan ]; then
  # Leaks: the runtime keeps process-lifetime singletons on purpose, and
  # Python/XLA leak at exit by design, so leak checking would only be noise.
  export ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:halt_on_error=1:abort_on_error=0:exitcode=86:log_path=$log_dir/asan:suppressions=$supp:detect_odr_violation=0"
  export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:exitcode=86:log_path=$log_dir/ubsan:suppressions=$PWD/scripts/sanitizers/ubsan.supp"
  tests=("$root/tests")
else
  # ignore_noninstrumented_modules: accesses by numpy, XLA and Python (seen
  # only through interceptors, never with their synchronisation) are not
  # recorded, so what TSan checks is our threads against our threads.
  # detect_deadlocks=0: XLA's compiler holds more locks at once than the
  # lock-order detector can track, and TSan then dies on an internal CHECK.
  export TSAN_OPTIONS="allocator_may_return_null=1:ignore_noninstrumented_modules=1:detect_deadlocks=0:halt_on_error=0:exitcode=0:report_signal_unsafe=0:log_path=$log_dir/tsan:suppressions=$supp:history_size=4"
  tests=("$root"/tests/test_collectives.py "$root"/tests/test_moe.py "$root"/tests/test_moe_traffic.py "$root"/tests/test_safety.py "$root"/tests/test_trust.py "$root"/tests/test_resume.py)
fi

# SANITIZE_TESTS="tests/a.py tests/b.py" replaces the default selection.
if [ -n "${SANITIZE_TESTS:-}" ]; then
  tests=()
  for t in $SANITIZE_TESTS; do tests+=("$root/$t"); done
fi

set +e
# libstdc++ too: python does not link it, and the runtime's __cxa_throw
# interceptor must find the real one when it starts.
# From inside the shadow dir: `python -m` puts the working directory first on
# sys.path, and the source tree's stratacl_jax must not be the one imported.
(cd "$build/pythonpath" && LD_PRELOAD="$runtime $(g++ -print-file-name=libstdc++.so.6)" \
  "$py" -m pytest -q -p no:cacheprovider -c "$root/pyproject.toml" --rootdir "$root" "${tests[@]}" "$@") \
  2>&1 | tee "$build/pytest.log"
status=${PIPESTATUS[0]}
# A runtime that dies (fatal error, internal CHECK) may exit with the code we
# set for reports (0 for TSan): the run counts only if pytest got to its summary.
if ! grep -qE "[0-9]+ passed" "$build/pytest.log"; then
  echo "sanitize: pytest did not finish under $kind"
  status=1
fi
set -e
if [ "$kind" = tsan ]; then
  # TSan sees none of XLA's synchronisation (uninstrumented): keep only the
  # reports with the project on both sides (scripts/sanitizers/tsan_filter.py).
  if [ -n "$(ls "$log_dir")" ]; then
    "$py" scripts/sanitizers/tsan_filter.py "$log_dir"/* > "$log_dir.project.txt" || true
    mkdir -p "$log_dir.all" && mv "$log_dir"/* "$log_dir.all/"
    if grep -q "WARNING: ThreadSanitizer" "$log_dir.project.txt"; then cp "$log_dir.project.txt" "$log_dir/project.txt"; fi
  fi
fi
# A sanitizer that died (an internal CHECK) exits with the code we set for
# reports (0 for TSan), so look for it.
died='CHECK failed|FATAL: (Address|Thread)Sanitizer|ERROR: ThreadSanitizer'
if grep -qsE "$died" "$log_dir"/* "$log_dir.all"/* 2>/dev/null; then
  echo "sanitize: the $kind runtime died:"; grep -hsE -A3 "$died" "$log_dir"/* "$log_dir.all"/* | head -20
  exit 1
fi
# A log may hold only warnings (e.g. an allocation the test means to fail);
# a report is an ERROR (ASan), a runtime error (UBSan) or a WARNING from TSan.
pattern='ERROR: AddressSanitizer|runtime error:|WARNING: ThreadSanitizer|ERROR: ThreadSanitizer'
reports=$( (grep -lE "$pattern" "$log_dir"/* 2>/dev/null || true) | wc -l)
echo "sanitize: $kind pytest exit $status, $reports report file(s) in $log_dir, $(( $(date +%s) - start )) s in all"
if [ "$reports" -gt 0 ]; then
  for f in $(grep -lE "$pattern" "$log_dir"/*); do echo "== $f"; head -80 "$f"; done
  exit 1
fi
exit "$status"
