"""The emulated supernode: what the hardware is, and meshes of emulated NPUs.

Each emulated NPU is one JAX CPU device. JAX creates its CPU devices once, when
its backend starts, so ask for them first:

    import stratacl_jax as strata
    strata.emulator.ensure_devices(8)      # before any JAX computation
    mesh = strata.emulator.make_mesh((2, 4), ("node", "npu"))
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import numpy as np
from jax._src import xla_bridge
from jax.sharding import AxisType, Mesh

from . import _runtime_setup


@dataclass(frozen=True)
class SupernodeSpec:
    """A supernode's shape and link figures (for presets and cost models)."""

    name: str
    num_npus: int
    npus_per_node: int
    dies_per_npu: int
    vector_cores_per_die: int
    cube_cores_per_die: int
    # Not published for the 910C: a parameter, not a fact.
    sdma_engines_per_die: int
    fabric_gbytes_per_s_per_npu: float  # unidirectional
    cross_node_extra_latency_us: float
    hbm_gbytes: int
    hbm_gbytes_per_s: float

    @property
    def num_nodes(self) -> int:
        return self.num_npus // self.npus_per_node


# arXiv 2506.12708 (CloudMatrix384) and summaries of it; see FACTS.md §4.
CLOUDMATRIX384 = SupernodeSpec(
    name="cloudmatrix384", num_npus=384, npus_per_node=8, dies_per_npu=2,
    vector_cores_per_die=48, cube_cores_per_die=24, sdma_engines_per_die=16,
    fabric_gbytes_per_s_per_npu=392.0, cross_node_extra_latency_us=1.0,
    hbm_gbytes=128, hbm_gbytes_per_s=3200.0)

# One CloudMatrix node: the 8-NPU slice the benchmarks run by default.
CLOUDMATRIX_NODE = SupernodeSpec(**{**CLOUDMATRIX384.__dict__, "name": "cloudmatrix_node", "num_npus": 8})

PRESETS = {spec.name: spec for spec in (CLOUDMATRIX384, CLOUDMATRIX_NODE)}


def preset(name: str) -> SupernodeSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown supernode preset {name!r}; known: {sorted(PRESETS)}") from None


def ensure_devices(n: int) -> None:
    """Asks JAX for `n` CPU devices (emulated NPUs) and sizes XLA's thread pool.

    Must run before JAX's backend starts; afterwards it only checks."""
    if xla_bridge.backends_are_initialized():
        have = len(jax.devices("cpu"))
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
    axis types so jit and shard_map take plain arrays."""
    shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    axis_names = tuple(axis_names) if isinstance(axis_names, (tuple, list)) else (axis_names,)
    if len(shape) != len(axis_names):
        raise ValueError(f"make_mesh: shape {shape} and axis_names {axis_names} differ in length")
    need = math.prod(shape)
    if devices is None:
        have = jax.devices("cpu")
        if len(have) < need:
            raise RuntimeError(
                f"make_mesh{shape}: needs {need} emulated NPUs but JAX has {len(have)} CPU devices. "
                f"Call strata.emulator.ensure_devices({need}) (or jax.config.update("
                f"'jax_num_cpu_devices', {need})) before JAX's first computation, or set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={need}.")
        devices = have[:need]
    grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, axis_names, axis_types=(AxisType.Auto,) * len(shape))
