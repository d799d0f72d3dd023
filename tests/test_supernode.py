"""A whole CloudMatrix384: every collective on 384 emulated NPUs (2-D mesh,
48 nodes x 8), in its own process since the device count is fixed at start."""
import os
import subprocess
import sys


def test_every_collective_on_384_npus():
    script = os.path.join(os.path.dirname(__file__), "supernode_check.py")
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "XLA_FLAGS")}
    proc = subprocess.run([sys.executable, script, "--npus", "384"], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "7 passed, 0 failed" in proc.stdout
