"""Builds and runs the C++ unit tests of the plans (tests/cpp/test_plans.cc: every
collective's transfers, pieces and per-rank bytes against closed forms).

The build dir is build/cpp-tests, configured once with this venv's Python (CMakeLists.txt
finds nanobind and the XLA FFI headers through it), then rebuilt incrementally; the
target is EXCLUDE_FROM_ALL, so the wheel never builds it. scripts/sanitize.sh points
STRATA_CPP_BUILD_DIR at its sanitizer build, so there the executable carries the
sanitizer and its reports land with the extension's."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd, env, what):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def test_cpp_plans():
    build = Path(os.environ.get("STRATA_CPP_BUILD_DIR") or ROOT / "build" / "cpp-tests")
    # cmake and ninja come from the venv (scripts/setup_env.sh installs them next to python).
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    # The compiler runs without the sanitizer runtime a sanitized pytest preloads; the test
    # executable keeps it (it links the same one).
    build_env = {k: v for k, v in env.items() if k != "LD_PRELOAD"}
    cmake = shutil.which("cmake", path=env["PATH"])
    assert cmake, "cmake not found (scripts/setup_env.sh installs it into the venv)"
    if not (build / "CMakeCache.txt").exists():
        _run([cmake, "-S", ROOT, "-B", build, "-G", "Ninja", f"-DPython_EXECUTABLE={sys.executable}"],
             build_env, "configuring the C++ tests")
    _run([cmake, "--build", build, "--target", "test_plans"], build_env, "building tests/cpp/test_plans.cc")
    proc = _run([build / "test_plans"], env, "tests/cpp/test_plans")
    assert " 0 failures" in proc.stdout, proc.stdout + proc.stderr
