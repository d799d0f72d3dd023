"""strata.ppermute — the twin of lax.ppermute.

The primitive `strata_ppermute` is linear; its transpose is the inverse
permutation."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _config
from . import _ffi
from . import _multiprocess as _mp

OPNAME = "strata.ppermute"


def _check_perm(perm, n, axes):
    try:
        raw = [tuple(pair) for pair in perm]
    except TypeError:
        raw = None
    if raw is None or any(len(pair) != 2 for pair in raw):
        raise ValueError(f"{OPNAME}: perm must be a sequence of (source, destination) pairs, got {perm!r}")
    for pair in raw:
        for v in pair:
            # As lax.ppermute: indices are ints (a float is not truncated).
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{OPNAME}: perm must hold int ranks, got {v!r} ({type(v).__name__}) in {perm!r}")
    pairs = tuple((int(s), int(d)) for s, d in raw)
    for s, d in pairs:
        if not (0 <= s < n and 0 <= d < n):
            raise ValueError(f"{OPNAME}: pair ({s}, {d}) is out of range for the {n} ranks of {axes}")
    srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ValueError(f"{OPNAME}: perm {pairs} repeats a source or a destination")
    return pairs


def ppermute(x, axis_name, perm):
    """Rank s sends `x` (an array or a pytree) to rank d for each (s, d) in
    `perm`; ranks that receive nothing get zeros."""
    axes = _ffi.normalize_axes(axis_name, OPNAME)
    mesh_axes, vmap_axes = _ffi.split_axes(OPNAME, axes)
    if vmap_axes:
        if mesh_axes:
            raise NotImplementedError(f"{OPNAME}: axes {axes} mix vmap axes {vmap_axes} with mesh axes {mesh_axes}")
        return lax.ppermute(x, axes, perm)
    group = _ffi.Group(OPNAME, axes).spec()
    pairs = _check_perm(perm, group.size, axes)
    settings = _config.current()

    def one(leaf):
        leaf = jnp.asarray(leaf)
        _ffi.check_dtype(OPNAME, leaf)
        leaf = _ffi.make_varying(leaf, axes)
        return ppermute_p.bind(leaf, group=group, pairs=pairs, settings=settings)

    return jax.tree.map(one, x)


def _abstract_eval(x, *, group, pairs, settings):
    return _ffi.typed(x)


def _lower(x, *, group, pairs, settings):
    parts = _mp.split(group.axes)
    if parts is not None:
        # A permutation whose pairs cross processes is XLA's collective-permute
        # over the whole group (one step, each block sent once).
        # lax.ppermute numbers the ranks of an axis tuple in mesh order (its
        # other collectives, and strata, in the order given): renumber.
        what = _mp.describe(OPNAME, group.axes, parts[1])
        order = _mp.mesh_order(group.axes)
        perm = [(_mp.rank_in_order(s, group.axes, order), _mp.rank_in_order(d, group.axes, order)) for s, d in pairs]
        return _mp.cross(lambda v: lax.ppermute(v, order, perm=perm), x, group.axes, what)
    return _ffi.call("strata_ppermute", group, x, x.shape, block_elems=x.size,
                     perm=[v for pair in pairs for v in pair], settings=settings)


def _transpose(ct, x, *, group, pairs, settings):
    return (ppermute_p.bind(ct, group=group, pairs=tuple((d, s) for s, d in pairs), settings=settings),)


def _batch(axis_data, vals, dims, *, group, pairs, settings):
    (x,), (d,) = vals, dims
    return ppermute_p.bind(x, group=group, pairs=pairs, settings=settings), d


ppermute_p = _ffi.primitive("strata_ppermute", _abstract_eval, _lower, transpose=_transpose, batch=_batch,
                            api=ppermute)
