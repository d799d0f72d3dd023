"""strata.broadcast — every rank gets rank `root`'s value (lax.pbroadcast's
semantics; jax 0.10.2 lowers pbroadcast only on GPU)."""
from __future__ import annotations

import jax.numpy as jnp

from . import _ffi

OPNAME = "strata.broadcast"


def broadcast(x, axis_name, *, root: int = 0):
    x = jnp.asarray(x)
    _ffi.check_dtype(OPNAME, x)
    axes = _ffi.normalize_axes(axis_name)
    n = _ffi.Group(OPNAME, axes).size
    if not isinstance(root, (int,)) or isinstance(root, bool) or not 0 <= root < n:
        raise ValueError(f"{OPNAME}: root must be an int in [0, {n}) for axes {axes}, got {root!r}")
    return _broadcast(_ffi.make_varying(x, axes), axes, int(root))


def _forward(x, axes, root):
    group = _ffi.Group(OPNAME, axes)
    flat = x.reshape(1, -1)
    out = _ffi.call("strata_broadcast", group, flat, flat.shape, block_elems=flat.size,
                    out_vma=_ffi.varying_axes(x), root=root)
    return out.reshape(x.shape)


def _transpose(ct, axes, root):
    # Every rank's output came from the root: the root gets the sum of all
    # cotangents, the others nothing.
    from .all_reduce import all_reduce

    total = _ffi.make_varying(all_reduce(ct, axes, op="sum"), axes)
    is_root = _ffi.Group(OPNAME, axes).rank() == root
    return jnp.where(is_root, total, jnp.zeros_like(total))


_broadcast = _ffi.linear_collective(_forward, _transpose, 2)
