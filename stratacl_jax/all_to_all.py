"""strata.all_to_all — the twin of lax.all_to_all.

The primitive `strata_all_to_all` is linear and its own transpose with the
split and concat axes swapped (it is a permutation of blocks)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from . import _config
from . import _ffi
from . import _multiprocess as _mp

OPNAME = "strata.all_to_all"


def all_to_all(x, axis_name, split_axis: int, concat_axis: int, *, tiled: bool = False, axis_index_groups=None):
    """Sends chunk j of `split_axis` to rank j; received chunks stack (or, tiled,
    concatenate) along `concat_axis` in rank order. `x` may be a pytree."""
    _ffi.check_axis_index_groups(OPNAME, axis_index_groups)
    axes = _ffi.normalize_axes(axis_name, OPNAME)
    split_axis = _ffi.static_int(OPNAME, "split_axis", split_axis)
    concat_axis = _ffi.static_int(OPNAME, "concat_axis", concat_axis)
    mesh_axes, vmap_axes = _ffi.split_axes(OPNAME, axes)
    if vmap_axes:
        if mesh_axes:
            raise NotImplementedError(
                f"{OPNAME}: axes {axes} mix vmap axes {vmap_axes} with mesh axes {mesh_axes}")
        return lax.all_to_all(x, axes, split_axis, concat_axis, tiled=tiled)
    group = _ffi.Group(OPNAME, axes).spec()
    n = group.size
    settings = _config.current()

    def one(leaf):
        leaf = jnp.asarray(leaf)
        _ffi.check_dtype(OPNAME, leaf)
        if leaf.ndim == 0:
            raise ValueError(f"{OPNAME}: the operand must have at least one dimension")
        if not -leaf.ndim <= split_axis < leaf.ndim:
            raise ValueError(f"{OPNAME}: split_axis {split_axis} is out of range for shape {leaf.shape}")
        s = split_axis % leaf.ndim
        if tiled and leaf.shape[s] % n:
            raise ValueError(
                f"{OPNAME}: split_axis {s} of shape {leaf.shape} is not divisible by the {n} ranks of {axes}")
        if not tiled and leaf.shape[s] != n:
            raise ValueError(
                f"{OPNAME}: with tiled=False split_axis {s} of shape {leaf.shape} must equal the {n} ranks of {axes}")
        if not -leaf.ndim <= concat_axis < leaf.ndim:
            raise ValueError(f"{OPNAME}: concat_axis {concat_axis} is out of range for shape {leaf.shape}")
        leaf = _ffi.make_varying(leaf, axes)
        return all_to_all_p.bind(leaf, group=group, split=s, concat=concat_axis % leaf.ndim, tiled=bool(tiled),
                                 settings=settings)

    return jax.tree.map(one, x)


def _out_shape(shape, n, s, c, tiled):
    shape = list(shape)
    if tiled:
        shape[s] //= n
        shape[c] *= n
        return tuple(shape)
    # Untiled: the split axis (of size n) goes, the stack of received chunks
    # comes in at `c`.
    del shape[s]
    shape.insert(c, n)
    return tuple(shape)


def _abstract_eval(x, *, group, split, concat, tiled, settings):
    return _ffi.typed(x, shape=_out_shape(x.shape, group.size, split, concat, tiled), weak_type=False)


def _lower(x, *, group, split, concat, tiled, settings):
    n, s, c = group.size, split, concat
    parts = _mp.split(group.axes)
    if parts is not None:
        split_x = x.reshape(x.shape[:s] + (n, x.shape[s] // n) + x.shape[s + 1:]) if tiled else x
        blocks = jnp.moveaxis(split_x, s, 0)
        chunk_shape = blocks.shape[1:]
        out = _lead_across(blocks.reshape(n, -1), group, settings, *parts)
        received = jnp.moveaxis(out.reshape((n,) + chunk_shape), 0, c)
        if not tiled:
            return received
        shape = received.shape
        return received.reshape(shape[:c] + (n * shape[c + 1],) + shape[c + 2:])
    if s == c:
        # [rows, n, block] -> [rows, n, block], rows = the dimensions before
        # the axis: nothing moves.
        return _ffi.call("strata_all_to_all", group, x, x.shape, block_elems=math.prod(x.shape[s:]) // n,
                         settings=settings)
    # Lay the chunks for ranks 0..n-1 out as leading blocks.
    split_x = x.reshape(x.shape[:s] + (n, x.shape[s] // n) + x.shape[s + 1:]) if tiled else x
    blocks = jnp.moveaxis(split_x, s, 0)
    chunk_shape = blocks.shape[1:]
    flat = blocks.reshape(n, -1)
    out = _ffi.call("strata_all_to_all", group, flat, flat.shape, block_elems=flat.shape[1], settings=settings)
    received = jnp.moveaxis(out.reshape((n,) + chunk_shape), 0, c)
    if not tiled:
        return received
    shape = received.shape
    return received.reshape(shape[:c] + (n * shape[c + 1],) + shape[c + 2:])


def _lead_across(flat, group, settings, local, crossing):
    """flat [n, m]: row j for rank j -> row i from rank i, over axes that cross
    processes: XLA's all_to_all over the crossing axes, then strata's over the
    local ones, the rows put in the rank order of group.axes."""
    what = _mp.describe(OPNAME, group.axes, crossing)
    if not local:
        return _mp.cross(lambda v: lax.all_to_all(v, group.axes, 0, 0, tiled=True), flat, group.axes, what)
    sub = _mp.sub_group(group, local)
    n, m = flat.shape
    if tuple(group.axes) == tuple(crossing) + tuple(local):
        # Process-major ranks: each stage works on its own dim, nothing is reordered.
        blocks = flat.reshape(n // sub.size, sub.size, m)  # [nP, nL, m]
        blocks = _mp.cross(lambda v: lax.all_to_all(v, crossing, 0, 0, tiled=True), blocks, crossing, what)
        got = _ffi.call("strata_all_to_all", sub, blocks, blocks.shape, block_elems=m, settings=settings)
        return got.reshape(n, m)
    blocks = _mp.to_split_order(flat, group.axes, local, crossing)  # [nL, nP, m]
    n_local, n_cross, m = blocks.shape
    blocks = _mp.cross(lambda v: lax.all_to_all(v, crossing, 1, 1, tiled=True), blocks, crossing, what)
    flat_local = blocks.reshape(n_local, n_cross * m)
    got = _ffi.call("strata_all_to_all", sub, flat_local, flat_local.shape, block_elems=n_cross * m,
                    settings=settings)
    return _mp.from_split_order(got.reshape(n_local, n_cross, m), group.axes, local, crossing)


def _transpose(ct, x, *, group, split, concat, tiled, settings):
    return (all_to_all_p.bind(ct, group=group, split=concat, concat=split, tiled=tiled, settings=settings),)


def _batch(axis_data, vals, dims, *, group, split, concat, tiled, settings):
    (x,), (d,) = vals, dims
    if d is None:
        return all_to_all_p.bind(x, group=group, split=split, concat=concat, tiled=tiled, settings=settings), None
    x = _ffi.move_batch_to_front(x, d)
    return all_to_all_p.bind(x, group=group, split=split + 1, concat=concat + 1, tiled=tiled,
                             settings=settings), 0


all_to_all_p = _ffi.primitive("strata_all_to_all", _abstract_eval, _lower, transpose=_transpose, batch=_batch,
                              api=all_to_all)
