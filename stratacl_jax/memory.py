"""strata.memory — registration-on-allocation for JAX arrays.

Each shard of an array made here lives in its device's arena: memory that was
registered with the emulated fabric (and pre-faulted in large pages) when the
arena was created. JAX imports the 64-byte aligned block without a copy, the
collectives then find it registered (a registry hit, nothing staged), and the
block goes back to the arena when JAX frees the array. An arena returns a
chunk to the OS when its last block is freed, keeping at most one wholly free
chunk of up to 64 MiB for reuse (xla_ffi/runtime/arena.h states the policy).

    x = strata.memory.device_put(np_array, NamedSharding(mesh, P("x")))
"""
from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Sharding

from . import _core
from ._multiprocess import local_device_index


_INT64_MAX = (1 << 63) - 1


def _shape(opname: str, shape) -> tuple:
    try:
        dims = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    except TypeError:
        dims = None
    if dims is None or any(isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)) for d in dims):
        raise TypeError(f"{opname}: shape must be a tuple of non-negative ints, got {shape!r}")
    dims = tuple(int(d) for d in dims)
    if any(d < 0 for d in dims):
        raise ValueError(f"{opname}: shape must be a tuple of non-negative ints, got {dims}")
    return dims


def _check_size(opname: str, shape: tuple, dtype: np.dtype) -> None:
    nbytes = math.prod(shape) * dtype.itemsize  # Python ints: exact
    if nbytes > _INT64_MAX:
        raise ValueError(f"{opname}: shape {shape} of {dtype} is {nbytes} bytes, more than any array can hold "
                         f"(sizes are int64)")


def _block(opname: str, device, shape, dtype) -> np.ndarray:
    nbytes = math.prod(shape) * dtype.itemsize
    raw = _core.arena_buffer(local_device_index(device), nbytes)  # owns the block
    if raw is None:
        raise MemoryError(
            f"{opname}: cannot allocate {nbytes} bytes ({nbytes / 2**30:.2f} GiB) for shard {list(shape)} {dtype} "
            f"on {device}: the host refused the memory (out of memory or an address-space limit)")
    return raw.view(dtype).reshape(shape)


def _assemble(opname: str, shape, dtype, sharding: Sharding, fill) -> jax.Array:
    shape = _shape(opname, shape)
    dtype = np.dtype(dtype)
    _check_size(opname, shape, dtype)
    shards = []
    try:
        for device, index in sharding.addressable_devices_indices_map(shape).items():
            local_shape = tuple(len(range(*sl.indices(dim))) for sl, dim in zip(index, shape))
            block = _block(opname, device, local_shape, dtype)
            fill(block, index)
            # Aligned host memory is imported zero-copy; JAX keeps `block` (and
            # with it the arena block) alive for as long as the buffer lives.
            shards.append(jax.device_put(block, device))
            del block
        return jax.make_array_from_single_device_arrays(shape, sharding, shards)
    except BaseException as e:
        # Give back what the shards already took, now: the traceback would
        # keep this frame (and the blocks) alive for as long as it lives.
        for a in shards:
            a.delete()
        shards.clear()
        block = None  # noqa: F841
        if isinstance(e, MemoryError) and len(e.args) == 1 and str(e.args[0]).startswith(opname):
            raise MemoryError(f"{e.args[0]}; the shards already allocated for this array were released") from None
        raise


def device_put(x, sharding: Sharding) -> jax.Array:
    """Like jax.device_put(x, sharding), with every shard in registered memory."""
    x = np.asarray(x)
    return _assemble("strata.memory.device_put", x.shape, x.dtype, sharding,
                     lambda block, index: np.copyto(block, x[index]))


def zeros(shape, dtype, sharding: Sharding) -> jax.Array:
    return _assemble("strata.memory.zeros", shape, dtype, sharding, lambda block, index: block.fill(0))


def empty(shape, dtype, sharding: Sharding) -> jax.Array:
    """Uninitialised registered memory (whatever the arena block held)."""
    return _assemble("strata.memory.empty", shape, dtype, sharding, lambda block, index: None)


def arena_info(device) -> dict:
    """chunks, bytes_reserved, bytes_in_use, live_blocks, allocations,
    chunks_released (returned to the OS, ever)."""
    index = local_device_index(device) if hasattr(device, "id") else int(device)
    return dict(_core.arena_info(index))


def is_registered(array: jax.Array) -> bool:
    """True when every shard of `array` lies in registered fabric memory."""
    return all(
        _core.region_registered(local_device_index(s.device), s.data.unsafe_buffer_pointer(), max(1, s.data.nbytes))
        for s in array.addressable_shards)
