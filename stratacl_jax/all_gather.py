"""strata.all_gather — the twin of lax.all_gather."""
from __future__ import annotations

import jax.numpy as jnp

from . import _ffi

OPNAME = "strata.all_gather"


def all_gather(x, axis_name, *, axis: int = 0, tiled: bool = False):
    """Gathers `x` from every rank of `axis_name` along `axis`."""
    x = jnp.asarray(x)
    _ffi.check_dtype(OPNAME, x)
    axes = _ffi.normalize_axes(axis_name)
    _ffi.Group(OPNAME, axes)
    ndim_out = x.ndim if tiled else x.ndim + 1
    if not -ndim_out <= axis < ndim_out or (tiled and x.ndim == 0):
        raise ValueError(f"{OPNAME}: axis {axis} is out of range for an operand of shape {x.shape} (tiled={tiled})")
    axis = axis % ndim_out
    return _all_gather(_ffi.make_varying(x, axes), axes, axis, bool(tiled))


def _forward(x, axes, axis, tiled):
    group = _ffi.Group(OPNAME, axes)
    n = group.size
    # The runtime gathers whole blocks along a leading axis; move the gather
    # axis there (free when it already is) and back afterwards.
    block = jnp.moveaxis(x, axis, 0) if tiled else x
    flat = block.reshape(1, -1)
    out = _ffi.call("strata_all_gather", group, flat, (n, flat.shape[1]), block_elems=flat.size,
                    out_vma=_ffi.varying_axes(x))
    out = out.reshape((n,) + block.shape)
    if tiled:
        out = out.reshape((n * block.shape[0],) + block.shape[1:])
    return jnp.moveaxis(out, 0, axis)


def _transpose(ct, axes, axis, tiled):
    from .reduce_scatter import reduce_scatter

    return reduce_scatter(ct, axes, scatter_dimension=axis, tiled=tiled)


_all_gather = _ffi.linear_collective(_forward, _transpose, 3)
