"""dispatch, combine and the layer written the usual JAX way, with
lax.all_to_all of padded [N, E_local, capacity, H] buffers: the peers of
strata.moe in tests and benchmarks (same layout, order, drop rule and sums)."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .. import _ffi
from ._common import sum_by_rank, weight_dtype
from .layer import check_layer, expert_ffn, route

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
    w = topk_weights.astype(weight_dtype(expert_y.dtype))
    owner = jnp.where(state["accepted"], state["send_row"] // (el * cap), -1)
    return sum_by_rank(rows, w, owner, expert_y.dtype)


def reference_expert_parallel_ffn(x, router_w, w_in, w_out, *, axis_name, top_k: int, capacity: int,
                                  activation="gelu", renormalize: bool = True):
    """:func:`expert_parallel_ffn` written with plain ``lax.all_to_all`` over
    padded ``[N, E_local, capacity, H]`` buffers: same routing, order, drop
    rule and math (the peer in tests and benchmarks)."""
    x = jnp.asarray(x)
    axes = _ffi.normalize_axes(axis_name, "strata.moe.reference_expert_parallel_ffn")
    e = check_layer(x, router_w, w_in, w_out, top_k, lax.axis_size(axes))
    weights, idx = route(x, router_w, top_k, renormalize=renormalize)
    recv_x, state = reference_dispatch(x, idx, axis_name=axes, num_experts=e, capacity=capacity)
    return reference_combine(expert_ffn(recv_x, w_in, w_out, activation), state, weights, axis_name=axes)


