"""strata.all_to_all — the twin of lax.all_to_all."""
from __future__ import annotations

import jax.numpy as jnp

from . import _ffi

OPNAME = "strata.all_to_all"


def all_to_all(x, axis_name, split_axis: int, concat_axis: int, *, tiled: bool = False):
    """Sends chunk j of `split_axis` to rank j; received chunks stack (or, tiled,
    concatenate) along `concat_axis` in rank order."""
    x = jnp.asarray(x)
    _ffi.check_dtype(OPNAME, x)
    axes = _ffi.normalize_axes(axis_name)
    n = _ffi.Group(OPNAME, axes).size
    if x.ndim == 0:
        raise ValueError(f"{OPNAME}: the operand must have at least one dimension")
    if not -x.ndim <= split_axis < x.ndim:
        raise ValueError(f"{OPNAME}: split_axis {split_axis} is out of range for shape {x.shape}")
    s = split_axis % x.ndim
    if tiled and x.shape[s] % n:
        raise ValueError(f"{OPNAME}: split_axis {s} of shape {x.shape} is not divisible by the {n} ranks of {axes}")
    if not tiled and x.shape[s] != n:
        raise ValueError(f"{OPNAME}: with tiled=False split_axis {s} of shape {x.shape} must equal the {n} ranks of {axes}")
    out_ndim = x.ndim
    if not -out_ndim <= concat_axis < out_ndim:
        raise ValueError(f"{OPNAME}: concat_axis {concat_axis} is out of range for shape {x.shape}")
    c = concat_axis % out_ndim
    return _all_to_all(_ffi.make_varying(x, axes), axes, s, c, bool(tiled))


def _forward(x, axes, s, c, tiled):
    group = _ffi.Group(OPNAME, axes)
    n = group.size
    # Lay the chunks for ranks 0..n-1 out as leading blocks (a copy only when
    # the split axis is not already leading).
    split = x.reshape(x.shape[:s] + (n, x.shape[s] // n) + x.shape[s + 1:]) if tiled else x
    blocks = jnp.moveaxis(split, s, 0)
    chunk_shape = blocks.shape[1:]
    flat = blocks.reshape(n, -1)
    out = _ffi.call("strata_all_to_all", group, flat, flat.shape, block_elems=flat.shape[1],
                    out_vma=_ffi.varying_axes(x))
    received = jnp.moveaxis(out.reshape((n,) + chunk_shape), 0, c)
    if not tiled:
        return received
    shape = received.shape
    return received.reshape(shape[:c] + (n * shape[c + 1],) + shape[c + 2:])


def _transpose(ct, axes, s, c, tiled):
    # all_to_all is a permutation of blocks: its transpose swaps the axes.
    return all_to_all(ct, axes, c, s, tiled=tiled)


_all_to_all = _ffi.linear_collective(_forward, _transpose, 4)
