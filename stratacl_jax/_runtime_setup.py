"""Makes XLA:CPU's runtime sound for multi-device programs before it starts.

XLA:CPU runs every per-device launch and execution on one client thread pool of
``max(PJRT_NPROC or core count, device count)`` threads. A collective needs one
thread per device, and launches that block on XLA's in-flight limit hold as
many more, so with fewer than two threads per device a stream of multi-device
programs deadlocks and XLA aborts the process (FACTS.md §1b). Each Python
thread that launches programs without waiting holds one more such gang of
blocked launches (measured: 2 threads x 200 calls on 8 devices hang with 16
threads and pass with 24; 4 threads hang with 32 and pass with 40), so the
pool needs (T + 1) x devices threads for T launching threads. We wrap the CPU
backend factory so that, at the moment the client is created, ``PJRT_NPROC``
is raised to that for T = ``STRATA_LAUNCH_THREADS`` (default 8), reduced so
the pool stays within ``MAX_POOL_THREADS`` but never below 2 x devices.
"""
from __future__ import annotations

import dataclasses
import os
import re
import warnings

from jax._src import xla_bridge

_INSTALLED = False
DEFAULT_LAUNCH_THREADS = 8
MAX_POOL_THREADS = 1024


def configured_cpu_device_count() -> int:
    """Devices the CPU client will get, from jax's config or XLA_FLAGS."""
    n = xla_bridge.num_cpu_devices.value
    if n is not None and n >= 0:
        return max(1, n)
    m = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(m.group(1)) if m else 1


def client_pool_threads() -> int:
    """Threads XLA:CPU's client pool gets from the environment as it is now."""
    for var in ("PJRT_NPROC", "NPROC"):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return os.cpu_count() or 1


def launch_threads() -> int:
    """Python threads that may launch programs at once without waiting
    (STRATA_LAUNCH_THREADS, default 8)."""
    value = os.environ.get("STRATA_LAUNCH_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else DEFAULT_LAUNCH_THREADS


def supported_launch_threads(num_devices: int, pool: int) -> int:
    """Launching threads a pool of `pool` threads carries without deadlock
    for `num_devices` devices: (T + 1) x devices <= pool."""
    return max(0, pool // max(1, num_devices) - 1)


def pool_for(num_devices: int) -> int:
    """The pool for `num_devices` devices: (T + 1) x devices, T launching
    threads, at most MAX_POOL_THREADS unless 2 x devices needs more."""
    threads = min(launch_threads(), max(1, MAX_POOL_THREADS // max(1, num_devices) - 1))
    return (threads + 1) * num_devices


def ensure_thread_pool(num_devices: int) -> None:
    """Raises PJRT_NPROC to pool_for(num_devices) (never lowers it)."""
    needed = pool_for(num_devices)
    if client_pool_threads() < needed:
        os.environ["PJRT_NPROC"] = str(needed)


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    if xla_bridge.backends_are_initialized():
        # Too late to size the pool: the handlers will refuse to run if it is
        # too small, and we say so now.
        try:
            import jax

            n = jax.local_device_count("cpu")
        except RuntimeError:
            return
        if client_pool_threads() < 2 * n and n > 1:
            warnings.warn(
                f"stratacl_jax was imported after JAX's CPU backend started with {n} devices "
                f"and a thread pool of {max(client_pool_threads(), n)} threads; XLA:CPU needs "
                f"{2 * n} to run multi-device programs without hanging (and {n} more per extra "
                f"Python thread launching programs at once). Import stratacl_jax first, or set "
                f"PJRT_NPROC={pool_for(n)} in the environment.",
                RuntimeWarning,
                stacklevel=3,
            )
        return
    registration = xla_bridge._backend_factories.get("cpu")
    if registration is None:
        return
    original = registration.factory

    def sized_cpu_client(*args, **kwargs):
        ensure_thread_pool(configured_cpu_device_count())
        return original(*args, **kwargs)

    xla_bridge._backend_factories["cpu"] = dataclasses.replace(registration, factory=sized_cpu_client)
