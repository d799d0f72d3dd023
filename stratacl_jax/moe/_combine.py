"""strata.moe.combine: the API, its checks and its primitives: combine, its
tangent in both arguments at once, and the backward op (the transposes of
both); each lowers to the runtime's FFI targets, batches as a sequence of
exchanges and has JVP and transpose rules built from the three."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from .. import _config, _ffi
from .. import _multiprocess as _mp
from ._across import combine_across
from ._common import (COMBINE, COMBINE_DTYPES, DispatchHandle, call, each_in_turn, out_aval, weight_dtype,
                      zero_tangent, zeros_for)


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
    group = _ffi.Group(COMBINE, axes).spec()  # a clear error outside shard_map
    w = _ffi.make_varying(topk_weights.astype(weight_dtype(expert_y.dtype)), axes)
    ey = _ffi.make_varying(expert_y, axes)
    if _mp.crosses_at_trace(axes):
        return combine_across(ey, w, handle.pair_slot, handle.slot_source, axes)
    return combine_p.bind(ey, w, handle.pair_slot, handle.slot_source, group=group, settings=_config.current())


def _check_linear(opname, linear, known):
    """These ops are bilinear: a transpose solves for `linear` given `known`."""
    if any(ad.is_undefined_primal(v) for v in known):
        raise NotImplementedError(f"{opname} is bilinear: it transposes in {' and '.join(linear)} only with its "
                                  f"other operands known")


# y [T, H] = combine(expert_y, weights) along the layout: linear in expert_y
# and in weights separately. slot_source is not read by the forward; it is an
# operand so the transpose (the backward op) has it.


def _abstract_eval(expert_y, weights, pair_slot, slot_source, *, group, settings):
    return out_aval(expert_y, (pair_slot.shape[0], expert_y.shape[-1]), expert_y.dtype,
                    expert_y, weights, pair_slot)


def _combine_rows(expert_y, weights, pair_slot, group, settings):
    result = jax.ShapeDtypeStruct((pair_slot.shape[0], expert_y.shape[-1]), expert_y.dtype)
    return call("strata_moe_combine", group, settings, (expert_y, weights, pair_slot), result)


def _lower(expert_y, weights, pair_slot, slot_source, *, group, settings):
    return _combine_rows(expert_y, weights, pair_slot, group, settings)


def _jvp(primals, tangents, *, group, settings):
    expert_y, weights, pair_slot, slot_source = primals
    d_ey, d_w = tangents[:2]
    y = combine_p.bind(*primals, group=group, settings=settings)
    zero_ey, zero_w = type(d_ey) is ad.Zero, type(d_w) is ad.Zero
    if zero_ey and zero_w:
        return y, zero_tangent(y)
    if zero_w:
        return y, combine_p.bind(d_ey, weights, pair_slot, slot_source, group=group, settings=settings)
    if zero_ey:
        return y, combine_p.bind(expert_y, d_w, pair_slot, slot_source, group=group, settings=settings)
    # Both: one primitive, so that reverse mode transposes it into one backward call.
    return y, combine_tangent_p.bind(d_ey, d_w, expert_y, weights, pair_slot, slot_source, group=group,
                                     settings=settings)


def _transpose(ct, expert_y, weights, pair_slot, slot_source, *, group, settings):
    undefined_ey, undefined_w = ad.is_undefined_primal(expert_y), ad.is_undefined_primal(weights)
    if undefined_ey and undefined_w:
        raise NotImplementedError(f"{COMBINE} is bilinear: it transposes in expert_y or in weights, one at a time, "
                                  f"with the other known")
    if type(ct) is ad.Zero:
        return (None if not undefined_ey else ad.Zero(expert_y.aval),
                None if not undefined_w else ad.Zero(weights.aval), None, None)
    ey = zeros_for(expert_y.aval, group.axes) if undefined_ey else expert_y
    w = zeros_for(weights.aval, group.axes) if undefined_w else weights
    d_ey, d_w = backward(ct, ey, w, pair_slot, slot_source, group, settings)
    return (d_ey if undefined_ey else None, d_w if undefined_w else None, None, None)


combine_p = _ffi.primitive("strata_moe_combine", _abstract_eval, _lower, jvp=_jvp, transpose=_transpose,
                           batch=each_in_turn("strata_moe_combine"), api=combine)


# The tangent of combine in both arguments at once: combine(d_ey, weights) +
# combine(expert_y, d_w); linear in (d_ey, d_w) (and, symmetrically, in
# (expert_y, weights)). Its transpose is one backward call: d_ey's cotangent
# scatters weights x ct to the rows, d_w's is <ct, expert_y row>.


def _tangent_abstract_eval(d_ey, d_w, expert_y, weights, pair_slot, slot_source, *, group, settings):
    return out_aval(expert_y, (pair_slot.shape[0], expert_y.shape[-1]), expert_y.dtype,
                    d_ey, d_w, expert_y, weights, pair_slot)


def _tangent_lower(d_ey, d_w, expert_y, weights, pair_slot, slot_source, *, group, settings):
    return (_combine_rows(d_ey, weights, pair_slot, group, settings)
            + _combine_rows(expert_y, d_w, pair_slot, group, settings))


def _tangent_jvp(primals, tangents, *, group, settings):
    a, b, expert_y, weights, pair_slot, slot_source = primals
    params = dict(group=group, settings=settings)
    y = combine_tangent_p.bind(*primals, **params)
    da, db, d_ey, d_w = (ad.instantiate_zeros(t) for t in tangents[:4])
    # Bilinear: T(a, b, ey, w) = C(a, w) + C(ey, b), so dT = T(da, db, ey, w) + T(a, b, d_ey, d_w).
    return y, (combine_tangent_p.bind(da, db, expert_y, weights, pair_slot, slot_source, **params)
               + combine_tangent_p.bind(a, b, d_ey, d_w, pair_slot, slot_source, **params))


def _tangent_transpose(ct, a, b, expert_y, weights, pair_slot, slot_source, *, group, settings):
    first = ad.is_undefined_primal(a) or ad.is_undefined_primal(b)
    solve, known = ((a, b), (expert_y, weights)) if first else ((expert_y, weights), (a, b))
    _check_linear(COMBINE, ("d_expert_y", "d_weights") if first else ("expert_y", "weights"), known)
    if type(ct) is ad.Zero:
        cts = [ad.Zero(v.aval) if ad.is_undefined_primal(v) else None for v in solve]
    else:
        cts = list(backward(ct, *known, pair_slot, slot_source, group, settings))
        cts = [c if ad.is_undefined_primal(v) else None for c, v in zip(cts, solve)]
    return (*cts, None, None, None, None) if first else (None, None, *cts, None, None)


combine_tangent_p = _ffi.primitive("strata_moe_combine_tangent", _tangent_abstract_eval, _tangent_lower,
                                   jvp=_tangent_jvp, transpose=_tangent_transpose,
                                   batch=each_in_turn("strata_moe_combine_tangent"))


# The backward op: (d_expert_y, d_weights) = (weights x ct scattered to the
# rows along the layout, <ct[t], expert_y[slot of (t, k)]>). Bilinear, B1(ct,
# weights) and B2(ct, expert_y): its transposes are a combine_tangent (in ct)
# and itself (in expert_y and weights).


def _backward_abstract_eval(ct, expert_y, weights, pair_slot, slot_source, *, group, settings):
    operands = (ct, expert_y, weights, pair_slot)
    return [out_aval(expert_y, expert_y.shape, expert_y.dtype, *operands),
            out_aval(weights, weights.shape, weights.dtype, *operands)]


def _backward_lower(ct, expert_y, weights, pair_slot, slot_source, *, group, settings):
    results = (jax.ShapeDtypeStruct(expert_y.shape, expert_y.dtype),
               jax.ShapeDtypeStruct(weights.shape, weights.dtype))
    return call("strata_moe_combine_backward", group, settings, (ct, expert_y, weights, pair_slot, slot_source),
                results)


def _backward_jvp(primals, tangents, *, group, settings):
    ct, expert_y, weights, pair_slot, slot_source = primals
    params = dict(group=group, settings=settings)
    outs = combine_backward_p.bind(*primals, **params)
    d_ct, d_ey, d_w = (ad.instantiate_zeros(t) for t in tangents[:3])
    first = combine_backward_p.bind(d_ct, expert_y, weights, pair_slot, slot_source, **params)
    second = combine_backward_p.bind(ct, d_ey, d_w, pair_slot, slot_source, **params)
    return outs, [u + v for u, v in zip(first, second)]


def _backward_transpose(cts, ct, expert_y, weights, pair_slot, slot_source, *, group, settings):
    ct_ey, ct_w = (ad.instantiate_zeros(c) for c in cts)
    if ad.is_undefined_primal(ct):
        _check_linear("strata.moe.combine backward", ("ct",), (expert_y, weights))
        return (combine_tangent_p.bind(ct_ey, ct_w, expert_y, weights, pair_slot, slot_source, group=group,
                                       settings=settings), None, None, None, None)
    _check_linear("strata.moe.combine backward", ("expert_y", "weights"), (ct,))
    # B1(ct, weights) and B2(ct, expert_y) transpose to B2(ct, ct_ey) for
    # weights and B1(ct, ct_w) for expert_y: one backward call with the roles swapped.
    for_ey, for_w = combine_backward_p.bind(ct, ct_ey, ct_w, pair_slot, slot_source, group=group, settings=settings)
    return (None, for_ey if ad.is_undefined_primal(expert_y) else None,
            for_w if ad.is_undefined_primal(weights) else None, None, None)


combine_backward_p = _ffi.primitive("strata_moe_combine_backward", _backward_abstract_eval, _backward_lower,
                                    jvp=_backward_jvp, transpose=_backward_transpose,
                                    batch=each_in_turn("strata_moe_combine_backward"), multiple_results=True)


def backward(ct, expert_y, weights, pair_slot, slot_source, group, settings):
    """(d_expert_y, d_weights) of combine for the cotangent ct of y."""
    ct = _ffi.make_varying(ct.astype(expert_y.dtype), group.axes)
    return combine_backward_p.bind(ct, expert_y, weights, pair_slot, slot_source, group=group, settings=settings)


def _combine_bwd(axes, res, ct):
    """The backward op on its own for residuals (expert_y, weights, pair_slot,
    slot_source): (d_expert_y, d_weights)."""
    return backward(ct, *res, _ffi.Group(COMBINE, axes).spec(), _config.current())

