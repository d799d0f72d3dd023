"""strata.moe.combine: the API, its checks and the op (with its backward)."""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from .. import _ffi
from .. import _multiprocess as _mp
from ._across import combine_across
from ._common import COMBINE, COMBINE_DTYPES, DispatchHandle, call, varying, weight_dtype

def combine(expert_y, handle: DispatchHandle, topk_weights):
    """``y[t] = sum_k topk_weights[t, k] * expert_y[slot of (t, k)]`` on the
    token's own rank; a dropped pair contributes 0.

    ``expert_y [E_local, capacity, H]`` (float32, float64, float16 or
    bfloat16); ``topk_weights [T, K]``. Sums run in float32 (float64 for
    float64 rows) in a fixed order (the same on every rank and run, and in
    :func:`reference_combine`): from zero, the ranks holding the token's pairs
    in ascending order, each adding one row: the weighted expert row when the
    rank holds one of the pairs, else the sum of its pairs' weighted rows in
    k order, made on that rank and rounded to ``expert_y``'s dtype (the row
    that crosses back); the total is rounded to ``expert_y``'s dtype.
    """
    expert_y = jnp.asarray(expert_y)
    topk_weights = jnp.asarray(topk_weights)
    if not isinstance(handle, DispatchHandle):
        raise TypeError(f"{COMBINE}: handle must be the DispatchHandle returned by strata.moe.dispatch, "
                        f"got {type(handle).__name__}")
    if np.dtype(expert_y.dtype) not in COMBINE_DTYPES:
        raise TypeError(f"{COMBINE}: expert_y must be float32, float64, float16 or bfloat16, got {expert_y.dtype}")
    want = handle.slot_source.shape
    if expert_y.ndim != 3 or expert_y.shape[:2] != want:
        raise ValueError(f"{COMBINE}: expert_y must be [E_local, capacity, H] = [{want[0]}, {want[1]}, H] "
                         f"as dispatched, got shape {expert_y.shape}")
    if topk_weights.shape != handle.pair_slot.shape:
        raise ValueError(f"{COMBINE}: topk_weights must be [T, K] = {handle.pair_slot.shape} as dispatched, "
                         f"got shape {topk_weights.shape}")
    if not jnp.issubdtype(topk_weights.dtype, jnp.floating):
        raise TypeError(f"{COMBINE}: topk_weights must be floating point, got {topk_weights.dtype}")
    axes = handle.axis_name
    _ffi.Group(COMBINE, axes)  # clear error outside shard_map
    w = _ffi.make_varying(topk_weights.astype(weight_dtype(expert_y.dtype)), axes)
    ey = _ffi.make_varying(expert_y, axes)
    if _mp.crosses_at_trace(axes):
        return combine_across(ey, w, handle.pair_slot, handle.slot_source, axes)
    return _combine(ey, w, handle.pair_slot, handle.slot_source, axes)


def combine_call(expert_y, weights, pair_slot, axes):
    group = _ffi.Group(COMBINE, axes)
    t = pair_slot.shape[0]
    result = jax.ShapeDtypeStruct((t, expert_y.shape[-1]), expert_y.dtype)
    y = call("strata_moe_combine", group, (expert_y, weights, pair_slot), result)
    vma = _ffi.varying_axes(expert_y) | _ffi.varying_axes(weights) | _ffi.varying_axes(pair_slot)
    return varying([y], vma)[0]


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _combine(expert_y, weights, pair_slot, slot_source, axes):
    return combine_call(expert_y, weights, pair_slot, axes)


def _combine_fwd(expert_y, weights, pair_slot, slot_source, axes):
    return combine_call(expert_y, weights, pair_slot, axes), (expert_y, weights, pair_slot, slot_source)


def _combine_bwd(axes, res, ct):
    # Linear in both: d expert_y scatters w * ct back to the rows (a weighted
    # dispatch along the recorded layout); d w[t, k] = <ct[t], expert_y[slot]>.
    expert_y, weights, pair_slot, slot_source = res
    group = _ffi.Group(COMBINE, axes)
    ct = _ffi.make_varying(ct.astype(expert_y.dtype), axes)
    results = (jax.ShapeDtypeStruct(expert_y.shape, expert_y.dtype),
               jax.ShapeDtypeStruct(weights.shape, weights.dtype))
    d_ey, d_w = call("strata_moe_combine_backward", group,
                      (ct, expert_y, weights, pair_slot, slot_source), results)
    d_ey, d_w = varying([d_ey, d_w], _ffi.varying_axes(expert_y) | _ffi.varying_axes(ct))
    return d_ey, d_w, None, None


_combine.defvjp(_combine_fwd, _combine_bwd)

