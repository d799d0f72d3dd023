"""strata.all_reduce — the twin of lax.psum / pmean / pmax / pmin (and a product).

One primitive, `strata_all_reduce`: sum is linear (its transpose is psum's:
invariant results hand each rank a varying copy of the cotangent, untracked
ones sum again); max/min/prod have JVP rules whose tangents are sums, so
reverse mode comes from transposing those (lax has no gradient for pmax/pmin:
jax#7167)."""
from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import ad

from . import _config
from . import _ffi
from . import _multiprocess as _mp

OPNAME = "strata.all_reduce"
OPS = ("sum", "max", "min", "prod", "mean")
_TWINS = {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin, "mean": lax.pmean}


def all_reduce(x, axis_name, *, op: str = "sum", axis_index_groups=None):
    """Reduces `x` (an array or a pytree of arrays) over the ranks of
    `axis_name`; every rank gets the result. op="mean" is lax.pmean; a sum
    of bools counts (int32), as lax.psum does. A sum (or mean) of constants
    (no leaf a tracer: `all_reduce(1, "i")`) folds as lax.psum's does: the
    axis size times the value, a Python int for an int, no communication."""
    if op not in OPS:
        raise ValueError(f"{OPNAME}: op must be one of {OPS}, got {op!r}")
    _ffi.check_axis_index_groups(OPNAME, axis_index_groups)
    axes = _ffi.normalize_axes(axis_name, OPNAME)
    mesh_axes, vmap_axes = _ffi.split_axes(OPNAME, axes)
    group = _ffi.Group(OPNAME, mesh_axes).spec() if mesh_axes or not vmap_axes else None
    if op in ("sum", "mean") and _ffi.is_constant(x):
        return _TWINS[op](x, axes)
    settings = _config.current()

    def one(leaf):
        leaf = jnp.asarray(leaf)
        reduce_op = "sum" if op == "mean" else op
        _ffi.check_dtype(OPNAME, leaf, reduce_op=reduce_op)
        if leaf.dtype == np.bool_ and reduce_op == "sum":
            leaf = leaf.astype(jnp.int32)  # lax.psum counts bools
        if vmap_axes:  # the batch is on this rank: no communication
            leaf = _TWINS[reduce_op](leaf, vmap_axes) if reduce_op in _TWINS else _vmap_prod(leaf, vmap_axes)
        if group is not None:
            leaf = _ffi.make_varying(leaf, mesh_axes)
            leaf = bind(leaf, group, reduce_op, settings)
        return leaf / math.prod(lax.axis_size(a) for a in axes) if op == "mean" else leaf

    return jax.tree.map(one, x)


def _vmap_prod(x, axes):
    return jnp.prod(lax.all_gather(x, axes), axis=0)


def bind(x, group, op, settings=None):
    return all_reduce_p.bind(x, group=group, op=op, invariant=_ffi.vma_checked(x, group.axes),
                             settings=settings or _config.current())


def _abstract_eval(x, *, group, op, invariant, settings):
    return _ffi.typed(x, vma=_ffi.varying_axes(x) - set(group.axes))


def _lower(x, *, group, op, invariant, settings):
    parts = _mp.split(group.axes)
    if parts is not None:
        return _lower_across(x, group, op, settings, *parts)
    return _local(x, group, op, settings)


def _local(x, group, op, settings):
    flat = x.reshape(1) if x.ndim == 0 else x  # any shape: one block of all its bytes
    y = _ffi.call("strata_all_reduce", group, flat, flat.shape, block_elems=flat.size,
                  reduce_op=_ffi.REDUCE_OPS[op], settings=settings)
    return y.reshape(x.shape)


# From this many bytes (when the elements divide by the local group), a
# reduction over axes that cross processes reduce-scatters inside the process
# first, so each local rank sends 1/n_local of the data over the cross-process
# link instead of all of it, and all-gathers the result back. Measured on 2
# processes x 4 devices it beat "local all_reduce, then the cross-process one"
# at every size from 4 KiB to 4 MiB per rank (1.3-2.1x; BENCHMARKS.md,
# "Several processes"), so it is always on; the variable is for measuring.
HIERARCHICAL_MIN_BYTES = int(os.environ.get("STRATA_XPROC_RS_MIN_BYTES", 0))


def _cross_reduce(x, axes, op, what):
    if op == "prod":
        return _mp.cross(lambda v: jnp.prod(lax.all_gather(v, axes), axis=0).astype(v.dtype), x, axes, what,
                         agree=("op", op))
    return _mp.cross(lambda v: _TWINS[op](v, axes), x, axes, what, agree=("op", op))


def _lower_across(x, group, op, settings, local, crossing):
    """Over axes that cross processes: strata inside each process, XLA's
    collectives (gloo) between processes. A reduction is the same whichever
    rank order it meets in, so the split needs no reordering."""
    what = _mp.describe(OPNAME, group.axes, crossing)
    if not local:
        return _cross_reduce(x, group.axes, op, what)
    sub = _mp.sub_group(group, local)
    n_local = sub.size
    if (op in ("sum", "max", "min") and x.size % n_local == 0 and x.size >= n_local
            and x.size * x.dtype.itemsize >= HIERARCHICAL_MIN_BYTES):
        blocks = x.reshape(n_local, -1)
        mine = _ffi.registered("strata_reduce_scatter").lower(blocks, group=sub, dim=0, tiled=False, op=op,
                                                             settings=settings)
        mine = _cross_reduce(mine, crossing, op, what)
        full = _ffi.registered("strata_all_gather").lower(mine, group=sub, axis=0, tiled=False, invariant=False,
                                                         settings=settings)
        return full.reshape(x.shape)
    y = _local(x, sub, op, settings)
    return _cross_reduce(y, crossing, op, what)


def _jvp(primals, tangents, *, group, op, invariant, settings):
    (x,), (t,) = primals, tangents
    params = dict(group=group, op=op, invariant=invariant, settings=settings)
    y = all_reduce_p.bind(x, **params)
    total = partial_sum(group, invariant, settings)
    if op == "sum":
        return y, total(t)
    if op in ("max", "min"):
        return y, total(t * extreme_weights(x, y, total))
    return y, total(t * _ffi.product_of_others(x, group))


def partial_sum(group, invariant, settings):
    return lambda v: all_reduce_p.bind(v, group=group, op="sum", invariant=invariant, settings=settings)


def extreme_weights(x, y_full, total):
    """1/ties where x holds the extreme, else 0: the tangent (and gradient) of a
    max/min is split evenly between the ranks that hold it (jnp.max's rule)."""
    hit = (x == _ffi.make_varying(y_full, _ffi.varying_axes(x))).astype(x.dtype)
    return hit / _ffi.make_varying(total(hit), _ffi.varying_axes(x))


def _transpose(ct, x, *, group, op, invariant, settings):
    if op != "sum":
        raise NotImplementedError(f"{OPNAME}: op={op!r} is not linear; its JVP is what transposes")
    if type(ct) is ad.Zero:
        return (ad.Zero(x.aval),)
    if invariant:
        # The cotangent of an invariant result is already the total: each rank
        # gets a (varying) copy, as psum's transpose does.
        return (_ffi.make_varying(ct, group.axes),)
    return (all_reduce_p.bind(ct, group=group, op="sum", invariant=False, settings=settings),)


def _batch(axis_data, vals, dims, *, group, op, invariant, settings):
    # Elementwise over ranks: the batch dimension rides along.
    (x,), (d,) = vals, dims
    return all_reduce_p.bind(x, group=group, op=op, invariant=invariant, settings=settings), d


all_reduce_p = _ffi.primitive("strata_all_reduce", _abstract_eval, _lower, jvp=_jvp, transpose=_transpose,
                              batch=_batch, api=all_reduce)
