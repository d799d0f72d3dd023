"""strata.moe — expert-parallel MoE dispatch and combine, and a ready MoE layer.

``E`` experts are spread evenly over the ranks of ``axis_name`` (``N`` ranks,
``E_local = E // N``; expert ``e`` lives on rank ``e // E_local``). Inside
``jax.shard_map``, on each rank::

    recv_x, handle = strata.moe.dispatch(x, topk_idx, axis_name="ep",
                                         num_experts=E, capacity=C)
    expert_y = my_experts(recv_x)                 # [E_local, C, H]
    y = strata.moe.combine(expert_y, handle, topk_weights)

The runtime computes the layout from every rank's routing when the group
meets (pairs per expert per source rank, prefix sums, the row of every
(token, k) pair). Then, as DeepEP does, a token crosses to each destination
rank once, however many of its experts live there: from the source rank's
``x`` into the owner's ``recv_x`` row of the token's first pair (lowest k) on
that rank, and from there into the rows of its other pairs on the same rank.
Combine sums a token's rows from one rank's experts on that rank and sends one
partial row back per (token, rank). Rows of an expert are ordered by (source
rank, source token, k); pairs past ``capacity`` are dropped and counted in
``handle.dropped`` on their source rank.

Also here: ``expert_parallel_ffn`` (a drop-in MoE FFN layer built on them),
``reference_expert_parallel_ffn`` (the same layer written the usual JAX way,
``lax.all_to_all`` of padded ``[N, E_local, capacity, H]`` buffers, the peer in
tests and benchmarks) and ``dense_moe_ffn`` (single-device, no capacity).
"""
from __future__ import annotations

import dataclasses
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _config, _ffi
from . import _multiprocess as _mp

DISPATCH = "strata.moe.dispatch"
COMBINE = "strata.moe.combine"
LAYER = "strata.moe.expert_parallel_ffn"

_COMBINE_DTYPES = tuple(np.dtype(d) for d in ("float32", "float64", "float16", jnp.bfloat16))


@partial(jax.tree_util.register_dataclass,
         data_fields=["recv_counts", "dropped", "pair_slot", "slot_source"],
         meta_fields=["axis_name"])
@dataclasses.dataclass(frozen=True)
class DispatchHandle:
    """What combine needs to undo a dispatch. A pytree of int32 arrays (it
    flows through jit, shard_map and scan); ``axis_name`` is static.

    recv_counts [E_local]:    valid rows per local expert (capped at capacity).
    dropped []:               this rank's (token, k) pairs that found their expert full.
    pair_slot [T, K]:         per pair, ``e * capacity + row`` of the row it filled, -1 if dropped.
    slot_source [E_local, C]: per row, ``(source_rank * T + t) * K + k``, -1 if empty.
    """

    recv_counts: jax.Array
    dropped: jax.Array
    pair_slot: jax.Array
    slot_source: jax.Array
    axis_name: tuple = ()

    @property
    def capacity(self) -> int:
        return self.slot_source.shape[-1]

    @property
    def local_experts(self) -> int:
        return self.slot_source.shape[-2]


def _weight_dtype(rows_dtype):
    """Weights (and their sums) are float64 for float64 rows, float32 otherwise."""
    return jnp.float64 if np.dtype(rows_dtype) == np.float64 else jnp.float32


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


def _call(target, group, operands, results, **attrs):
    """One MoE custom call: the group's (rank, group) operand and the runtime
    settings in force now (mode="buffer_centric" stages rows through
    communication buffers, as the vendor-library baseline does)."""
    s = _config.current()
    fn = jax.ffi.ffi_call(target, results, vmap_method="sequential")
    return fn(
        *operands,
        group.meta(),
        site_id=np.int64(_ffi.next_site_id(target, group.axes, group.others,
                                           *[(o.shape, o.dtype) for o in operands], attrs)),
        group_size=np.int32(group.size),
        num_devices=np.int32(group.num_devices),
        cores=np.int32(s.cores_per_npu),
        engines=np.int32(s.sdma_engines_per_npu),
        mode=np.int32(_ffi._MODE_CODE[s.mode]),
        comm_buffer_bytes=np.int64(s.comm_buffer_bytes),
        timeout_ms=np.int64(max(1, round(s.timeout_s * 1000))),
        **attrs,
    )


def _varying(outs, vma):
    return [_ffi.make_varying(o, tuple(vma)) if vma else o for o in outs]


# ------------------------------------------------------------------------------------------------
# dispatch


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
        recv_x, pair_slot, slot_source, counts, dropped = _dispatch_across(x, idx, axes, num_experts, capacity)
    else:
        recv_x, pair_slot, slot_source, counts, dropped = _dispatch(x, idx, axes, num_experts, capacity)
    return recv_x, DispatchHandle(counts, dropped, pair_slot, slot_source, axes)


def _dispatch_across(x, idx, axes, num_experts, capacity):
    """dispatch over an expert axis that crosses processes, composed from
    strata.all_gather (the counts) and strata.all_to_all (the rows; both
    split into strata inside a process and XLA's collectives between
    processes): each source writes its accepted rows straight at their final
    row of the owner's recv_x in a padded [N, E_local, capacity, H] buffer.
    Same layout, order, drop rule and handle as the runtime's; an expert id
    outside [0, E) that only the running program sees is counted in
    `dropped` (the runtime raises; this path has no runtime to raise from)."""
    from .all_gather import all_gather
    from .all_to_all import all_to_all

    n = lax.axis_size(axes)
    rank = lax.axis_index(axes)
    t, h = x.shape
    k = idx.shape[1]
    el, cap = num_experts // n, capacity
    i32 = jnp.int32
    e = lax.stop_gradient(idx).reshape(-1)
    in_range = (e >= 0) & (e < num_experts)
    e = jnp.where(in_range, e, 0).astype(i32)
    onehot = ((e[:, None] == jnp.arange(num_experts, dtype=i32)[None]) & in_range[:, None]).astype(i32)
    counts = onehot.sum(0)
    all_counts = all_gather(counts, axes)  # [N, E]
    before = jnp.cumsum(all_counts, 0) - all_counts
    local_pos = ((jnp.cumsum(onehot, 0) - onehot) * onehot).sum(1)
    row = jnp.take(before[rank], e) + local_pos
    accepted = in_range & (row < cap)
    dest = jnp.where(accepted, e * cap + row, num_experts * cap)
    pairs = jnp.arange(t * k, dtype=i32)
    send = jnp.zeros((num_experts * cap, h), x.dtype).at[dest].set(x[pairs // k], mode="drop")
    source = jnp.full((num_experts * cap,), -1, i32).at[dest].set((rank * t * k + pairs).astype(i32), mode="drop")
    recv = all_to_all(send.reshape(n, el, cap, h), axes, 0, 0)  # [N_src, E_local, C, H]
    sources = all_to_all(source.reshape(n, el, cap), axes, 0, 0)  # [N_src, E_local, C]
    slot_source = sources.max(0)
    owner = jnp.where(slot_source >= 0, slot_source // (t * k), 0)
    picked = jnp.take_along_axis(recv, owner[None, :, :, None], axis=0)[0]
    recv_x = jnp.where((slot_source >= 0)[..., None], picked, jnp.zeros((), x.dtype))
    mine = rank * el + jnp.arange(el, dtype=i32)
    recv_counts = jnp.minimum(jnp.take(all_counts.sum(0), mine), cap).astype(i32)
    pair_slot = jnp.where(accepted, e * cap + row, -1).astype(i32).reshape(t, k)
    dropped = jnp.sum(~accepted).astype(i32)
    return recv_x, pair_slot, slot_source, recv_counts, dropped


def _combine_across(expert_y, weights, pair_slot, slot_source, axes):
    """combine over axes that cross processes: every owner sends each source
    the rows that source filled (strata.all_to_all of padded [N, E_local,
    capacity, H] buffers), and every rank sums its pairs' rows, weighted, in
    float32 (float64 for float64 rows) in the runtime's order (per-rank partials, then ranks ascending)."""
    from .all_to_all import all_to_all

    n = lax.axis_size(axes)
    el, cap, h = expert_y.shape
    t, k = pair_slot.shape
    owner = jnp.where(slot_source >= 0, slot_source // (t * k), -1)
    ranks = jnp.arange(n, dtype=owner.dtype)[:, None, None, None]
    back = jnp.where(owner[None, :, :, None] == ranks, expert_y[None], jnp.zeros((), expert_y.dtype))
    got = all_to_all(back, axes, 0, 0).reshape(n * el * cap, h)
    rows = jnp.take(got, pair_slot.reshape(-1), axis=0, mode="fill", fill_value=0).reshape(t, k, h)
    owner = jnp.where(pair_slot >= 0, pair_slot // (el * cap), -1)
    return _sum_by_rank(rows, weights, owner, expert_y.dtype)


def _sum_by_rank(rows, weights, owner, dtype):
    """combine's sum in the runtime's order (moe.cc): per token, from zero, in
    ascending rank order, each rank's contribution added in the accumulation
    type of ``weights``: weight x row for a rank holding one of the token's
    pairs; for several, their partial (weight x row summed from zero in k
    order) rounded to ``dtype`` (the row that crosses back); the sum rounded
    to ``dtype``. rows [T, K, H]; weights [T, K]; owner [T, K]: the rank
    holding the pair's row, -1 if dropped."""
    t, k, h = rows.shape
    acc_dtype = weights.dtype
    last = jnp.iinfo(jnp.int32).max  # dropped pairs sort after every rank
    key = jnp.where(owner >= 0, owner, last).astype(jnp.int32)
    order = jnp.argsort(key, axis=1, stable=True)  # by rank, then k
    key = jnp.take_along_axis(key, order, axis=1)
    rows = jnp.take_along_axis(rows, order[..., None], axis=1)
    w = jnp.take_along_axis(weights, order, axis=1)
    acc = jnp.zeros((t, h), acc_dtype)
    part = jnp.zeros((t, h), acc_dtype)
    count = jnp.zeros((t, 1), jnp.int32)  # pairs in the rank's group so far
    for j in range(k):
        part = part + w[:, j, None] * rows[:, j].astype(acc_dtype)
        count = count + 1
        following = key[:, j + 1] if j + 1 < k else jnp.full((t,), last, jnp.int32)
        ends = ((key[:, j] != following) & (key[:, j] != last))[:, None]  # a rank's group ends here
        rounded = part.astype(dtype).astype(acc_dtype)
        acc = jnp.where(ends, acc + jnp.where(count == 1, part, rounded), acc)
        part = jnp.where(ends, jnp.zeros((), acc_dtype), part)
        count = jnp.where(ends, 0, count)
    return acc.astype(dtype)


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


def _dispatch_call(x, idx, axes, num_experts, capacity):
    group = _ffi.Group(DISPATCH, axes)
    t, h = x.shape
    k = idx.shape[1]
    el = num_experts // group.size
    i32 = jnp.int32
    results = (jax.ShapeDtypeStruct((el, capacity, h), x.dtype),
               jax.ShapeDtypeStruct((t, k), i32),
               jax.ShapeDtypeStruct((el, capacity), i32),
               jax.ShapeDtypeStruct((el,), i32),
               jax.ShapeDtypeStruct((), i32))
    outs = _call("strata_moe_dispatch", group, (x, idx), results,
                 num_experts=np.int32(num_experts), capacity=np.int64(capacity))
    return tuple(_varying(outs, _ffi.varying_axes(x) | _ffi.varying_axes(idx)))


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _dispatch(x, idx, axes, num_experts, capacity):
    return _dispatch_call(x, idx, axes, num_experts, capacity)


def _dispatch_fwd(x, idx, axes, num_experts, capacity):
    outs = _dispatch_call(x, idx, axes, num_experts, capacity)
    return outs, outs[1]


def _dispatch_bwd(axes, num_experts, capacity, pair_slot, cts):
    # Each row went to at most one slot per pair: the transpose sums, per
    # token, the cotangents of the slots its pairs filled (a combine, weights 1).
    ct_recv = cts[0]
    ones = jnp.ones(pair_slot.shape, _weight_dtype(ct_recv.dtype))
    return _combine_call(ct_recv, ones, pair_slot, axes), None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


# ------------------------------------------------------------------------------------------------
# combine


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
    if np.dtype(expert_y.dtype) not in _COMBINE_DTYPES:
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
    w = _ffi.make_varying(topk_weights.astype(_weight_dtype(expert_y.dtype)), axes)
    ey = _ffi.make_varying(expert_y, axes)
    if _mp.crosses_at_trace(axes):
        return _combine_across(ey, w, handle.pair_slot, handle.slot_source, axes)
    return _combine(ey, w, handle.pair_slot, handle.slot_source, axes)


def _combine_call(expert_y, weights, pair_slot, axes):
    group = _ffi.Group(COMBINE, axes)
    t = pair_slot.shape[0]
    result = jax.ShapeDtypeStruct((t, expert_y.shape[-1]), expert_y.dtype)
    y = _call("strata_moe_combine", group, (expert_y, weights, pair_slot), result)
    vma = _ffi.varying_axes(expert_y) | _ffi.varying_axes(weights) | _ffi.varying_axes(pair_slot)
    return _varying([y], vma)[0]


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _combine(expert_y, weights, pair_slot, slot_source, axes):
    return _combine_call(expert_y, weights, pair_slot, axes)


def _combine_fwd(expert_y, weights, pair_slot, slot_source, axes):
    return _combine_call(expert_y, weights, pair_slot, axes), (expert_y, weights, pair_slot, slot_source)


def _combine_bwd(axes, res, ct):
    # Linear in both: d expert_y scatters w * ct back to the rows (a weighted
    # dispatch along the recorded layout); d w[t, k] = <ct[t], expert_y[slot]>.
    expert_y, weights, pair_slot, slot_source = res
    group = _ffi.Group(COMBINE, axes)
    ct = _ffi.make_varying(ct.astype(expert_y.dtype), axes)
    results = (jax.ShapeDtypeStruct(expert_y.shape, expert_y.dtype),
               jax.ShapeDtypeStruct(weights.shape, weights.dtype))
    d_ey, d_w = _call("strata_moe_combine_backward", group,
                      (ct, expert_y, weights, pair_slot, slot_source), results)
    d_ey, d_w = _varying([d_ey, d_w], _ffi.varying_axes(expert_y) | _ffi.varying_axes(ct))
    return d_ey, d_w, None, None


_combine.defvjp(_combine_fwd, _combine_bwd)


# ------------------------------------------------------------------------------------------------
# The MoE layer


_ACTIVATIONS = {"gelu": jax.nn.gelu, "relu": jax.nn.relu}


def _activation(activation):
    if callable(activation):
        return activation
    try:
        return _ACTIVATIONS[activation]
    except KeyError:
        raise ValueError(f"{LAYER}: activation must be one of {tuple(_ACTIVATIONS)} or a callable, "
                         f"got {activation!r}") from None


def route(x, router_w, top_k: int, *, renormalize: bool = True):
    """Softmax top-k router: ``(weights [T, K], expert ids [T, K] int32)``.

    Probabilities are a softmax over all experts of ``x @ router_w``
    (float32, float64 for float64 inputs); with ``renormalize`` the k chosen
    ones are rescaled to sum to 1 (Mixtral's choice), otherwise they are the
    raw probabilities (Switch/GShard's)."""
    logits = (x @ router_w).astype(_weight_dtype(jnp.result_type(x, router_w)))
    probs = jax.nn.softmax(logits, axis=-1)
    weights, idx = lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights, idx.astype(jnp.int32)


def expert_ffn(recv_x, w_in, w_out, activation="gelu"):
    """Every local expert's 2-layer FFN on its rows: ``[E_local, C, H] -> [E_local, C, H]``.
    Zero rows stay zero (no biases), so the padding costs nothing but flops."""
    act = _activation(activation)
    hidden = act(jnp.einsum("ech,ehf->ecf", recv_x, w_in))
    return jnp.einsum("ecf,efh->ech", hidden, w_out)


def _check_layer(x, router_w, w_in, w_out, top_k, n):
    if x.ndim != 2:
        raise ValueError(f"{LAYER}: x must be [T, H], got shape {x.shape}")
    h = x.shape[1]
    if router_w.ndim != 2 or router_w.shape[0] != h:
        raise ValueError(f"{LAYER}: router_w must be [H, E] with H={h}, got shape {router_w.shape}")
    e = router_w.shape[1]
    if e % n:
        raise ValueError(f"{LAYER}: {e} experts are not divisible by the {n} ranks")
    el = e // n
    if w_in.ndim != 3 or w_in.shape[:2] != (el, h):
        raise ValueError(f"{LAYER}: w_in must be this rank's [E_local, H, F] = [{el}, {h}, F], got {w_in.shape}")
    if w_out.shape != (el, w_in.shape[2], h):
        raise ValueError(f"{LAYER}: w_out must be [E_local, F, H] = [{el}, {w_in.shape[2]}, {h}], got {w_out.shape}")
    if not 1 <= top_k <= e:
        raise ValueError(f"{LAYER}: top_k must be in [1, {e}], got {top_k}")
    return e


def expert_parallel_ffn(x, router_w, w_in, w_out, *, axis_name, top_k: int, capacity: int,
                        activation="gelu", renormalize: bool = True):
    """A MoE FFN layer over the expert-parallel axis ``axis_name``, inside shard_map.

    x [T, H]: this rank's tokens; router_w [H, E] replicated; w_in [E_local, H, F]
    and w_out [E_local, F, H]: this rank's slice of the expert weights (sharded on
    the expert axis: rank r holds experts r*E_local ...). Softmax top-k routing
    (renormalised over the chosen k unless ``renormalize=False``), dispatch with
    ``capacity`` rows per expert, ``activation`` ("gelu" (tanh form), "relu" or a
    callable) between the two matmuls, combine weighted by the router. Returns
    y [T, H]; pairs dropped for capacity contribute 0."""
    x = jnp.asarray(x)
    axes = _ffi.normalize_axes(axis_name, LAYER)
    e = _check_layer(x, router_w, w_in, w_out, top_k, _ffi.Group(LAYER, axes).size)
    weights, idx = route(x, router_w, top_k, renormalize=renormalize)
    recv_x, handle = dispatch(x, idx, axis_name=axes, num_experts=e, capacity=capacity)
    return combine(expert_ffn(recv_x, w_in, w_out, activation), handle, weights)


# ------------------------------------------------------------------------------------------------
# References


def reference_dispatch(x, topk_idx, *, axis_name, num_experts: int, capacity: int):
    """dispatch() the usual JAX way: every rank scatters its rows into a padded
    ``[N, E_local, capacity, H]`` send buffer, one ``lax.all_to_all`` moves it,
    and the owner gathers the rows into place. Same order and drop rule.
    Returns ``(recv_x, state)``; ``state`` is what :func:`reference_combine` needs."""
    axes = _ffi.normalize_axes(axis_name, "strata.moe.reference_dispatch")
    n = lax.axis_size(axes)
    rank = lax.axis_index(axes)
    t, h = x.shape
    k = topk_idx.shape[1]
    el, cap = num_experts // n, capacity
    i32 = jnp.int32

    e = lax.stop_gradient(topk_idx).reshape(-1).astype(i32)  # pairs in (t, k) order
    onehot = (e[:, None] == jnp.arange(num_experts, dtype=i32)[None]).astype(i32)
    counts = onehot.sum(0)
    all_counts = lax.all_gather(counts, axes)  # [N, E]
    before = jnp.cumsum(all_counts, 0) - all_counts  # pairs of lower ranks, per expert
    local_pos = ((jnp.cumsum(onehot, 0) - onehot) * onehot).sum(1)  # earlier pairs of this rank
    accepted = before[rank][e] + local_pos < cap
    # A source sends an expert at most `cap` rows, at its own positions.
    send_row = jnp.where(accepted, e * cap + local_pos, num_experts * cap)
    tokens = jnp.arange(t * k, dtype=i32) // k
    send = jnp.zeros((num_experts * cap, h), x.dtype).at[send_row].set(x[tokens], mode="drop")
    recv = lax.all_to_all(send.reshape(n, el, cap, h), axes, 0, 0)  # [N_src, E_local, C, H]

    mine = rank * el + jnp.arange(el, dtype=i32)
    base = jnp.take(before, mine, axis=1)  # [N, E_local]: first row of each source
    end = base + jnp.take(all_counts, mine, axis=1)
    rows = jnp.arange(cap, dtype=i32)
    src = (end[:, :, None] <= rows[None, None]).sum(0).astype(i32)  # [E_local, C]
    valid = rows[None] < end[-1][:, None]
    src = jnp.where(valid, src, 0)
    j = rows[None] - jnp.take_along_axis(base.T, src, axis=1)
    j = jnp.where(valid, j, 0)
    l_idx = jnp.broadcast_to(jnp.arange(el, dtype=i32)[:, None], (el, cap))
    recv_x = jnp.where(valid[..., None], recv[src, l_idx, j], jnp.zeros((), x.dtype))
    state = {"accepted": accepted.reshape(t, k), "send_row": send_row.reshape(t, k),
             "src": src, "j": j, "valid": valid,
             "recv_counts": jnp.minimum(end[-1], cap).astype(i32),
             "dropped": jnp.sum(~accepted).astype(i32)}
    return recv_x, state


def reference_combine(expert_y, state, topk_weights, *, axis_name):
    """combine() the usual JAX way: owners scatter rows back into padded
    ``[N, E_local, capacity, H]`` buffers, one ``lax.all_to_all`` returns them,
    and every rank takes the weighted sum of its pairs' rows, in combine's
    order and roundings (per-rank partials, then ranks ascending)."""
    axes = _ffi.normalize_axes(axis_name, "strata.moe.reference_combine")
    n = lax.axis_size(axes)
    el, cap, h = expert_y.shape
    l_idx = jnp.broadcast_to(jnp.arange(el)[:, None], (el, cap))
    back = jnp.zeros((n, el, cap, h), expert_y.dtype).at[state["src"], l_idx, state["j"]].add(
        jnp.where(state["valid"][..., None], expert_y, 0))
    got = lax.all_to_all(back, axes, 0, 0).reshape(n * el * cap, h)  # this rank's rows, by e*C + pos
    t, k = state["send_row"].shape
    rows = jnp.take(got, state["send_row"].reshape(-1), axis=0, mode="fill", fill_value=0).reshape(t, k, h)
    w = topk_weights.astype(_weight_dtype(expert_y.dtype))
    owner = jnp.where(state["accepted"], state["send_row"] // (el * cap), -1)
    return _sum_by_rank(rows, w, owner, expert_y.dtype)


def reference_expert_parallel_ffn(x, router_w, w_in, w_out, *, axis_name, top_k: int, capacity: int,
                                  activation="gelu", renormalize: bool = True):
    """:func:`expert_parallel_ffn` written with plain ``lax.all_to_all`` over
    padded ``[N, E_local, capacity, H]`` buffers: same routing, order, drop
    rule and math (the peer in tests and benchmarks)."""
    x = jnp.asarray(x)
    axes = _ffi.normalize_axes(axis_name, "strata.moe.reference_expert_parallel_ffn")
    e = _check_layer(x, router_w, w_in, w_out, top_k, lax.axis_size(axes))
    weights, idx = route(x, router_w, top_k, renormalize=renormalize)
    recv_x, state = reference_dispatch(x, idx, axis_name=axes, num_experts=e, capacity=capacity)
    return reference_combine(expert_ffn(recv_x, w_in, w_out, activation), state, weights, axis_name=axes)


def dense_moe_ffn(x, router_w, w_in, w_out, *, top_k: int, activation="gelu", renormalize: bool = True):
    """The same MoE on one device with no capacity limit: every token through
    its top-k experts, weighted. x [T, H]; w_in [E, H, F]; w_out [E, F, H]
    (all experts). For tests: it evaluates every expert on every token."""
    weights, idx = route(x, router_w, top_k, renormalize=renormalize)
    t = x.shape[0]
    gates = jnp.zeros((t, router_w.shape[1]), weights.dtype).at[jnp.arange(t)[:, None], idx].add(weights)
    act = _activation(activation)
    out = jnp.einsum("tef,efh->teh", act(jnp.einsum("th,ehf->tef", x, w_in)), w_out)
    return jnp.einsum("te,teh->th", gates.astype(out.dtype), out)
