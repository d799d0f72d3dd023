"""strata.moe.dispatch: the API, its checks and its primitives: dispatch,
and dispatch_rows (recv_x of another x along a layout already made: the
tangent). Both lower to the runtime's dispatch, batch as a sequence of
exchanges, and transpose to a combine with weights 1."""
from __future__ import annotations

import os
import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from .. import _config, _ffi
from .. import _multiprocess as _mp
from ._across import dispatch_across
from ._combine import combine_p
from ._common import (DISPATCH, DispatchHandle, call, each_in_turn, out_aval, weight_dtype, zero_tangent,
                      zeros_for)

def _positive_int(opname, name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{opname}: {name} must be a positive int, got {value!r}")
    return int(value)


_INT32_MAX = (1 << 31) - 1


def _host_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _check_capacity(local_experts, capacity, x, top_k, n):
    """The handle numbers rows and pairs in int32 (``e * capacity + row``,
    ``(rank * T + t) * K + k``), and recv_x [E_local, capacity, H] must fit
    in memory: say which argument breaks that instead of failing to allocate."""
    tokens, hidden = x.shape
    if local_experts * capacity > _INT32_MAX:
        raise ValueError(
            f"{DISPATCH}: capacity={capacity} gives {local_experts} local experts x {capacity} rows = "
            f"{local_experts * capacity} rows, past the int32 row ids of the handle ({_INT32_MAX}); at most "
            f"{n * tokens * top_k} (token, k) pairs of the {n} ranks can reach one expert")
    if n * tokens * top_k > _INT32_MAX:
        raise ValueError(f"{DISPATCH}: {n} ranks x {tokens} tokens x top-{top_k} = {n * tokens * top_k} pairs, "
                         f"past the int32 pair ids of the handle ({_INT32_MAX})")
    nbytes = local_experts * capacity * hidden * np.dtype(x.dtype).itemsize
    memory = _host_memory_bytes()
    if memory is not None and nbytes > memory:
        raise ValueError(
            f"{DISPATCH}: capacity={capacity} makes recv_x [E_local={local_experts}, {capacity}, H={hidden}] "
            f"{nbytes} bytes per rank, more than this host's {memory} bytes of memory; at most "
            f"{n * tokens * top_k} (token, k) pairs of the {n} ranks can reach one expert")



def dispatch(x, topk_idx, *, axis_name, num_experts: int, capacity: int):
    """Sends every (token, k) pair's row of ``x [T, H]`` to the rank owning
    expert ``topk_idx[t, k]``.

    Returns ``recv_x [E_local, capacity, H]`` (row ``j`` of local expert ``l``
    is the ``j``-th pair routed to it in (source rank, token, k) order; rows
    past the count are zero) and a :class:`DispatchHandle` for :func:`combine`.
    Expert ids outside ``[0, num_experts)`` are an error.
    """
    x = jnp.asarray(x)
    topk_idx = jnp.asarray(topk_idx)
    _ffi.check_dtype(DISPATCH, x)
    if x.ndim != 2:
        raise ValueError(f"{DISPATCH}: x must be [T, H], got shape {x.shape}")
    if topk_idx.ndim != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"{DISPATCH}: topk_idx must be [T, K] with T={x.shape[0]}, got shape {topk_idx.shape}")
    if not jnp.issubdtype(topk_idx.dtype, jnp.integer):
        raise TypeError(f"{DISPATCH}: topk_idx must hold integer expert ids, got {topk_idx.dtype}")
    num_experts = _positive_int(DISPATCH, "num_experts", num_experts)
    capacity = _positive_int(DISPATCH, "capacity", capacity)
    axes = _ffi.normalize_axes(axis_name, DISPATCH)
    n = _ffi.Group(DISPATCH, axes).size
    if num_experts % n:
        raise ValueError(f"{DISPATCH}: num_experts={num_experts} is not divisible by the {n} ranks of {axes}")
    _check_capacity(num_experts // n, capacity, x, topk_idx.shape[1], n)
    _check_ids_if_known(topk_idx, num_experts)
    if np.dtype(topk_idx.dtype) == np.uint64:  # past int64's range is out of range either way
        topk_idx = jnp.minimum(topk_idx, np.iinfo(np.int64).max).astype(jnp.int64)
    elif np.dtype(topk_idx.dtype) not in _IDS_AS_GIVEN:
        topk_idx = topk_idx.astype(jnp.int32)  # narrower ids: exact in int32
    # Wide ids go to the runtime as they are, so an id outside [0, num_experts)
    # is reported as the user gave it (a cast would wrap it, a clip would hide it).
    idx = _ffi.make_varying(topk_idx, axes)
    x = _ffi.make_varying(x, axes)
    if _mp.crosses_at_trace(axes):
        recv_x, pair_slot, slot_source, counts, dropped = dispatch_across(x, idx, axes, num_experts, capacity)
    else:
        recv_x, pair_slot, slot_source, counts, dropped = dispatch_p.bind(
            x, idx, group=_ffi.Group(DISPATCH, axes).spec(), num_experts=num_experts, capacity=capacity,
            settings=_config.current())
    return recv_x, DispatchHandle(counts, dropped, pair_slot, slot_source, axes)


_IDS_AS_GIVEN = tuple(np.dtype(d) for d in ("int32", "int64", "uint32", "uint8"))


def _check_ids_if_known(topk_idx, num_experts):
    """A readable error at trace time when the ids are concrete (the runtime
    checks traced ids and names the rank, token and id)."""
    if isinstance(topk_idx, jax.core.Tracer):
        return
    ids = np.asarray(topk_idx)
    bad = np.argwhere((ids < 0) | (ids >= num_experts))
    if bad.size:
        t, k = bad[0]
        raise ValueError(f"{DISPATCH}: token {t}, k={k} is routed to expert id {ids[t, k]}, "
                         f"outside [0, {num_experts})")


# (recv_x, pair_slot, slot_source, recv_counts, dropped) = dispatch(x, idx):
# the runtime lays the rows out from every rank's ids. recv_x is linear in x
# for a given layout; the handle is integers (no tangents).


def _abstract_eval(x, idx, *, group, num_experts, capacity, settings):
    (t, h), k = x.shape, idx.shape[1]
    el = num_experts // group.size
    i32 = np.int32
    return [out_aval(x, (el, capacity, h), x.dtype, x, idx), out_aval(x, (t, k), i32, x, idx),
            out_aval(x, (el, capacity), i32, x, idx), out_aval(x, (el,), i32, x, idx), out_aval(x, (), i32, x, idx)]


def _lower(x, idx, *, group, num_experts, capacity, settings):
    results = [jax.ShapeDtypeStruct(a.shape, a.dtype)
               for a in _abstract_eval(x, idx, group=group, num_experts=num_experts, capacity=capacity,
                                       settings=settings)]
    return call("strata_moe_dispatch", group, settings, (x, idx), results, num_experts=np.int32(num_experts),
                capacity=np.int64(capacity), planner=np.int32(_ffi._PLANNER_CODE[settings.planner]))


def _jvp(primals, tangents, *, group, num_experts, capacity, settings):
    x, idx = primals
    params = dict(group=group, num_experts=num_experts, capacity=capacity, settings=settings)
    outs = dispatch_p.bind(x, idx, **params)
    recv_x, pair_slot, slot_source = outs[:3]
    d_x = tangents[0]
    d_recv = (zero_tangent(recv_x) if type(d_x) is ad.Zero
              else dispatch_rows_p.bind(d_x, idx, pair_slot, slot_source, **params))
    return outs, [d_recv] + [zero_tangent(o) for o in outs[1:]]


def _transpose(cts, x, idx, *, group, num_experts, capacity, settings):
    # Only jax.linear_transpose of dispatch itself lands here (a JVP's tangent
    # is dispatch_rows): the layout of these ids is one more dispatch away.
    if type(cts[0]) is ad.Zero:
        return ad.Zero(x.aval), None
    params = dict(group=group, num_experts=num_experts, capacity=capacity, settings=settings)
    zeros = zeros_for(x.aval, group.axes)
    _, pair_slot, slot_source, _, _ = dispatch_p.bind(zeros, idx, **params)
    ct_x = _rows_transpose(cts[0], x, idx, pair_slot, slot_source, **params)[0]
    return ct_x, None


dispatch_p = _ffi.primitive("strata_moe_dispatch", _abstract_eval, _lower, jvp=_jvp, transpose=_transpose,
                            batch=each_in_turn("strata_moe_dispatch"), api=dispatch, multiple_results=True)


# recv_x of x for a layout already made (by the dispatch whose handle is
# pair_slot, slot_source): linear in x. Lowered to the same dispatch call
# (the runtime lays out the same ids the same way); its transpose sums, per
# token, the cotangents of the rows its pairs filled: a combine, weights 1.


def _rows_abstract_eval(x, idx, pair_slot, slot_source, *, group, num_experts, capacity, settings):
    return _abstract_eval(x, idx, group=group, num_experts=num_experts, capacity=capacity, settings=settings)[0]


def _rows_lower(x, idx, pair_slot, slot_source, **params):
    return _lower(x, idx, **params)[0]


def _rows_jvp(primals, tangents, **params):
    x, idx, pair_slot, slot_source = primals
    recv_x = dispatch_rows_p.bind(*primals, **params)
    d_x = tangents[0]
    if type(d_x) is ad.Zero:
        return recv_x, zero_tangent(recv_x)
    return recv_x, dispatch_rows_p.bind(d_x, idx, pair_slot, slot_source, **params)


def _rows_transpose(ct, x, idx, pair_slot, slot_source, *, group, num_experts, capacity, settings):
    if type(ct) is ad.Zero:
        return ad.Zero(x.aval), None, None, None
    ct = _ffi.make_varying(ct, group.axes)
    ones = _ffi.make_varying(jnp.ones(pair_slot.shape, weight_dtype(ct.dtype)), group.axes)
    ct_x = combine_p.bind(ct, ones, pair_slot, slot_source, group=group, settings=settings)
    return ct_x, None, None, None


dispatch_rows_p = _ffi.primitive("strata_moe_dispatch_rows", _rows_abstract_eval, _rows_lower, jvp=_rows_jvp,
                                 transpose=_rows_transpose, batch=each_in_turn("strata_moe_dispatch_rows"))
