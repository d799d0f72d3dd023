"""strata.all_gather — the twin of lax.all_gather (and, with to="invarying",
of lax.all_gather_invariant).

The primitive `strata_all_gather` is linear: its transpose is reduce_scatter
(varying result) or taking this rank's block of the cotangent (invariant)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from . import _config
from . import _ffi
from . import _multiprocess as _mp

OPNAME = "strata.all_gather"
_TO = ("varying", "invarying")
_REDUCED_REFUSAL = (
    f"{OPNAME}: to='reduced' is not supported. In jax 0.10.2 lax.all_gather(to='reduced') is "
    "all_gather_reduced, a Varying -> Reduced collective: its result is typed 'reduced' over the axes "
    "(a sum still owed, jax's unreduced/reduced sharding types) and its transpose is an unreduced "
    "reduce-scatter, whose result XLA keeps unreduced; strata's primitives carry varying/invariant "
    "typing only. Use to='invarying' (the same values, typed invariant), or lax.all_gather(..., "
    "to='reduced'), which stays on XLA even under strata.config(lax_collectives='strata').")


def all_gather(x, axis_name, *, axis: int = 0, tiled: bool = False, to: str = "varying", axis_index_groups=None):
    """Gathers `x` (an array or a pytree) from every rank of `axis_name` along
    `axis`: a new axis of the group's size (tiled=False) or concatenated into
    `axis` (tiled=True). `to="invarying"` types the result invariant over the
    group (lax.all_gather_invariant). `to="reduced"` is refused: see
    _REDUCED_REFUSAL."""
    if to == "reduced":
        raise NotImplementedError(_REDUCED_REFUSAL)
    if to not in _TO:
        raise ValueError(f"{OPNAME}: to must be one of {_TO}, got {to!r}")
    _ffi.check_axis_index_groups(OPNAME, axis_index_groups)
    axes = _ffi.normalize_axes(axis_name, OPNAME)
    axis = _ffi.static_int(OPNAME, "axis", axis)
    mesh_axes, vmap_axes = _ffi.split_axes(OPNAME, axes)
    if vmap_axes:
        if mesh_axes:
            raise NotImplementedError(
                f"{OPNAME}: axes {axes} mix vmap axes {vmap_axes} with mesh axes {mesh_axes}; gather them in two calls")
        return lax.all_gather(x, axes, axis=axis, tiled=tiled, to=to)
    group = _ffi.Group(OPNAME, axes).spec()
    settings = _config.current()

    def one(leaf):
        leaf = jnp.asarray(leaf)
        _ffi.check_dtype(OPNAME, leaf)
        ndim_out = leaf.ndim if tiled else leaf.ndim + 1
        if not -ndim_out <= axis < ndim_out or (tiled and leaf.ndim == 0):
            raise ValueError(
                f"{OPNAME}: axis {axis} is out of range for an operand of shape {leaf.shape} (tiled={tiled})")
        leaf = _ffi.make_varying(leaf, axes)
        return all_gather_p.bind(leaf, group=group, axis=axis % ndim_out, tiled=bool(tiled),
                                 invariant=(to == "invarying"), settings=settings)

    return jax.tree.map(one, x)


def _out_shape(shape, n, axis, tiled):
    shape = list(shape)
    if tiled:
        shape[axis] *= n
    else:
        shape.insert(axis, n)
    return tuple(shape)


def _abstract_eval(x, *, group, axis, tiled, invariant, settings):
    vma = _ffi.varying_axes(x)
    return _ffi.typed(x, shape=_out_shape(x.shape, group.size, axis, tiled),
                      vma=vma - set(group.axes) if invariant else vma)


def _lower(x, *, group, axis, tiled, invariant, settings):
    parts = _mp.split(group.axes)
    if parts is not None:
        return _lower_across(x, group, axis, tiled, settings, *parts)
    return _local(x, group, axis, tiled, settings)


def _lower_across(x, group, axis, tiled, settings, local, crossing):
    """Across processes: XLA's all_gather over the crossing axes first (each
    rank's block crosses the link once), then strata's over the local ones;
    blocks are then put in the rank order of group.axes."""
    what = _mp.describe(OPNAME, group.axes, crossing)
    if not local:
        return _mp.cross(lambda v: lax.all_gather(v, group.axes, axis=axis, tiled=tiled), x, group.axes, what)
    sub = _mp.sub_group(group, local)
    g = _mp.cross(lambda v: lax.all_gather(v, crossing, axis=0, tiled=False), x, crossing, what)  # [nP, ...]
    if tuple(group.axes) == tuple(crossing) + tuple(local):  # process-major: no reordering
        g = _local(g, sub, 1, False, settings)  # [nP, nL, ...]
        g = g.reshape((group.size,) + g.shape[2:])
    else:
        g = _local(g, sub, 0, False, settings)  # [nL, nP, ...]
        g = _mp.from_split_order(g, group.axes, local, crossing)  # [n, ...] in rank order
    g = jnp.moveaxis(g, 0, axis)
    if not tiled:
        return g
    return g.reshape(g.shape[:axis] + (g.shape[axis] * g.shape[axis + 1],) + g.shape[axis + 2:])


def _local(x, group, axis, tiled, settings):
    # The runtime gathers [rows, 1, block] into [rows, n, block]: rows are the
    # dimensions before `axis`, so no axis ever has to move.
    block = math.prod(x.shape[axis:])
    out_shape = _out_shape(x.shape, group.size, axis, tiled)
    return _ffi.call("strata_all_gather", group, x, out_shape, block_elems=block, settings=settings)


def _transpose(ct, x, *, group, axis, tiled, invariant, settings):
    if invariant:
        # Invariant -> varying: this rank's block of the cotangent.
        ct = _ffi.make_varying(ct, group.axes)
        size = x.aval.shape[axis] if tiled else 1
        mine = lax.dynamic_slice_in_dim(ct, group.rank() * size, size, axis=axis)
        return (mine if tiled else lax.squeeze(mine, (axis,)),)
    reduce_scatter_p = _ffi.registered("strata_reduce_scatter").primitive
    return (reduce_scatter_p.bind(ct, group=group, dim=axis, tiled=tiled, op="sum", settings=settings),)


def _batch(axis_data, vals, dims, *, group, axis, tiled, invariant, settings):
    (x,), (d,) = vals, dims
    if d is None:
        return all_gather_p.bind(x, group=group, axis=axis, tiled=tiled, invariant=invariant,
                                 settings=settings), None
    x = _ffi.move_batch_to_front(x, d)
    return all_gather_p.bind(x, group=group, axis=axis + 1, tiled=tiled, invariant=invariant,
                             settings=settings), 0


all_gather_p = _ffi.primitive("strata_all_gather", _abstract_eval, _lower, transpose=_transpose, batch=_batch,
                              api=all_gather)
