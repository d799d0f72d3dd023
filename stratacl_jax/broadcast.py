"""strata.broadcast — every rank gets rank `root`'s value (lax.pbroadcast's
semantics; jax 0.10.2 lowers pbroadcast only on GPU).

The primitive `strata_broadcast` is linear; its transpose sums the
cotangents onto the root (the other ranks' inputs were not used)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _config
from . import _ffi
from . import _multiprocess as _mp

OPNAME = "strata.broadcast"


def broadcast(x, axis_name, *, root: int = 0):
    """Rank `root`'s `x` (an array or a pytree) on every rank of `axis_name`."""
    axes = _ffi.normalize_axes(axis_name, OPNAME)
    mesh_axes, vmap_axes = _ffi.split_axes(OPNAME, axes)
    if vmap_axes and mesh_axes:
        raise NotImplementedError(f"{OPNAME}: axes {axes} mix vmap axes {vmap_axes} with mesh axes {mesh_axes}")
    n = _ffi.Group(OPNAME, axes).size if not vmap_axes else jax.lax.axis_size(axes)
    if isinstance(root, (bool, np.bool_)) or not isinstance(root, (int, np.integer)):
        raise TypeError(f"{OPNAME}: root must be an int in [0, {n}) for axes {axes}, got {root!r}")
    if not 0 <= root < n:
        raise ValueError(f"{OPNAME}: root must be an int in [0, {n}) for axes {axes}, got {root!r}")
    root = int(root)
    if vmap_axes:  # the batch is on this rank
        return jax.tree.map(lambda v: lax.all_gather(v, axes)[root], x)
    group = _ffi.Group(OPNAME, axes).spec()
    settings = _config.current()

    def one(leaf):
        leaf = jnp.asarray(leaf)
        _ffi.check_dtype(OPNAME, leaf)
        leaf = _ffi.make_varying(leaf, axes)
        return broadcast_p.bind(leaf, group=group, root=int(root), settings=settings)

    return jax.tree.map(one, x)


def _abstract_eval(x, *, group, root, settings):
    return _ffi.typed(x)


def _lower(x, *, group, root, settings):
    parts = _mp.split(group.axes)
    if parts is not None:
        return _lower_across(x, group, root, settings, *parts)
    return _ffi.call("strata_broadcast", group, x, x.shape, block_elems=x.size, root=root, settings=settings)


def _lower_across(x, group, root, settings, local, crossing):
    """Across processes: strata broadcasts inside each process from the rank
    with the root's local coordinates, then every rank takes the root
    process-rank's value from XLA's all_gather over the crossing axes (exact
    for every dtype: nothing is added)."""
    what = _mp.describe(OPNAME, group.axes, crossing)
    coords = dict(zip(group.axes, np.unravel_index(root, _mp.sizes(group.axes))))

    def rank_in(axes):
        return int(np.ravel_multi_index([coords[a] for a in axes], _mp.sizes(axes))) if axes else 0

    if local:
        sub = _mp.sub_group(group, local)
        x = _ffi.call("strata_broadcast", sub, x, x.shape, block_elems=x.size, root=rank_in(local),
                      settings=settings)
    src = rank_in(crossing)
    return _mp.cross(lambda v: lax.all_gather(v, crossing, axis=0)[src], x, crossing, what)


def _transpose(ct, x, *, group, root, settings):
    all_reduce = _ffi.registered("strata_all_reduce").api
    total = _ffi.make_varying(all_reduce(ct, group.axes, op="sum"), group.axes)
    return (jnp.where(group.rank() == root, total, jnp.zeros_like(total)),)


def _batch(axis_data, vals, dims, *, group, root, settings):
    (x,), (d,) = vals, dims
    return broadcast_p.bind(x, group=group, root=root, settings=settings), d


broadcast_p = _ffi.primitive("strata_broadcast", _abstract_eval, _lower, transpose=_transpose, batch=_batch,
                             api=broadcast)
