"""strata.reduce_scatter — the twin of lax.psum_scatter (plus max/min/prod)."""
from __future__ import annotations

import jax.numpy as jnp

from . import _ffi

OPNAME = "strata.reduce_scatter"


def reduce_scatter(x, axis_name, *, scatter_dimension: int = 0, tiled: bool = False, op: str = "sum"):
    """Reduces `x` over `axis_name`; rank r keeps block r of `scatter_dimension`."""
    x = jnp.asarray(x)
    _ffi.check_dtype(OPNAME, x, reduce_op=op)
    axes = _ffi.normalize_axes(axis_name)
    n = _ffi.Group(OPNAME, axes).size
    if not -x.ndim <= scatter_dimension < x.ndim:
        raise ValueError(f"{OPNAME}: scatter_dimension {scatter_dimension} is out of range for shape {x.shape}")
    d = scatter_dimension % x.ndim
    if tiled and x.shape[d] % n:
        raise ValueError(f"{OPNAME}: dimension {d} of shape {x.shape} is not divisible by the {n} ranks of {axes}")
    if not tiled and x.shape[d] != n:
        raise ValueError(f"{OPNAME}: with tiled=False dimension {d} of shape {x.shape} must equal the {n} ranks of {axes}")
    return _reduce_scatter(_ffi.make_varying(x, axes), axes, d, bool(tiled), op)


def _forward(x, axes, d, tiled, op):
    group = _ffi.Group(OPNAME, axes)
    n = group.size
    moved = jnp.moveaxis(x, d, 0)
    piece_shape = ((moved.shape[0] // n,) if tiled else ()) + moved.shape[1:]
    flat = moved.reshape(n, -1)
    out = _ffi.call("strata_reduce_scatter", group, flat, (1, flat.shape[1]), block_elems=flat.shape[1],
                    out_vma=_ffi.varying_axes(x), reduce_op=_ffi.REDUCE_OPS[op])
    out = out.reshape(piece_shape)
    return jnp.moveaxis(out, 0, d) if tiled else out


def _transpose(ct, axes, d, tiled, op):
    if op != "sum":
        raise NotImplementedError(
            f"{OPNAME}: the gradient is defined for op='sum' only (as lax.psum_scatter); got op={op!r}")
    from .all_gather import all_gather

    return all_gather(ct, axes, axis=d, tiled=tiled)


_reduce_scatter = _ffi.linear_collective(_forward, _transpose, 4)
