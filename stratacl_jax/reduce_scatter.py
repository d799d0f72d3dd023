"""strata.reduce_scatter — the twin of lax.psum_scatter (plus max/min/prod).

The primitive `strata_reduce_scatter` with op="sum" is linear (transpose:
all_gather); max/min/prod have JVP rules whose tangents are sum-scatters, as
all_reduce's are."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.interpreters import ad

from . import _config
from . import _ffi
from . import _multiprocess as _mp

OPNAME = "strata.reduce_scatter"


def reduce_scatter(x, axis_name, *, scatter_dimension: int = 0, tiled: bool = False, op: str = "sum",
                   axis_index_groups=None):
    """Reduces `x` (an array or a pytree) over `axis_name`; rank r keeps block
    r of `scatter_dimension`."""
    _ffi.check_axis_index_groups(OPNAME, axis_index_groups)
    axes = _ffi.normalize_axes(axis_name, OPNAME)
    scatter_dimension = _ffi.static_int(OPNAME, "scatter_dimension", scatter_dimension)
    mesh_axes, vmap_axes = _ffi.split_axes(OPNAME, axes)
    if vmap_axes:
        if mesh_axes or op != "sum":
            raise NotImplementedError(
                f"{OPNAME}: over vmap axes {vmap_axes} only op='sum' alone is supported (lax.psum_scatter)")
        return lax.psum_scatter(x, axes, scatter_dimension=scatter_dimension, tiled=tiled)
    group = _ffi.Group(OPNAME, axes).spec()
    n = group.size
    settings = _config.current()

    def one(leaf):
        leaf = jnp.asarray(leaf)
        _ffi.check_dtype(OPNAME, leaf, reduce_op=op)
        if not -leaf.ndim <= scatter_dimension < leaf.ndim:
            raise ValueError(f"{OPNAME}: scatter_dimension {scatter_dimension} is out of range for shape {leaf.shape}")
        d = scatter_dimension % leaf.ndim
        if tiled and leaf.shape[d] % n:
            raise ValueError(
                f"{OPNAME}: dimension {d} of shape {leaf.shape} is not divisible by the {n} ranks of {axes}")
        if not tiled and leaf.shape[d] != n:
            raise ValueError(
                f"{OPNAME}: with tiled=False dimension {d} of shape {leaf.shape} must equal the {n} ranks of {axes}")
        if leaf.dtype == jnp.bool_ and op == "sum":
            leaf = leaf.astype(jnp.int32)  # counts, as all_reduce's sum of bools
        leaf = _ffi.make_varying(leaf, axes)
        return reduce_scatter_p.bind(leaf, group=group, dim=d, tiled=bool(tiled), op=op, settings=settings)

    return jax.tree.map(one, x)


def _out_shape(shape, n, dim, tiled):
    shape = list(shape)
    if tiled:
        shape[dim] //= n
    else:
        del shape[dim]
    return tuple(shape)


def _abstract_eval(x, *, group, dim, tiled, op, settings):
    return _ffi.typed(x, shape=_out_shape(x.shape, group.size, dim, tiled))


def _lower(x, *, group, dim, tiled, op, settings):
    parts = _mp.split(group.axes)
    if parts is not None:
        return _lower_across(x, group, dim, tiled, op, settings, *parts)
    return _local(x, group, dim, tiled, op, settings)


def _cross_scatter(x, axes, op, what):
    """Rank r of `axes` gets x[r] reduced over `axes` (XLA's collectives)."""
    if op == "sum":
        return _mp.cross(lambda v: lax.psum_scatter(v, axes, scatter_dimension=0, tiled=False), x, axes, what,
                         agree=("op", op))

    def reduce_then_take(v):
        if op == "prod":
            total = jnp.prod(lax.all_gather(v, axes), axis=0).astype(v.dtype)
        else:
            total = {"max": lax.pmax, "min": lax.pmin}[op](v, axes)
        return lax.dynamic_index_in_dim(total, lax.axis_index(axes), axis=0, keepdims=False)

    return _mp.cross(reduce_then_take, x, axes, what, agree=("op", op))


def _lower_across(x, group, dim, tiled, op, settings, local, crossing):
    """Across processes: strata reduce-scatters inside the process first (the
    link then carries 1/n_local of the data), XLA reduce-scatters the rest
    between processes."""
    what = _mp.describe(OPNAME, group.axes, crossing)
    n = group.size
    shape = x.shape
    xs = x.reshape(shape[:dim] + (n, shape[dim] // n) + shape[dim + 1:]) if tiled else x
    blocks = jnp.moveaxis(xs, dim, 0)  # [n, ...rest]: block r for rank r
    if not local:
        return _cross_scatter(blocks, group.axes, op, what)
    sub = _mp.sub_group(group, local)
    if tuple(group.axes) == tuple(crossing) + tuple(local):  # process-major: no reordering
        blocks = blocks.reshape((group.size // sub.size, sub.size) + blocks.shape[1:])  # [nP, nL, ...]
        mine = _local(blocks, sub, 1, False, op, settings)  # [nP, ...]
    else:
        blocks = _mp.to_split_order(blocks, group.axes, local, crossing)  # [nL, nP, ...]
        mine = _local(blocks, sub, 0, False, op, settings)  # [nP, ...]
    return _cross_scatter(mine, crossing, op, what)


def _local(x, group, dim, tiled, op, settings):
    # [rows, n, block] -> [rows, 1, block] with rows = the dimensions before
    # `dim`: nothing moves.
    block = math.prod(x.shape[dim:]) // group.size
    return _ffi.call("strata_reduce_scatter", group, x, _out_shape(x.shape, group.size, dim, tiled),
                     block_elems=block, reduce_op=_ffi.REDUCE_OPS[op], settings=settings)


def _sum_scatter(group, dim, tiled, settings):
    return lambda v: reduce_scatter_p.bind(v, group=group, dim=dim, tiled=tiled, op="sum", settings=settings)


def _jvp(primals, tangents, *, group, dim, tiled, op, settings):
    (x,), (t,) = primals, tangents
    y = reduce_scatter_p.bind(x, group=group, dim=dim, tiled=tiled, op=op, settings=settings)
    scatter = _sum_scatter(group, dim, tiled, settings)
    if op == "sum":
        return y, scatter(t)
    all_gather_p = _ffi.registered("strata_all_gather").primitive
    if op in ("max", "min"):
        # The full reduction, as every rank would see it, from the pieces.
        y_full = all_gather_p.bind(y, group=group, axis=dim, tiled=tiled, invariant=False, settings=settings)
        hit = (x == y_full).astype(x.dtype)
        return y, scatter(t * hit) / scatter(hit)
    return y, scatter(t * _ffi.product_of_others(x, group))


def _transpose(ct, x, *, group, dim, tiled, op, settings):
    if op != "sum":
        raise NotImplementedError(f"{OPNAME}: op={op!r} is not linear; its JVP is what transposes")
    if type(ct) is ad.Zero:
        return (ad.Zero(x.aval),)
    all_gather_p = _ffi.registered("strata_all_gather").primitive
    return (all_gather_p.bind(ct, group=group, axis=dim, tiled=tiled, invariant=False, settings=settings),)


def _batch(axis_data, vals, dims, *, group, dim, tiled, op, settings):
    (x,), (d,) = vals, dims
    if d is None:
        return reduce_scatter_p.bind(x, group=group, dim=dim, tiled=tiled, op=op, settings=settings), None
    x = _ffi.move_batch_to_front(x, d)
    return reduce_scatter_p.bind(x, group=group, dim=dim + 1, tiled=tiled, op=op, settings=settings), 0


reduce_scatter_p = _ffi.primitive("strata_reduce_scatter", _abstract_eval, _lower, jvp=_jvp,
                                  transpose=_transpose, batch=_batch, api=reduce_scatter)
