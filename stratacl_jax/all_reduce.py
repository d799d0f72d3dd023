"""strata.all_reduce — the twin of lax.psum / pmax / pmin (and a product)."""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from . import _ffi

OPNAME = "strata.all_reduce"


def all_reduce(x, axis_name, *, op: str = "sum"):
    """Reduces `x` over the ranks of `axis_name`; every rank gets the result."""
    _ffi.check_dtype(OPNAME, x, reduce_op=op)
    axes = _ffi.normalize_axes(axis_name)
    _ffi.Group(OPNAME, axes)  # validate early, with the op's name
    x = _ffi.make_varying(jnp.asarray(x), axes)
    return _all_reduce(x, axes, op)


def _forward(x, axes, op):
    group = _ffi.Group(OPNAME, axes)
    out_vma = _ffi.varying_axes(x) - set(axes)
    flat = x.reshape(1, -1) if x.ndim == 0 else x
    y = _ffi.call("strata_all_reduce", group, flat, flat.shape, block_elems=flat.size,
                  out_vma=out_vma, reduce_op=_ffi.REDUCE_OPS[op])
    return y.reshape(x.shape)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _all_reduce(x, axes, op):
    return _forward(x, axes, op)


def _fwd(x, axes, op):
    y = _forward(x, axes, op)
    return y, (x, y)


def _bwd(axes, op, residuals, ct):
    x, y = residuals
    if _ffi.vma_checked(x, axes):
        # The cotangent of an invariant result is already the total; hand
        # each rank a (varying) copy, as psum's transpose does.
        total = _ffi.make_varying(ct, axes)
    else:
        total = all_reduce(ct, axes, op="sum")
    if op == "sum":
        return (total,)
    if op in ("max", "min"):
        # Split evenly between the ranks that hold the extreme (jnp.max's rule).
        hit = (x == y).astype(ct.dtype)
        ties = all_reduce(hit, axes, op="sum")
        return (total * hit / _ffi.make_varying(ties, axes),)
    # prod: d/dx_r Π x = Π_{s≠r} x_s, computed exactly (no division by zero).
    from .all_gather import all_gather

    everyone = all_gather(x, axes)
    rank = _ffi.Group(OPNAME, axes).rank()
    others = jnp.where(jnp.arange(everyone.shape[0]).reshape((-1,) + (1,) * x.ndim) == rank,
                       jnp.ones_like(everyone), everyone)
    return (total * jnp.prod(others, axis=0),)


_all_reduce.defvjp(_fwd, _bwd)
