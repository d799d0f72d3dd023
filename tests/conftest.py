"""Every test process emulates 8 NPUs (JAX CPU devices). The device count and
XLA's thread pool must be set before JAX's backend starts, hence at import."""
import numpy as np
import pytest

import stratacl_jax as strata

strata.emulator.ensure_devices(8)

import jax  # noqa: E402

# float64 and int64 are in the contract: test them for real, not as float32.
jax.config.update("jax_enable_x64", True)

from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from random_data import random_array  # noqa: E402,F401  (tests import it from here)


@pytest.fixture(scope="session")
def mesh8():
    return strata.emulator.make_mesh((8,), ("x",))


@pytest.fixture(scope="session")
def mesh2x4():
    return strata.emulator.make_mesh((2, 4), ("node", "npu"))


def shard_run(fn, mesh, *args, check_vma=True, out_axes=None):
    """Runs fn under jit(shard_map) with every argument split on dim 0 over
    all mesh axes; returns numpy results stacked the same way."""
    axes = tuple(mesh.axis_names)
    spec = P(axes)
    placed = [jax.device_put(a, NamedSharding(mesh, spec)) for a in args]
    out_spec = P(out_axes if out_axes is not None else axes)
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * len(args), out_specs=out_spec,
                              check_vma=check_vma))
    return jax.tree.map(np.asarray, f(*placed))


