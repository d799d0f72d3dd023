"""strata.memory — registration-on-allocation for JAX arrays.

Each shard of an array made here lives in its device's arena: memory that was
registered with the emulated fabric (and pre-faulted in large pages) when the
arena was created. JAX imports the 64-byte aligned block without a copy, the
collectives then find it registered (a registry hit, nothing staged), and the
block goes back to the arena when JAX frees the array.

    x = strata.memory.device_put(np_array, NamedSharding(mesh, P("x")))
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Sharding

from . import _core
from ._multiprocess import local_device_index


def _block(device, shape, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = _core.arena_buffer(local_device_index(device), nbytes)  # owns the block
    return raw.view(dtype).reshape(shape)


def _assemble(shape, dtype, sharding: Sharding, fill) -> jax.Array:
    shape = tuple(int(s) for s in shape)
    shards = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        local_shape = tuple(len(range(*sl.indices(dim))) for sl, dim in zip(index, shape))
        block = _block(device, local_shape, dtype)
        fill(block, index)
        # Aligned host memory is imported zero-copy; JAX keeps `block` (and
        # with it the arena block) alive for as long as the buffer lives.
        shards.append(jax.device_put(block, device))
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def device_put(x, sharding: Sharding) -> jax.Array:
    """Like jax.device_put(x, sharding), with every shard in registered memory."""
    x = np.asarray(x)
    return _assemble(x.shape, x.dtype, sharding, lambda block, index: np.copyto(block, x[index]))


def zeros(shape, dtype, sharding: Sharding) -> jax.Array:
    return _assemble(shape, dtype, sharding, lambda block, index: block.fill(0))


def empty(shape, dtype, sharding: Sharding) -> jax.Array:
    """Uninitialised registered memory (whatever the arena block held)."""
    return _assemble(shape, dtype, sharding, lambda block, index: None)


def arena_info(device) -> dict:
    """chunks, bytes_reserved, bytes_in_use, live_blocks, allocations."""
    index = local_device_index(device) if hasattr(device, "id") else int(device)
    return dict(_core.arena_info(index))


def is_registered(array: jax.Array) -> bool:
    """True when every shard of `array` lies in registered fabric memory."""
    return all(
        _core.region_registered(local_device_index(s.device), s.data.unsafe_buffer_pointer(), max(1, s.data.nbytes))
        for s in array.addressable_shards)
