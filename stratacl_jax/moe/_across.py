"""dispatch and combine over an expert axis that crosses processes, composed
from strata's collectives (split into strata inside a process and XLA's
collectives between processes)."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .. import _ffi
from ._common import sum_by_rank

def dispatch_across(x, idx, axes, num_experts, capacity):
    """dispatch over an expert axis that crosses processes, composed from
    strata.all_gather (the counts) and strata.all_to_all (the rows; both
    split into strata inside a process and XLA's collectives between
    processes): each source writes its accepted rows straight at their final
    row of the owner's recv_x in a padded [N, E_local, capacity, H] buffer.
    Same layout, order, drop rule and handle as the runtime's; an expert id
    outside [0, E) that only the running program sees is counted in
    `dropped` (the runtime raises; this path has no runtime to raise from)."""
    all_gather = _ffi.registered("strata_all_gather").api
    all_to_all = _ffi.registered("strata_all_to_all").api
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


def combine_across(expert_y, weights, pair_slot, slot_source, axes):
    """combine over axes that cross processes: every owner sends each source
    the rows that source filled (strata.all_to_all of padded [N, E_local,
    capacity, H] buffers), and every rank sums its pairs' rows, weighted, in
    float32 (float64 for float64 rows) in the runtime's order (per-rank partials, then ranks ascending)."""
    all_to_all = _ffi.registered("strata_all_to_all").api
    n = lax.axis_size(axes)
    el, cap, h = expert_y.shape
    t, k = pair_slot.shape
    owner = jnp.where(slot_source >= 0, slot_source // (t * k), -1)
    ranks = jnp.arange(n, dtype=owner.dtype)[:, None, None, None]
    back = jnp.where(owner[None, :, :, None] == ranks, expert_y[None], jnp.zeros((), expert_y.dtype))
    got = all_to_all(back, axes, 0, 0).reshape(n * el * cap, h)
    rows = jnp.take(got, pair_slot.reshape(-1), axis=0, mode="fill", fill_value=0).reshape(t, k, h)
    owner = jnp.where(pair_slot >= 0, pair_slot // (el * cap), -1)
    return sum_by_rank(rows, weights, owner, expert_y.dtype)


