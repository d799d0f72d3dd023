"""A collective's group as static primitive parameters, and the
varying/invariant typing of values over it: what the primitive machinery
(_ffi) and the cross-process path (_multiprocess) both build on."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """A collective's group as static (hashable) primitive parameters: the
    axes it spans, their size, the other manual axes (which tell groups
    apart) and the mesh's device count."""
    axes: tuple
    size: int
    others: tuple
    num_devices: int

    def rank(self):
        return lax.axis_index(self.axes)

    def meta(self):
        """(rank in group, group id) as the int32 operand the handler reads."""
        group = lax.axis_index(self.others) if self.others else jnp.int32(0)
        return jnp.stack([self.rank(), group]).astype(jnp.int32)


def varying_axes(x) -> frozenset:
    aval = x if isinstance(x, jax.core.AbstractValue) else jax.typeof(x)
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", frozenset()))


def make_varying(x, axes: Sequence):
    """Types x as varying over `axes` (as lax does before a collective)."""
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return lax.pcast(x, missing, to="varying") if missing else x
