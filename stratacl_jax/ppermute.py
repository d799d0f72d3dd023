"""strata.ppermute — the twin of lax.ppermute."""
from __future__ import annotations

import jax.numpy as jnp

from . import _ffi

OPNAME = "strata.ppermute"


def _check_perm(perm, n, axes):
    try:
        pairs = tuple((int(s), int(d)) for s, d in perm)
    except (TypeError, ValueError):
        raise ValueError(f"{OPNAME}: perm must be a sequence of (source, destination) pairs, got {perm!r}") from None
    for s, d in pairs:
        if not (0 <= s < n and 0 <= d < n):
            raise ValueError(f"{OPNAME}: pair ({s}, {d}) is out of range for the {n} ranks of {axes}")
    srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ValueError(f"{OPNAME}: perm {pairs} repeats a source or a destination")
    return pairs


def ppermute(x, axis_name, perm):
    """Rank s sends `x` to rank d for each (s, d) in `perm`; ranks that receive
    nothing get zeros."""
    x = jnp.asarray(x)
    _ffi.check_dtype(OPNAME, x)
    axes = _ffi.normalize_axes(axis_name)
    pairs = _check_perm(perm, _ffi.Group(OPNAME, axes).size, axes)
    return _ppermute(_ffi.make_varying(x, axes), axes, pairs)


def _forward(x, axes, pairs):
    group = _ffi.Group(OPNAME, axes)
    flat = x.reshape(1, -1)
    out = _ffi.call("strata_ppermute", group, flat, flat.shape, block_elems=flat.size,
                    out_vma=_ffi.varying_axes(x), perm=[v for pair in pairs for v in pair])
    return out.reshape(x.shape)


def _transpose(ct, axes, pairs):
    return ppermute(ct, axes, [(d, s) for s, d in pairs])


_ppermute = _ffi.linear_collective(_forward, _transpose, 2)
