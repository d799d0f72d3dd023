"""The emulated supernode: what the hardware is, and meshes of emulated NPUs.

Each emulated NPU is one JAX CPU device. JAX creates its CPU devices once, when
its backend starts, so ask for them first:

    import stratacl_jax as strata
    strata.emulator.ensure_devices(8)      # before any JAX computation
    mesh = strata.emulator.make_mesh((2, 4), ("node", "npu"))

It also models the supernode: ``model(op, bytes_per_rank, npus=...)`` times
the plan the runtime would execute on the preset's links, memory and lanes
(no host execution), and ``trace()`` records real runs with their modeled
twins as a Chrome/Perfetto trace.
"""
from __future__ import annotations

import math

import jax
import numpy as np
from jax._src import xla_bridge
from jax.sharding import AxisType, Mesh

from . import _multiprocess
from . import _runtime_setup
# The supernode model, re-exported: strata.emulator.preset, model, trace, simulate, ...
from .supernode.op_model import ModeledOp, model, parse_bytes, round_bytes  # noqa: F401
from .supernode.spec import (CLOUDMATRIX384, CLOUDMATRIX384_DIES, CLOUDMATRIX_NODE, PRESETS,  # noqa: F401
                             SupernodeSpec, preset)
from .supernode.step import ModeledStep, abstract_mesh, fused, simulate  # noqa: F401
from .supernode.trace import Trace, trace  # noqa: F401


def ensure_devices(n: int) -> None:
    """Asks JAX for `n` CPU devices (emulated NPUs) in this process and sizes
    XLA's thread pool.

    Must run before JAX's backend starts (and, with several processes, before
    jax.distributed.initialize: each process then gets `n`, and make_mesh
    spans all of them); afterwards it only checks."""
    if xla_bridge.backends_are_initialized():
        have = len(jax.local_devices(backend="cpu"))
        if have < n:
            raise RuntimeError(
                f"strata.emulator.ensure_devices({n}): JAX already started with {have} CPU devices. "
                f"Call it before the first JAX computation, or set XLA_FLAGS="
                f"--xla_force_host_platform_device_count={n} in the environment.")
        return
    if _runtime_setup.configured_cpu_device_count() < n:
        jax.config.update("jax_num_cpu_devices", n)
    _runtime_setup.ensure_thread_pool(max(n, _runtime_setup.configured_cpu_device_count()))


def make_mesh(shape, axis_names, *, devices=None) -> Mesh:
    """A mesh of emulated NPUs (the first prod(shape) CPU devices), with Auto
    axis types so jit and shard_map take plain arrays.

    After jax.distributed.initialize the devices are every process's, in
    process-major order (process 0's first), so a leading axis of size
    num_processes is the process axis and the axes after it stay inside a
    process; every strata op works over any of the axes (README, "Several
    processes")."""
    shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    axis_names = tuple(axis_names) if isinstance(axis_names, (tuple, list)) else (axis_names,)
    if len(shape) != len(axis_names):
        raise ValueError(f"make_mesh: shape {shape} and axis_names {axis_names} differ in length")
    need = math.prod(shape)
    if devices is None:
        have = sorted(jax.devices("cpu"), key=lambda d: (d.process_index, d.id))
        if len(have) < need and _multiprocess.process_count() > 1:
            raise RuntimeError(
                f"make_mesh{shape}: needs {need} emulated NPUs but the {_multiprocess.process_count()} "
                f"processes have {len(have)} CPU devices in all ({jax.local_device_count()} here). Call "
                f"strata.emulator.ensure_devices(n_local) in every process before jax.distributed.initialize, "
                f"with n_local * num_processes >= {need}.")
        if len(have) < need:
            raise RuntimeError(
                f"make_mesh{shape}: needs {need} emulated NPUs but JAX has {len(have)} CPU devices. "
                f"Call strata.emulator.ensure_devices({need}) (or jax.config.update("
                f"'jax_num_cpu_devices', {need})) before JAX's first computation, or set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={need}.")
        devices = have[:need]
    grid = np.asarray(devices, dtype=object).reshape(shape)
    mesh = Mesh(grid, axis_names, axis_types=(AxisType.Auto,) * len(shape))
    _multiprocess.remember_mesh(mesh)
    return mesh

